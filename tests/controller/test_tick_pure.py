"""The tick's decide step on hand-built observations (no sockets, no HTTP, no mocks), and the tick's order:
every pool's canaries are sent before any HAProxy write."""

from __future__ import annotations

import math

import pytest

from grayguard.config import PoolConfig, RecoveryConfig, ServerConfig
from grayguard.controller import canary, decide
from grayguard.controller.haproxy import ServerState
from grayguard.controller.policy import NodeState, Policy
from grayguard.promclient import Sample
from tests.support.ctl_helpers import (
    LAT_Q,
    RATE_Q,
    FakeHaproxy,
    FakeProm,
    fake_controller,
    samples,
    seasoned,
    tick_settled,
)

POOL = PoolConfig(name="chat", backend="vllm_chat")
ADDR = {f"node{i}": f"10.0.0.{i}:8000" for i in range(4)}
SERVERS = {n: ServerState("vllm_chat", n, a, 100, 100, 0, 2) for n, a in ADDR.items()}
# the 30 s window evaluated every 10 s: three samples are one observation, so a node's window can ask for a
# quarantine on its third tick (these ticks are 5 s apart, each with a new sample)
POLICIES = {"chat": Policy(window_samples=3)}


def observe(now, prev, lat, ttft=None, optional=None, pool=POOL, servers=SERVERS):
    """The observation the shell would build: latency/rate by address; canary rounds due now, answered by ttft."""
    rounds = ()
    if ttft is not None:
        due = canary.canary_rounds(sorted(servers), prev, {n: None for n in servers}, now, Policy().recovery)
        rounds = tuple(decide.CanaryRound(n, tuple(t[1:]), {m: ttft[m] for m in t}) for n, t in due)
    lat_s = [Sample({"instance": servers[n].address}, v, now) for n, v in lat.items()]
    rate_s = [Sample({"instance": servers[n].address}, 5.0, now) for n in lat]
    return decide.Observation(now, {"latency": lat_s, "rate": rate_s}, optional or {},
                              {pool.name: decide.PoolObservation(servers, prev, rounds)})


def run(ticks, t0=1000.0, step=5.0, **kw):
    """Feed the decide step its own states forward, from a controller that knows its quiet fleet (its learned
    noise: scoring.Noise); -> [(state, weight, drain, canary outcomes) of node0]."""
    prev: dict[str, NodeState] = {n: seasoned(since=t0 - step) for n in kw.get("servers", SERVERS)}
    seen = []
    for k, (lat, ttft) in enumerate(ticks):
        out = decide.decide_tick(observe(t0 + k * step, prev, lat, ttft, **kw), [POOL], POLICIES)["chat"]
        d = out.decision.nodes["node0"]
        seen.append((d.state.state, d.weight, d.drain, out.canaries))
        for n in ("node1", "node2", "node3"):
            assert out.decision.nodes[n].state.state == "healthy" and out.decision.nodes[n].weight == 100
        prev = out.states
    return seen


def slow(x=5.0):
    return {n: (0.02 * x if n == "node0" else 0.02) for n in ADDR}


def drained():
    return {n: 0.02 for n in ADDR if n != "node0"}  # drained: no traffic, no series


def test_a_5x_slow_node_of_four_degrades_is_quarantined_then_canaried_back():
    bad = {"node0": 0.5, "node1": 0.1, "node2": 0.1, "node3": 0.1}
    good = {"node0": 0.1, "node1": 0.1, "node2": 0.1, "node3": 0.1}
    seen = run([(slow(), None)] * 3 + [(drained(), bad)] * 8 + [(drained(), good)] * 6)[:16]
    states = [s for s, *_ in seen]
    assert seen[:3] == [("degraded", 1, False, []), ("degraded", 1, False, []), ("quarantined", 0, True, [])]
    assert states[3:6] == ["quarantined"] * 3 and states[6] == "canary"  # min_quarantine_s 20 at 5 s ticks
    # canaries every canary_interval_s (10 s = every other tick), each measured, each 5x: still canary
    assert [c for *_, c in seen[7:11]] == [[("node0", "measured")], [], [("node0", "measured")], []]
    assert states[7:11] == ["canary"] * 4
    # healthy again: canary_successes (3) good canaries in a row -> slow start at 10 % of base, back in rotation
    assert [c for *_, c in seen[11:]].count([("node0", "measured")]) == 3
    assert [s for s, *_ in seen[11:15]] == ["canary"] * 4
    assert seen[15] == ("slow_start", 10, False, [("node0", "measured")])


