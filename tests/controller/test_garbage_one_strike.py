"""A bad probe response quarantines at once when the GPU corroborates it; alone it still takes two strikes."""

from grayguard.config import ThresholdsConfig
from grayguard.controller import signals
from grayguard.controller.policy import Policy
from grayguard.controller.replay import Row, replay
from grayguard.controller.signals import SignalMemory


def trace(ticks=30, step=5.0, **per_node):
    """Four steady nodes; per_node: node -> fn(t) -> Row overrides."""
    rows = []
    for k in range(ticks):
        t = k * step
        for i in range(4):
            node = f"n{i}"
            over = {"probe_result": "ok", "probe_ttft": 0.03, **per_node.get(node, lambda t: {})(t)}
            rows.append(Row(t, "p", node, 0.02 * (1 + 0.01 * ((k + i) % 3)), **over))
    return rows


def states(rows, node):
    return [r for r in replay(rows, Policy()) if r["node"] == node]


def first(recs, state):
    return next((r["t"] for r in recs if r["state"] == state), None)


def test_one_bad_response_with_gpu_evidence_quarantines_at_once():
    recs = states(trace(n2=lambda t: {"probe_result": "bad_response", "probe_ttft": None, "gpu_xid": True}
                        if t == 60 else {}), "n2")
    assert first(recs, "quarantined") == 60
    reason = next(r["reason"] for r in recs if r["state"] == "quarantined")
    assert "bad response" in reason and "one strike" in reason


def test_one_bad_response_alone_is_not_enough():
    recs = states(trace(n2=lambda t: {"probe_result": "bad_response", "probe_ttft": None} if t == 60 else {}), "n2")
    assert first(recs, "quarantined") is None
    assert all(r["state"] == "healthy" for r in recs)


def test_two_bad_responses_without_evidence_still_quarantine():
    recs = states(trace(n2=lambda t: {"probe_result": "bad_response", "probe_ttft": None}
                        if t in (60, 65) else {}), "n2")
    assert first(recs, "quarantined") == 65


def test_probe_rule_directly():
    t = ThresholdsConfig()
    m, found = signals.probe(SignalMemory(), "bad_response", None, 1, None, t, evidence=("xid",))
    assert found.quarantine is not None and found.factor == 1.0 and m.probe_bad == 1
    _m, found = signals.probe(SignalMemory(), "bad_response", None, 1, None, t)
    assert found.quarantine is None
    # evidence alone with an answered probe quarantines nothing
    _m, found = signals.probe(SignalMemory(), "ok", 0.03, 0, 0.03, t, evidence=("xid",))
    assert found.quarantine is None
