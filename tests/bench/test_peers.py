"""The peers' balancers (bench.peers), each against the choice rule of its source, and the report's best peer."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import pytest

from grayguard.bench import cli as bench
from grayguard.bench.engine import Run
from grayguard.bench.lb import make_balancer
from grayguard.bench.node import VirtualNode
from grayguard.bench.peers import (
    EPP_REFRESH_S,
    LINKERD_DECAY_S,
    LINKERD_DEFAULT_RTT_S,
    EndpointPicker,
    LeastRequest,
    PeakEwma,
)
from grayguard.bench.policies import make_policy
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario

PEER_BALANCERS = ["peak_ewma", "least_request", "epp"]


def small(n: int = 4, faults=(), duration: float = 40.0) -> Scenario:
    return Scenario("t", tuple(NodeSpec(f"node{i}") for i in range(n)), LoadSpec(utilization=0.4), tuple(faults),
                    duration_s=duration, seed=5)


# -- Peak-EWMA (tower's load::PeakEwma, linkerd2-proxy's constants) ----------------------------------
def test_peak_ewma_starts_at_linkerds_default_rtt():
    lb = PeakEwma(2)
    assert lb.cost(0, 0.0) == pytest.approx(LINKERD_DEFAULT_RTT_S) and LINKERD_DEFAULT_RTT_S == 0.030
    assert LINKERD_DECAY_S == 10.0


def test_peak_ewma_a_peak_replaces_the_estimate_at_once():
    lb = PeakEwma(1)
    lb.started(0, 0.0)
    lb.first_byte(0, 0.001, 2.0)  # far above the 30 ms estimate, a millisecond after the last update
    assert lb.rtt[0] == 2.0


def test_peak_ewma_a_lower_sample_decays_with_tau_weighted_by_the_gap():
    lb = PeakEwma(1)
    lb.started(0, 0.0)
    lb.first_byte(0, 1.0, 2.0)
    lb.started(0, 1.0)
    lb.first_byte(0, 11.0, 0.5)  # one time constant later
    k = math.exp(-1.0)
    assert lb.rtt[0] == pytest.approx(2.0 * k + 0.5 * (1 - k))
    lb.started(0, 11.0)
    lb.first_byte(0, 11.0, 0.1)  # no time since the last update: a lower sample moves nothing
    assert lb.rtt[0] == pytest.approx(2.0 * k + 0.5 * (1 - k))


def test_peak_ewma_reading_the_cost_decays_toward_zero_and_counts_pending_until_the_first_byte():
    lb = PeakEwma(1)
    lb.started(0, 0.0)
    lb.first_byte(0, 0.0, 1.0)
    for _ in range(3):
        lb.started(0, 0.0)
    assert lb.cost(0, 10.0) == pytest.approx(math.exp(-1.0) * 4)  # three pending: x (3 + 1)
    lb.first_byte(0, 10.0, 0.0)  # the first token of one of them: pending now 2, the stream still active
    assert lb.pending[0] == 2 and lb.active[0] == 4
    lb.ended(0, 12.0)
    assert lb.pending[0] == 2 and lb.active[0] == 3


def test_p2c_takes_the_lower_cost_of_two():
    lb = PeakEwma(2)
    lb.started(0, 0.0)
    lb.first_byte(0, 0.0, 5.0)
    assert all(lb.pick([100, 100], [False, False], 0.0) == 1 for _ in range(50))


def test_peak_ewma_a_fast_500_lowers_the_cost_and_p2c_bounds_the_black_hole():
    lb = PeakEwma(4, seed=3)
    for t in range(20):
        lb.failed_at_once(0, float(t), "500")
    assert lb.cost(0, 20.0) < lb.cost(1, 20.0)
    got = Counter(lb.pick([100] * 4, [False] * 4, 20.0) for _ in range(4000))
    assert got[0] / 4000 == pytest.approx(0.5, abs=0.03)  # chosen whenever it is one of the two drawn: 2/4


def test_peak_ewma_a_refused_connection_makes_the_endpoint_unready_until_a_reconnect_succeeds():
    lb = PeakEwma(2)
    lb.failed_at_once(0, 1.0, "conn-failure")
    assert all(lb.pick([100, 100], [False, False], 1.0) == 1 for _ in range(20))
    lb.refresh(1.1, [None, (0, 0, 0.0)])  # the reconnect at 100 ms fails: backoff doubles
    assert lb.unready[0] and lb.retry_at[0] == pytest.approx(1.3)
    lb.refresh(1.2, [(0, 0, 0.0), (0, 0, 0.0)])  # not due yet
    assert lb.unready[0]
    lb.refresh(1.3, [(0, 0, 0.0), (0, 0, 0.0)])
    assert not lb.unready[0]


# -- Envoy LEAST_REQUEST ---------------------------------------------------------------------------
def test_least_request_draws_two_with_replacement_and_keeps_the_fewer_active():
    lb = LeastRequest(3, seed=1)
    for _ in range(5):
        lb.started(0)
        lb.started(2)
    got = Counter(lb.pick([100] * 3, [False] * 3) for _ in range(9000))
    assert got[1] / 9000 == pytest.approx(1 - (2 / 3) ** 2, abs=0.02)  # idle host: picked unless both draws miss it


def test_least_request_with_unequal_weights_uses_weight_over_active_plus_one():
    lb = LeastRequest(2)
    got = Counter(lb.pick([200, 100], [False, False]) for _ in range(300))
    assert got[0] == pytest.approx(200, abs=2)  # nothing active: in proportion to the weights
    lb2 = LeastRequest(2)
    for _ in range(3):
        lb2.started(0)  # 200 / (3 + 1) = 50 against 100 / 1
    got = Counter(lb2.pick([200, 100], [False, False]) for _ in range(300))
    assert got[1] == pytest.approx(200, abs=2)


# -- the inference extension's endpoint picker -------------------------------------------------------
def test_epp_prefers_the_lower_queue_then_the_lower_kv():
    lb = EndpointPicker(3)
    lb.refresh(0.0, [(0, 5, 0.1), (0, 0, 0.9), (0, 5, 0.0)])  # queue range (5 - 0) // 3 = 1: node1 alone
    assert {lb.pick([100] * 3, [False] * 3) for _ in range(30)} == {1}
    lb.refresh(0.05, [(0, 0, 0.8), (0, 0, 0.2), (0, 1, 0.1)])  # queues 0, 0 pass; KV .2 .. .2 + .6 / 2: node1
    assert {lb.pick([100] * 3, [False] * 3) for _ in range(30)} == {1}
    lb.refresh(0.1, [(0, 0, 0.2), (0, 0, 0.21), (0, 0, 0.5)])  # KV .2 .. .2 + .3 / 3: nodes 0 and 1, at random
    assert {lb.pick([100] * 3, [False] * 3) for _ in range(200)} == {0, 1}


def test_epp_decides_on_the_last_refresh_between_refreshes():
    lb = EndpointPicker(2)
    lb.refresh(0.0, [(0, 3, 0.5), (0, 0, 0.5)])
    for _ in range(20):  # what it sends in between is not in the gauges it read: it keeps herding to node1
        k = lb.pick([100, 100], [False, False])
        lb.started(k)
        assert k == 1
    assert EPP_REFRESH_S == 0.050


def test_epp_drops_a_refusing_pod_after_kubelets_readiness_failures():
    lb = EndpointPicker(2)
    lb.refresh(0.0, [(0, 0, 0.0), (0, 9, 0.9)])
    lb.refresh(1.0, [None, (0, 9, 0.9)])
    lb.refresh(30.9, [None, (0, 9, 0.9)])
    assert lb.pick([100, 100], [False, False]) == 0  # its last gauges still win: still Ready
    lb.refresh(31.0, [None, (0, 9, 0.9)])
    assert lb.pick([100, 100], [False, False]) == 1
    lb.refresh(31.05, [(0, 0, 0.0), (0, 9, 0.9)])
    assert lb.pick([100, 100], [False, False]) == 0


def test_a_hung_vllms_gauges_freeze():
    scn = small(1)
    node = VirtualNode(scn.nodes[0], 0, scn)
    for i in range(3):
        node.engine.submit(i, 200, 50, 0.0)
    node.engine.advance(0.5)
    before = node.vllm_gauges()
    node.faults.set("hang", {}, 0.5)
    node.engine.stall(0.5)
    for i in range(3, 10):
        node.engine.submit(i, 200, 50, 0.6)
    node.engine.advance(5.0)
    assert node.vllm_gauges() == before and before[0] > 0
    node.faults.set("refused", {}, 6.0)
    assert node.vllm_gauges() is None


def test_the_picker_keeps_sending_to_a_hung_node_whose_gauges_froze():
    lb = EndpointPicker(3, seed=4)
    sent = [0, 0, 0]
    for step in range(40):  # node1 hung with a short queue: its gauges stay; the others' show what they were sent
        lb.refresh(step * EPP_REFRESH_S, [(sent[0] // 4, sent[0] // 8, min(1.0, sent[0] / 40)), (2, 0, 0.05),
                                          (sent[2] // 4, sent[2] // 8, min(1.0, sent[2] / 40))])
        for _ in range(3):
            k = lb.pick([100] * 3, [False] * 3)
            sent[k] += 1
    assert sent[1] > sent[0] + sent[2]  # most of the traffic, none of it answered


# -- every peer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PEER_BALANCERS)
def test_p2c_and_picker_never_pick_a_drained_or_zero_weight_server(name):
    lb = make_balancer(name, 4, seed=2)
    got = Counter()
    for i in range(400):
        k = lb.pick([100, 0, 100, 50], [False, False, True, False], i * 0.01)
        got[k] += 1
        lb.started(k, i * 0.01)
    assert set(got) == {0, 3}
    assert lb.pick([100, 0], [True, False]) is None
    assert lb.pick([0, 100], [False, False]) == 1


@pytest.mark.parametrize("name", PEER_BALANCERS)
def test_peer_draws_are_seeded(name):
    def picks(seed):
        lb = make_balancer(name, 8, seed)
        if name == "epp":
            lb.refresh(0.0, [(0, 0, 0.0)] * 8)
        return [lb.pick([100] * 8, [False] * 8, 0.0) for _ in range(50)]
    assert picks(1) == picks(1) != picks(2)


@pytest.mark.parametrize("policy", ["linkerd", "envoy-lr", "epp"])
def test_peer_policies_run_without_controller_or_reflexes(policy):
    det, _ = make_policy(policy, small().nodes, small())
    assert det.interval_s is None and det.reflexes is None
    with pytest.raises(ValueError):
        make_policy(policy + "@roundrobin", small().nodes, small())
    r = Run(small(faults=[FaultSpec("node0", "thermal", 15.0)]), policy)
    res = r.execute()
    assert res.canaries == 0 and len(res.timeline) == 4  # nobody changed a weight
    if policy == "linkerd":  # every request sent got its first byte, or ended without one: nothing left pending
        assert r.lb.pending == [0] * 4


# -- the report ------------------------------------------------------------------------------------
SUITE = """
suite: peers-test
policies: [leastconn, linkerd, envoy-lr, epp, grayguard, oracle]
base: {duration_s: 60, control_start_s: 20, fault_at_s: 25, seed: 3}
pools: {homogeneous: {4: [[4, h100]]}}
loads: {steady: {utilization: 0.4}}
faults: {thermal: {fault: thermal}}
groups:
  - group: fault
    matrix: {fault: [thermal], size: [4], mix: [homogeneous], load: [steady]}
