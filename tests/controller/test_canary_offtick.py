"""Canaries never block the tick (controller/canary_rounds.py): a round runs off the tick and a later tick decides it.

On a real fleet a canary to a hung (SIGSTOPped) vLLM waited its whole 5 s timeout inside the tick: 9 of 30 one-second
ticks were skipped, the controller blind to the rest of the pool. These tests hold the tick to never waiting: a
blocked canary leaves every tick free, its round fails once canary_timeout_s has passed since it was sent, a
passing round still brings a drained node back through canaries and slow start, and a round that no longer answers
for its node (gone, out of its canary stage, another replica's pool) is dropped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from grayguard.bench.ticklocal import Leads
from grayguard.controller.canary_rounds import Workers
from grayguard.controller.policy import NodeState
from grayguard.localstack.procs import wait_until
from tests.support.ctl_helpers import FakeHaproxy, FakeProm, fake_controller, samples, settle, tick_settled

ADDR = {f"node{i}": f"10.0.0.{i}:8000" for i in range(4)}
NODE0 = f"http://{ADDR['node0']}"
T0 = 1000.0


class Fleet:
    """node0 drained in canary, three healthy peers; a canary to node0 blocks while `hung` is set (a SIGSTOPped
    engine: it accepts and says nothing), each canary call is recorded with the controller's time."""

    def __init__(self, hung: bool = False, leadership=None):
        self.t = [T0]
        self.events: list = []
        self.sent: list[tuple[float, str]] = []
        self.hung = threading.Event()
        self.entered = threading.Event()
        if hung:
            self.hung.set()
        self.release = threading.Event()
        self.hap = FakeHaproxy("127.0.0.1:9999", {"vllm_chat": [(n, a, 100) for n, a in ADDR.items()]}, self.events)
        lat = {a: 0.02 for n, a in ADDR.items() if n != "node0"}  # drained: node0 has no traffic, no series
        prom = FakeProm(lambda q: samples(lat if "latency" in q else dict.fromkeys(lat, 5.0), self.t[0]), self.events)
        self.ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [self.hap], prom, canary=self.canary,
                                   clock=lambda: self.t[0])
        if leadership is not None:
            self.ctl.leadership = leadership
        self.ctl.states["chat"] = {
            "node0": NodeState(state="canary", since=900.0, cause="latency", weight=0, reason="probing"),
            **{n: NodeState(ema=0.02, score=0.0, weight=100) for n in ADDR if n != "node0"}}
        self.hap.table[("vllm_chat", "node0")] = replace(self.hap.table[("vllm_chat", "node0")], weight=0,
                                                         admin_state=0x8)  # drained in HAProxy too

    def canary(self, url: str) -> float | None:
        self.sent.append((self.t[0], url))
        if url == NODE0 and self.hung.is_set():
            self.entered.set()
            self.release.wait(5.0)  # as long as a hung engine keeps a 5 s canary waiting
            return None
        return 0.1  # node0 answers like its peers

    def node0(self) -> NodeState:
        return self.ctl.states["chat"]["node0"]

    def counted(self, result: str) -> float | None:
        return self.ctl.metrics.registry.get_sample_value("grayguard_canaries_total",
                                                          {"pool": "chat", "node": "node0", "result": result})

    def to_node0(self) -> int:
        return sum(1 for _, u in self.sent if u == NODE0)

    def close(self) -> None:
        self.release.set()
        self.ctl.close(1.0)


@pytest.fixture
def fleet():
    made: list[Fleet] = []

    def make(**kw) -> Fleet:
        made.append(Fleet(**kw))
        return made[-1]
    yield make
    for f in made:
        f.close()


def _tick_within(ctl, bound_s: float = 5.0):
    """Tick in a thread; fail (not hang) if the tick does not return within bound_s."""
    done, out = threading.Event(), []
    threading.Thread(target=lambda: (out.append(ctl.tick()), done.set()), daemon=True).start()
    assert done.wait(bound_s), f"a tick did not return within {bound_s:g}s: it waited on a canary"
    return out[0]


