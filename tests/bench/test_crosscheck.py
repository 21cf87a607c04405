"""`grayguard bench --cross-check`: one scenario description, both sides (the engine and the live stack), one
definition of every figure, and a table with real numbers on both sides."""

from __future__ import annotations

import io
import math

import pytest

from grayguard.bench import cli
from grayguard.bench.crosscheck import SCENARIOS, PhasedRun, Setup, cross_check, figures, report, scenario
from grayguard.bench.crosslive import _result, run_live
from grayguard.bench.crosstable import markdown, rows
from grayguard.bench.engine import Run
from grayguard.bench.spec import make_arrivals
from grayguard.sim.loadgen import LoadConfig, arrival_plan
from grayguard.sim.loadstats import RequestRecord

TINY = Setup(nodes=4, rate=8.0, duration_s=30.0, control_start_s=10.0, fault_at_s=15.0, window_s=10.0)


def test_the_engine_and_the_load_generator_draw_the_same_arrivals():
    # a steady load: the engine's arrivals are exactly what `grayguard loadgen` with the same seed sends
    setup = Setup()
    arr = make_arrivals(scenario(setup, None))
    plan = list(arrival_plan(LoadConfig(url="http://x", rate=setup.rate, duration_s=setup.duration_s,
                                        seed=setup.seed)))
    assert list(zip(arr.t, arr.prompt, arr.gen, strict=True)) == plan


def test_one_description_makes_both_scenarios():
    setup = Setup()
    thermal, surge = scenario(setup, SCENARIOS["thermal"]), scenario(setup, SCENARIOS["traffic_surge"])
    assert [f.node for f in thermal.faults] == ["node3"] and thermal.faults[0].params == {"k": 6}
    assert thermal.window == (45.0, 75.0) and thermal.control_start_s == 30.0 and thermal.load.rate == 20.0
    assert [n.name for n in thermal.nodes] == [f"node{i}" for i in range(1, 9)]
    assert surge.faults == () and surge.load.surges == ((45.0, 75.0, 2.0),)
    assert scenario(setup, None).traffic_key() == thermal.traffic_key()  # the healthy run is the thermal's twin


def _rec(i, t, status, ttft=None, backend="node1"):
    return RequestRecord(i, t, status, 100, 50, ttft_s=ttft, e2e_s=1.0 if status != "pending" else None,
                         backend=backend)


def test_the_live_run_is_summarized_by_the_engines_own_code():
    scn = scenario(TINY, SCENARIOS["cuda_error"])
    scn = scn.__class__(**{**scn.__dict__, "faults": (scn.faults[0].__class__("node3", "cuda_error", 15.2),)})
    recs = [_rec(0, 5.0, "ok", 0.1), _rec(1, 16.0, "ok", 0.2), _rec(2, 17.0, "http_5xx"),
            _rec(3, 18.0, "timeout", None), _rec(4, 19.0, "pending"), _rec(5, 20.0, "garbage", 0.1, "node3"),
            _rec(6, 21.0, "ok", 0.3, "unknown")]
    timeline = [(0.0, k, 100, False, "healthy") for k in range(4)]
    timeline += [(16.0, 2, 40, False, "degraded"), (17.4, 2, 0, True, "quarantined"), (18.0, 0, 50, False, "degraded")]
    res = _result(scn, recs, timeline, [f"node{i}" for i in range(1, 5)], 1.0)
    f = figures(res)
    assert f["requests"] == 6 and f["failed"] == 4  # 5xx, timeout, never answered, garbage
    assert math.isclose(f["t_cut_s"], 0.8) and math.isclose(f["t_quarantine_s"], 2.2)
    assert f["false_cuts"] == 1 and f["false_quarantines"] == 0
    assert res.node == [0, 0, 0, 0, 0, 2, -1]
    assert f["ttft_p99"] == pytest.approx(30.0)  # failures count as the client deadline, as in the engine


def _fig(cut, q, p99, failed=0):
    return {"t_cut_s": cut, "t_quarantine_s": q, "ttft_p99": p99, "requests": 100, "failed": failed,
            "false_cuts": 0, "false_quarantines": 0}


def test_rows_pass_within_one_tick_and_15_percent_else_the_engines_phase_spread_decides():
    h = _fig(None, None, 0.2)
    healthy = {"bench": h, "live": h}
    got = rows("x", True, 1.0, _fig(3.0, 5.0, 0.24), _fig(3.9, 6.5, 0.27, 2), healthy, [])
    assert {r["metric"]: r["verdict"] for r in got} == {
        "time to cut (s)": "PASS", "time to quarantine (s)": "DIFF", "P99 TTFT / healthy run's": "PASS",
        "failed requests": "PASS", "false cuts + quarantines": "PASS"}
    got = rows("x", True, 1.0, _fig(None, None, 0.2), _fig(2.0, None, 0.3, 10), healthy, [])
    assert [r["verdict"] for r in got] == ["DIFF", "PASS", "DIFF", "DIFF", "PASS"]
    # the engine quarantines at 5 s at the live run's phases, at 6 to 8 s over other phase draws: 8.5 s is in reach
    spread = [(_fig(3.0, q, 0.24), h) for q in (6.0, 8.0, 7.0)]
    got = rows("x", True, 1.0, _fig(3.0, 5.0, 0.24), _fig(3.5, 8.5, 0.24), healthy, spread)
    assert [r["verdict"] for r in got][:2] == ["PASS", "SPREAD"]
    got = rows("x", True, 1.0, _fig(3.0, 5.0, 0.24), _fig(3.5, 9.5, 0.24), healthy, spread)
    assert got[1]["verdict"] == "DIFF" and got[1]["spread"] == [6.0, 8.0, 7.0]
    md = markdown(got, 3)
    assert "| x | time to quarantine (s) | 5.0 | 6.0–8.0 | 9.5 | +4.5 s | DIFF |" in md


