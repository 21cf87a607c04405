"""Production traces (sim/traces.py): each format read, errors that name file, line and column, the window and its
pace, clipping to the model's context, shared prefixes from Mooncake's hash ids, and determinism."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from grayguard.sim.loadgen import PROMPT_WORDS, LoadConfig, arrival_plan, request_prompt
from grayguard.sim.traces import (
    ATTRIBUTION,
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    TraceLoad,
    clip,
    detect_format,
    parse_window,
    plan_trace,
    read_trace,
)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "traces"
AZURE_2023 = ROOT / "bench" / "suites" / "traces" / "azure-llm-inference-2023-conv.csv"


def rows(path, fmt=None):
    return [(round(r.t, 6), r.prompt, r.output, r.hash_ids) for r in read_trace(path, fmt)]


def test_each_format_is_read_with_times_from_the_first_request():
    assert rows(FIX / "azure.csv") == [(0.0, 374, 44, ()), (1.0, 9000, 44, ()), (1.5, 100, 6000, ()),
                                       (4.0, 20, 0, ()), (10.0, 200, 10, ())]
    assert rows(FIX / "azure2024.csv") == [(0.0, 2162, 5, ()), (0.5, 1000, 50, ()), (2.0, 300, 12, ())]
    assert rows(FIX / "mooncake.jsonl") == [(0.0, 1100, 12, (0, 1, 2)), (0.5, 700, 30, (0, 1)),
                                            (1.5, 600, 5, (7, 8)), (3.0, 1024, 40, (0, 9))]  # ms -> s
    assert rows(FIX / "burstgpt.csv") == [(0.0, 472, 18, ()), (0.5, 1087, 231, ()), (2.0, 4000, 500, ())]
    assert [detect_format(FIX / f) for f in ("azure.csv", "azure2024.csv", "mooncake.jsonl", "burstgpt.csv")] == [
        "azure", "azure", "mooncake", "burstgpt"]


def test_the_shipped_azure_trace_reads_through_the_parser():
    first = list(itertools.islice(read_trace(AZURE_2023), 4))
    assert [(r.prompt, r.output) for r in first] == [(374, 44), (396, 109), (879, 55), (91, 16)]
    assert first[1].t == pytest.approx(50.9951690 - 46.6805900, abs=1e-5)  # 18:15:46.6805900 -> 18:15:50.9951690
    assert detect_format(AZURE_2023) == "azure"


@pytest.mark.parametrize("name, fmt, message", [
    ("bad_missing_column.csv", None, r"bad_missing_column.csv:1: column 'GeneratedTokens' is missing"),
    ("bad_not_a_number.csv", None, r"bad_not_a_number.csv:3:2: column 'ContextTokens': 'lots' is not a number"),
    ("bad_negative.csv", None, r"bad_negative.csv:3:4: column 'Response tokens': '-3' is not a token count"),
    ("bad_backwards.jsonl", None, r"bad_backwards.jsonl:3: column 'timestamp': the time goes backwards"),
    ("bad_short_row.csv", None, r"bad_short_row.csv:3:3: column 'GeneratedTokens' is missing"),
    ("azure.csv", "burstgpt", r"azure.csv:1: column 'Timestamp' is missing"),  # a wrong --trace-format
    ("README.md", None, r"README.md:1: not a known trace format"),
    ("nonexistent.csv", None, r"nonexistent.csv: cannot read the trace"),
])
def test_a_bad_trace_is_a_trace_error_naming_file_line_and_column(name, fmt, message):
    with pytest.raises(TraceError, match=message):
        list(read_trace(FIX / name, fmt))


def test_a_window_is_read_only_as_far_as_it_needs(tmp_path):
    """Streamed: a broken line after the window is never reached (the 2024 traces hold millions of lines)."""
    f = tmp_path / "t.csv"
    f.write_text((FIX / "azure.csv").read_text() + "2023-11-16 18:15:59.0,garbage,1\n")
    plan = plan_trace(TraceLoad(str(f), start_s=1.0, duration_s=3.0))
    assert plan.t == (0.0, 0.5) and plan.meta["window_s"] == [1.0, 4.0]
    with pytest.raises(TraceError, match=r"t.csv:7:2"):
        plan_trace(TraceLoad(str(f)))


def test_speedup_rate_and_utilization_scale_the_window():
    azure = str(FIX / "azure.csv")  # requests at 0, 1, 1.5, 4, 10 s
    fast = plan_trace(TraceLoad(azure, speedup=2.0))
    assert fast.t == (0.0, 0.5, 0.75, 2.0, 5.0) and fast.meta["speedup"] == 2.0
    # a 10 s window holds 4 requests: 0.4/s; a target of 2/s compresses it 5x into 2 s of run
    by_rate = plan_trace(TraceLoad(azure, duration_s=10.0, rate=2.0))
    assert by_rate.t == pytest.approx((0.0, 0.2, 0.3, 0.8)) and by_rate.meta["run_s"] == pytest.approx(2.0)
    by_util = plan_trace(TraceLoad(azure, duration_s=10.0, utilization=0.5), capacity_rps=4.0)
    assert by_util.t == by_rate.t
    # without a window length, the run's length at the target says how much trace it takes: 1/s x 3 s = 3
    # requests, the 4th (at 4 s) closes the window: 4 trace seconds over 3 run seconds
    need = plan_trace(TraceLoad(azure, rate=1.0), run_s=3.0)
    assert need.t == pytest.approx((0.0, 0.75, 1.125)) and need.meta["speedup"] == pytest.approx(4 / 3, rel=1e-3)
    # in tokens: the window's prompt + output (clipped) at the target token rate
    tokens = plan_trace(TraceLoad(azure, duration_s=10.0, utilization=0.5), capacity_tps=2000.0)
    window_tokens = sum(p + o for p, o in zip(tokens.prompt, tokens.output, strict=True))
    assert tokens.meta["speedup"] == pytest.approx(1000.0 * 10.0 / window_tokens, rel=1e-3)
    assert tokens.meta["mean_tokens_per_s"] == pytest.approx(1000.0, rel=1e-3)
    # the run bounds the arrivals; the window starts at START
    assert plan_trace(TraceLoad(azure, speedup=1.0), run_s=1.2).t == (0.0, 1.0)
    assert plan_trace(TraceLoad(azure, start_s=1.5)).t == (0.0, 2.5, 8.5)


@pytest.mark.parametrize("kwargs, message", [
    ({"speedup": 2.0, "rate": 3.0}, "one of speed-up, rate and utilization"),
    ({"speedup": 0.0}, "speedup must be > 0"),
    ({"duration_s": -1.0}, "duration_s must be > 0"),
    ({"format": "csv"}, "known are azure, mooncake, burstgpt"),
])
def test_options_that_do_not_fit_are_refused(kwargs, message):
    with pytest.raises(TraceError, match=message):
        TraceLoad(str(FIX / "azure.csv"), **kwargs)


def test_an_empty_window_and_a_utilization_without_capacity_are_refused():
    with pytest.raises(TraceError, match=r"azure.csv: no requests in the trace window from 60 s"):
        plan_trace(TraceLoad(str(FIX / "azure.csv"), start_s=60.0))
    with pytest.raises(TraceError, match="needs the pool's capacity"):
        plan_trace(TraceLoad(str(FIX / "azure.csv"), utilization=0.4))


def test_window_syntax():
    assert parse_window("600:300") == (600.0, 300.0)
    assert parse_window("60:") == (60.0, None) == parse_window("60")
    assert parse_window("0:") == (0, None)
    for bad in ("x:1", "10:0", "-5:10"):
        with pytest.raises(TraceError, match="trace window"):
            parse_window(bad)


def test_lengths_are_clipped_to_the_model_context():
    assert clip(9000, 44, 8192) == (8148, 44)  # the prompt gives way
    assert clip(100, 6000, 8192) == (100, 4096)  # the output at most half the context
    assert clip(20, 0, 8192) == (20, 1)  # a request generates at least one token
    plan = plan_trace(TraceLoad(str(FIX / "azure.csv"), max_model_len=8192))
    assert list(zip(plan.prompt, plan.output, strict=True)) == [(374, 44), (8148, 44), (100, 4096), (20, 1), (200, 10)]
    assert plan.meta["clipped"] == 3 and all(p + o <= 8192 for p, o in zip(plan.prompt, plan.output, strict=True))


def test_shared_hash_ids_share_a_prompt_prefix_of_whole_blocks():
    plan = plan_trace(TraceLoad(str(FIX / "mooncake.jsonl")))
    words = [plan.prompt_text(i, plan.prompt[i]).split() for i in range(len(plan))]
    assert [len(w) for w in words] == list(plan.prompt)  # one word a token
    assert all(w in PROMPT_WORDS for ws in words for w in ws)
    b = MOONCAKE_BLOCK_TOKENS
    assert words[1] == words[0][:700]  # [0, 1] is a prefix of [0, 1, 2]
    assert words[3][:b] == words[0][:b] and words[3][b:2 * b] != words[0][b:2 * b]  # [0, 9]: block 0 only
    assert words[2][:b] != words[0][:b]  # [7, 8]: nothing shared
    assert plan.hottest() == [True, True, False, True]  # the most frequent first block: 0


def test_the_hottest_tenant_of_a_trace_without_tenants_is_its_longest_prompt_decile():
    plan = plan_trace(TraceLoad(str(AZURE_2023), duration_s=300.0))
    hot = plan.hottest()
    cut = min(p for p, h in zip(plan.prompt, hot, strict=True) if h)
    assert sum(hot) == pytest.approx(0.1 * len(plan), rel=0.05)
    assert all((p >= cut) == h for p, h in zip(plan.prompt, hot, strict=True))


def test_plans_and_prompts_are_deterministic_and_requests_without_blocks_draw_their_own_words():
    load = TraceLoad(str(AZURE_2023), start_s=60.0, rate=20.0)
    a, b = plan_trace(load, run_s=30.0), plan_trace(load, run_s=30.0)
    assert a == b and len(a) == 600 and a.meta["mean_rate"] == pytest.approx(20.0)
    assert a.prompt_text(3, 50, seed=1) == b.prompt_text(3, 50, seed=1)
    assert a.prompt_text(3, 50)[:40] != a.prompt_text(4, 50)[:40]
    cfg = LoadConfig(url="http://x", duration_s=30.0, trace=a)
    assert list(arrival_plan(cfg)) == list(zip(a.t, a.prompt, a.output, strict=True))
    assert request_prompt(cfg, 3, 50) == a.prompt_text(3, 50, cfg.seed)
    assert len(list(arrival_plan(LoadConfig(url="http://x", duration_s=10.0, trace=a)))) < 600  # the run bounds it


def test_the_synthetic_arrival_plan_is_unchanged():
    """The Poisson path is bit-identical to the one before traces (the old loop, inlined)."""
    import random
    cfg = LoadConfig(url="http://x", rate=37.0, duration_s=20.0, seed=11)
    rng_gap, rng_len, t, old = random.Random(11), random.Random(12), 0.0, []
    while True:
        t += rng_gap.expovariate(37.0)
        if t >= 20.0:
            break
        old.append((t, cfg.prompt_tokens.sample(rng_len), cfg.completion_tokens.sample(rng_len)))
    assert list(arrival_plan(cfg)) == old


def test_the_attribution_travels_with_the_plan():
    meta = plan_trace(TraceLoad(str(FIX / "azure.csv"))).meta
    assert meta["attribution"] == ATTRIBUTION["azure"] and "CC-BY 4.0" in meta["attribution"]
    assert "Splitwise" in meta["attribution"]
    json.dumps(meta)  # it goes into reports as is
    assert math.isfinite(meta["mean_rate"])


def test_plot_command_writes_one_svg_of_three_charts(tmp_path):
    from grayguard.sim.traces_plot import main
    out = tmp_path / "t.svg"
    assert main([str(FIX / "burstgpt.csv"), "--plot", str(out), "--bin", "1"]) == 0
    svg = out.read_text()
    assert svg.count('class="plot"') == 3 and "Arrivals per second" in svg and "Prompt tokens" in svg
    assert main([str(FIX / "bad_negative.csv"), "--plot", str(out)]) == 2
