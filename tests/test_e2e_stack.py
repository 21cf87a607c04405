"""End-to-end: the whole local stack (simulated fleet, exporters, real HAProxy, Prometheus, Alertmanager,
webhook pager, controller) catches a thermal fault. Bounded: about 45 s."""

import io

import pytest

from sim.demo import DemoOptions, run_scenario

pytestmark = pytest.mark.e2e


def test_stack_quarantines_a_throttled_node_and_pages(tmp_path):
    opts = DemoOptions(nodes=5, rate=12, duration_s=34, fault="thermal", fault_node="node2", fault_start_s=6,
                       fault_end_s=None, fault_params={"k": 8}, live="off", seed=3)
    out = io.StringIO()
    r = run_scenario(opts, tmp_path / "report", out)
    assert r["quarantine_s"] is not None, out.getvalue()
    assert r["quarantine_s"] - r["fault_start_s"] <= 30
    assert r["first_weight_cut_s"] is not None and r["first_weight_cut_s"] <= r["quarantine_s"]
    assert r["false_quarantines"] == []
    pages = [e for e in r["events"] if e["kind"] == "page" and e.get("alert") == "GrayguardNodeQuarantined"]
    assert pages and pages[0]["node"] == "node2" and pages[0]["pool"] == "chat", out.getvalue()
    assert pages[0]["runbook_url"].endswith("docs/runbook.md#grayguardnodequarantined")
    assert r["page_s"] is not None
    # the report files exist and carry the required keys
    import json
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    for key in ("fault_start_s", "first_weight_cut_s", "quarantine_s", "page_s", "recovered_s", "faulty_node",
                "false_quarantines", "phases"):
        assert key in doc
    assert set(doc["phases"]) == {"baseline", "fault"}
    assert "<svg" in (tmp_path / "report" / "report.html").read_text()
