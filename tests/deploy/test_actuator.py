"""The gateway tier with actuators (`haproxy.writer: actuators`): one real etcd, two real HAProxies, an actuator
beside each (its admin socket pod-local, a read-only runtime view on TCP) and a leading controller that reads the
tier only through those views. Both HAProxies converge to the leader's weights within one tick of each decision;
with one actuator down the other still converges, and the one that comes back converges at its first round. The
controller never writes a runtime API (its endpoints refuse writes) and the views refuse every write.

Also the pure parts: the desired-state document round trip and its checks, the view's allow list.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from grayguard.config import ConfigError, parse_config
from grayguard.controller import desired as dd
from grayguard.controller.actuator import Actuator, ActuatorMetrics
from grayguard.controller.cmd_controller import build_leadership
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeDecision, NodeState, PoolDecision
from grayguard.controller.runtime_view import ALLOWED, RuntimeView
from grayguard.controller.ticker import Periodic
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import free_port, wait_until
from grayguard.registry import Registry
from tests.support.ctl_helpers import LAT_Q, OPTIONAL, PROM, RATE_Q, FakeProm, samples, servers
from tests.support.stack import require

BE = "vllm_chat"
TICK = 1.0  # the controller's tick_interval_s (the shipped default)
INTERVAL = 0.25  # the actuators' --interval in this test (shipped: 500ms)


# ---- the desired-state document (pure) --------------------------------------------------------------------------
def _decision() -> PoolDecision:
    nodes = {"node0": NodeDecision(NodeState(state="quarantined", weight=0), "healthy", 0, True),
             "node1": NodeDecision(NodeState(state="degraded", weight=35), "healthy", 35, False),
             "node2": NodeDecision(NodeState(state="healthy", weight=100), "healthy", None, False)}  # held (MAINT)
    return PoolDecision(nodes, 1, 1, False, agent_off=frozenset({"node1"}))


def test_desired_document_round_trip_leaves_held_nodes_out():
    d = dd.from_decision("chat", BE, _decision())
    text = dd.dump(d)
    assert dd.load(text) == d and dd.dump(dd.load(text)) == text
    assert set(d.servers) == {"node0", "node1"} and d.agent_off == {"node1"}
    got = d.decisions()
    assert (got["node0"].weight, got["node0"].drain, got["node1"].weight, got["node1"].drain) == (0, True, 35, False)


@pytest.mark.parametrize("doc, field", [
    ({"version": 2}, "version"),
    ({"backend": "a b"}, "backend"),
    ({"servers": {"n;1": {"weight": 1, "drain": False, "state": "healthy"}}}, "servers"),
    ({"servers": {"n1": {"weight": 257, "drain": False, "state": "healthy"}}}, "servers.n1.weight"),
    ({"servers": {"n1": {"weight": True, "drain": False, "state": "healthy"}}}, "servers.n1.weight"),
    ({"servers": {"n1": {"weight": 1, "drain": "no", "state": "healthy"}}}, "servers.n1.drain"),
    ({"servers": {"n1": {"weight": 1, "drain": False, "state": "sick"}}}, "servers.n1.state"),
    ({"agent_off": ["x\n"]}, "agent_off"),
])
def test_desired_document_refuses_what_it_cannot_apply(doc, field):
    base = json.loads(dd.dump(dd.from_decision("chat", BE, _decision())))
    with pytest.raises(dd.DesiredError, match=f"^{field}"):
        dd.load(json.dumps({**base, **doc}))


def test_actuators_need_a_registry_and_static_pools():
    doc = {"pools": [{"name": "chat", "backend": BE}], "haproxy": {"writer": "actuators"}}
    with pytest.raises(ConfigError, match="haproxy.writer"):
        parse_config(doc)
    reg = {"registry": {"url": "http://127.0.0.1:2379"}}
    assert parse_config({**doc, **reg}).haproxy.writer == "actuators"
    with pytest.raises(ConfigError, match=r"pools\[0\].discovery"):
        parse_config({**doc, **reg, "pools": [{"name": "chat", "backend": BE, "discovery": "registry"}]})
    with pytest.raises(ConfigError, match="haproxy.writer"):
        parse_config({**doc, "haproxy": {"writer": "nobody"}, **reg})


def test_the_view_allows_only_the_reads_the_controller_sends():
    for ok in ("show servers state", f"show servers state {BE}", "show stat -1 4 -1", f"show stat {BE} 4 -1",
               "show stat -1 2 -1"):
        assert ALLOWED.fullmatch(ok), ok
    for bad in ("set weight vllm_chat/node0 0", "set server vllm_chat/node0 state drain", "disable agent a/b",
                "shutdown sessions server a/b", "show servers state a; set weight a/b 0", "show sess", "show info",
                "add server a/b 1.2.3.4:80", "del server a/b", "show stat -1 4 -1 x", "show errors", "show env"):
        assert not ALLOWED.fullmatch(bad), bad


# ---- the tier, for real -------------------------------------------------------------------------------------------
LAT = {0: 0.2, 1: 0.03}  # node0 10x its peers (drained), node1 1.5x (a cut weight); the others 0.02


class Side:
    """One gateway replica's sidecar: the actuator's rounds and its read-only view over the HAProxy admin socket."""

    def __init__(self, hap, etcd: EtcdProc):
        self.admin = RuntimeClient(hap.endpoint, 1.0)
        self.metrics = ActuatorMetrics()
        self.actuator = Actuator(Registry(etcd.url, timeout=0.5), self.admin, metrics=self.metrics)
        self.start()

    def start(self) -> None:
        self.view = RuntimeView(("127.0.0.1", getattr(self, "port", 0)), self.admin, self.metrics.view_requests).start()
        self.port = self.view.address[1]
        self.stop_event = threading.Event()
        self.job = Periodic("actuator", self.actuator.round, INTERVAL, self.stop_event).start()

    def stop(self) -> None:
        self.stop_event.set()
        self.job.join(5)
        self.view.stop()

    def table(self) -> dict[str, tuple[int, bool]]:
        return {s.name: (s.weight, s.drain) for s in self.admin.show_servers_state(BE)}

    def view_count(self, result: str) -> float:
        return self.metrics.registry.get_sample_value("grayguard_actuator_view_requests_total", {"result": result}) or 0


def answer(lat: dict[int, float]):
    def q(query: str) -> list:
        now = time.time()
        inner = query.removeprefix("timestamp(").removesuffix(")")
        values = {f"127.0.0.1:{9100 + i}": lat.get(i, 0.02) for i in range(6)}
        got = {k: 5.0 for k in values} if inner == RATE_Q else values if inner == LAT_Q else {}
        return samples({k: now for k in got} if inner != query else got, now)
    return q


@pytest.fixture
def tier(tmp_path, haproxy_factory):
    require("haproxy", "etcd")
    etcd = EtcdProc(tmp_path / "etcd").start()
    haps = [haproxy_factory({BE: servers(6)}) for _ in range(2)]
    sides = [Side(h, etcd) for h in haps]
    lat = dict(LAT)
    cfg = parse_config({
        "prometheus": {"url": PROM}, "pools": [{"name": "chat", "backend": BE}],
        "haproxy": {"endpoints": [f"127.0.0.1:{s.port}" for s in sides], "timeout_s": 1.0, "writer": "actuators"},
        "rules": {"control_interval": "15s"}, "signals": {f"{k}_query": "" for k in OPTIONAL}, "state_file": None,
        "tick_interval_s": TICK, "registry": {"url": etcd.url, "lease_ttl_s": 3, "timeout_s": 0.5}})
    metrics = ControllerMetrics.create()
    ctl = Controller(cfg, FakeProm(answer(lat), []), [RuntimeClient(e, 1.0) for e in cfg.haproxy.endpoints],
                     metrics=metrics, leadership=build_leadership(cfg, "leader", metrics))
    yield ctl, sides, lat
    for s in sides:
        if not s.stop_event.is_set():
            s.stop()
    ctl.leadership.close()
    etcd.stop()


def wanted(ctl: Controller) -> dict[str, tuple[int, bool]]:
    """What the leader decided last, as HAProxy shows it: (weight, drained) per server."""
    return {n: (d.weight, d.drain) for n, d in ctl.last_decisions["chat"].nodes.items() if d.weight is not None}


def tick_and_converge(ctl: Controller, sides: list[Side]) -> float:
    """One tick; the seconds from its end until every given side's HAProxy shows what the leader decided."""
    res = ctl.tick()
    assert not res.failed and not res.held, (res.held, res.failed)
    done, want = time.monotonic(), wanted(ctl)
    wait_until(lambda: all(s.table() == want for s in sides), 5 * TICK, interval_s=0.01,
               what=f"both HAProxies at the leader's weights {want}")
    return time.monotonic() - done


