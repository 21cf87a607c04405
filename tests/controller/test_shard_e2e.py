"""Two controller replicas with registry.shard_pools, six pools behind one real HAProxy, one real etcd: the pools are
split 3/3, each led by exactly one replica, and every runtime-API write to a backend comes from the replica whose
leader key for that pool is in etcd before and after the write (no two writers of a backend ever overlap); a dead
replica's pools are taken over within the lease + one tick with its drained nodes still drained (their states
from etcd) and no weight moving; a replica that joins later gets its share by hand-over, each pool unled for
about a tick at most. The unsharded election: test_leader_e2e.py; the assignment on an in-memory etcd:
test_leader.py.

Prometheus is a fake seam (latencies fixed per node, in every pool node0 10x its peers: drained, node1 1.5x: a cut
weight); a "perturber" sets node4's weight to 77 in every backend every 0.2 s, so each pool's leader has something
to repair, and writes, on nearly every tick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from grayguard.config import parse_config
from grayguard.controller.cmd_controller import build_leadership, run_loop
from grayguard.controller.haproxy import HaproxyError, RuntimeClient
from grayguard.controller.leader import leader_key
from grayguard.controller.leader_store import ElectionStore
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import SEEDED
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import wait_until
from grayguard.registry import RegistryError
from grayguard.vocab import State
from tests.support.ctl_helpers import LAT_Q, OPTIONAL, PROM, RATE_Q, FakeProm, Sampler, samples, servers
from tests.support.stack import require

pytestmark = pytest.mark.e2e

TTL, TICK = 2, 0.5  # lease_ttl_s, tick_interval_s
SLACK = 2.0  # etcd expires leases on a 0.5 s sweep, and these 2 cores are shared: generous, but finite
PREFIX = "/grayguard/v1"  # registry.prefix's default
POOLS = [f"p{i}" for i in range(6)]
BACKEND = {p: f"vllm_{p}" for p in POOLS}
POOL_OF = {be: p for p, be in BACKEND.items()}
NODES = 5  # per pool: with max_ejected_fraction 0.3, one may be drained
LAT = {0: 0.2, 1: 0.03}  # node0 10x its peers (drained), node1 1.5x (degraded: a cut weight); the others 0.02
KEPT = ("node1", "node2", "node3")  # weights that must not move (node0 is drained, node4 perturbed)


def port(pool: int, node: int) -> int:
    return 9100 + 10 * pool + node


@dataclass
class Writes:
    """Every HAProxy runtime-API batch: (writer, backends, start, end, holders before, holders after), monotonic
    times; holders: backend -> (value, create_revision) of its pool's leader key in etcd, read by the test."""

    rows: list[tuple[str, frozenset[str], float, float, dict, dict]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by(self, who: str, backend: str | None = None, since: float = 0.0) -> list:
        with self.lock:
            return [r for r in self.rows if r[0] == who and (backend is None or backend in r[1]) and r[2] >= since]

    def assert_sound(self) -> None:
        """Each write by the pool's leader as etcd has it, before and after, under one key (no hand-over in the
        middle); no two replicas' writes to one backend overlap."""
        with self.lock:
            rows = sorted(self.rows, key=lambda r: r[2])
        assert rows
        for who, backends, t0, _t1, before, after in rows:
            for be in backends:
                assert before[be][0] == who, f"{who} wrote {be} while etcd had {before[be]} lead it ({t0:.3f})"
                assert after[be] == before[be], f"{be}'s leader key changed during {who}'s write: {before[be]} " \
                                                f"-> {after[be]}"
        for be in BACKEND.values():
            mine = [r for r in rows if be in r[1]]
            for i, a in enumerate(mine):
                for b in mine[i + 1:]:
                    if b[2] >= a[3]:
                        break
                    assert b[0] == a[0], f"{a[0]} and {b[0]} wrote {be} at the same time: {a} {b}"


class RecordingClient(RuntimeClient):
    """The replica's HAProxy client; each batch recorded with who leads its backends' pools in etcd around it."""

    def __init__(self, endpoint: str, writer: str, writes: Writes, etcd: ElectionStore):
        super().__init__(endpoint, 1.0)
        self.writer, self.writes, self.etcd = writer, writes, etcd

    def holders(self, backends) -> dict:
        out = {}
        for be in backends:
            e = self.etcd.get(leader_key(PREFIX, POOL_OF[be]))
            out[be] = (e.value, e.create_revision) if e else (None, 0)
        return out

    def apply(self, commands):
        backends = frozenset(c.backend for c in commands)
        before = self.holders(backends)
        t0 = time.monotonic()
        try:
            return super().apply(commands)
        finally:
            t1 = time.monotonic()
            row = (self.writer, backends, t0, t1, before, self.holders(backends))
            with self.writes.lock:
                self.writes.rows.append(row)


def answer(q: str) -> list:
    now = time.time()
    inner = q.removeprefix("timestamp(").removesuffix(")")
    out = []
    for i, pool in enumerate(POOLS):
        values = {f"127.0.0.1:{port(i, j)}": LAT.get(j, 0.02) for j in range(NODES)}
        got = {k: 5.0 for k in values} if inner == RATE_Q else values if inner == LAT_Q else {}
        out += samples({k: now for k in got} if inner != q else got, now, pool)
    return out


class Replica:
    """A controller in a thread of its own (run_loop), as `grayguard controller` runs it, pools sharded."""

    def __init__(self, rid: str, hap, etcd: EtcdProc, writes: Writes):
        cfg = parse_config({
            "prometheus": {"url": PROM}, "haproxy": {"endpoints": [hap.endpoint], "timeout_s": 1.0},
            "pools": [{"name": p, "backend": be} for p, be in BACKEND.items()], "rules": {"control_interval": "15s"},
            "signals": {f"{k}_query": "" for k in OPTIONAL}, "state_file": None, "tick_interval_s": TICK,
            "registry": {"url": etcd.url, "lease_ttl_s": TTL, "timeout_s": 0.5, "shard_pools": True}})
        self.id, self.metrics = rid, ControllerMetrics.create()
        client = RecordingClient(hap.endpoint, rid, writes, ElectionStore(etcd.url, timeout=1.0))
        self.ctl = Controller(cfg, FakeProm(answer, []), [client], metrics=self.metrics,
                              leadership=build_leadership(cfg, rid, self.metrics))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=run_loop, args=(self.ctl, TICK, self.stop), daemon=True)
        self.thread.start()

    def leads(self) -> set[str]:
        """The pools this replica leads, as it says itself."""
        return set(self.ctl.leadership.status()["leads"])

    def kill(self) -> None:
        """Stop ticking and renewing without resigning: what a crash leaves behind (the lease runs out)."""
        self.stop.set()
        self.thread.join(10)


