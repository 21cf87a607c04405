"""Membership from the registry on real processes: etcd, HAProxy 2.6 and the simulated fleet (and a static test
backend), the controller ticking every 0.5 s. Join, crash (lease expiry and HAProxy's checks agreeing), graceful
leave, mass death (doubted for a minute, then capped, paged), etcd down (frozen, restart on the snapshot, reconciled
without a flap). tests/controller/test_membership_failsafe_e2e.py has the failures membership must not act on."""

from __future__ import annotations

import threading
import time

import pytest

from grayguard.controller.haproxy import ADMF_FDRAIN, CHK_ST_ENABLED
from grayguard.localstack.procs import free_port
from grayguard.registry import NodeRecord
from tests.support.registry_rig import BACKEND, TICK_S, Member, Rig, UpAgent
from tests.support.stack import require
from tests.support.static_backend import StaticBackend

WARM = 10  # slow_start_initial (10 %) of the base weight 100


@pytest.fixture
def rig_factory(tmp_path):
    require("etcd", "haproxy")
    rigs = []

    def make(nodes: int, **kw) -> Rig:
        rigs.append(Rig(tmp_path / f"rig{len(rigs)}", nodes, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def in_rotation(rig: Rig, names) -> bool:
    s = rig.servers()
    return all(n in s and s[n].ready and s[n].op == 2 for n in names)


def stop_node(rig: Rig, i: int) -> None:
    """The node's vLLM is gone: its address refuses connections, HAProxy's checks fail."""
    rig.fleet.run(rig.fleet.fleet.node(rig.nodes[i].name).stop(), 10)


# HAProxy has a server DOWN within fall (3) checks of inter (2 s) after they start failing
CHECKS_DOWN_S = 4 * 2.0


def test_a_registered_node_enters_within_2s_at_the_warm_up_weight_then_slow_starts(rig_factory):
    rig = rig_factory(4)
    for i in range(3):
        rig.register(i)
    rig.start_controller()
    first = [n.name for n in rig.nodes[:3]]
    rig.wait(lambda: in_rotation(rig, first), 10, "the first three nodes in rotation")

    new = rig.nodes[3].name
    t0 = time.monotonic()
    rig.register(3)
    s = rig.wait(lambda: (x := rig.servers().get(new)) is not None and x.admin == 0 and x, 2.0,
                 "the new node in HAProxy, out of maintenance")
    assert time.monotonic() - t0 <= 2.0
    assert s.address == rig.nodes[3].address and s.weight == WARM
    # it holds the warm-up weight for new_node_warmup_s (2 s), then the policy's slow start ramps it up
    ramp = rig.wait(lambda: (w := rig.servers()[new].weight) > WARM and w, 8, "the slow start")
    assert ramp < 100
    rig.wait(lambda: rig.servers()[new].weight == 100, 20, "full weight")
    rig.wait(lambda: rig.ctl.states["chat"][new].state == "healthy", 5, "the slow start done")
    assert rig.metric("grayguard_membership_nodes", pool="chat") == 4
    assert rig.metric("grayguard_registry_up") == 1


def test_a_new_node_with_an_agent_check_is_shown_to_the_policy_once_its_agent_answers(rig_factory):
    """A dynamic server's agent starts DOWN (HAProxy 2.6): the node is hidden until it is UP, so the policy warms it
    up instead of taking the first "DOWN (agent)" for an agent mark-down (a quarantine, or its agent disabled)."""
    agent = UpAgent()
    try:
        rig = rig_factory(4, static_agent_port=agent.port)  # node4 is the static server, its agent on agent.port
        for i in range(3):
            rig.register(i)
        rig.start_controller()
        names = [n.name for n in rig.nodes[:3]]
        rig.wait(lambda: in_rotation(rig, names), 10, "the registered nodes UP through their agent")
        rows = [ln.split() for ln in rig.rc.execute([f"show servers state {BACKEND}"])[0].splitlines()[2:]]
        agents = {r[3]: (int(r[14]), r[-1]) for r in rows}  # srv_name: (srv_agent_state, srv_agent_port)
        for n in names:
            assert agents[n][1] == str(agent.port)  # the static server's agent port, at the node's exporter host
            assert agents[n][0] & CHK_ST_ENABLED  # never disabled as "past the cap"
        rig.wait(lambda: all(n in rig.ctl.states["chat"] for n in names), 5, "the policy sees them")
        time.sleep(2 * TICK_S)
        for n in names:
            s = rig.ctl.states["chat"][n]
            assert s.state in ("slow_start", "healthy") and "agent" not in s.reason, (n, s.state, s.reason)
        assert rig.metric("grayguard_membership_joining", pool="chat") == 0
    finally:
        agent.close()


def test_a_dead_node_leaves_rotation_once_haproxy_agrees_and_is_deleted_once_its_connections_are_gone(rig_factory):
    """Its lease ends (its exporter crashed): kept while HAProxy still has it UP; its checks fail: drained, and
    deleted once its streamed request ends."""
    rig = rig_factory(2)
    backend = StaticBackend(stream_s=15.0)
    try:
        for i in range(2):
            rig.register(i)
        rec = NodeRecord(pool="chat", node="static-a", endpoint=backend.address, exporter=f"127.0.0.1:{free_port()}",
                         model="m", ttl_s=2)
        m = rig.members[rec.node] = Member(rig.etcd.url, rec, 2)
        rig.start_controller()
        names = [n.name for n in rig.nodes] + [rec.node]
        rig.wait(lambda: in_rotation(rig, names), 10, "three nodes in rotation")
        reqs = [rig.long_request() for _ in range(3)]  # round robin: one of them streams from the static backend
        rig.wait(lambda: rig.servers()[rec.node].scur >= 1, 5, "a request in flight on it")
        m.crash()  # no more keep-alives: the lease ends within its TTL (etcd checks expiries every 0.5 s)
        rig.wait(lambda: rig.metric("grayguard_membership_expired_kept", pool="chat", node=rec.node) == 1,
                 m.ttl + TICK_S + 2.0, "the expired node kept: HAProxy still has it UP")
        assert in_rotation(rig, names)
        t0 = time.monotonic()
        backend.healthy = False  # and now its checks fail
        s = rig.wait(lambda: (x := rig.servers()[rec.node]).admin & ADMF_FDRAIN and x, CHECKS_DOWN_S + 2 * TICK_S,
                     "the node drained")
        assert time.monotonic() - t0 <= CHECKS_DOWN_S + 2 * TICK_S
        assert s.scur >= 1 and any(r.is_alive() for r in reqs)  # drained, not deleted: its request goes on
        assert rig.metric("grayguard_membership_expired_kept", pool="chat", node=rec.node) is None
        rig.wait(lambda: (x := rig.servers().get(rec.node)) is None or x.scur == 0, 20, "the request finished")
        rig.wait(lambda: rec.node not in rig.servers(), 10, "the server deleted")
        # the tick counts the delete once HAProxy answered it: the server can be gone a moment before the counter
        rig.wait(lambda: rig.metric("grayguard_membership_changes_total", pool="chat", action="delete") == 1, 5,
                 "the delete counted")
        assert rig.metric("grayguard_membership_expiries_held", pool="chat") == 0
        assert in_rotation(rig, names[:2])
    finally:
        backend.close()


def test_a_graceful_leave_is_drained_at_once_and_never_capped(rig_factory):
    rig = rig_factory(6)
    members = [rig.register(i, ttl=5) for i in range(6)]
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    rig.wait(lambda: in_rotation(rig, names), 10, "six nodes in rotation")
    leaving = names[:3]  # half the pool at once: more than any expiry cap allows
    t0 = time.monotonic()
    for m in members[:3]:
        m.leave()
    rig.wait(lambda: not any(n in (s := rig.servers()) and s[n].ready for n in leaving), 2 * TICK_S + 1,
             "the leaving nodes out of rotation")
    assert time.monotonic() - t0 <= 2 * TICK_S + 1
    for m in members[:3]:
        m.reg.revoke(m.lease)
    rig.wait(lambda: not set(leaving) & set(rig.servers()), 10, "the leaving servers deleted")
    assert in_rotation(rig, names[3:])
    assert rig.metric("grayguard_membership_expiries_held", pool="chat") == 0


def test_a_mass_death_is_doubted_for_a_minute_then_removed_at_most_the_cap_per_minute_even_across_a_restart(
        rig_factory):
    """Seven of ten nodes die at once (HAProxy has them DOWN) and their leases end together: a view that lost that
    many at once is not trusted for a minute (nothing removed, held, paged); then the cap (and the floor) per minute,
    whose window a restarted controller reads from etcd: it does not start a new minute."""
    rig = rig_factory(10)
    members = [rig.register(i, ttl=5) for i in range(10)]
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    rig.wait(lambda: in_rotation(rig, names), 15, "ten nodes in rotation")
    dead = names[:7]
    cap = 3  # max(1, floor(0.3 x 10)): the default, the pool's ejection cap share; the floor leaves 7 as well
    for i, m in enumerate(members[:7]):  # their leases at once
        stop_node(rig, i)
        m.revoke()
    # (stopping seven nodes takes a few seconds, then HAProxy needs its fall checks)
    rig.wait(lambda: rig.metric("grayguard_membership_expiries_held", pool="chat") == 7, 30,
             "every dead node held: the view is doubted")
    assert rig.metric("grayguard_membership_view_untrusted", pool="chat") == 1
    assert rig.metric("grayguard_membership_expiry_cap", pool="chat") == cap
    end = time.monotonic() + 4 * TICK_S
    while time.monotonic() < end:
        assert set(rig.servers()) == set(names)
        time.sleep(TICK_S / 2)

    def gone() -> int:
        return len(set(dead) - set(rig.servers()))
    # a minute later (the controller's clock) the losses stand: the cap's share goes
    rig.offset += 61
    rig.wait(lambda: gone() == cap, 10, "the capped removals deleted")
    assert rig.metric("grayguard_membership_view_untrusted", pool="chat") == 0
    assert rig.metric("grayguard_membership_expiries_held", pool="chat") == 7 - cap
    # a controller restarted within that minute counts its removals too (etcd has them): nothing more goes
    rig.stop_controller()
    rig.start_controller()
    rig.wait(lambda: rig.metric("grayguard_membership_expiries_held", pool="chat") == 7 - cap, 10,
             "the restarted controller holds the rest")
    end = time.monotonic() + 4 * TICK_S
    while time.monotonic() < end:
        assert gone() == cap
        time.sleep(TICK_S / 2)
    assert in_rotation(rig, names[7:])
    # a minute later, the next share goes; the pool is smaller, so is its share
    rig.offset += 61
    rig.wait(lambda: gone() == cap + 2, 10, "the next minute's removals")
    assert rig.metric("grayguard_membership_expiry_cap", pool="chat") == 2
    assert rig.metric("grayguard_membership_expiries_held", pool="chat") == 7 - cap - 2


def test_etcd_down_freezes_membership_a_restart_uses_the_snapshot_and_etcd_back_reconciles_without_a_flap(
        rig_factory):
    rig = rig_factory(5)
    for i in range(5):
        rig.register(i, ttl=3)
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    rig.wait(lambda: in_rotation(rig, names), 10, "five nodes in rotation")
    rig.wait(lambda: (rig.tmp / "members.json").exists(), 5, "the snapshot written")
    out: list[tuple[float, str]] = []  # (when, what) any time a node that stays registered left rotation
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            s = rig.servers()
            for n in names[:4]:
                if n not in s or not s[n].ready:
                    out.append((time.monotonic(), n))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rig.etcd.kill()
        rig.members[names[4]].crash()  # a node dies while etcd is down: nobody can see it go
        stop_node(rig, 4)
        rig.wait(lambda: rig.metric("grayguard_registry_up") == 0, 5, "registry_up 0")
        # the alert's condition (rules: GrayguardRegistryDown): up 0, the snapshot ageing
        rig.wait(lambda: rig.metric("grayguard_registry_snapshot_age_seconds") >= 3, 10, "the snapshot ageing")
        rig.wait(lambda: rig.servers()[names[4]].op == 0, CHECKS_DOWN_S, "the dead node DOWN in HAProxy")
        assert in_rotation(rig, names[:4])  # frozen: nothing removed, not even the dead node
        assert names[4] in rig.servers()

        # a controller restarted during the outage, beside a restarted HAProxy (which lost every dynamic server):
        # the new controller has only the snapshot to go by, and it restores the membership from it
        rig.stop_controller()
        watching.set()
        watcher.join()
        assert out == [], f"a live node left rotation: {out[:5]}"
        rig.hap.restart()
        assert rig.servers() == {}
        rig.start_controller()
        rig.wait(lambda: in_rotation(rig, names[:4]) and names[4] in rig.servers(), 10,
                 "the snapshot's nodes back in HAProxy")
        assert rig.metric("grayguard_registry_up") == 0
        assert rig.discovery.view("chat").fresh is False
        watching.clear()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(4 * TICK_S)  # several frozen ticks: still nothing removed
        assert in_rotation(rig, names[:4]) and names[4] in rig.servers()

        rig.etcd.start()  # back with its data: the live nodes' leases are renewed again, the dead one's ends
        rig.wait(lambda: rig.metric("grayguard_registry_up") == 1, 10, "registry_up 1")
        rig.wait(lambda: names[4] not in rig.servers(), 15, "the dead node removed after its lease ended")
        assert in_rotation(rig, names[:4])
    finally:
        watching.set()
        watcher.join()
    assert out == [], f"a live node left rotation: {out[:5]}"
    assert rig.metric("grayguard_membership_expiries_held", pool="chat") == 0


def test_once_dry_run_prints_the_membership_plan_and_writes_nothing(rig_factory):
    import subprocess
    import sys

    import yaml

    rig = rig_factory(2)
    for i in range(2):
        rig.register(i)
    doc = rig.config()
    doc["prometheus"] = {"url": "http://127.0.0.1:9", "timeout_s": 0.5}  # down: the weights hold, membership not
    doc["state_file"] = str(rig.tmp / "state.json")
    path = rig.tmp / "grayguard.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(path), "--once",
                        "--dry-run"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr  # held: Prometheus is down
    for n in rig.nodes:
        assert f"plan: {rig.hap.endpoint}: add server {BACKEND}/{n.name} {n.address} weight 100 check" in p.stdout
        assert f"set server {BACKEND}/{n.name} weight {WARM}" in p.stdout
    assert rig.servers() == {}  # a dry run writes nothing: not HAProxy, not the snapshot
    assert not (rig.tmp / "members.json").exists()
