"""End-to-end: the whole local stack (simulated fleet, exporters, real HAProxy, Prometheus, Alertmanager,
webhook pager, controller) catches faults. Each run is bounded: about 30-45 s."""

import csv
import io
import json
import re

import pytest

from grayguard.config import ThresholdsConfig
from grayguard.demo.cli import DemoOptions, run_scenario

pytestmark = pytest.mark.e2e


def scenario(tmp_path, fault, node, duration, **params):
    # The demo's 10 s rate windows: 5 s windows at ~2.4 req/s per node hold a dozen heavy-tailed requests,
    # noisy enough to make a healthy node look 1.5x slow now and then. The short client deadline only
    # bounds the run (long generations time out on every node alike).
    opts = DemoOptions(nodes=5, rate=12, duration_s=duration, fault=fault, fault_node=node, fault_start_s=13,
                       fault_end_s=None, fault_params=params, live="off", seed=3, control_window="10s",
                       timeout_s=6)
    out = io.StringIO()
    return run_scenario(opts, tmp_path / "report", out), out.getvalue()


def pages(r, alert):
    return [e for e in r["events"] if e["kind"] == "page" and e.get("alert") == alert and e["status"] == "firing"]


def quarantine_reason(r):
    return next(e["text"] for e in r["events"] if e["kind"] == "transition" and "quarantined" in e["text"])


def test_stack_quarantines_a_throttled_node_and_pages(tmp_path):
    r, log = scenario(tmp_path, "thermal", "node2", 36, k=8)
    assert r["quarantine_s"] is not None, log
    assert r["quarantine_s"] - r["fault_start_s"] <= 30
    # the watcher (0.1 s) can see the controller's state a poll before the tick's HAProxy write lands
    assert r["first_weight_cut_s"] is not None and r["first_weight_cut_s"] <= r["quarantine_s"] + 1.0
    assert r["false_quarantines"] == [], log
    p = pages(r, "GrayguardNodeQuarantined")
    assert p and p[0]["node"] == "node2" and p[0]["pool"] == "chat", log
    assert p[0]["runbook_url"].endswith("docs/runbook.md#grayguardnodequarantined")
    assert r["page_s"] is not None
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    for key in ("fault_start_s", "first_weight_cut_s", "quarantine_s", "page_s", "recovered_s", "faulty_node",
                "false_quarantines", "phases"):
        assert key in doc
    assert set(doc["phases"]) == {"baseline", "fault"}
    assert "<svg" in (tmp_path / "report" / "report.html").read_text()


def test_a_hung_node_is_quarantined_within_10s_through_the_probes(tmp_path):
    r, log = scenario(tmp_path, "hang", "node4", 28)
    assert r["quarantine_s"] is not None and r["quarantine_s"] - r["fault_start_s"] <= 10, log
    reason = quarantine_reason(r)
    # why, in the reason: the exporter's agent check (no token while its probe waited) or, where the node's own
    # recent stalls were long (a loaded machine: its hang is then called later, exporters/hang.py), the probes'
    # timeouts in a row (probe_consecutive, 2, at least: a loaded machine's tick can read the exporter's count at 3,
    # seen in a fresh-clone CI run on 73d35cd), whichever reached the controller first
    runs = re.search(r"(\d+) consecutive failed probes \(last: timeout\)", reason)
    assert ("agent check" in reason and "hang: no token" in reason) or (
        runs is not None and int(runs.group(1)) >= ThresholdsConfig().probe_consecutive), reason
    assert r["false_quarantines"] == [], log


def test_a_cuda_error_is_quarantined_and_pages_naming_cuda(tmp_path):
    r, log = scenario(tmp_path, "cuda_error", "node1", 30)
    assert r["quarantine_s"] is not None and r["quarantine_s"] - r["fault_start_s"] <= 10, log
    reason = quarantine_reason(r)
    assert "CUDA" in reason
    p = pages(r, "GrayguardProbeCudaError")
    assert p and "CUDA" in p[0]["summary"], log
    assert r["false_quarantines"] == [], log
    # HAProxy's reflexes (grayguard/reflexes.py: retry-on 500 with redispatch) hide the failing node from
    # clients: no HTTP error reaches one (timeouts are the short client deadline cutting long generations)
    with open(tmp_path / "report" / "requests.csv", newline="") as f:
        during = [row for row in csv.DictReader(f) if float(row["start_s"]) >= r["fault_start_s"]]
    errors = [row for row in during if row["http_status"] and int(row["http_status"]) >= 500]
    assert during and len(errors) <= 3, (len(errors), len(during), errors[:5])


def test_garbage_text_is_taken_out_by_the_agent_check_within_seconds(tmp_path):
    """HAProxy cannot see a 200 with broken text; the node's exporter answers its agent check "down" after one
    garbage probe, so the real HAProxy stops sending it requests about a second later, before any tick."""
    r, log = scenario(tmp_path, "garbage", "node3", 26)
    assert r["quarantine_s"] is not None and r["quarantine_s"] - r["fault_start_s"] <= 10, log
    reason = quarantine_reason(r)
    assert "agent check" in reason, reason
    # why, in the reason: the agent's words ("bad_response: ...", from HAProxy's last_agt) or, when HAProxy showed
    # none at that read, the probe class Prometheus had; the agent can answer "down" a scrape before Prometheus
    # has the garbage probe (the reason then says "its last probe: ok", as the scrape had it), so the exporter's
    # own probe series is checked too: it shows the garbage within a few seconds of the quarantine
    assert "bad_response" in reason or "its last probe: " in reason, reason
    samples = json.loads((tmp_path / "report" / "report.json").read_text())["samples"]
    seen = [x["nodes"]["node3"]["probe_result"] for x in samples
            if 0 <= x["t"] - r["quarantine_s"] <= 5 and "node3" in x["nodes"]]
    assert "bad_response" in seen, seen
    assert r["false_quarantines"] == [], log
    with open(tmp_path / "report" / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    garbage = [float(row["start_s"]) - r["fault_start_s"] for row in rows if row["status"] == "garbage"]
    # only requests that reached node3 before its agent said down (probe every 0.5 s in the demo, agent-inter
    # 0.5 s); often none at all: the probe is the first to see the garbage
    assert all(g <= 4.0 for g in garbage), sorted(garbage)