@dataclass
class Stack:
    start: Callable[[str], Replica]  # a replica more, ticking at once
    writes: Writes
    table: Sampler  # HAProxy's servers: (backend, server) -> (weight, drained)
    keys: Sampler  # etcd's leader keys: pool -> holder


def steady(read: Callable[[], dict], errors: tuple[type[Exception], ...]) -> Callable[[], dict]:
    """read, tried again after a transient error (a read that timed out on a loaded machine): a Sampler whose function
    raises stops for good, and its last row would stand for the world from then on. The row keeps the time the first
    try began, so a row at or after t was read at or after t."""
    def again() -> dict:
        for _ in range(20):
            try:
                return read()
            except errors:
                time.sleep(0.05)
        return read()
    return again


@pytest.fixture
def stack(tmp_path, haproxy_factory):
    require("haproxy", "etcd")
    hap = haproxy_factory({be: servers(NODES, base_port=port(i, 0)) for i, be in enumerate(BACKEND.values())})
    etcd = EtcdProc(tmp_path / "etcd").start()
    writes, replicas = Writes(), []
    perturb = RuntimeClient(hap.endpoint)
    perturber = Sampler(lambda: perturb.execute([f"set server {be}/node4 weight 77" for be in BACKEND.values()]),
                        0.2)
    view = RuntimeClient(hap.endpoint)
    table = Sampler(steady(lambda: {(s.backend, s.name): (s.weight, s.drain) for s in view.show_servers_state()},
                           (HaproxyError, OSError)), 0.05)
    reg = ElectionStore(etcd.url, timeout=1.0)
    keys = Sampler(steady(lambda: {k.rsplit("/", 1)[1]: e.value
                                   for k, e in reg.get_prefix(leader_key(PREFIX, ""))[0].items()}, (RegistryError,)),
                   0.05)

    def start(rid: str) -> Replica:
        replicas.append(Replica(rid, hap, etcd, writes))
        return replicas[-1]
    yield Stack(start, writes, table, keys)
    for r in replicas:
        r.kill()
    perturber.close()
    table.close()
    keys.close()
    etcd.stop()


