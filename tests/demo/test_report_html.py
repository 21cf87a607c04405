"""The demo's report.html, the --compare report and the membership report, from synthetic runs (pure: no stack)."""

import html
import json
import re

from grayguard.demo import cli
from grayguard.demo.compare_report import figures
from grayguard.demo.report_html import markers, milestones, story_line, timeline, what_happened
from tests.support import demo_inputs

RAW = re.compile(r"\{'|\['|\{\"|\[\]|\{\}")


def text(page: str) -> str:
    """What a person reads: the markup and the SVG drawing instructions gone."""
    bare = re.sub(r"<[^>]+>", " ", re.sub(r"<(style|title)>.*?</\1>", "", page, flags=re.S))
    return " ".join(html.unescape(bare).split()).replace(" :", ":").replace(" ,", ",")


def report(controller=True, fault="thermal"):
    return demo_inputs.run(cli.DemoOptions(controller=controller, fault=fault), None)


def test_the_story_gives_the_fault_and_the_times_after_it():
    r = report()
    s = text(story_line(r))
    assert "thermal (k=10) on node3 at 30.0 s" in s
    assert "weight cut after 3.0 s, quarantined after 3.0 s, paged after 8.2 s" in s
    assert "the fault cleared at 90.0 s and node3 was back at full weight 47.0 s later (+107.0 s after the fault)" in s
    assert re.search(r"Client P99 TTFT during the fault: 0\.\d+ s, against 0\.\d+ s before it \(1\.\d×\)", s)
    off = text(story_line(report(controller=False), {"p99_ttft_fault_without": 2.4,
                                                     "p99_ttft_fault_window_healthy": 0.24}))
    assert "with grayguard off: not cut, not quarantined, not paged" in off
    assert "2.4 s without grayguard" in off and "0.24 s in the healthy run over the same window" in off
    healthy = text(story_line(report(fault="none")))
    assert healthy.startswith("No fault injected (a healthy fleet): nobody quarantined. Client P99 TTFT over the "
                              "window of the fault")
    assert markers(report(fault="none")) == [] and [m[1] for m in markers(report())] == [
        "fault thermal", "fault cleared", "cut", "quarantine", "page", "recovered"]


def test_milestones_are_relative_to_the_fault_and_a_healthy_run_has_none():
    m = text(milestones(report()))
    assert "first weight cut 33.0 s +3.0 s" in m
    assert "full weight again 137.0 s +107.0 s (+47.0 s after it cleared)" in m
    h = text(milestones(report(fault="none")))
    assert "nodes quarantined none" in h and "weight cut" not in h and "full weight" not in h


def test_the_timeline_says_why_and_links_each_alert_to_its_runbook_section():
    r = report()
    t = timeline(r["events"], r["fault_start_s"], "node3")
    assert "<b>healthy → quarantined</b>: probe slow (788 ms vs peers 369 ms) with GPU evidence" in t
    page = re.search(r"<tr class=\"page\">(.*?)</tr>", t)[1]
    assert "+8.2 s" in page and "GrayguardNodeQuarantined, severity page" in page
    assert '<a href="https://github.com/grayguard/grayguard/blob/main/docs/runbook.md#grayguardnodequarantined">' \
           "runbook</a>" in page
    assert "thermal injected (k=10)" in t and "−9.9 s" in t  # before the fault: negative
    assert t.count('<tr class="faulty">') == 7  # node3's fault, transitions and ticket (pages have their own)
    # an alert without its annotation still links the shipped runbook's section; severity from the receiver
    old = what_happened({"t": 1, "kind": "page", "text": "firing X", "alert": "GrayguardNodeQuarantined",
                         "status": "firing"})
    assert "severity page" in old and "runbook.md#grayguardnodequarantined" in old
    # an old report's transition (text only) still shows its reason
    assert "drained 10s" in what_happened({"t": 1, "kind": "transition", "text": "node3: quarantined -> canary: "
                                          "drained 10s (probe)", "state": "canary"})


def test_compare_writes_one_report_with_the_three_runs(tmp_path):
    cmp = cli.compare(cli.DemoOptions(), tmp_path, run=demo_inputs.run)
    assert json.loads((tmp_path / "compare.json").read_text()) == cmp and cmp["verdict"].startswith("PASS")
    page = (tmp_path / "report.html").read_text()
    for label in ("with grayguard", "without grayguard", "no fault (healthy)"):
        assert page.count(f'data-series="{label}"') >= 1 and f">{label}</text>" in page  # line and legend
    assert "<h2>The three runs side by side</h2>" in page and cmp["verdict"] in html.unescape(page)
    for d in ("with-controller", "without-controller", "healthy"):
        assert f'href="{d}/report.html"' in page and (tmp_path / d / "report.html").exists()
    assert not RAW.search(text(page))


def test_compare_figures_and_verdict():
    on, off, healthy = report(), report(controller=False), report(fault="none")
    cmp = figures(on, off, healthy)
    assert cmp["improvement_x"] > 3 and 0.9 < cmp["fault_vs_healthy_with_x"] < 1.5
    assert cmp["healthy_run_false_quarantines"] == []
    assert figures(on, on, healthy)["verdict"].startswith("MISS")


def test_no_page_shows_a_raw_structure(tmp_path):
    for opts in (cli.DemoOptions(), cli.DemoOptions(controller=False), cli.DemoOptions(fault="none")):
        r = demo_inputs.run(opts, tmp_path / opts.fault / str(opts.controller))
        page = (tmp_path / opts.fault / str(opts.controller) / "report.html").read_text()
        assert not RAW.search(text(page)), RAW.search(text(page))
        assert r["fault_params"] == {"k": 10} and "k=10" in page  # report.json keeps the dict; the page reads
    demo_inputs.membership(tmp_path / "membership")
    page = (tmp_path / "membership" / "report.html").read_text()
    assert not RAW.search(text(page)) and "protocol=6" in page and "node9 registered at 32.90s" in page
    assert "registered (s)" in page and "registered_s" not in text(page)


def test_the_checker_regex_catches_what_the_old_page_showed():
    assert RAW.search("{'t': 12.01, 'kind': 'controller'}") and RAW.search("false_quarantines []")