@pytest.mark.e2e
def test_both_haproxies_converge_within_one_tick_and_one_actuator_down_does_not_stop_the_other(tier):
    ctl, (a, b), lat = tier
    # every tick until node0 is drained and node1 cut: each decision is on both HAProxies within one tick
    took = []
    for _ in range(12):
        took.append(tick_and_converge(ctl, [a, b]))
        w = wanted(ctl)
        if w["node0"][1] and 0 < w["node1"][0] < 100:
            break
        time.sleep(max(0.0, TICK - took[-1]))
    else:
        pytest.fail(f"the leader never drained node0 and cut node1: {wanted(ctl)}")
    assert max(took) <= TICK, f"converged {max(took):.2f}s after a tick (tick {TICK}s): {took}"
    assert a.table() == b.table() == wanted(ctl)

    # the controller never wrote: its endpoints are the read-only views, which refused nothing and served reads
    writes = [s for m in ctl.metrics.registry.collect() if m.name == "grayguard_haproxy_writes" for s in m.samples]
    assert not any(s.value for s in writes)
    assert a.view_count("denied") == b.view_count("denied") == 0 and a.view_count("ok") > 0

    # actuator a down (its view too): the leader reads b alone, decides node2 slow, and b converges within a tick
    a.stop()
    frozen = a.table()
    lat[2] = 0.2
    for _ in range(12):
        res = ctl.tick()
        assert not res.held and any("127.0.0.1:" in e for e in res.errors)  # a's view does not answer
        start = time.monotonic()
        want = wanted(ctl)
        wait_until(lambda w=want: b.table() == w, 5 * TICK, interval_s=0.01, what="b at the leader's weights")
        assert time.monotonic() - start <= TICK
        if want["node2"][0] < 100:
            break
        time.sleep(TICK / 2)
    else:
        pytest.fail(f"the leader never cut node2: {wanted(ctl)}")
    assert a.table() == frozen != b.table()  # nobody else writes a's HAProxy

    # a lost write on b (a perturbation) is repaired by b's own rounds, without a tick
    b.admin.execute([f"set server {BE}/node4 weight 77"])
    wait_until(lambda: b.table() == want, 3 * INTERVAL + 1, interval_s=0.01, what="b repairs node4")

    # a back: it converges at its first round, without waiting for a new decision
    back = time.monotonic()
    a.start()
    wait_until(lambda: a.table() == want, TICK, interval_s=0.01, what="a at the leader's weights")
    assert time.monotonic() - back <= TICK


