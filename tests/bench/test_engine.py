"""Unit tests of the benchmark engine: balancers, normalized latency, detectors, determinism, branching."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from grayguard.bench.engine import OK, TIMEOUT, Run, run, run_family
from grayguard.bench.lb import LeastConn, RoundRobin, make_balancer
from grayguard.bench.metrics import capacity_kept, out_of_full, percentile, summarize, transitions
from grayguard.bench.node import CANARY, PROBE, REAL, FixedBackend, NodeObs, VirtualNode, node_input, observe
from grayguard.bench.policies import Envoy, Grayguard, Seeds, make_policy
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario, make_arrivals
from grayguard.controller.policy import NodeState
from grayguard.sim.loadgen import LengthDist
from grayguard.sim.model import NO_SLOWDOWN, Finished, FirstToken, Slowdown


def pool(n: int, **kw) -> tuple[NodeSpec, ...]:
    return tuple(NodeSpec(f"node{i}", **kw) for i in range(n))


def small(n: int = 4, faults=(), duration: float = 40.0, **kw) -> Scenario:
    return Scenario("t", pool(n), LoadSpec(utilization=0.3), tuple(faults), duration_s=duration, seed=3, **kw)


# -- balancers ------------------------------------------------------------------------------------
def test_leastconn_picks_lowest_active_per_weight():
    lb = LeastConn(3)
    for _ in range(4):
        lb.started(0)
    lb.started(1)
    # (4+1)/100, (1+1)/10, (0+1)/100: node2
    assert lb.pick([100, 10, 100], [False] * 3) == 2
    lb.started(2)
    lb.started(2)
    # (4+1)/100 = .05, (1+1)/10 = .2, (2+1)/100 = .03
    assert lb.pick([100, 10, 100], [False] * 3) == 2


def test_leastconn_ties_go_to_the_server_that_waited_longest():
    lb = LeastConn(3)
    picks = []
    for _ in range(6):
        k = lb.pick([100, 100, 100], [False] * 3)
        picks.append(k)
        lb.started(k)
    assert picks == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("name", ["leastconn", "roundrobin"])
def test_zero_weight_and_drained_servers_get_nothing(name):
    lb = make_balancer(name, 4)
    got = Counter()
    for _ in range(300):  # requests stay open: leastconn spreads them by weight too
        k = lb.pick([100, 0, 100, 50], [False, False, True, False])
        got[k] += 1
        lb.started(k)
    assert got == {0: 200, 3: 100}
    assert lb.pick([0, 0, 0, 0], [False] * 4) is None
    assert lb.pick([1, 1, 1, 1], [True] * 4) is None


def test_roundrobin_follows_weights_and_interleaves():
    lb = RoundRobin(3)
    seq = [lb.pick([300, 100, 0], [False] * 3) for _ in range(400)]
    c = Counter(seq)
    assert c[0] == 300 and c[1] == 100 and c[2] == 0
    assert "0000" not in "".join(map(str, seq))  # smooth: never four in a row at 3:1


def test_leastconn_weights_share_when_requests_stay_open():
    lb = LeastConn(2)
    for _ in range(30):  # long requests: nothing ends
        lb.started(lb.pick([200, 100], [False, False]))
    assert lb.active == [20, 10]


def test_unknown_balancer():
    with pytest.raises(ValueError, match="unknown balancer"):
        make_balancer("random", 2)


# -- normalized latency -----------------------------------------------------------------------------
def test_observe_is_the_recording_rule_over_the_lagged_window():
    scn = replace(small(), window_s=30.0, signal_lag_s=5.0, omega=0.25)
    node = VirtualNode(scn.nodes[0], 0, scn)
    # (finish time, e2e, prompt, generated, kind)
    node.finished.extend([(60.0, 9.0, 100, 10, REAL), (70.0, 2.0, 400, 50, REAL), (80.0, 4.0, 40, 40, REAL),
                          (85.0, 0.5, 8, 1, CANARY), (90.0, 0.1, 8, 1, PROBE), (96.0, 50.0, 1, 1, REAL)])
    node.errors.extend([75.0, 97.0])
    # window (65, 95]: the 70 s and 80 s requests, a canary, a probe and the 75 s error
    o = observe(node, 100.0, scn)
    assert o.latency == pytest.approx((2.0 + 4.0 + 0.5) / (0.25 * 400 + 50 + 0.25 * 40 + 40 + 0.25 * 8 + 1))
    assert o.request_rate == pytest.approx(2 / 30)  # neither the canary nor the probe is one of the node's requests
    assert o.error_ratio == pytest.approx(1 / 5)  # vLLM's request_success_total counts them both
    assert len(node.finished) == 5  # the 60 s record is gone for good


def test_no_sample_when_nothing_finished():
    scn = small()
    node = VirtualNode(scn.nodes[0], 0, scn)
    o = observe(node, 50.0, scn)
    assert o.latency is None and o.request_rate == 0 and o.error_ratio is None
    inp = node_input(scn.nodes[0], o)
    assert inp.latency is None and inp.base_weight == 100


def test_node_input_passes_the_signals_nodeinput_has():
    spec = NodeSpec("a", peer_group="h100", base_weight=80)
    o = NodeObs(latency=0.01, request_rate=2.0, error_ratio=0.5, kv_cache_usage=0.3, gpu_throttled=True,
                probe_result="timeout", probe_failures=2)
    inp = node_input(spec, o, canary=0.02)
    assert (inp.base_weight, inp.latency, inp.request_rate, inp.peer_group, inp.canary) == (80, 0.01, 2.0, "h100",
                                                                                           0.02)
    for name in ("error_ratio", "kv_cache_usage", "gpu_throttled", "probe_result", "probe_failures"):
        if hasattr(inp, name):
            assert getattr(inp, name) == getattr(o, name)


def test_fixed_backend_latency_slowdown_and_stall():
    k = {"v": 1.0}
    b = FixedBackend(0.01, lambda now: Slowdown(k["v"], k["v"]) if k["v"] != 1 else NO_SLOWDOWN)
    b.submit(1, 1, 1, 0.0)
    k["v"] = 200.0
    b.submit(2, 1, 1, 0.0)
    evs = b.advance(0.5)
    assert [type(e) for e in evs] == [FirstToken, Finished] and evs[1].stats.e2e == pytest.approx(0.01)
    b.stall(1.0)
    assert b.advance(5.0) == [] and b.next_event_time() == math.inf
    b.resume(3.0)
    assert b.next_event_time() == pytest.approx(4.0)  # 2.0 s of work, stalled for 2 s
    assert not b.abort(2)  # a plain server finishes the work anyway


# -- determinism, branching, routing ----------------------------------------------------------------
def test_same_seed_same_run_and_other_seed_other_run():
    scn = small(faults=[FaultSpec("node0", "thermal", 15.0)])
    a, b = run(scn, "grayguard"), run(scn, "grayguard")
    assert (a.status, a.ttft, a.e2e, a.node, a.timeline) == (b.status, b.ttft, b.e2e, b.node, b.timeline)
    c = run(replace(scn, seed=4), "grayguard")
    assert c.t != a.t


def test_every_policy_sees_identical_traffic():
    scn = small()
    arr = make_arrivals(scn)
    assert len(arr) > 100
    results = [run(scn, p) for p in ("roundrobin", "leastconn", "envoy")]
    assert all(r.t == arr.t for r in results)


def test_branching_equals_full_runs():
    scns = [small(faults=[FaultSpec("node0", f, 20.0)], duration=35.0) for f in ("thermal", "cuda_error", "hang")]
    scns = [replace(s, name=f"t{i}") for i, s in enumerate(scns)] + [replace(scns[0].healthy_twin(), name="h")]
    fam = run_family(scns, "grayguard")
    for s, r in zip(scns, fam, strict=True):
        full = run(s, "grayguard")
        assert (r.status, r.ttft, r.node, r.timeline) == (full.status, full.ttft, full.node, full.timeline), s.name


def test_a_drained_node_gets_no_new_requests():
    r = run(small(faults=[FaultSpec("node0", "thermal", 10.0)], duration=90.0), "grayguard")
    drained = [t for t, k, _w, d, _s in r.timeline if k == 0 and d]
    assert drained, "a x6 node is quarantined"
    start = drained[0]
    assert not [t for t, k in zip(r.t, r.node, strict=True) if k == 0 and t > start]


def test_hang_requests_time_out_and_abort():
    short = LengthDist(20, 0.5, 4, 60)  # under a second each: only the hung node misses the deadline
    scn = replace(small(faults=[FaultSpec("node0", "hang", 10.0)], duration=30.0),
                  load=LoadSpec(utilization=0.3, timeout_s=5.0, completion=short))
    r = run(scn, "roundrobin")
    hung = [s for t, k, s in zip(r.t, r.node, r.status, strict=True) if k == 0 and t > 10.5]
    assert hung and set(hung) == {TIMEOUT}
    others = [s for k, s in zip(r.node, r.status, strict=True) if k != 0]
    assert Counter(others)[OK] == len(others)


# -- detectors --------------------------------------------------------------------------------------
def test_envoy_default_ejects_nobody_below_ten_hosts_unless_always_eject_one():
    scn = small()
    for n, always, ejected in ((4, False, False), (4, True, True), (11, False, True)):
        e = Envoy(pool(n), scn, always_eject_one_host=always)
        out = {}
        for i in range(5):
            out = e.on_result("node0", False, float(i))
        assert bool(out) is ejected, (n, always)
    e = Envoy(pool(11), scn)
    for i in range(5):
        e.on_result("node0", False, float(i))
    assert e.tick(40.0, {}, {})["node0"].weight == 100  # back after 30 s x 1 ejection


def test_seeds_z_score_cannot_reach_two_in_a_four_node_pool():
    s = Seeds(pool(4), small())
    obs = {f"node{i}": NodeObs(latency=0.01 * (100 if i == 0 else 1), request_rate=1.0) for i in range(4)}
    out = s.tick(5.0, obs, {})
    assert all(a.weight == 100 for a in out.values())  # z of the outlier is sqrt(3) = 1.73


def test_grayguard_canary_estimate_is_the_loops_formula():
    g = Grayguard(pool(4), small())
    g.states = {"node0": NodeState(state="canary", since=0.0),
                "node1": NodeState(ema=0.010, score=0.1), "node2": NodeState(ema=0.020, score=0.2),
                "node3": NodeState(ema=0.5, score=3.0)}
    rounds = g.canaries(100.0)
    assert rounds == [("node0", ["node0", "node1", "node2"])]  # the two lowest-score peers
    est = g.canary_estimates(100.0, {"node0": 0.3, "node1": 0.05, "node2": 0.15})
    assert est["node0"] == pytest.approx(0.015 * 0.3 / 0.1)
    assert g.canary_estimates(100.0, {"node0": None, "node1": 0.05, "node2": 0.1})["node0"] == math.inf


def test_policy_names():
    scn = small()
    assert make_policy("grayguard", scn.nodes, scn)[1] == "leastconn"
    assert make_policy("envoy@roundrobin", scn.nodes, scn)[1] == "roundrobin"
    with pytest.raises(ValueError):
        make_policy("nginx", scn.nodes, scn)
    with pytest.raises(ValueError):
        make_policy("leastconn@roundrobin", scn.nodes, scn)


# -- metrics ----------------------------------------------------------------------------------------
def test_percentile_and_transitions_and_capacity():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None
    scn = small(faults=[FaultSpec("node0", "thermal", 10.0)], duration=100.0)
    r = Run(scn, "leastconn").res
    r.timeline += [(20.0, 0, 50, False, "degraded"), (30.0, 0, 0, True, "quarantined"),
                   (40.0, 1, 50, False, "degraded"), (60.0, 1, 100, False, "healthy")]
    assert transitions(r) == [(20.0, 0, "cut"), (30.0, 0, "quarantine"), (40.0, 1, "cut")]
    # nodes 1-3 carry the healthy capacity; node1 at half weight for 20 of 100 s
    assert capacity_kept(r, 0.0, 100.0) == pytest.approx(1 - (0.5 / 3) * 0.2)
    s = summarize(r)
    assert s["t_cut_s"] == 10.0 and s["t_quarantine_s"] == 20.0 and s["false_cuts"] == 1
    # spans below full weight: node0's cut runs on into its quarantine and to the run's end; node1's lasts 20 s
    assert sorted(out_of_full(r)) == [(20.0, 100.0, 0), (40.0, 60.0, 1)]
    assert s["false_cut_longest_s"] == 20.0 and s["tick_s"] == scn.tick_s
    r.timeline += [(70.0, 2, 80, False, "degraded"), (71.0, 2, 100, False, "healthy")]  # one tick
    assert summarize(r)["false_cut_longest_s"] == 20.0 and (70.0, 71.0, 2) in out_of_full(r)


def test_routing_does_not_depend_on_how_often_nodes_are_stepped():
    # envoy cannot eject in a 4-node pool, so it must route exactly like plain leastconn, although its
    # interval timer steps every node at other moments than leastconn's arrivals do
    scn = small(duration=60.0)
    a, b = run(scn, "leastconn"), run(scn, "envoy")
    assert a.node == b.node and a.ttft == b.ttft
