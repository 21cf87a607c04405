"""Membership that fails safe, on real processes (etcd, HAProxy 2.6, the simulated fleet, a controller ticking every
0.5 s): a node the policy holds out stays out across an HAProxy restart; a partition of the exporters from etcd
deletes no node HAProxy has UP (kept, flagged); an etcd freeze past the TTL drains nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from grayguard.controller.haproxy import ADMF_FDRAIN, HaproxyError
from grayguard.controller.policy import EJECTED, QUARANTINED
from grayguard.registry import NodeRecord, RegistryError
from tests.support.ctl_helpers import samples
from tests.support.registry_rig import LAT_Q, TICK_S, Member, Rig
from tests.support.stack import require


class SlowMember(Member):
    """A registration whose exporter heartbeats every third of the TTL and, finding its lease gone, registers
    again rejoin_s later (its next heartbeat): the registry has no record of it in between."""

    def __init__(self, url: str, rec: NodeRecord, ttl: int, rejoin_s: float):
        self.rejoin_s = rejoin_s
        super().__init__(url, rec, ttl)

    def _keep(self) -> None:
        while not self.stop.wait(self.ttl / 3):
            try:
                if self.reg.keep_alive(self.lease) == 0 and not self.stop.wait(self.rejoin_s):
                    self.lease = self._register()
            except RegistryError:
                pass  # etcd frozen: try again at the next heartbeat


class FailsafeRig(Rig):
    """The registry rig with config overrides, and nodes the fake Prometheus shows 10x slow."""

    def __init__(self, tmp, nodes: int, overrides: dict | None = None, **kw):
        super().__init__(tmp, nodes, **kw)
        self.overrides = overrides or {}
        self.slow: set[str] = set()  # addresses

    def config(self) -> dict:
        doc = super().config()
        for k, v in self.overrides.items():
            doc[k] = {**doc.get(k, {}), **v}
        return doc

    def prom(self, q: str):
        if q == LAT_Q:
            return samples({n.address: 0.2 if n.address in self.slow else 0.02 for n in self.nodes}, time.time())
        return super().prom(q)

    def stop_node(self, i: int) -> None:
        """The node's vLLM is gone: its address refuses connections, HAProxy's checks fail."""
        n = self.nodes[i]
        self.fleet.run(self.fleet.fleet.node(n.name).stop(), 10)


@pytest.fixture
def rig_factory(tmp_path):
    require("etcd", "haproxy")
    rigs = []

    def make(nodes: int, **kw) -> FailsafeRig:
        rigs.append(FailsafeRig(tmp_path / f"rig{len(rigs)}", nodes, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def in_rotation(rig: Rig, names) -> bool:
    s = rig.servers()
    return all(n in s and s[n].ready and s[n].op == 2 for n in names)


class Watcher:
    """Polls HAProxy every 20 ms and records every sighting for which bad(name, server or None) is true."""

    def __init__(self, rig: Rig, names, bad):
        self.rig, self.names, self.bad = rig, list(names), bad
        self.seen: list[tuple[float, str, object]] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.rig.servers()
            except HaproxyError:  # HAProxy restarting: its socket answers again in a moment
                time.sleep(0.02)
                continue
            self.polls += 1
            for n in self.names:
                if self.bad(n, s.get(n)):
                    self.seen.append((time.monotonic(), n, s.get(n)))
            time.sleep(0.02)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def test_a_quarantined_node_stays_drained_across_an_haproxy_restart(rig_factory):
    """HAProxy restarted (its dynamic servers gone): the next tick adds them again; the node the policy holds
    quarantined comes back drained at weight 0, never UP and ready in between, and stays quarantined."""
    rig = rig_factory(4, overrides={"recovery": {"min_quarantine_s": 600.0}})
    rig.slow = {rig.nodes[0].address}  # 10x slower than its peers all along
    for i in range(4):
        rig.register(i)
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    sick = names[0]
    rig.wait(lambda: (s := rig.ctl.states["chat"].get(sick)) is not None and s.state == QUARANTINED, 60,
             "the slow node quarantined")
    rig.wait(lambda: (s := rig.servers().get(sick)) is not None and s.admin & ADMF_FDRAIN and s.weight == 0, 5,
             "the quarantined node drained in HAProxy")
    rig.wait(lambda: in_rotation(rig, names[1:]), 30, "the others in rotation")

    watch = Watcher(rig, [sick], lambda n, s: s is not None and (s.ready or (s.admin == 0 and s.op == 2)))
    rig.hap.restart()  # HAProxy 2.6 keeps no dynamic server
    try:
        rig.wait(lambda: (s := rig.servers().get(sick)) is not None and s.admin & ADMF_FDRAIN and s.weight == 0, 5,
                 "the quarantined node added again, drained at weight 0")
        rig.wait(lambda: in_rotation(rig, names[1:]), 10, "the healthy ones added again, in rotation")
        end = time.monotonic() + 6 * TICK_S  # several ticks more: the policy, not membership, decides now
        while time.monotonic() < end:
            assert rig.ctl.states["chat"][sick].state in EJECTED
            time.sleep(TICK_S / 2)
    finally:
        seen = watch.stop()
    assert watch.polls > 20
    assert seen == [], f"the quarantined node was in rotation after the restart: {seen[:3]}"
    assert rig.ctl.states["chat"][sick].state == QUARANTINED


def test_a_partition_of_the_exporters_from_etcd_deletes_no_node_haproxy_has_up(rig_factory):
    """Every lease ends (the exporters cut off from etcd) while vLLM serves and HAProxy's checks pass: no node leaves
    rotation, each is flagged kept. One that dies afterwards (HAProxy has it DOWN) is removed."""
    rig = rig_factory(6)
    members = [rig.register(i, ttl=2) for i in range(6)]
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    rig.wait(lambda: in_rotation(rig, names), 15, "six nodes in rotation")
    watch = Watcher(rig, names, lambda n, s: s is None or not s.ready)
    try:
        for m in members:  # the heartbeats stop: each lease ends within its TTL
            m.crash()
        rig.wait(lambda: rig.discovery.view("chat").nodes == {}, 2 + 3, "every lease ended")
        end = time.monotonic() + 6 * TICK_S
        while time.monotonic() < end:
            assert in_rotation(rig, names)
            time.sleep(TICK_S / 2)
    finally:
        seen = watch.stop()
    assert seen == [], f"a serving node left rotation on the registry's word alone: {seen[:3]}"
    for n in names:
        assert rig.metric("grayguard_membership_expired_kept", pool="chat", node=n) == 1, n
    assert rig.metric("grayguard_membership_changes_total", pool="chat", action="drain") is None

    # node0's vLLM dies: HAProxy's checks agree now. A minute on (the mass loss no longer doubted) it is removed.
    rig.offset += 61
    rig.stop_node(0)
    rig.wait(lambda: names[0] not in rig.servers(), 30, "the dead node removed")
    assert rig.metric("grayguard_membership_expired_kept", pool="chat", node=names[0]) is None
    assert in_rotation(rig, names[1:])
    assert rig.metric("grayguard_membership_expired_kept", pool="chat", node=names[1]) == 1


def test_an_etcd_freeze_past_the_ttl_drains_nothing(rig_factory):
    """etcd SIGSTOPped longer than the leases' TTL, then SIGCONTinued: every lease ends at once, the re-list shows
    none of them for a moment, the exporters register again. No node leaves rotation meanwhile."""
    rig = rig_factory(6)
    ttl = 3
    members = [SlowMember(rig.etcd.url, rig.record(i), ttl, rejoin_s=5.0) for i in range(6)]
    rig.members.update({m.rec.node: m for m in members})
    rig.start_controller()
    names = [n.name for n in rig.nodes]
    rig.wait(lambda: in_rotation(rig, names), 15, "six nodes in rotation")
    leases = {m.rec.node: m.lease for m in members}
    watch = Watcher(rig, names, lambda n, s: s is None or not s.ready)
    pid = rig.etcd.proc.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(ttl + 2.0)  # the freeze itself: past every lease's TTL
        finally:
            os.kill(pid, signal.SIGCONT)
        # the leases ended: each exporter registers again on a new lease
        rig.wait(lambda: all(m.lease != leases[m.rec.node] for m in members), 15, "every node on a new lease")
        rig.wait(lambda: set(rig.discovery.view("chat").nodes) == set(names) and rig.discovery.view("chat").fresh,
                 10, "every node registered again")
        end = time.monotonic() + 6 * TICK_S
        while time.monotonic() < end:
            assert in_rotation(rig, names)
            time.sleep(TICK_S / 2)
    finally:
        seen = watch.stop()
    assert seen == [], f"a node left rotation after the freeze: {seen[:3]}"
    assert rig.metric("grayguard_membership_changes_total", pool="chat", action="drain") is None
