"""The benchmark's report.html: the time to detect per fault type and policy (pure; the page itself: test_smoke)."""

from grayguard.bench.report_html import detect_s, detect_times


def row(fault, policy, cut=None, quarantine=None, group="fault"):
    return {"group": group, "fault": fault, "policy": policy, "t_cut_s": cut, "t_quarantine_s": quarantine}


def test_time_to_detect_is_the_first_action_and_its_median_per_fault_and_policy():
    assert detect_s(row("thermal", "grayguard", 4.0, 3.0)) == 3.0 and detect_s(row("hang", "leastconn")) is None
    rows = [row("thermal", "grayguard", 2.0), row("thermal", "grayguard", 4.0, 9.0), row("thermal", "grayguard"),
            row("thermal", "leastconn"), row("hang", "grayguard", None, 1.0), row("hang", "leastconn"),
            row("thermal", "grayguard", 0.5, group="benign")]  # not a fault scenario: not counted
    times, policies = detect_times(rows)
    assert policies == ["leastconn", "grayguard"]  # the report's order
    assert times == {"hang": {"leastconn": None, "grayguard": 1.0}, "thermal": {"leastconn": None, "grayguard": 3.0}}