def test_a_failed_canary_is_bad_and_no_reference_is_no_estimate():
    failed = {"node0": None, "node1": 0.1, "node2": 0.1, "node3": 0.1}
    noref = {"node0": 0.1, "node1": None, "node2": None, "node3": None}
    seen = run([(slow(), None)] * 3 + [(drained(), None)] * 4 + [(drained(), failed), (drained(), noref)])
    assert seen[-2][0] == "canary" and seen[-2][3] == [("node0", "failed")]
    assert seen[-1][0] == "canary" and seen[-1][3] == []  # 10 s not yet elapsed since the failed one
    seen = run([(slow(), None)] * 3 + [(drained(), None)] * 4 + [(drained(), noref)])
    assert seen[-1][3] == [("node0", "no_reference")]


def test_the_decide_step_is_deterministic_and_leaves_its_inputs_alone():
    prev = {n: NodeState(ema=0.02) for n in ADDR}
    snapshot = dict(prev)
    obs = observe(1000.0, prev, slow())
    a = decide.decide_tick(obs, [POOL], POLICIES)
    b = decide.decide_tick(obs, [POOL], POLICIES)
    assert a == b and prev == snapshot
    # a pool the shell could not observe (its backend is missing) is not decided
    other = PoolConfig(name="code", backend="vllm_code")
    assert set(decide.decide_tick(obs, [POOL, other], {**POLICIES, "code": Policy()})) == {"chat"}


def test_inputs_match_samples_by_series_key_and_read_the_optional_signals():
    pool = PoolConfig(name="chat", backend="vllm_chat", series_label="node",
                      servers={"node1": ServerConfig(series="gpu-1", peer_group="h100")})
    opt = {"probe_result": [Sample({"node": "10.0.0.2:8000", "result": "cuda_error"}, 1.0, 0.0),
                            Sample({"node": "10.0.0.3:8000", "result": "ok"}, 0.0, 0.0)],
           "gpu_xid": [Sample({"node": "10.0.0.2:8000"}, 1.0, 0.0), Sample({"node": "10.0.0.3:8000"}, math.nan, 0.0)],
           "probe_failures": [Sample({"node": "10.0.0.2:8000"}, math.inf, 0.0)]}
    lat = [Sample({"node": "gpu-1"}, 0.03, 0.0), Sample({"node": "10.0.0.2:8000"}, 0.02, 0.0)]
    inputs = decide.node_inputs(pool, SERVERS, {"latency": lat, "rate": []}, opt, {"node0": math.inf})
    assert inputs["node1"].latency == 0.03 and inputs["node1"].peer_group == "h100"
    assert inputs["node2"].latency == 0.02 and inputs["node2"].probe_result == "cuda_error"
    assert inputs["node3"].probe_result is None  # only the result whose gauge is 1
    assert inputs["node2"].gpu_xid is True and inputs["node3"].gpu_xid is None  # NaN is no data
    assert inputs["node2"].probe_failures is None and inputs["node0"].canary == math.inf
    assert inputs["node0"].latency is None and inputs["node0"].request_rate is None  # absent is not zero


# -- the shell's order: observe every pool, start its canaries (off the tick), decide, then write -----------------
def test_every_pool_starts_its_canaries_in_the_tick_that_drains_and_the_next_tick_decides_them():
    now = 1000.0
    events: list = []
    backends = {b: [(f"node{i}", f"10.{k}.0.{i}:8000", 100) for i in range(4)]
                for k, b in enumerate(("vllm_a", "vllm_b"))}
    hap = FakeHaproxy("127.0.0.1:9999", backends, events)
    lat = {a: 0.02 for srvs in backends.values() for _n, a, _w in srvs[1:]}

    def answer(q):  # each pool's series carry its own pool label
        vals = lat if "latency" in q else dict.fromkeys(lat, 5.0)
        return [x for k, p in enumerate("ab") for x in samples({a: v for a, v in vals.items()
                                                                if a.startswith(f"10.{k}.")}, now, pool=p)]
    prom = FakeProm(answer, events)

    def send(url):
        events.append(("canary", url))
        return 0.1

    ctl = fake_controller([{"name": "a", "backend": "vllm_a"}, {"name": "b", "backend": "vllm_b"}], [hap], prom,
                          canary=send, clock=lambda: now)
    # node0 of each pool is due a canary, and HAProxy still has it in rotation: the tick must drain it
    for pool in ("a", "b"):
        ctl.states[pool] = {"node0": NodeState(state="canary", since=900.0, reason="x", cause="latency"),
                            **{f"node{i}": NodeState(ema=0.02, score=0.0) for i in (1, 2, 3)}}
    r = tick_settled(ctl)
    assert r.held is None and not r.errors
    kinds = [e[0] for e in events]
    assert kinds.count("canary") == 6 and kinds.count("apply") == 2  # node0 and two peers, per pool; a batch each
    sent = {e[1] for e in events if e[0] == "canary"}
    assert sent == {f"http://10.{k}.0.{i}:8000" for k in (0, 1) for i in (0, 1, 2)}
    written = {c for e in events if e[0] == "apply" for c in e[2]}
    assert {"set server vllm_a/node0 state drain", "set server vllm_b/node0 state drain"} <= written
    measured = {"pool": "b", "node": "node0", "result": "measured"}
    assert ctl.metrics.registry.get_sample_value("grayguard_canaries_total", measured) is None  # not decided yet
    del events[:]
    r = ctl.tick()
    assert r.held is None and not r.errors
    assert [e for e in events if e[0] == "canary"] == []  # the rounds taken now: no other starts this tick
    assert ctl.metrics.registry.get_sample_value("grayguard_canaries_total", measured) == 1
    assert ctl.states["a"]["node0"].canary_ok == 1 and ctl.states["a"]["node0"].last_canary == now


