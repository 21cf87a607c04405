"""`grayguard bench --suite smoke` end to end, and the suite format (the default suite is expanded, not run)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from grayguard.bench import cli as bench
from grayguard.bench.scenarios import SuiteError, expand, load_suite, suites


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)  # every option at its default, as the command line gives them
    args = parser.parse_args(["--suite", "smoke", "--report-dir", str(out), "--workers", "1"])
    rc = bench.run(args)
    return rc, out, json.loads((out / "report.json").read_text())


def test_smoke_suite_runs_and_writes_reports(smoke, capsys):
    rc, out, data = smoke
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "### Targets" in md and "## Per scenario" in md
    assert {t["status"] for t in data["targets"]} <= {"PASS", "MISS", "n/a"} and len(data["targets"]) == 16
    assert "### The whole pool failing at once" in md and "### Fast failures and garbage" in md
    scenarios, _ = load_suite("smoke")
    runs = {(r["scenario"], r["policy"]) for r in data["runs"]}
    for s in scenarios:
        for p in s.policies:
            assert (s.name, p) in runs
    assert any(r["group"] == "healthy" for r in data["runs"])  # baselines ran too
    assert data["meta"]["runs"] == len(data["runs"])


@pytest.mark.browser
def test_smoke_report_html_has_the_tables_and_reads_well_in_a_browser(smoke):
    from tests.support.browser import check_pages
    _rc, out, data = smoke
    page = (out / "report.html").read_text()
    assert "Targets (grayguard default policy)" in page and "<h3>Time to detect</h3>" in page
    assert page.count('<svg class="plot"') == 1 and "Per fault type" in page and "<details>" in page
    for p in {r["policy"] for r in data["runs"] if r["group"] == "fault"}:
        assert f">{p}</text>" in page  # in the plot's legend
    assert check_pages([out / "report.html"]) == {out / "report.html": []}


def test_smoke_measures_what_the_policies_are_known_to_do(smoke):
    _rc, _out, data = smoke
    by = {(r["scenario"], r["policy"]): r for r in data["runs"]}
    thermal = "thermal/n4/homog/steady"
    # round robin keeps feeding the x6 node: its queue grows until requests time out
    assert by[(thermal, "roundrobin")]["timeout"] > by[(thermal, "leastconn")]["timeout"]
    assert by[(thermal, "grayguard")]["t_quarantine_s"] is not None
    for p in ("roundrobin", "leastconn", "envoy"):  # Envoy ejects nobody in a 4-node pool by default
        assert by[(thermal, p)]["t_cut_s"] is None
    assert by[("cuda_error/n4/homog/steady", "grayguard")]["t_quarantine_s"] is not None
    # leastconn sends almost everything to a node that fails fast (the black hole)
    assert by[("cuda_error/n4/homog/steady", "leastconn")]["error"] > by[("cuda_error/n4/homog/steady",
                                                                           "roundrobin")]["error"]
    # behind HAProxy's reflexes a node that fails fast (500 or refused) costs the clients nothing
    for fault in ("cuda_error", "refused"):
        scn = f"{fault}/n4/homog/steady"
        assert by[(scn, "leastconn")]["error"] > 100
        for p in ("haproxy", "grayguard"):
            assert by[(scn, p)]["error"] + by[(scn, p)]["no_server"] == 0 and by[(scn, p)]["retried"] > 0
    pool = by[("pool_cuda_error/n4/homog/steady", "grayguard")]
    assert pool["retried_share"] <= 0.10  # the retry budget holds
    link = {r["policy"]: r for r in data["runs"] if r["group"] == "linkerd"}
    assert link["roundrobin"]["success_ratio"] < 0.98 < link["leastconn"]["success_ratio"]
    benign = [r for r in data["runs"] if r["group"] == "benign" and r["policy"] == "grayguard"]
    assert benign and all(r["false_quarantines"] == 0 for r in benign)
    for r in data["runs"]:
        assert 0 <= (r["capacity_kept"] if r["capacity_kept"] is not None else 1) <= 1


def test_default_suite_is_the_full_cross_product():
    scenarios, spec = load_suite("default")
    groups = Counter(s.group for s in scenarios)
    assert groups["fault"] == 8 * 3 * 2 * 2 + 8  # and every fault type under the production trace (8 nodes)
    assert groups["benign"] == 11 * 3 + 3 * 3 and groups["linkerd"] == 1 and groups["pool"] == 3  # 3 trace cases
    assert all(len(s.faults) == len(s.nodes) for s in scenarios if s.group == "pool")
    faults = [s for s in scenarios if s.group == "fault"]
    assert {s.tag["fault"] for s in faults} == {"thermal", "pcie", "kv_thrash", "hang", "cuda_error", "garbage",
                                              "slow_recovery", "refused"}
    assert {len(s.nodes) for s in faults} == {4, 8, 32}
    for s in faults:
        mixed = s.tag["mix"] == "mixed"
        assert (len({n.speed_class for n in s.nodes}) > 1) == mixed
        assert all((n.peer_group == n.speed_class) if mixed else n.peer_group is None for n in s.nodes)
    # same pool, load and seed: one shared healthy baseline per (size, mix, load); the trace's faults share one
    assert len({s.traffic_key() for s in faults}) == 3 * 2 * 2 + 1
    assert "smoke" in suites() and "default" in suites()


def test_bad_suites_name_the_problem():
    with pytest.raises(SuiteError, match="unknown key"):
        expand({"groups": [{"group": "fault", "matrix": {"fault": ["x"], "sizes": [4]}}]})
    with pytest.raises(SuiteError, match="not declared"):
        expand({"pools": {"homogeneous": {4: [[4, "h100"]]}}, "loads": {"steady": {}},
                "groups": [{"group": "fault", "matrix": {"fault": ["nope"], "size": [4]}}]})
    with pytest.raises(SuiteError, match="no suite"):
        load_suite("does-not-exist")


def test_suite_faults_are_the_sim_schedule_entries():
    from grayguard.bench.spec import FaultSpec
    from grayguard.sim.faults import ScheduledFault
    assert FaultSpec is ScheduledFault
    scenarios, _ = load_suite("smoke")
    slow = next(s for s in scenarios if s.group == "linkerd")
    assert slow.faults == (ScheduledFault("node0", "thermal", 10.0, 25.0, {"k": 200}),)
    assert slow.tag["slowdown"] == 200.0
    pools = {"homogeneous": {4: [[4, "h100"]]}}
    with pytest.raises(SuiteError, match="at_s < until_s"):
        expand({"pools": pools, "loads": {"steady": {}}, "faults": {"t": {"fault": "thermal", "until_s": 5}},
                "groups": [{"group": "fault", "matrix": {"fault": ["t"], "size": [4]}}]})


def test_bench_is_a_grayguard_subcommand():
    from grayguard.cli import build_parser
    args = build_parser().parse_args(["bench", "--suite", "smoke", "--report-dir", "/tmp/x"])
    assert args._run is bench.run and args.suite == "smoke"