"""


def test_the_report_names_each_scenarios_best_peer_and_grayguards_ratio(tmp_path):
    (tmp_path / "suite.yaml").write_text(SUITE)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "out"
    assert bench.run(parser.parse_args(["--suite", str(tmp_path / "suite.yaml"), "--report-dir", str(out),
                                        "--workers", "1"])) == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    scn = "thermal/n4/homog/steady"
    rows = {r["policy"]: r for r in runs if r["scenario"] == scn}
    peers = {p: r["ttft_p99"] for p, r in rows.items() if p not in ("grayguard", "oracle")}
    best = min(peers, key=peers.get)
    g = rows["grayguard"]
    assert g["best_peer"] == best and all(r["best_peer"] == best for r in rows.values())
    assert g["ttft_p99_vs_best_peer"] == pytest.approx(g["ttft_p99"] / peers[best])
    if rows["oracle"]["ttft_p99"] < peers[best]:
        assert g["best_peer"] != "oracle"
    line = f"| {scn} | {best} | {peers[best]:.3f} | {g['ttft_p99']:.3f} | {g['ttft_p99_vs_best_peer']:.2f} |"
    md = (out / "report.md").read_text()
    assert "### grayguard against the best peer of each scenario (P99 TTFT)" in md and line in md
    assert "P99 TTFT vs best peer" in md
    html = (out / "report.html").read_text()
    assert "grayguard against the best peer" in html and "grayguard / best peer" in html