def test_a_held_tick_sends_no_canary_and_writes_nothing():
    events: list = []
    hap = FakeHaproxy("127.0.0.1:9999", {"vllm_a": [(f"node{i}", f"10.0.0.{i}:8000", 100) for i in range(4)]},
                      events)
    # evaluated at 1000, data of time 0 (timestamp()): 1000 s old, stale
    prom = FakeProm({q: samples({"10.0.0.1:8000": 0.0 if q.startswith("timestamp(") else 0.02}, 1000.0, pool="a")
                     for q in (LAT_Q, RATE_Q, f"timestamp({LAT_Q})", f"timestamp({RATE_Q})")}, events)

    def send(url):
        events.append(("canary", url))
        return 0.1

    ctl = fake_controller([{"name": "a", "backend": "vllm_a"}], [hap], prom, canary=send, clock=lambda: 1000.0)
    ctl.states["a"] = {"node0": NodeState(state="canary", since=900.0),
                       **{f"node{i}": NodeState(ema=0.02) for i in (1, 2, 3)}}
    r = ctl.tick()
    assert r.held and "old" in r.held
    assert [e[0] for e in events if e[0] in ("canary", "apply")] == []


@pytest.mark.parametrize("interval,due", [(10.0, True), (60.0, False)])
def test_canary_rounds_follow_the_recovery_interval(interval, due):
    prev = {"node0": NodeState(state="canary", since=0.0, last_canary=950.0),
            **{f"node{i}": NodeState(ema=0.02) for i in (1, 2, 3)}}
    rounds = canary.canary_rounds(sorted(SERVERS), prev, {}, 1000.0, RecoveryConfig(canary_interval_s=interval))
    assert rounds == ([("node0", ["node0", "node1", "node2"])] if due else [])


def test_the_pool_data_the_shell_checked_is_the_data_decided_on(monkeypatch):
    # the shell matches every pool's series to its servers once a tick (check_pool_data, before the canaries) and
    # decide_tick takes that match as it is: the same outcome as matching again, one match per pool
    now, prev = 1000.0, {}
    obs = observe(now, prev, slow())
    data = decide.pool_data(POOL, SERVERS, obs.samples, obs.max_age_s)
    given = decide.Observation(now, obs.samples, {}, {"chat": decide.PoolObservation(SERVERS, prev, data=data)},
                               obs.max_age_s)
    assert decide.decide_tick(given, [POOL], POLICIES) == decide.decide_tick(obs, [POOL], POLICIES)

    backends = {"vllm_chat": [(n, a, 100) for n, a in ADDR.items()]}
    hap = FakeHaproxy("127.0.0.1:9999", backends, [])
    prom = FakeProm(lambda q: samples({a: 0.02 * (5 if n == "node0" else 1) if "latency" in q else 5.0
                                       for n, a in ADDR.items()}, now), [])
    ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [hap], prom, clock=lambda: now)
    calls = []
    real = decide.pool_data
    monkeypatch.setattr(decide, "pool_data", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    r = ctl.tick()
    assert r.held is None and calls == ["chat"]
    assert r.decisions["chat"].nodes["node0"].state.state == "degraded"