def test_ticks_go_on_while_a_canary_hangs_and_its_failure_is_applied_once_it_times_out(fleet):
    f = fleet(hung=True)
    timeout = f.ctl.cfg.recovery.canary_timeout_s
    assert timeout == 5.0
    r = _tick_within(f.ctl)  # the round to node0 and its two peers starts, and the tick goes on
    assert r.held is None and r.decisions["chat"].nodes["node0"].state.state == "canary"
    assert f.entered.wait(5.0), "the canary to node0 never started"
    wait_until(lambda: f.ctl.workers.in_flight() == 1, 5.0, 0.01, "the peers' reference canaries answering")
    for _ in range(3):  # three ticks while its canary is still blocked: each returns, node0 stays drained
        f.t[0] += 1
        r = _tick_within(f.ctl)
        assert r.held is None and not r.errors
        assert f.node0().state == "canary" and f.node0().canary_ok == 0 and f.node0().last_canary is None
        assert f.counted("failed") is None and f.counted("measured") is None  # in flight: not decided
        assert f.hap.table[("vllm_chat", "node0")].drain
    assert f.to_node0() == 1  # a round in flight is not sent again
    assert not f.release.is_set()  # and all of that while the canary was blocked
    assert f.ctl.metrics.registry.get_sample_value("grayguard_canaries_in_flight") == 1  # node0's; the peers answered
    f.t[0] = T0 + timeout  # canary_timeout_s after it was sent
    r = _tick_within(f.ctl)
    assert f.counted("failed") == 1
    assert f.node0().state == "canary" and f.node0().canary_ok == 0 and "failed" in f.node0().reason
    assert f.node0().last_canary == T0  # the round's own time: the next one is due canary_interval_s after it
    f.release.set()  # the engine wakes up: its answer, too late, is not decided a second time
    settle(f.ctl)
    f.t[0] += 1
    _tick_within(f.ctl)
    assert f.counted("failed") == 1 and f.to_node0() == 1
    f.hung.clear()
    f.t[0] = T0 + f.ctl.cfg.recovery.canary_interval_s
    tick_settled(f.ctl)
    assert f.to_node0() == 2  # the next round, at the interval


def test_a_passing_round_brings_a_drained_node_back_through_slow_start_at_the_canary_interval(fleet):
    f = fleet()
    rec = f.ctl.cfg.recovery
    seen = []
    for _ in range(int(rec.canary_interval_s * rec.canary_successes) + 2):  # one tick a second
        tick_settled(f.ctl)  # its canaries answer before the next tick, as a fleet's do
        seen.append((f.t[0], f.node0().state, f.node0().canary_ok))
        f.t[0] += 1
        if f.node0().state != "canary":
            break
    assert seen[-1][1] == "slow_start"
    assert f.counted("measured") == rec.canary_successes
    # a round is decided on the tick after it was sent, and the next one starts canary_interval_s after it was sent
    assert [t for t, u in f.sent if u == NODE0] == [T0 + k * rec.canary_interval_s for k in range(3)]
    assert [ok for _, s, ok in seen if s == "canary"][:2] == [0, 1]
    assert seen[-1][0] == T0 + 2 * rec.canary_interval_s + 1
    s = f.hap.table[("vllm_chat", "node0")]
    assert not s.drain and s.weight == round(100 * rec.slow_start_initial)  # back to ready, at 10 %


@pytest.mark.parametrize("change", ["gone", "slow_start", "drained_anew"])
def test_a_round_whose_node_left_the_pool_or_its_canary_stage_is_discarded(fleet, change):
    f = fleet()
    tick_settled(f.ctl)  # node0's round is sent and answered
    f.t[0] += 1
    if change == "gone":  # removed from the backend
        del f.hap.table[("vllm_chat", "node0")]
    elif change == "slow_start":  # it left the drained state (the cap released it, say)
        f.ctl.states["chat"]["node0"] = replace(f.node0(), state="slow_start", since=f.t[0])
    else:  # drained and back in canary since: another canary stage
        f.ctl.states["chat"]["node0"] = replace(f.node0(), since=f.t[0] - 0.5)
    f.ctl.tick()
    assert f.counted("measured") is None and f.counted("failed") is None
    if change != "gone":
        assert f.node0().canary_ok == 0 and f.node0().last_canary is None


