"""Replay tests per signal (multi-signal policy): the same decision code the live loop runs."""

import random

from grayguard.controller.policy import Policy
from grayguard.controller.replay import Row, replay


def trace(n=4, ticks=40, step=5.0, seed=1, noise=0.05, **per_node):
    """per_node: node -> fn(t) -> dict of Row overrides (latency multiplier under key 'x')."""
    rnd = random.Random(seed)
    rows = []
    for k in range(ticks):
        t = k * step
        for i in range(n):
            node = f"n{i}"
            over = per_node.get(node, lambda t: {})(t)
            x = over.pop("x", 1.0)
            lat = over.pop("latency", 0.02 * (1 + rnd.gauss(0, noise)) * x)
            rows.append(Row(t, "p", node, lat, **{"probe_result": "ok", "probe_ttft": 0.03, **over}))
    return rows


def by_node(rows, node):
    return [r for r in replay(rows, Policy()) if r["node"] == node]


def first(recs, state):
    return next((r["t"] for r in recs if r["state"] == state), None)


def test_probe_timeouts_quarantine_a_hung_node_with_no_latency_data():
    hung = by_node(trace(n0=lambda t: {"latency": None, "probe_result": "timeout", "probe_ttft": None}
                         if t >= 50 else {}), "n0")
    q = first(hung, "quarantined")
    assert q is not None and q <= 55  # two consecutive timed-out probes
    assert "probe" in next(r["reason"] for r in hung if r["state"] == "quarantined")
    assert all(r["state"] == "healthy" for r in hung if r["t"] < 50)


def test_cuda_error_quarantines_at_once():
    recs = by_node(trace(n1=lambda t: {"probe_result": "cuda_error"} if t >= 50 else {}), "n1")
    assert first(recs, "quarantined") == 50
    assert "CUDA" in next(r["reason"] for r in recs if r["state"] == "quarantined")


def test_kv_saturated_node_gets_no_new_traffic_and_returns_without_quarantine():
    kv = by_node(trace(n2=lambda t: {"kv_cache_usage": 0.97 if 50 <= t < 80 else (0.9 if 80 <= t < 90 else 0.5)}),
                 "n2")
    assert all(r["state"] in ("healthy",) for r in kv)  # load, not sickness: no degrade, no quarantine
    during = [r["weight"] for r in kv if 50 <= r["t"] < 90]
    assert during and all(w == 0 for w in during)  # 0.9 is still above kv_drained (0.85): hysteresis
    assert all(r["weight"] == 100 for r in kv if r["t"] >= 90)
    assert "KV cache" in next(r["reason"] for r in kv if r["t"] == 55)


def test_throttled_slow_node_is_quarantined_sooner_than_without_evidence():
    slow = {"x": 3.0}
    plain = by_node(trace(n0=lambda t: dict(slow) if t >= 50 else {}), "n0")
    evid = by_node(trace(n0=lambda t: {**slow, "gpu_throttled": True} if t >= 50 else {}), "n0")
    assert first(evid, "quarantined") < first(plain, "quarantined")
    assert "GPU evidence: GPU throttling under load" in next(r["reason"] for r in evid if r["state"] == "quarantined")


def test_hardware_evidence_never_ejects_a_fast_node():
    recs = by_node(trace(n0=lambda t: {"gpu_throttled": True, "gpu_xid": True, "pcie_degraded": True}), "n0")
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in recs)
    assert "GPU evidence" in recs[-1]["reason"]  # but it is named


def test_slow_probes_degrade_and_good_probes_clear():
    recs = by_node(trace(n3=lambda t: {"probe_result": "slow", "probe_ttft": 0.9} if 50 <= t < 80 else {}), "n3")
    during = [r for r in recs if 50 <= r["t"] < 80]
    assert during[0]["state"] == "healthy"  # one slow probe is noise
    assert all(r["state"] == "degraded" and r["weight"] == 30 for r in during[1:])  # -70 % from the second
    assert "probe slow" in during[1]["reason"]
    after = [r for r in recs if r["t"] >= 80]
    assert [r["state"] for r in after[:2]] == ["degraded", "degraded"]  # 3 good probes to clear
    assert after[2]["state"] == "healthy" and after[-1]["weight"] == 100


def test_errors_cut_weight_and_a_high_error_share_opens_the_circuit():
    """The error share is a rate over the control window's requests: its first sample above error_ratio cuts (a
    tick count would only count the same sample again), and a sample below it ends the cut."""
    recs = by_node(trace(n1=lambda t: {"error_ratio": 0.05} if 50 <= t < 100 else {"error_ratio": 0.0}), "n1")
    assert all(r["weight"] == 100 for r in recs if r["t"] < 50)
    assert all(r["weight"] == 30 and r["state"] == "degraded" for r in recs if 50 <= r["t"] < 100)
    assert all(r["weight"] == 100 and r["state"] == "healthy" for r in recs if r["t"] >= 100)
    circ = by_node(trace(n1=lambda t: {"error_ratio": 0.8} if t >= 50 else {"error_ratio": 0.0}), "n1")
    assert first(circ, "quarantined") == 50 and "circuit open" in next(
        r["reason"] for r in circ if r["state"] == "quarantined")


