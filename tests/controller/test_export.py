"""The node series written as differences (controller/export.py) show what writing every series each tick shows."""

from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.controller.export import FACTOR_SIGNALS, NodeRow, NodeSeries, node_row
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import Finding, NodeDecision, NodeState
from grayguard.vocab import STATES, Signal, State

NODE_METRICS = ("grayguard_node_state", "grayguard_node_base_weight", "grayguard_node_info",
                "grayguard_node_weight_factor", "grayguard_node_weight", "grayguard_node_score",
                "grayguard_node_latency_ema", "grayguard_node_peer_median", "grayguard_node_reason_info",
                "grayguard_node_shadow_weight_factor", "grayguard_node_shadow_quarantine")


def shown(m: ControllerMetrics) -> set[tuple]:
    """Every node series the registry would serve: (name, labels, value as text: NaN equals NaN)."""
    out = set()
    for family in m.registry.collect():
        for s in family.samples:
            if s.name in NODE_METRICS:
                out.add((s.name, tuple(sorted(s.labels.items())), repr(s.value)))
    return out


class FullExport:
    """The reference: every series of every node written again each tick (the controller's export before)."""

    def __init__(self, m: ControllerMetrics):
        self.m, self.info, self.reason = m, {}, {}

    def export(self, p: str, rows: dict[str, NodeRow], tracked: set[str]) -> None:
        m = self.m
        for n, r in rows.items():
            for state in STATES:
                m.node_state.labels(p, n, state).set(1 if r.state == state else 0)
            m.node_base_weight.labels(p, n).set(r.base_weight)
            if self.info.get((p, n), r.info) != r.info:
                m.node_info.remove(p, n, *self.info[(p, n)])
            m.node_info.labels(p, n, *r.info).set(1)
            self.info[(p, n)] = r.info
            for signal, f in zip(FACTOR_SIGNALS, r.factors, strict=True):
                m.node_factor.labels(p, n, signal).set(f)
            if r.weight is not None:
                m.node_weight.labels(p, n).set(r.weight)
            for gauge, value in ((m.node_score, r.score), (m.node_latency_ema, r.ema),
                                 (m.node_peer_median, r.peer_median)):
                if value is None:
                    with contextlib.suppress(KeyError):
                        gauge.remove(p, n)
                else:
                    gauge.labels(p, n).set(value)
            old = self.reason.get((p, n))
            if old != r.reason:
                if old is not None:
                    m.node_reason.remove(p, n, *old)
                m.node_reason.labels(p, n, *r.reason).set(1)
                self.reason[(p, n)] = r.reason
            for gauge in (m.node_shadow_factor, m.node_shadow_quarantine):  # every detector's series, again
                for d in ("live", "probe"):
                    with contextlib.suppress(KeyError):
                        gauge.remove(p, n, d)
            for d, f, q in r.shadow:
                if f is not None:
                    m.node_shadow_factor.labels(p, n, d).set(f)
                if q:
                    m.node_shadow_quarantine.labels(p, n, d).set(1)
        for gone in sorted({n for q, n in self.reason if q == p} - tracked):
            m.forget_node(p, gone)
            self.reason.pop((p, gone))
            self.info.pop((p, gone), None)


maybe_float = st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 2.5, float("nan"), float("inf")]))
rows = st.builds(
    NodeRow, st.sampled_from(STATES), st.sampled_from([0, 50, 100]),
    st.tuples(st.just("be"), st.sampled_from(["10.0.0.1:8000", "host-a:8000"])),
    st.tuples(*[st.sampled_from([0.25, 1.0])] * 4, st.sampled_from([0.0, 1.0])),
    st.one_of(st.none(), st.sampled_from([0, 1, 71, 100])), maybe_float, maybe_float, maybe_float,
    st.tuples(st.sampled_from(STATES), st.sampled_from(["none", "latency", "probe,live"])),
    st.lists(st.tuples(st.sampled_from(["live", "probe"]), st.sampled_from([None, 0.5]), st.booleans()),
             max_size=2, unique_by=lambda f: f[0]).map(tuple))
