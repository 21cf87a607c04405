import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller.haproxy import ServerState
from grayguard.controller.live import LiveMemory
from grayguard.controller.peers import coefficients
from grayguard.controller.plan import plan_backend
from grayguard.controller.policy import (
    CANARY,
    DEGRADED,
    EJECTED,
    HEALTHY,
    QUARANTINED,
    SLOW_START,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
    latency_factor,
    max_ejected,
    on_this_clock,
    target_weight,
)
from grayguard.controller.scoring import Noise
from grayguard.vocab import DrainCause, ProbeResult
from tests.support.ctl_helpers import seasoned

P = Policy()
STATES = [HEALTHY, DEGRADED, QUARANTINED, CANARY, SLOW_START]

node_state = st.builds(
    NodeState,
    state=st.sampled_from(STATES),
    since=st.floats(0, 1000),
    ema=st.one_of(st.none(), st.floats(0.001, 1.0)),
    score=st.one_of(st.none(), st.floats(-20, 50)),
    canary_ok=st.integers(0, 5),
    last_canary=st.one_of(st.none(), st.floats(0, 1000)),
    weight=st.one_of(st.none(), st.integers(0, 256)),
)
node_input = st.builds(
    NodeInput,
    base_weight=st.integers(0, 256),
    latency=st.one_of(st.none(), st.just(math.nan), st.just(math.inf), st.floats(0.001, 1.0)),
    request_rate=st.one_of(st.none(), st.floats(0, 100)),
    peer_group=st.sampled_from([None, None, "a", "b"]),
    canary=st.one_of(st.none(), st.just(math.inf), st.floats(0.001, 1.0)),
    hold=st.booleans(),
    down=st.booleans(),
    haproxy_weight=st.one_of(st.none(), st.integers(0, 256)),
    haproxy_drain=st.booleans(),
)


@st.composite
def pools(draw):
    n = draw(st.integers(1, 12))
    names = [f"n{i}" for i in range(n)]
    inputs = {k: draw(node_input) for k in names}
    prev = {k: draw(node_state) for k in names if draw(st.booleans())}
    # any previous tick, even one over the cap (nodes went to MAINT or DOWN since, the cap was lowered)
    return prev, inputs, draw(st.floats(1000, 2000))


@settings(max_examples=300, deadline=None)
@given(pools(), st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]))
def test_the_cap_bounds_what_is_out_of_rotation_from_any_cause_and_weights_in_range(p, fraction):
    prev, inputs, now = p
    pol = Policy(ThresholdsConfig(max_ejected_fraction=fraction), RecoveryConfig())
    d = decide_pool(prev, inputs, pol, now)
    cap = max_ejected(len(inputs), fraction)
    away = {n for n, i in inputs.items() if i.hold or i.down}  # MAINT or DOWN: capacity already gone
    drained = [n for n, nd in d.nodes.items() if nd.state.state in EJECTED]
    kv_zero = [n for n, nd in d.nodes.items() if nd.weight == 0 and not nd.drain and inputs[n].base_weight > 0]
    ours = {n for n in drained + kv_zero if n not in away}  # what the controller took out
    assert len(ours) <= max(0, cap - len(away))
    assert len(away | ours) <= max(cap, len(away)) and d.out_of_rotation == len(away | ours)
    assert d.ejected == len(drained)
    for nd in d.nodes.values():
        assert nd.weight is None or 0 <= nd.weight <= 256
        assert nd.state.state in STATES


@settings(max_examples=200, deadline=None)
@given(pools(), st.randoms())
def test_permuting_nodes_changes_nothing(p, rnd):
    prev, inputs, now = p
    names = list(inputs)
    rnd.shuffle(names)
    shuffled_inputs = {n: inputs[n] for n in names}
    shuffled_prev = {n: prev[n] for n in reversed(names) if n in prev}
    a = decide_pool(prev, inputs, P, now)
    b = decide_pool(shuffled_prev, shuffled_inputs, P, now)
    assert a == b


@settings(max_examples=200, deadline=None)
@given(pools())
def test_a_converged_state_plans_no_writes(p):
    prev, inputs, now = p
    d = decide_pool(prev, inputs, P, now)
    # HAProxy after applying the plan: exactly what was decided
    actual = {n: ServerState("be", n, "127.0.0.1:1", nd.weight if nd.weight is not None else 7,
                             inputs[n].base_weight, 0x08 if nd.drain else 0, 2) for n, nd in d.nodes.items()}
    first = plan_backend("p", "be", d.nodes, {})
    assert first == []  # no known servers: nothing to write
    assert plan_backend("p", "be", d.nodes, actual) == []


