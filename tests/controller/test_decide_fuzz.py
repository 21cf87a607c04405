"""decide_pool fuzzed with full inputs (issue 33): every field a node reports (window, live, probes, KV, GPU evidence,
agent, gateway reflex, MAINT, DOWN) drawn at random over a few ticks, each tick starting from the state the last one
decided. Two properties that no mix of signals may break:
- the cap: what the controller takes out of rotation, from any cause, stays within max_ejected;
- a node that gets slower never gains weight: the same tick with one node's latencies (window, live ITL and TTFT,
  probes, canary) multiplied by k >= 1, everything else equal, leaves that node at most the weight it had.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller.policy import EJECTED, NodeInput, Policy, decide_pool, max_ejected

PROBE_CLASSES = [None, "ok", "ok", "ok", "slow", "timeout", "hang", "cuda_error", "garbage", "refused"]
SECONDS = st.floats(0.001, 2.0)


def maybe(s):
    return st.one_of(st.none(), s)


full_input = st.builds(
    NodeInput,
    base_weight=st.sampled_from([0, 1, 100, 100, 256]),
    latency=st.one_of(st.none(), st.just(math.nan), SECONDS),
    request_rate=maybe(st.floats(0, 50)),
    peer_group=st.sampled_from([None, None, None, "a"]),
    canary=st.one_of(st.none(), st.just(math.inf), SECONDS),
    hold=st.booleans(),
    probe_result=st.sampled_from(PROBE_CLASSES),
    probe_ttft=maybe(SECONDS),
    probe_failures=maybe(st.integers(0, 5)),
    error_ratio=maybe(st.floats(0, 1)),
    live_itl=maybe(st.floats(0.005, 1.0)),
    live_ttft=maybe(SECONDS),
    probe_ttft_median=maybe(SECONDS),
    live_prefill_rate=maybe(st.floats(0, 20000)),
    live_decode_batch=maybe(st.floats(0, 64)),
    kv_cache_usage=maybe(st.floats(0, 1)),
    gpu_throttled=maybe(st.booleans()),
    pcie_degraded=maybe(st.booleans()),
    gpu_ecc_uncorrectable=maybe(st.booleans()),
    gpu_xid=maybe(st.booleans()),
    down=st.booleans(),
    gateway_marked_down=st.booleans(),
    gateway_errors=maybe(st.integers(0, 3)),
    agent_down=st.booleans(),
    haproxy_weight=maybe(st.integers(0, 256)),
    haproxy_drain=st.booleans(),
).map(lambda i: replace(i, down=i.down or i.agent_down or i.gateway_marked_down))  # as HAProxy reports them: both
# the agent's and the reflex's mark-downs are DOWN (controller/haproxy.py ServerState)


def healthy_ish(i: NodeInput) -> NodeInput:
    """Most nodes most of the time: no hard fault, no MAINT, up (so the soft signals decide)."""
    return replace(i, hold=False, down=False, gateway_marked_down=False, agent_down=False,
                   probe_result=i.probe_result if i.probe_result in (None, "ok", "slow") else "ok",
                   gpu_ecc_uncorrectable=None, gpu_xid=None)


@st.composite
def histories(draw, soft_only: bool = False):
    """A pool of 3-10 nodes over 1-6 ticks, one second apart: each tick's inputs for every node."""
    n = draw(st.integers(3, 10))
    names = [f"n{i}" for i in range(n)]
    ticks = draw(st.integers(1, 6))
    base = {k: draw(full_input) for k in names}
    seq = []
    for _ in range(ticks):  # a node keeps its inputs or draws new ones each tick
        base = {k: (draw(full_input) if draw(st.booleans()) else v) for k, v in base.items()}
        seq.append({k: healthy_ish(v) if soft_only or draw(st.integers(0, 3)) else v for k, v in base.items()})
    return seq


def run(seq, pol, start=1000.0):
    """The decisions of every tick in turn, each from the last one's states (and the nodes it retained)."""
    prev, out = {}, []
    for k, inputs in enumerate(seq):
        d = decide_pool(prev, inputs, pol, start + k)
        out.append(d)
        prev = {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}
    return prev, out