# a tick: (pool, {node: row}, nodes retained without a row this tick)
ticks = st.lists(st.tuples(st.sampled_from(["a", "b"]),
                           st.dictionaries(st.sampled_from(["n0", "n1", "n2"]), rows, max_size=3),
                           st.sets(st.sampled_from(["n0", "n1", "n2"]), max_size=2),
                           st.booleans()),  # the replica stops leading the pool before this tick
                 min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(ticks)
def test_written_differences_show_what_a_full_export_shows(seq):
    diff_m, full_m = ControllerMetrics.create(), ControllerMetrics.create()
    diff, full = NodeSeries(diff_m), FullExport(full_m)
    for pool, now, retained, handed_away in seq:
        if handed_away:
            diff.forget_pool(pool)
            full_m.forget_pool(pool)
            full.info = {k: v for k, v in full.info.items() if k[0] != pool}
            full.reason = {k: v for k, v in full.reason.items() if k[0] != pool}
        tracked = set(now) | retained
        diff.export(pool, now, tracked)
        full.export(pool, now, tracked)
        assert shown(diff_m) == shown(full_m)


def test_an_unchanged_node_writes_nothing():
    m = ControllerMetrics.create()
    series = NodeSeries(m)
    row = NodeRow(State.HEALTHY, 100, ("be", "10.0.0.1:8000"), (1.0, 1.0, 1.0, 1.0, 1.0), 100, 0.3, 0.02, 0.021,
                  (State.HEALTHY, "none"))
    series.export("p", {"n0": row}, {"n0"})
    m.node_weight.labels("p", "n0").set(7)  # a write the exporter did not make: it is not repeated
    series.export("p", {"n0": row}, {"n0"})
    assert m.registry.get_sample_value("grayguard_node_weight", {"pool": "p", "node": "n0"}) == 7
    series.export("p", {"n0": NodeRow(**{**row.__dict__, "weight": 50})}, {"n0"})
    assert m.registry.get_sample_value("grayguard_node_weight", {"pool": "p", "node": "n0"}) == 50


def test_a_node_row_from_its_decision():
    cut = NodeState(state=State.DEGRADED, score=4.0, ema=0.05,
                    factors=((Signal.LATENCY, 0.25, "latency 3x"), (Signal.PROBE, 0.5, "slow probes"),
                             (Signal.LIVE, 0.125, "live ITL 4x")))
    r = node_row(NodeDecision(cut, State.HEALTHY, 12, False, 0.02), 100, "be", "10.0.0.1:8000")
    assert r.factors == (0.25, 0.5, 1.0, 0.125, 1.0) and r.reason == (State.DEGRADED, "latency,probe,live")
    assert (r.weight, r.score, r.ema, r.peer_median, r.info) == (12, 4.0, 0.05, 0.02, ("be", "10.0.0.1:8000"))
    full = node_row(NodeDecision(NodeState(), State.HEALTHY, 0, False), 100, "be", "k")  # weight 0, not drained
    assert full.factors[-1] == 0.0 and full.reason == (State.HEALTHY, "kv_cache")
    drained = node_row(NodeDecision(NodeState(state=State.QUARANTINED, cause="probe"), State.HEALTHY, 0, True),
                       100, "be", "k")
    assert drained.factors[-1] == 1.0 and drained.reason == (State.QUARANTINED, "probe")


def test_a_value_gone_and_back_is_shown_again():
    m = ControllerMetrics.create()
    series = NodeSeries(m)
    row = NodeRow(State.HEALTHY, 100, ("be", "k"), (1.0, 1.0, 1.0, 1.0, 1.0), 100, 0.3, 0.02, 0.021,
                  (State.HEALTHY, "none"))
    score = {"pool": "p", "node": "n0"}
    for value, expected in ((0.3, 0.3), (None, None), (0.7, 0.7), (0.7, 0.7)):
        series.export("p", {"n0": NodeRow(**{**row.__dict__, "score": value})}, {"n0"})
        assert m.registry.get_sample_value("grayguard_node_score", score) == expected  # absent: None
    series.forget_pool("p")
    assert m.registry.get_sample_value("grayguard_node_score", score) is None
    series.export("p", {"n0": row}, {"n0"})  # led again: shown again
    assert m.registry.get_sample_value("grayguard_node_score", score) == 0.3


def test_the_shadowed_detectors_findings_are_shown_while_they_last():
    m = ControllerMetrics.create()
    series = NodeSeries(m)
    asks = (Finding("live", 0.25, None, "live ITL 4x"), Finding("probe", 1.0, "2 failed probes", "2 failed probes"))
    d = NodeDecision(NodeState(), State.HEALTHY, 100, False, None, asks)
    row = node_row(d, 100, "be", "k")
    assert row.shadow == (("live", 0.25, False), ("probe", None, True))
    key = {"pool": "p", "node": "n0"}
    series.export("p", {"n0": row}, {"n0"})
    assert m.registry.get_sample_value("grayguard_node_shadow_weight_factor", {**key, "detector": "live"}) == 0.25
    assert m.registry.get_sample_value("grayguard_node_shadow_quarantine", {**key, "detector": "probe"}) == 1
    assert m.registry.get_sample_value("grayguard_node_shadow_weight_factor", {**key, "detector": "probe"}) is None
    assert m.registry.get_sample_value("grayguard_node_weight_factor", {**key, "signal": "live"}) == 1.0  # not applied
    series.export("p", {"n0": node_row(NodeDecision(NodeState(), State.HEALTHY, 100, False), 100, "be", "k")}, {"n0"})
    for name, det in (("grayguard_node_shadow_weight_factor", "live"), ("grayguard_node_shadow_quarantine", "probe")):
        assert m.registry.get_sample_value(name, {**key, "detector": det}) is None  # asks nothing now: gone