def mixed(slow=None, factor=5.0):
    groups = {**{f"n{i}": "h100" for i in range(4)}, "n4": "a100", "n5": "a100"}
    rnd = random.Random(4)
    rows = []
    for k in range(40):
        t = k * 5.0
        for n, g in groups.items():
            v = 0.02 * (1.6 if g == "a100" else 1.0) * (1 + rnd.gauss(0, 0.05))
            if n == slow and t >= 50:
                v *= factor
            rows.append(Row(t, "p", n, v, peer_group=g))
    return [r for r in replay(rows, Policy())]


def test_mixed_pool_of_two_groups_ejects_nobody():
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in mixed())


def test_mixed_pool_still_catches_a_slow_node_in_either_group():
    for node in ("n1", "n5"):  # a fast-group node, and one of the two slower ones
        recs = mixed(slow=node)
        assert any(r["state"] == "quarantined" for r in recs if r["node"] == node), node
        assert all(r["state"] == "healthy" for r in recs if r["node"] != node), node


def test_without_groups_the_slower_generation_would_be_punished():
    rnd = random.Random(4)
    rows = [Row(k * 5.0, "p", f"n{i}", 0.02 * (1.6 if i >= 4 else 1.0) * (1 + rnd.gauss(0, 0.05)))
            for k in range(20) for i in range(6)]
    assert any(r["state"] != "healthy" for r in replay(rows, Policy()))


def test_membership_new_node_slow_starts_gone_node_is_remembered():
    rows = trace(n=4, ticks=10)
    rows += [Row(r.t, "p", "n9", 0.02) for r in rows if r.node == "n0" and r.t >= 20]
    recs = [r for r in replay(rows, Policy()) if r["node"] == "n9"]
    assert recs[0]["state"] == "slow_start" and recs[0]["weight"] == 10 and "new node" in recs[0]["reason"]


def test_a_quarantined_node_that_leaves_and_returns_is_still_quarantined():
    from grayguard.controller.policy import QUARANTINED, NodeInput, NodeState, decide_pool
    pol = Policy()
    prev = {n: NodeState() for n in "abc"} | {"d": NodeState(state=QUARANTINED, since=0.0)}
    d1 = decide_pool(prev, {n: NodeInput(100) for n in "abc"}, pol, 1.0)
    assert "d" not in d1.nodes and d1.retained["d"].state == QUARANTINED and d1.retained["d"].gone_since == 1.0
    states = {n: x.state for n, x in d1.nodes.items()} | d1.retained
    d2 = decide_pool(states, {n: NodeInput(100) for n in "abcd"}, pol, 5.0)
    assert d2.nodes["d"].state.state == QUARANTINED and d2.nodes["d"].weight == 0
    late = decide_pool(states, {n: NodeInput(100) for n in "abc"}, pol, 1.0 + pol.thresholds.forget_after_s)
    assert "d" not in late.retained  # forgotten after the grace period


def test_a_backend_that_is_starting_is_not_a_fault():
    recs = by_node(trace(n2=lambda t: {"latency": None, "probe_result": "starting", "probe_ttft": None}
                         if t < 60 else {}), "n2")
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in recs)


def test_probes_the_exporter_calls_ok_cut_nothing_however_far_above_the_peers_those_it_calls_slow_do():
    # 13x the peers' probes, under the exporter's absolute threshold: one probe queued behind a long prompt looks so
    # on a fast engine (the real fleet: 135 ms against 13 ms); the node's speed is the live signals' to judge
    ok = by_node(trace(n3=lambda t: {"probe_result": "ok", "probe_ttft": 0.4} if t >= 50 else {}), "n3")
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in ok)
    slow = by_node(trace(n3=lambda t: {"probe_result": "slow", "probe_ttft": 0.4} if t >= 50 else {}), "n3")
    assert [r["state"] for r in slow if 50 <= r["t"] < 60] == ["healthy", "degraded"]  # a run of two cuts


def test_slow_probes_with_gpu_evidence_quarantine_slow_probes_alone_only_degrade():
    both = by_node(trace(n1=lambda t: {"probe_result": "slow", "probe_ttft": 0.5, "gpu_throttled": True}
                         if t >= 50 else {}), "n1")
    assert first(both, "quarantined") == 50  # corroborated by the GPU: the first slow probe is enough
    assert "GPU evidence" in next(r["reason"] for r in both if r["state"] == "quarantined")
    alone = by_node(trace(n1=lambda t: {"probe_result": "slow", "probe_ttft": 0.5} if t >= 50 else {}), "n1")
    assert first(alone, "quarantined") is None and first(alone, "degraded") == 55


def test_a_single_probe_spike_cuts_nothing():
    recs = by_node(trace(n3=lambda t: {"probe_result": "slow", "probe_ttft": 0.4} if t == 50 else {}), "n3")
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in recs)