def test_plan_orders_drain_before_weight_and_weight_before_ready():
    d = decide_pool({"a": NodeState(state=QUARANTINED, since=0), "b": NodeState(), "c": NodeState()}, {
        "a": NodeInput(100), "b": NodeInput(100), "c": NodeInput(100)}, P, 1.0)
    actual = {n: ServerState("be", n, "h:1", 100, 100, 0, 2) for n in "abc"}
    plan = plan_backend("p", "be", d.nodes, actual)
    assert [(c.command.kind, c.command.value) for c in plan] == [("state", "drain"), ("weight", 0)]
    back = {"a": ServerState("be", "a", "h:1", 0, 100, 0x08, 2)}
    d2 = decide_pool({"a": NodeState(state=SLOW_START, since=0)}, {"a": NodeInput(100)}, P, 0.0)
    plan2 = plan_backend("p", "be", d2.nodes, back)
    assert [(c.command.kind, c.command.value) for c in plan2] == [("weight", 10), ("state", "ready")]


def test_maint_servers_are_left_alone():
    d = decide_pool({}, {"a": NodeInput(100, hold=True)}, P, 0.0)
    actual = {"a": ServerState("be", "a", "h:1", 3, 100, 0x01, 0)}
    assert d.nodes["a"].weight is None
    assert plan_backend("p", "be", d.nodes, actual) == []


def fleet(latencies, prev=None, now=100.0, policy=P, groups=None):
    inputs = {n: NodeInput(100, v, peer_group=(groups or {}).get(n)) for n, v in latencies.items()}
    return decide_pool(prev or {}, inputs, policy, now)


def test_degraded_weight_follows_the_seeds_formula_in_half_steps():
    def w(score):
        return target_weight(NodeState(state=DEGRADED, factors=(("latency", latency_factor(score), ""),)), 100, 0, P)
    assert w(3.2) == round(100 * 2 ** -1.0)  # 3.2 -> 3.0
    assert w(2.3) == 100
    assert w(40) == 1  # keeps being measured


