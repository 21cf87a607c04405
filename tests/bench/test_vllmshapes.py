"""bench/vllmshapes (the pure parts): the batch fit, the ratio table, the JSON/SVG files, the client's parsing.

No engine is started: the raw numbers are made up with known shapes, and the report must give those shapes back.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict

import pytest

from grayguard.bench import vllmshapes
from grayguard.bench import vllmshapes_report as rep
from grayguard.bench.shapeclient import Stream, chunk_tokens, histogram_totals
from grayguard.sim.model import ModelParams

GRID = asdict(vllmshapes.Grid())


def _engine(a: float, slope: float, t0: float, per_tok: float, k: float) -> dict:
    """Raw numbers of an engine whose ITL is a·(1 + slope·(b−1)) and whose TTFT is t0 + per_tok·tokens."""
    def itl(b: int) -> float:
        return a * (1 + slope * (b - 1))
    batch = [{"b": b, "itl_mean_s": itl(b), "itl_median_s": itl(b), "server_itl_mean_s": 0.98 * itl(b),
              "ttft_median_s": t0 * b, "tokens": 200 * b, "errors": 0,
              "itl_mean_reps_s": [itl(b), (1 + 0.01 * b) * itl(b)]}
             for b in GRID["batches"]]
    prompt = [{"tokens": n, "ttft_median_s": t0 + per_tok * n, "ttft_s": [t0 + per_tok * n]} for n in GRID["prompts"]]
    long_idle = t0 + per_tok * GRID["long_prompt"]
    reps = [{"steady_itl_s": a, "stall_s": 0.9 * long_idle, "longest_gap_s": a + long_idle, "long_steps": 2.0,
             "long_ttft_s": 1.1 * long_idle, "probe_beside_s": 1.5 * t0, "probe_behind_s": 20 * t0,
             "probe_after_long": True}, {"error": "the long prompt produced no token"}]
    base = {"itl_b1_s": a, "cpu_per_token_b1_s": 1.5 * a, "itl_batch_s": itl(4), "ttft_s": t0 + 512 * per_tok,
            "probe_s": t0}
    return {"batch": batch, "prompt": prompt, "prefill": {"probe_idle_s": [t0, t0, None], "reps": reps},
            "thermal": {"k": k, "base": base, "fault": {key: k * v for key, v in base.items()}},
            "version": "test", "wall_s": 1.0}


def _result() -> dict:
    meta = {"grid": GRID, "engines": ["real", "sim"], "started": "now", "cpus": 2, "loadavg_start": (3.0, 2, 1),
            "loadavg_end": (4.0, 2, 1), "wall_s": 10.0}
    return rep.derive({"meta": meta, "engines": {"real": _engine(0.010, 0.05, 0.02, 1e-5, 12.0),
                                                  "sim": _engine(0.015, 1 / 63, 0.015, 1e-4, 10.0)}})


def test_the_batch_fit_gives_back_the_slope_of_a_linear_engine():
    fit = rep.fit_batch([(b, 0.02 * (1 + 0.028 * (b - 1))) for b in (1, 2, 4, 8, 16)])
    assert fit["slope"] == pytest.approx(0.028) and fit["a_s"] == pytest.approx(0.02)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_miss"] == pytest.approx(0.0, abs=1e-12)


def test_a_curved_batch_curve_shows_in_the_fit_quality():
    fit = rep.fit_batch([(b, 0.01 * b ** 0.5) for b in (1, 2, 4, 8, 16)])
    assert fit["r2"] < 0.99 and fit["max_rel_miss"] > 0.1


@pytest.mark.parametrize("points", [[], [(1, 0.01)], [(4, 0.01), (4, 0.02)], [(1, 0.01), (2, None)]])
def test_no_fit_without_two_distinct_batch_sizes(points):
    assert rep.fit_batch(points) is None


def test_the_prefill_fit_separates_the_fixed_part():
    fit = rep.fit_prefill([(n, 0.05 + 1e-4 * n) for n in (8, 512, 4000)])
    assert fit["t0_s"] == pytest.approx(0.05) and fit["s_per_token"] == pytest.approx(1e-4)
    assert fit["fixed_share"] == pytest.approx(0.05 / 0.45)


def test_the_quadratic_part_of_a_prefill_is_found_and_a_linear_one_has_none():
    ns = (8, 128, 512, 1024, 2048, 4000)
    c0, c1, c2 = rep.quadratic_fit(ns, [0.01 + 2e-5 * n + 5e-9 * n * n for n in ns])
    assert (c0, c1, c2) == pytest.approx((0.01, 2e-5, 5e-9), rel=1e-6)
    curved = rep.fit_prefill([(n, 0.01 + 2e-5 * n + 5e-9 * n * n) for n in ns])
    assert curved["quadratic_share"] == pytest.approx(5e-9 * 4000 ** 2 / (0.01 + 0.08 + 0.08))
    assert rep.fit_prefill([(n, 0.01 + 1e-4 * n) for n in ns])["quadratic_share"] == pytest.approx(0.0, abs=1e-9)
    assert rep.fit_prefill([(8, 0.01), (4000, 0.4)])["quadratic_share"] is None  # two points: no curvature


def test_ratios_leave_an_absent_value_or_baseline_absent():
    assert rep.ratios([2.0, None, 4.0], 2.0) == [1.0, None, 2.0]
    assert rep.ratios([2.0], None) == [None] and rep.ratios([2.0], 0.0) == [None]


def test_each_engine_is_measured_against_its_own_baseline():
    d = _result()["derived"]
    for engine, slope, k in (("real", 0.05, 12.0), ("sim", 1 / 63, 10.0)):
        b = d[engine]["batch"]
        assert b["fit"]["slope"] == pytest.approx(slope)
        assert b["fit_server"]["slope"] == pytest.approx(slope)  # a constant factor of the server's: same shape
        assert b["itl_mean_ratio"][-1] == pytest.approx(1 + slope * 15)
        assert b["rep_spread"] == pytest.approx(1.16)  # the noisiest batch size's runs: 16 streams
        assert d[engine]["thermal"] == pytest.approx({"itl_b1_ratio": k, "itl_batch_ratio": k, "ttft_ratio": k,
                                                      "probe_ratio": k, "cpu_per_token_b1_ratio": k,
                                                      "cpu_wall_b1": 1.5, "quota_bound_b1": 1.5 * k * k})
        p = d[engine]["prefill"]
        assert p["stall_ratio"] == pytest.approx(0.9) and p["long_ttft_beside_ratio"] == pytest.approx(1.1)
        assert p["reps"] == 1  # the failed repetition is left out, not counted as zero
    assert d["real"]["prefill"]["probe_behind_ratio"] == pytest.approx(20.0)


def test_the_model_on_paper_is_sim_models_own_step_cost():
    p = ModelParams()
    m = rep.model_expectation(GRID, p)
    assert m["batch"]["fit"]["slope"] == pytest.approx(1 / 63)
    assert m["batch"]["itl_mean_ratio"][-1] == pytest.approx(1 + 15 / 63)
    step8, step4000 = p.decode_s_base + 8 * p.prefill_s_per_token, p.decode_s_base + 4000 * p.prefill_s_per_token
    assert m["prompt"]["ttft_ratio"][-1] == pytest.approx(step4000 / step8)
    assert m["prefill"]["long_steps"] == 1.0  # 4,000 tokens fit one step's budget of 8,192
    assert set(m["thermal"].values()) == {GRID["thermal_k"]}


def test_the_table_has_a_row_per_shape_and_a_column_per_engine_and_the_model():
    r = _result()
    rows = rep.table_rows(r)
    assert all(len(cells) == 3 for _, cells in rows)
    by = dict(rows)
    assert by["fitted slope, ITL = a·(1 + slope·(b−1)), client"] == ["0.0500", "0.0159", "0.0159"]
    assert by["thermal k=10: ITL(b=1) / healthy"] == ["12.00", "10.00", "10.00"]
    assert by["TTFT of 16 streams sent at once / of one"][2] == "–"  # the model has no such number
    md = rep.markdown(r)
    assert md.count(") / ITL(1), ") == 8 and md.count("\n| ITL(b=1), ") == 2
    assert "load average 3.0 at the start and 4.0 at the end" in md
    assert "`live_batch_slope` 0.028" in md


def test_a_phase_not_measured_is_shown_absent():
    r = _result()
    del r["engines"]["real"]["thermal"], r["engines"]["real"]["prefill"]
    r = rep.derive(r)
    by = dict(rep.table_rows(r))
    assert by["thermal k=10: ITL(b=1) / healthy"][0] == "–"
    assert by["probe TTFT just behind the long prompt / idle"][0] == "–"
    ET.fromstring(rep.svg(r))  # still a whole plot


def test_the_files_are_the_json_the_tables_and_one_svg_of_three_panels(tmp_path):
    r = _result()
    paths = rep.write(r, tmp_path / "out")
    assert [p.name for p in paths] == ["shapes.json", "shapes.md", "shapes.svg"]
    back = json.loads(paths[0].read_text())
    assert back["derived"]["real"]["batch"]["fit"]["slope"] == pytest.approx(0.05)
    assert back["controller_slope"] == rep.CONTROLLER_SLOPE
    root = ET.fromstring(paths[2].read_text())
    panels = [e for e in root if e.get("class") == "plot"]
    assert len(panels) == 3
    assert [float(p.get("y")) for p in panels] == sorted(float(p.get("y")) for p in panels)
    text = paths[2].read_text()
    for series in ("real vLLM", "simulator", "sim/model.py on paper", "controller (slope 0.028)"):
        assert f'data-series="{series}"' in text


def test_a_streamed_chunk_counts_vllms_token_ids_else_the_simulators_words():
    assert chunk_tokens({"text": "xyz", "token_ids": [5, 6]}) == 2
    assert chunk_tokens({"text": " the model well."}) == 4
    assert chunk_tokens({"text": ""}) == 0


def test_gaps_are_taken_by_the_time_their_chunk_arrived():
    s = Stream(sent=0.0, times=[1.0, 1.1, 1.5, 1.6], tokens=[1, 1, 2, 1])
    assert s.ttft_s == 1.0
    assert [round(g, 9) for g, _ in s.gaps()] == [0.1, 0.4, 0.1] and [n for _, n in s.gaps()] == [1, 2, 1]
    assert [(round(g, 9), n) for g, n in s.gaps(1.2, 1.55)] == [(0.4, 2)]


def test_the_histogram_is_summed_over_its_label_sets():
    page = ('# TYPE vllm:inter_token_latency_seconds histogram\n'
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01"} 3.0\n'
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.5\n'
            'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10.0\n'
            'vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.25\n'
            'vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 5.0\n'
            'vllm:inter_token_latency_seconds_created{engine="0"} 1.7e9\n')
    assert histogram_totals(page, "vllm:inter_token_latency_seconds") == (0.75, 15.0)
    assert histogram_totals(page, "vllm:time_to_first_token_seconds") is None


def test_the_command_refuses_nonsense_before_starting_anything(capsys):
    for bad in (["--engines", "gpu"], ["--batches", "1,x"], ["--thermal-k", "1"], ["--engines", "sim,sim"]):
        with pytest.raises(SystemExit) as e:
            vllmshapes.main(bad)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        vllmshapes.main(["--help"])
    assert e.value.code == 0 and "--budget-s" in capsys.readouterr().out


def test_the_cpu_of_a_process_tree_is_read_from_proc_and_a_gone_one_is_absent():
    import os
    sum(i * i for i in range(200_000))  # some CPU of this process's own
    assert vllmshapes.tree_cpu_s(os.getpid()) > 0
    assert vllmshapes.tree_cpu_s(2 ** 22 + 1) is None  # above pid_max: no such process


def test_replot_makes_the_same_report_from_a_saved_run_without_measuring(tmp_path, capsys):
    r = _result()
    saved = rep.write(r, tmp_path / "run")[0]
    assert vllmshapes.main(["--replot", str(saved), "--out", str(tmp_path / "again")]) == 0
    assert capsys.readouterr().out == rep.markdown(r) + "\n"
    assert (tmp_path / "again" / "shapes.svg").read_text() == rep.svg(r)