def settled(table: Sampler, for_s: float = 3.0) -> dict:
    """Every pool's node0 drained and node1's weight cut, as HAProxy has them now, and the kept nodes as they were
    for the last for_s seconds (a cut node's weight follows its score, which moves while the controller learns the
    pool's noise: controller/scoring.py Noise)."""
    rows = list(table.rows)
    t = rows[-1][1] if rows else {}
    for be in BACKEND.values():
        if not (t.get((be, "node0"), (0, False))[1] and 0 < t.get((be, "node1"), (100, False))[0] < 100):
            return {}
    now = rows[-1][0]
    if rows[0][0] > now - for_s or any(kept(r) != kept(t) for at, r in rows if at >= now - for_s):
        return {}
    return t


def kept(t: dict) -> dict:
    return {(be, n): t[(be, n)] for be in BACKEND.values() for n in KEPT}


def assert_no_flap(table: Sampler, since: float, expect: dict) -> None:
    """Every sample since `since`: each node0 drained, node1..node3 at the weights they had (node4 is perturbed)."""
    rows = [t for at, t in table.rows if at >= since]
    assert rows
    for t in rows:
        for be in BACKEND.values():
            assert t[(be, "node0")][1], f"{be}/node0 came back without canaries"
        assert kept(t) == expect


def split(*reps, even: bool = False) -> dict[str, set[str]] | None:
    """Who leads what, when every pool is led by exactly one of reps (even: as many by each), else None."""
    owners = {r.id: r.leads() for r in reps}
    led = [p for ps in owners.values() for p in ps]
    if sorted(led) != sorted(POOLS) or even and len({len(ps) for ps in owners.values()}) != 1:
        return None
    return owners


def unled_s(keys: Sampler, since: float) -> dict[str, float]:
    """The longest run of samples since `since` without a leader key, per pool (0.0: always led)."""
    rows = [r for r in list(keys.rows) if r[0] >= since]
    longest, gap_from = dict.fromkeys(POOLS, 0.0), {}
    for at, held in rows + [(rows[-1][0], dict.fromkeys(POOLS))]:  # a gap still open ends at the last sample
        for p in POOLS:
            if p in held:
                if p in gap_from:
                    longest[p] = max(longest[p], at - gap_from.pop(p))
            else:
                gap_from.setdefault(p, at)
    return longest


def drained_states(rep: Replica, pools) -> dict:
    """pool -> node0's (state, since, cause) at rep, drained by a decision (not seeded from HAProxy)."""
    out = {}
    for p in pools:
        s = rep.ctl.states[p]["node0"]
        assert s.state in (State.QUARANTINED, State.CANARY) and s.cause != SEEDED, (p, s)
        out[p] = (s.state, s.since, s.cause)
    return out