@settings(max_examples=300, deadline=None)
@given(histories(), st.sampled_from([0.1, 0.3, 0.5]))
def test_the_cap_holds_on_every_tick_whatever_the_nodes_report(seq, fraction):
    pol = Policy(ThresholdsConfig(max_ejected_fraction=fraction), RecoveryConfig())
    _, decisions = run(seq, pol)
    for inputs, d in zip(seq, decisions, strict=True):
        cap = max_ejected(len(inputs), fraction)
        # MAINT or DOWN, less the agent-marked nodes whose agent the decision disables (their health check puts
        # them back: capacity that returns)
        away = {n for n, i in inputs.items() if i.hold or i.down} - d.agent_off
        drained = {n for n, nd in d.nodes.items() if nd.state.state in EJECTED}
        kv_zero = {n for n, nd in d.nodes.items() if nd.weight == 0 and not nd.drain and inputs[n].base_weight > 0}
        ours = (drained | kv_zero) - away
        assert len(ours) <= max(0, cap - len(away)), (sorted(ours), sorted(away), cap)
        for nd in d.nodes.values():
            assert nd.weight is None or 0 <= nd.weight <= 256


def slower(i: NodeInput, k: float) -> NodeInput:
    """The same node, its every latency k times longer (what it reports as load is unchanged)."""
    def x(v):
        return None if v is None else v * k
    return replace(i, latency=x(i.latency), canary=x(i.canary), probe_ttft=x(i.probe_ttft), live_itl=x(i.live_itl),
                   live_ttft=x(i.live_ttft), probe_ttft_median=x(i.probe_ttft_median))


def weight_of(d, n: str, before: int) -> int:
    """The weight HAProxy gives node n once the decision is applied (0 drained; None: left as it was)."""
    nd = d.nodes[n]
    if nd.drain or nd.state.state in EJECTED:
        return 0
    return before if nd.weight is None else nd.weight


@settings(max_examples=300, deadline=None)
@given(histories(soft_only=True), st.data(), st.floats(1.0, 40.0))
def test_a_node_that_gets_slower_never_gains_weight(seq, data, k):
    pol = Policy()
    prev, decisions = run(seq[:-1], pol)
    last = seq[-1]
    n = data.draw(st.sampled_from(sorted(last)))
    now = 1000.0 + len(seq) - 1
    before = last[n].haproxy_weight if last[n].haproxy_weight is not None else last[n].base_weight
    if n in prev and prev[n].weight is not None:
        before = prev[n].weight
    as_is = decide_pool(prev, last, pol, now)
    slowed = decide_pool(prev, {**last, n: slower(last[n], k)}, pol, now)
    w0, w1 = weight_of(as_is, n, before), weight_of(slowed, n, before)
    assert w1 <= w0, (n, k, w0, w1, as_is.nodes[n].state.reason, slowed.nodes[n].state.reason)


# What a broken exporter or a lying backend can put in a finite float: magnitudes a float holds but no latency has
GARBAGE = st.sampled_from([1e-300, 1e-30, 1e-9, 0.02, 1e9, 1e30, 1e300, 0.0, -1.0, math.inf, math.nan])
garbage_input = st.builds(
    NodeInput, base_weight=st.just(100), latency=maybe(GARBAGE), request_rate=maybe(GARBAGE),
    peer_group=st.sampled_from([None, "a", "b"]), probe_ttft=maybe(GARBAGE), error_ratio=maybe(GARBAGE),
    live_itl=maybe(GARBAGE), live_ttft=maybe(GARBAGE), probe_ttft_median=maybe(GARBAGE),
    live_prefill_rate=maybe(GARBAGE), live_decode_batch=maybe(GARBAGE), kv_cache_usage=maybe(GARBAGE),
    probe_result=st.sampled_from(PROBE_CLASSES))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from([f"n{i}" for i in range(8)]), garbage_input, min_size=1),
                min_size=1, max_size=4))
def test_garbage_values_are_survived(ticks):
    """A node reporting garbage (1e300 s of ITL among peers of milliseconds, 1e-300 s, zero, negative, NaN, infinity,
    in any latency, rate, batch or cache field) does not stop the decision: before, a ratio of 1e300 / 1e-3 overflowed
    math.exp (OverflowError), a speed coefficient underflowed to 0 (ZeroDivisionError) and a quotient to 0 had no log
    (ValueError), and one such node failed the tick of every pool. Every weight stays within HAProxy's range."""
    prev = {}
    for k, inputs in enumerate(ticks):
        d = decide_pool(prev, inputs, Policy(), 1000.0 + k)
        assert all(nd.weight is None or 0 <= nd.weight <= 256 for nd in d.nodes.values())
        prev = {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}
