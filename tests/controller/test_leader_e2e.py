"""Two controller replicas, one real HAProxy, one real etcd: exactly one leads; no two ever write HAProxy at the same
time (every runtime-API write is recorded with its writer and its start and end); a dead leader is replaced within
the lease + one tick and the drained node stays drained across the hand-over (its state from etcd); etcd down: the
leader steers on under its fencing epoch in HAProxy and nobody else writes; etcd back: the same leader, no weight
flaps. Pauses and partitions of a leader, and HAProxy restarted during an outage: test_outage_e2e.py.

Prometheus is a fake seam (latencies fixed per node); a "perturber" sets node5's weight to 77 every 0.2 s, so the
leader has something to repair, and writes, on nearly every tick.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from grayguard.config import parse_config
from grayguard.controller.cmd_controller import build_leadership, run_loop
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import SEEDED
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import wait_until
from grayguard.vocab import State
from tests.support.ctl_helpers import LAT_Q, OPTIONAL, PROM, RATE_Q, FakeProm, Sampler, samples, servers
from tests.support.stack import require

pytestmark = pytest.mark.e2e

TTL, TICK = 2, 0.5  # lease_ttl_s, tick_interval_s
SLACK = 2.0  # etcd expires leases on a 0.5 s sweep, and these 2 cores are shared: generous, but finite
BE = "vllm_chat"
LAT = {0: 0.2, 1: 0.03}  # node0 10x its peers (drained), node1 1.5x (degraded: a cut weight); the others 0.02


@dataclass
class Writes:
    """Every HAProxy runtime-API batch: (writer, start, end, commands), monotonic times."""

    rows: list[tuple[str, float, float, tuple[str, ...]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by(self, who: str) -> list[tuple[str, float, float, tuple[str, ...]]]:
        with self.lock:
            return [r for r in self.rows if r[0] == who]

    def assert_no_overlap(self) -> None:
        with self.lock:
            rows = sorted(self.rows, key=lambda r: r[1])
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                if b[1] >= a[2]:
                    break
                assert b[0] == a[0], f"{a[0]} and {b[0]} wrote at the same time: {a} {b}"


class RecordingClient(RuntimeClient):
    def __init__(self, endpoint: str, writer: str, writes: Writes):
        super().__init__(endpoint, 1.0)
        self.writer, self.writes = writer, writes

    def apply(self, commands):
        t0 = time.monotonic()
        try:
            return super().apply(commands)
        finally:
            with self.writes.lock:
                self.writes.rows.append((self.writer, t0, time.monotonic(), tuple(c.render() for c in commands)))


def answer(q: str) -> list:
    now = time.time()
    inner = q.removeprefix("timestamp(").removesuffix(")")
    values = {f"127.0.0.1:{9100 + i}": LAT.get(i, 0.02) for i in range(6)}
    got = {k: 5.0 for k in values} if inner == RATE_Q else values if inner == LAT_Q else {}
    return samples({k: now for k in got} if inner != q else got, now)


class Replica:
    """A controller in a thread of its own (run_loop), as `grayguard controller` runs it."""

    def __init__(self, rid: str, hap, etcd: EtcdProc, writes: Writes):
        cfg = parse_config({
            "prometheus": {"url": PROM}, "haproxy": {"endpoints": [hap.endpoint], "timeout_s": 1.0},
            "pools": [{"name": "chat", "backend": BE}], "rules": {"control_interval": "15s"},
            "signals": {f"{k}_query": "" for k in OPTIONAL}, "state_file": None, "tick_interval_s": TICK,
            "registry": {"url": etcd.url, "lease_ttl_s": TTL, "timeout_s": 0.5}})
        self.id, self.metrics = rid, ControllerMetrics.create()
        self.ctl = Controller(cfg, FakeProm(answer, []), [RecordingClient(hap.endpoint, rid, writes)],
                              metrics=self.metrics, leadership=build_leadership(cfg, rid, self.metrics))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=run_loop, args=(self.ctl, TICK, self.stop), daemon=True)
        self.thread.start()

    def leads(self) -> bool:
        return self.metrics.registry.get_sample_value("grayguard_controller_leader", {"id": self.id}) == 1

    def kill(self) -> None:
        """Stop ticking and renewing without resigning: what a crash leaves behind (the lease runs out)."""
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def stack(tmp_path, haproxy_factory):
    require("haproxy", "etcd")
    hap = haproxy_factory({BE: servers(6)})
    etcd = EtcdProc(tmp_path / "etcd").start()
    writes, replicas = Writes(), []
    perturb = RuntimeClient(hap.endpoint)
    perturber = Sampler(lambda: perturb.execute([f"set server {BE}/node5 weight 77"]), 0.2)
    table = RuntimeClient(hap.endpoint)
    watcher = Sampler(lambda: {s.name: (s.weight, s.drain) for s in table.show_servers_state(BE)}, 0.05)

    def start(rid: str) -> Replica:
        replicas.append(Replica(rid, hap, etcd, writes))
        return replicas[-1]
    yield start, etcd, writes, watcher
    for r in replicas:
        r.kill()
    perturber.close()
    watcher.close()
    etcd.stop()


def settled(watcher: Sampler, for_s: float = 3.0) -> dict:
    """node0 drained and node1's weight cut, as HAProxy has them now, and node1..node4 as they were for the last
    for_s seconds (a cut node's weight follows its score, which moves while the controller learns the pool's noise:
    controller/scoring.py Noise)."""
    rows = list(watcher.rows)
    t = rows[-1][1] if rows else {}
    if not (t.get("node0", (0, False))[1] and 0 < t.get("node1", (100, False))[0] < 100):
        return {}
    now, keys = rows[-1][0], ("node1", "node2", "node3", "node4")
    recent = [r for at, r in rows if at >= now - for_s]
    if rows[0][0] > now - for_s or any({n: r.get(n) for n in keys} != {n: t.get(n) for n in keys} for r in recent):
        return {}
    return t


def assert_no_flap(watcher: Sampler, since: float, expect: dict) -> None:
    """Every sample since `since`: node0 drained, node1..node4 at the weights they had (node5 is perturbed)."""
    rows = [t for at, t in watcher.rows if at >= since]
    assert rows
    for t in rows:
        assert t["node0"][1], "node0 came back without canaries"
        assert {n: t[n] for n in ("node1", "node2", "node3", "node4")} == expect


def test_the_standby_takes_over_a_dead_leader_within_the_lease_and_keeps_the_drained_node_drained(stack):
    start, etcd, writes, watcher = stack
    a = start("a")
    wait_until(a.leads, 10, what="a leads")
    b = start("b")
    before = wait_until(lambda: settled(watcher), 40, what="node0 drained and node1 cut by a, steady")
    settled_at = time.monotonic()
    expect = {n: before[n] for n in ("node1", "node2", "node3", "node4")}
    wait_until(lambda: b.ctl.leadership.status()["leaders"].get("all") == "a", 5, what="b sees a lead")
    assert a.leads() and not b.leads() and not writes.by("b")
    drained = a.ctl.states["chat"]["node0"]
    assert drained.state in (State.QUARANTINED, State.CANARY) and drained.cause != SEEDED

    killed = time.monotonic()
    a.kill()
    wait_until(b.leads, TTL + TICK + SLACK + 5, interval_s=0.05, what="b leads")
    took = time.monotonic() - killed
    assert took <= TTL + TICK + SLACK, f"b led {took:.2f}s after a died (lease {TTL}s + tick {TICK}s)"
    wait_until(lambda: len(writes.by("b")) >= 2, 10, what="b writes (repairs node5)")

    got = b.ctl.states["chat"]["node0"]
    assert (got.state, got.since, got.cause) == (drained.state, drained.since, drained.cause)  # from etcd, not seeded
    assert max(r[2] for r in writes.by("a")) < min(r[1] for r in writes.by("b"))
    writes.assert_no_overlap()
    assert_no_flap(watcher, settled_at, expect)  # from before the death to b's first writes


def test_etcd_down_the_leader_steers_on_under_its_epoch_nobody_else_writes_and_back_one_leader_without_flaps(
        stack):
    start, etcd, writes, watcher = stack
    a = start("a")
    wait_until(a.leads, 10, what="a leads")
    b = start("b")
    before = wait_until(lambda: settled(watcher), 40, what="node0 drained and node1 cut by a, steady")
    settled_at = time.monotonic()
    expect = {n: before[n] for n in ("node1", "node2", "node3", "node4")}
    wait_until(lambda: len(writes.by("a")) >= 3, 10, what="a repairs node5")
    drained = a.ctl.states["chat"]["node0"]

    down = time.monotonic()
    etcd.kill()
    without = ("grayguard_controller_steering_without_registry", {"id": "a"})
    wait_until(lambda: a.metrics.registry.get_sample_value(*without) == 1, TTL + TICK + SLACK + 5,
               interval_s=0.05, what="a steers without etcd")
    # past its lease, on its HAProxy epoch alone: it repairs node5 every tick
    wait_until(lambda: len([r for r in writes.by("a") if r[1] > down + TTL]) >= 3, 10,
               what="a goes on repairing node5 with etcd down")
    assert not writes.by("b") and not b.leads() and a.leads()

    back = time.monotonic()
    etcd.restart()
    wait_until(lambda: a.metrics.registry.get_sample_value(*without) == 0, 30, what="a's lease confirmed again")
    wait_until(lambda: len([r for r in writes.rows if r[1] > back]) >= 2, 10, what="the leader writes again")
    leaders = [r for r in (a, b) if r.leads()]
    assert leaders == [a] and not writes.by("b")  # its lease survived the restart: the same term goes on
    writes.assert_no_overlap()
    assert_no_flap(watcher, settled_at, expect)
    got = leaders[0].ctl.states["chat"]["node0"]
    assert (got.state, got.since, got.cause) == (drained.state, drained.since, drained.cause)