def test_a_replica_that_lost_the_pool_discards_its_rounds(fleet):
    leads = Leads(["chat"])
    f = fleet(leadership=leads)
    tick_settled(f.ctl)  # its round is sent and answered
    leads.led = frozenset()  # another replica leads the pool now
    f.t[0] += 1
    assert f.ctl.tick().standby
    leads.led = frozenset({"chat"})  # and back: what it sent while it led is no answer now
    f.t[0] += 1
    tick_settled(f.ctl)
    assert f.counted("measured") is None and f.node0().canary_ok == 0
    assert f.to_node0() == 2  # a fresh round instead
    f.t[0] += 1
    f.ctl.tick()
    assert f.counted("measured") == 1 and f.node0().canary_ok == 1


def test_a_round_older_than_stale_after_s_is_not_decided(fleet):
    f = fleet()
    tick_settled(f.ctl)
    f.t[0] += f.ctl.cfg.stale_after_s + 1  # the pool held that long, say: the answer is too old to act on
    tick_settled(f.ctl)
    assert f.counted("measured") is None and f.node0().canary_ok == 0
    assert f.to_node0() == 1  # it was the node's round in flight: the next tick starts another
    f.t[0] += 1
    tick_settled(f.ctl)
    assert f.to_node0() == 2


def test_stop_does_not_wait_for_a_hung_canary_and_starts_no_other(fleet):
    f = fleet(hung=True)
    _tick_within(f.ctl)
    assert f.entered.wait(5.0)
    deadline = time.monotonic() + 5.0  # the round's three requests (node0, two peers) go out on the workers
    while len(f.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(f.sent) == 3
    done = threading.Event()
    threading.Thread(target=lambda: (f.ctl.close(0.2), done.set()), daemon=True).start()
    assert done.wait(5.0), "close() waited on a hung canary"
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("canary-"))  # never hold the exit
    f.t[0] = T0 + 20
    _tick_within(f.ctl)
    assert len(f.sent) == 3  # nothing sent since close()


def test_the_workers_are_bounded_and_a_queued_canary_is_not_sent_yet_so_not_timed_out():
    release = threading.Event()
    t = [0.0]
    started = threading.Semaphore(0)

    def fn(url):
        started.release()
        release.wait(5.0)
        return 0.1

    w = Workers(fn, lambda: t[0], size=2)
    try:
        probes = [w.submit(f"http://n{i}") for i in range(3)]
        assert started.acquire(timeout=5.0) and started.acquire(timeout=5.0)
        assert not started.acquire(timeout=0.05)  # two workers: the third waits its turn
        assert sum(p.started is not None for p in probes) == 2 and w.in_flight() == 3
        t[0] = 5.0
        over = [p.outcome(t[0], 5.0) for p in probes]
        assert sorted(over) == [(False, None), (True, "timeout"), (True, "timeout")]
        release.set()
        assert w.wait_idle(5.0) and w.in_flight() == 0
        queued = next(p for p, o in zip(probes, over, strict=True) if not o[0])
        assert queued.outcome(t[0], 5.0) == (True, None) and queued.value(None) == 0.1  # sent at 5.0, answered
    finally:
        release.set()
        w.close(1.0)


def test_a_canary_that_raises_or_answers_after_its_timeout_is_a_failure():
    t = [0.0]

    def slow(url):
        t[0] += 6.0  # the callable took 6 s by the controller's clock
        return 0.1

    def broken(url):
        raise ValueError("boom")

    for fn, why in ((slow, "timeout"), (broken, "raised")):
        w = Workers(fn, lambda: t[0])
        p = w.submit("http://n")
        assert w.wait_idle(5.0)
        assert p.outcome(t[0], 5.0) == (True, why) and p.value(why) is None
        w.close()


def test_every_canary_sent_is_counted_under_its_targets_instance_for_the_rules_to_take_out(fleet):
    f = fleet()
    _tick_within(f.ctl)  # node0's round: node0 and its reference peers, one request each
    deadline = time.monotonic() + 5.0  # the round's requests go out on the workers, off the tick
    while len(f.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    targets = {u.removeprefix("http://") for _, u in f.sent}
    assert ADDR["node0"] in targets and len(targets) >= 2
    node_of = {a: n for n, a in ADDR.items()}
    for addr in targets:
        assert f.ctl.metrics.registry.get_sample_value(
            "grayguard_canary_requests_total", {"pool": "chat", "node": node_of[addr], "instance": addr}) == 1