def test_safeguard_caps_quarantine_and_says_so():
    pol = Policy(window_samples=1)  # one sample a window: one sample's evidence is one observation
    lat = {"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1, "e": 0.5, "f": 0.6}
    d = fleet(lat, policy=pol)
    assert max_ejected(6, 0.3) == 1
    assert [n for n, x in d.nodes.items() if x.state.state == QUARANTINED] == ["f"]  # the worst first
    assert d.nodes["e"].state.state == DEGRADED and d.safeguard
    assert "safeguard" in d.nodes["e"].state.reason


def test_a_full_cap_goes_to_the_node_sick_now_not_to_a_drained_one_whose_canaries_pass():
    """Found on the real fleet (tests/fixtures/vllm/runs/thermal-1.5rps-quiet-b): a healthy node drained for an
    agent's 2 s hang verdict held the 4-node pool's cap of one in canary, passing, while the throttled node waited
    at weight 1 until it left: quarantined 14.1 s after the fault instead of 7.2 s."""
    pol = Policy(window_samples=1)  # one sample a window: one sample's evidence is one observation
    lat = {"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1, "e": 0.1, "f": 0.6}
    drained = {"a": seasoned(state=CANARY, since=50.0, canary_ok=1, cause=DrainCause.GATEWAY)}
    prev = {**{n: seasoned(since=0.0) for n in "bcdef"}, **drained}
    d = decide_pool(prev, {**{n: NodeInput(100, v) for n, v in lat.items() if n != "a"}, "a": NodeInput(100)},
                    pol, 100.0)
    assert d.nodes["f"].state.state == QUARANTINED and not d.safeguard
    assert d.nodes["a"].state.state == SLOW_START and "released for f" in d.nodes["a"].state.reason
    # a drained node whose canaries have not passed yet is no sicker a candidate's to take: the cap holds
    held = {"a": seasoned(state=CANARY, since=50.0, canary_ok=0, cause=DrainCause.GATEWAY)}
    d = decide_pool({**prev, **held}, {**{n: NodeInput(100, v) for n, v in lat.items() if n != "a"},
                                       "a": NodeInput(100)}, pol, 100.0)
    assert d.nodes["a"].state.state == CANARY and d.nodes["f"].state.state != QUARANTINED and d.safeguard


def test_small_pools_never_eject():
    assert max_ejected(2, 1.0) == 0 and max_ejected(3, 0.3) == 1 and max_ejected(10, 0.3) == 3
    d = fleet({"a": 0.1, "b": 1.0})
    assert all(x.state.state == HEALTHY and x.state.score is None for x in d.nodes.values())


def test_hysteresis_a_node_at_the_edge_does_not_flap():
    """The window's test cuts at the evidence of 1.5x in one sample (a quiet pool) and ends the cut only at a calm
    sample, within one noise width of the allowance (below 1.1 x e^0.1 = 1.22x): a node alternating above and below
    the cut ratio stays cut."""
    peers = {"a": 0.1, "b": 0.1, "c": 0.1}
    prev: dict = {n: seasoned(since=0.0) for n in ("a", "b", "c", "x")}  # a controller that knows its quiet fleet
    states = []
    for i in range(7):  # alternates just above and just below the cut ratio (longer: its evidence drains it)
        x = 0.16 if i % 2 == 0 else 0.14
        d = fleet({**peers, "x": x}, prev=prev, now=float(i))
        prev = {n: nd.state for n, nd in d.nodes.items()}
        states.append(prev["x"].state)
    assert states[0] == DEGRADED and set(states) == {DEGRADED}  # 1.4x is not calm
    d = fleet({**peers, "x": 0.115}, prev=prev, now=20.0)  # 1.15x: calm, the cut ends
    assert d.nodes["x"].state.state == HEALTHY


def test_a_thin_window_fast_by_chance_sets_no_group_mates_expectation():
    """A mixed pool of two 2-node GPU groups: each group's speed is its fastest member's (a sick node is slower,
    never faster). A node back in slow start finished three short requests in its window, fast by chance (0.54x):
    counted at its value, it made its healthy group-mate read 1.85x (seed 2, kv_thrash/n4/mixed/bursty: a healthy
    node cut 5 s, when `min_request_rate` was taken out). Each member counts at its value times its sampling noise
    beyond the best-measured member's: the group-mate is not cut, and a slow group-mate still is."""
    groups = {"a1": "a", "a2": "a", "b1": "b", "b2": "b"}

    def tick(a2: float):
        inputs = {"a1": NodeInput(100, 0.054, peer_group="a", request_rate=0.1),  # 3 requests in 30 s
                  "a2": NodeInput(100, a2, peer_group="a", request_rate=10.0),
                  **{n: NodeInput(100, 0.1, peer_group=groups[n], request_rate=10.0) for n in ("b1", "b2")}}
        prev = {n: seasoned(since=0.0) for n in inputs}
        return decide_pool(prev, inputs, Policy(window_samples=1), 100.0).nodes
    d = tick(0.1)
    assert all(x.state.state == HEALTHY and x.weight == 100 for x in d.values()), \
        {n: (x.state.state, x.state.reason) for n, x in d.items()}
    assert d["a2"].state.ratio < 1.2
    slow = tick(0.3)  # 3x its well-measured peers: the thin fast member does not hide it either
    assert slow["a2"].state.state in (DEGRADED, QUARANTINED)
    # the plain minimum, for values without a noise of their own (the canary baseline, the live signals)
    assert coefficients({"a1": 0.054, "a2": 0.1, "b1": 0.1, "b2": 0.1}, groups, 3, {})["a"] == pytest.approx(0.54)


def test_no_data_holds_state_and_weight():
    prev = {"x": NodeState(state=DEGRADED, score=4.0, weight=25, ema=0.5, window=LiveMemory(cut=True, z=4.0))}
    d = fleet({"a": None, "b": None, "c": None, "x": None}, prev=prev)
    assert d.nodes["x"].state.state == DEGRADED and d.nodes["x"].weight == 25


_TIME = st.one_of(st.none(), st.floats(0, 2e9))


@given(st.floats(1e8, 1e9), _TIME, _TIME, _TIME, _TIME, _TIME, _TIME)
def test_states_on_this_clock_hold_no_time_after_now_but_a_warm_up_and_keep_the_rest(now, since, canary, ramp, gone,
                                                                                    w_at, l_at):
    """on_this_clock (the state file's and the registry's states, written on another clock): a time after now is
    now, a warm-up ends at most new_node_warmup_s from now, and every time before now is kept as it was."""
    t = ThresholdsConfig()
    s = NodeState(state=QUARANTINED, since=since or 0.0, last_canary=canary, ramp_start=ramp, gone_since=gone,
                  window=LiveMemory(noise=Noise(0.2, 60.0, w_at)), live_itl=LiveMemory(noise=Noise(0.3, 60.0, l_at)),
                  reason="kept")
    got = on_this_clock({"n": s}, now, t)["n"]
    for name, at in (("since", lambda x: x.since), ("last_canary", lambda x: x.last_canary),
                     ("gone_since", lambda x: x.gone_since), ("window", lambda x: x.window.noise.at),
                     ("live_itl", lambda x: x.live_itl.noise.at)):
        before, after = at(s), at(got)
        assert after == (before if before is None or before <= now else now), name
    assert got.ramp_start == (ramp if ramp is None or ramp <= now + t.new_node_warmup_s
                              else now + t.new_node_warmup_s)
    assert (got.state, got.reason, got.window.noise.dev, got.live_itl.noise.dev) == (QUARANTINED, "kept", 0.2, 0.3)
    if all(x is None or x <= now for x in (since, canary, gone, w_at, l_at)) and \
            (ramp is None or ramp <= now + t.new_node_warmup_s):
        assert got is s  # on this clock already: the same object


@pytest.mark.parametrize("n", [3, 4, 10, 1000])
def test_one_node_stays_in_rotation_whatever_the_fraction(n):
    """At max_ejected_fraction 1.0 a pool whose every node asks for a quarantine was drained whole: one node at least
    stays in rotation now, the one the others' cap leaves. (Found with a pool whose probes all time out, the probe
    path broken; those drain no one since 2026-12-06, their peers' failing too: a CUDA error on every node, a bad
    driver rolled out, is such a pool now.)"""
    assert max_ejected(n, 1.0) == n - 1 and max_ejected(n, 0.999999999999) == n - 1
    pol = Policy(ThresholdsConfig(max_ejected_fraction=1.0), RecoveryConfig())
    prev = {f"n{i}": NodeState(since=0.0) for i in range(n if n < 100 else 20)}
    for k in range(5):
        d = decide_pool(prev, {m: NodeInput(100, 0.02, request_rate=5.0, probe_result=ProbeResult.CUDA_ERROR,
                                            probe_failures=k + 1) for m in prev}, pol, 100.0 + k)
        prev = {m: x.state for m, x in d.nodes.items()}
    assert sum(x.state.state == QUARANTINED for x in d.nodes.values()) == len(prev) - 1 and d.safeguard


@pytest.mark.parametrize("groups, speed, live, uncompared", [
    (lambda i: "a", {}, True, []),  # one group: everyone compared
    (lambda i: f"g{i}", {}, True, [f"n{i}" for i in range(10)]),  # a label that gives every node a group of its own
    (lambda i: f"g{i // 2}", {}, True, []),  # pairs: each pair's speed from the pair, compared with the pool
    (lambda i: "a" if i else "b", {}, True, ["n0"]),  # one L40S among H100s, no speed for it
    (lambda i: "a" if i else "b", {"b": 2.0}, True, []),  # its speed configured: compared at that speed
    (lambda i: "a" if i else "b", {}, False, ["n0"]),  # the window alone, the same
])
def test_nodes_no_comparison_scores_are_named(groups, speed, live, uncompared):
    """PoolDecision.uncompared: nodes in rotation with a latency value that no peer comparison scores (the shell counts
    them, grayguard_pool_nodes_uncompared, and names them): a slow one would go unseen by the latency detectors."""
    prev: dict = {}
    for k in range(3):
        ins = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0, peer_group=groups(i),
                                  live_itl=0.02 if live else None, live_decode_batch=8.0, live_prefill_rate=1000.0)
               for i in range(10)}
        d = decide_pool(prev, ins, Policy(group_speed=speed), 1000.0 + k)
        prev = {m: nd.state for m, nd in d.nodes.items()}
    assert sorted(d.uncompared) == uncompared