@pytest.mark.e2e
def test_the_view_refuses_writes_and_answers_like_haproxy(tier):
    _, (a, _), _ = tier
    client = RuntimeClient(f"127.0.0.1:{a.port}", 1.0)
    show, stat, write = client.execute([f"show servers state {BE}", "show stat -1 4 -1", f"set weight {BE}/node0 1"])
    assert show == a.admin.execute([f"show servers state {BE}"])[0]
    assert stat.startswith("# pxname,svname") and write == "Permission denied\n"
    assert client.show_servers_state(BE) and a.table()["node0"][0] == 100  # the write did not happen
    with socket.create_connection(("127.0.0.1", a.port), timeout=2) as s:  # non-interactive, as socat sends it
        s.sendall(b"set server vllm_chat/node0 state maint\n")
        assert s.recv(100) == b"Permission denied\n"
    assert a.view_count("denied") == 2


@pytest.mark.e2e
def test_the_actuator_command_applies_serves_and_stops_on_sigterm(tmp_path, haproxy_factory):
    require("haproxy", "etcd")
    etcd = EtcdProc(tmp_path / "etcd").start()
    hap = haproxy_factory({BE: servers(3)})
    view, web = free_port(), free_port()
    argv = [sys.executable, "-m", "grayguard.cli", "actuator", "--registry.url", etcd.url, "--haproxy.socket",
            hap.endpoint, "--interval", "200ms", "--view.listen-address", f"127.0.0.1:{view}",
            "--web.listen-address", f"127.0.0.1:{web}"]
    bad = subprocess.run([*argv[:4], "--registry.url", "etcd:2379"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--registry.url" in bad.stderr
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        doc = dd.Desired("chat", BE, {"node1": dd.DesiredServer(0, True, "quarantined"),
                                      "node2": dd.DesiredServer(40, False, "degraded")}, frozenset())
        Registry(etcd.url).put(dd.desired_key("/grayguard/v1", "chat"), dd.dump(doc))
        admin = RuntimeClient(hap.endpoint, 1.0)
        want = {"node0": (100, False), "node1": (0, True), "node2": (40, False)}
        wait_until(lambda: {s.name: (s.weight, s.drain) for s in admin.show_servers_state(BE)} == want, 10,
                   what="the actuator process applies the desired state")
        assert RuntimeClient(f"127.0.0.1:{view}", 1.0).show_servers_state(BE)
        body = urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=5).read().decode()
        assert 'grayguard_actuator_writes_total{kind="weight"} 2.0' in body  # node1 0, node2 40: once each
        assert 'grayguard_actuator_rounds_total{result="ok"}' in body
        for probe, start in (("healthz", "ok: the last round completed"), ("readyz", "ready: ")):  # its probes
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/{probe}", timeout=5) as r:
                assert r.status == 200 and r.read().decode().startswith(start)
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
        etcd.stop()
