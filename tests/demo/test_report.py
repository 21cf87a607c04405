"""The demo's headline figures (pure)."""

from grayguard.demo.report import headline


def sample(t, state, weight, drained=False):
    return {"t": t, "nodes": {"n1": {"state": state, "weight": weight, "drained": drained},
                              "n2": {"state": "healthy", "weight": 100}}}


def test_headline_counts_a_drain_to_weight_zero_as_the_first_cut():
    samples = [sample(0, "healthy", 100), sample(31, "healthy", 100), sample(33, "quarantined", 0, True),
               sample(60, "canary", 0, True), sample(91, "slow_start", 10), sample(95, "healthy", 100)]
    events = [{"t": 36, "kind": "page", "node": "n1", "status": "firing"}]
    h = headline(samples, events, "n1", 30, 90)
    assert h["first_weight_cut_s"] == 33 and h["quarantine_s"] == 33 and h["page_s"] == 36
    assert h["recovered_s"] == 95 and h["false_quarantines"] == []


def test_headline_reports_other_nodes_quarantined():
    samples = [sample(0, "healthy", 100), {"t": 40, "nodes": {"n1": {"state": "healthy", "weight": 100},
                                                             "n2": {"state": "quarantined", "weight": 0}}}]
    h = headline(samples, [], "n1", 30, None)
    assert h["false_quarantines"] == ["n2"] and h["first_weight_cut_s"] is None and h["recovered_s"] is None


def test_headline_takes_the_watchers_marks_when_they_saw_the_change_first():
    # the once-a-second samples saw the cut at 33; the watcher's 0.1 s polls at 32.3 (weight) and 32.4 (state)
    samples = [sample(0, "healthy", 100), sample(32, "healthy", 100), sample(33, "quarantined", 0, True)]
    marks = [{"t": 32.3, "nodes": {"n1": {"weight": 0, "drained": True, "state": "healthy"}}},
             {"t": 32.4, "nodes": {"n1": {"weight": 0, "drained": True, "state": "quarantined"}}}]
    h = headline(samples, [], "n1", 30, None, marks=marks)
    assert h["first_weight_cut_s"] == 32.3 and h["quarantine_s"] == 32.4
    assert headline(samples, [], "n1", 30, None)["first_weight_cut_s"] == 33  # without marks: the samples'