def test_two_replicas_split_the_pools_and_the_survivor_takes_over_a_dead_ones_pools_with_their_states(stack):
    a, b = stack.start("a"), stack.start("b")
    owners = wait_until(lambda: split(a, b, even=True), 20, what="the pools split 3/3")
    split_at = time.monotonic()
    before = wait_until(lambda: settled(stack.table), 40, what="every node0 drained and every node1 cut, steady")
    settled_at = time.monotonic()
    expect = kept(before)
    for r in (a, b):  # each replica repairs node4 in each of its pools, and writes no other backend
        for p in owners[r.id]:
            wait_until(lambda r=r, p=p: stack.writes.by(r.id, BACKEND[p], since=split_at), 10,
                       what=f"{r.id} writes {p}")
        assert {POOL_OF[be] for row in stack.writes.by(r.id, since=split_at) for be in row[1]} == owners[r.id]
    assert split(a, b) == owners  # nothing moved while they were at it
    assert all(held == {p: r for r, ps in owners.items() for p in ps}  # etcd agrees, all along
               for at, held in stack.keys.rows if at >= split_at)
    drained = drained_states(a, owners["a"]) | drained_states(b, owners["b"])  # each drained its own pools' node0
    stack.writes.assert_sound()

    killed = time.monotonic()
    a.kill()
    wait_until(lambda: b.leads() == set(POOLS), TTL + TICK + SLACK + 5, interval_s=0.05, what="b leads every pool")
    led = time.monotonic()
    took = led - killed
    assert took <= TTL + TICK + SLACK, f"b led a's pools {took:.2f}s after a died (lease {TTL}s + tick {TICK}s)"
    for p in owners["a"]:  # b repairs node4 in a's pools too
        wait_until(lambda p=p: stack.writes.by("b", BACKEND[p], since=killed), 10, what=f"b writes {p}")
    # etcd agrees: every read of the leader keys begun after b said it led every pool (b holds a key before it says
    # so) has b hold each one; the last row alone may have been read before b's campaigns, and a loaded machine can
    # leave it the last for a while
    after = wait_until(lambda: [held for at, held in list(stack.keys.rows) if at >= led], 5, interval_s=0.05,
                       what="a read of the leader keys after b led every pool")
    assert all(held == dict.fromkeys(POOLS, "b") for held in after), after

    got = {p: (s.state, s.since, s.cause) for p, s in ((p, b.ctl.states[p]["node0"]) for p in POOLS)}
    assert got == drained  # a's pools: the states a published, loaded from etcd (not seeded from HAProxy)
    for p in owners["a"]:  # in a's pools b's writes begin after a's last one ended
        be = BACKEND[p]
        assert max(r[3] for r in stack.writes.by("a", be)) < min(r[2] for r in stack.writes.by("b", be, since=killed))
    stack.writes.assert_sound()
    assert_no_flap(stack.table, settled_at, expect)  # from before the death to b's writes in a's pools


def test_a_replica_that_joins_later_gets_its_share_by_handover_without_a_pool_unled_or_two_writers(stack):
    a = stack.start("a")
    wait_until(lambda: a.leads() == set(POOLS), 10, what="a leads every pool")
    before = wait_until(lambda: settled(stack.table), 40, what="every node0 drained and every node1 cut by a, steady")
    settled_at = time.monotonic()
    expect = kept(before)
    drained = drained_states(a, POOLS)

    joined = time.monotonic()
    b = stack.start("b")
    owners = wait_until(lambda: split(a, b, even=True), 4 * TICK + SLACK + 5, interval_s=0.05,
                        what="b takes its share")
    took = time.monotonic() - joined
    assert took <= 4 * TICK + SLACK, f"the hand-over took {took:.2f}s (tick {TICK}s)"
    for p in owners["b"]:
        wait_until(lambda p=p: stack.writes.by("b", BACKEND[p]), 10, what=f"b writes {p}")
    gaps = unled_s(stack.keys, joined)
    assert max(gaps.values()) <= 2 * TICK, f"pools unled during the hand-over: {gaps}"
    assert {p for p, g in gaps.items() if g > 0} <= owners["b"]  # a's own share never left it
    assert {POOL_OF[be] for row in stack.writes.by("b") for be in row[1]} == owners["b"]

    got = {p: (s.state, s.since, s.cause) for p, s in ((p, b.ctl.states[p]["node0"]) for p in owners["b"])}
    assert got == {p: drained[p] for p in owners["b"]}  # handed over through etcd
    stack.writes.assert_sound()
    assert_no_flap(stack.table, settled_at, expect)