def test_a_phase_draw_moves_only_the_phases():
    scn = scenario(TINY, SCENARIOS["thermal"])
    a, b = PhasedRun(scn, "grayguard", 1), PhasedRun(scn, "grayguard", 2)
    assert a.arr == b.arr == Run(scn, "grayguard").arr
    assert a.probe_due != b.probe_due and a.agent_due != b.agent_due
    assert [n.live.phase for n in a.nodes] != [n.live.phase for n in b.nodes]


def test_cli_refuses_an_unknown_scenario_and_needs_a_report_dir_without_cross_check(capsys):
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--cross-check", "--cross-scenarios", "nope"])) == 2
    assert cli.run(p.parse_args([])) == 2
    assert "--report-dir is required" in capsys.readouterr().err


def test_cli_bench_only_prints_the_engines_figures(capsys):
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--cross-check", "--cross-bench-only", "--cross-scenarios", "cuda_error"])) == 0
    out = capsys.readouterr().out
    assert "| cuda_error | 1.0 (" in out and "| healthy |" in out


@pytest.mark.e2e
def test_tiny_cross_check_has_real_numbers_on_both_sides(tmp_path):
    notes: list[str] = []
    result = cross_check(TINY, ["cuda_error"], lambda scn: run_live(scn, notes.append), notes.append, draws=2)
    out = io.StringIO()
    report(result, tmp_path, out)
    for name in ("healthy", "cuda_error"):
        b, lv = result["scenarios"][name]["bench"], result["scenarios"][name]["live"]
        assert b["requests"] == lv["requests"] > 0, notes  # the very same arrivals on both sides
        assert b["ttft_p99"] > 0 and lv["ttft_p99"] > 0, notes
    table = {r["metric"]: r for r in result["table"] if r["scenario"] == "cuda_error"}
    assert set(table) == {"time to cut (s)", "time to quarantine (s)", "P99 TTFT / healthy run's",
                          "failed requests", "false cuts + quarantines"}
    ratio = table["P99 TTFT / healthy run's"]
    assert ratio["bench"] > 0 and ratio["live"] > 0 and ratio["verdict"] in ("PASS", "SPREAD", "DIFF")
    assert len(ratio["spread"]) == 2 and all(x > 0 for x in ratio["spread"])
    assert table["time to quarantine (s)"]["bench"] is not None  # the agent check catches a CUDA error at once
    assert "| cuda_error | P99 TTFT" in out.getvalue()
    assert (tmp_path / "crosscheck.md").read_text().count("| cuda_error |") == 5
    assert any("cuda_error set on node3" in n for n in notes)


def test_on_the_real_fleet_the_engine_runs_the_measured_equivalent_of_the_physical_fault_without_gpu_evidence():
    from grayguard.bench.crosscheck import VLLM_SCENARIOS, VLLM_SETUP, engine_side
    from grayguard.bench.engine import run
    from grayguard.sim.model import VLLM_CPU_TINY

    cs = VLLM_SCENARIOS["thermal"]
    live = scenario(VLLM_SETUP, cs)
    assert live.faults[0].fault == "thermal" and live.faults[0].params == {"k": 10}  # a CPU quota of 0.1 core
    assert not live.gpu_evidence and len(live.nodes) == 4 and live.load.rate == 3.0
    eng = engine_side(live, cs)
    assert (eng.faults[0].fault, eng.faults[0].params) == ("pcie", {"k": 41, "prefill_k": 19})
    assert eng.faults[0].at_s == live.faults[0].at_s
    assert set(VLLM_SCENARIOS) <= set(SCENARIOS) | {"thermal"} and "cuda_error" not in VLLM_SCENARIOS
    # no GPU evidence: the fault is found later than when the fake GPU says "PCIe link down" as well
    with_gpu = figures(run(engine_side(scenario(Setup(nodes=4, rate=3.0), cs), cs), "grayguard", params=VLLM_CPU_TINY))
    without = figures(run(eng, "grayguard", params=VLLM_CPU_TINY))
    assert without["t_cut_s"] is not None and with_gpu["t_cut_s"] is not None
    assert without["t_quarantine_s"] >= with_gpu["t_quarantine_s"]


def test_a_fault_the_real_fleet_cannot_make_is_refused(capsys):
    import argparse
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--cross-check", "--fleet", "vllm", "--cross-scenarios", "cuda_error"])) == 2
    assert "for --fleet vllm" in capsys.readouterr().err
