"""`grayguard demo --trace`: the option's parsing (the model's context of each fleet) and what the report says."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from grayguard.demo import cli

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
AZURE = Path(__file__).resolve().parents[2] / "bench" / "suites" / "traces" / "azure-llm-inference-2023-conv.csv"


def parse(*argv: str) -> cli.DemoOptions:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.options_from_args(p.parse_args(list(argv)))


def test_without_a_trace_the_demo_runs_its_poisson_load():
    assert parse().trace is None and cli.trace_report(parse()) is None


def test_a_trace_is_compressed_to_the_default_loads_tokens_per_second_or_to_a_rate_given():
    o = parse("--trace", str(AZURE), "--trace-window", "60:")
    m = o.trace.meta
    # 20 req/s of the default mix (~424 tokens each): the same tokens/s in larger trace requests, fewer of them
    assert m["mean_tokens_per_s"] == pytest.approx(20 * 424.26, rel=0.01) and m["mean_rate"] < 10
    assert m["run_s"] == o.duration_s == 150.0
    assert parse("--trace", str(AZURE), "--rate", "12").trace.meta["mean_rate"] == pytest.approx(12.0)
    assert m["window_s"][0] == 60.0 and m["max_model_len"] == 8192  # the simulator's max_model_len
    fixed = parse("--trace", str(FIX / "azure.csv"), "--trace-speedup", "2", "--duration", "60",
                  "--fault-until", "50")
    assert fixed.trace.t == (0.0, 0.5, 0.75, 2.0, 5.0) and fixed.trace.meta["speedup"] == 2.0


def test_the_real_fleet_clips_to_the_real_servers_context():
    from grayguard.localstack.vllmserver import MAX_MODEL_LEN
    o = parse("--fleet", "vllm", "--trace", str(FIX / "azure.csv"), "--trace-speedup", "1")
    assert o.trace.meta["max_model_len"] == MAX_MODEL_LEN
    assert all(p + g <= MAX_MODEL_LEN for p, g in zip(o.trace.prompt, o.trace.output, strict=True))
    assert o.trace.meta["mean_rate"] == pytest.approx(5 / 180.0, rel=0.02)  # its own pace over the real run


@pytest.mark.parametrize("argv, message", [
    (("--trace", str(FIX / "bad_backwards.jsonl")), r"bad_backwards.jsonl:3: column 'timestamp'"),
    (("--trace", str(FIX / "azure.csv"), "--trace-speedup", "2", "--rate", "5"), "--trace-speedup or --rate"),
    (("--trace-speedup", "2",), "needs --trace"),
    (("--trace", str(FIX / "azure.csv"), "--trace-window", "600:"), "no requests in the trace window"),
])
def test_a_bad_trace_is_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_the_report_and_its_summary_say_the_run_was_on_the_trace():
    o = parse("--trace", str(AZURE), "--trace-window", "60:600")
    t = cli.trace_report(o)
    assert t["file"] == str(AZURE) and t["format"] == "azure" and t["window_s"][0] == 60.0
    assert "Splitwise" in t["attribution"] and "CC-BY 4.0" in t["attribution"]
    r = {"fault": "thermal", "faulty_node": "node3", "controller": True, "fault_start_s": 30.0, "fault_end_s": 90.0,
         "first_weight_cut_s": 32.0, "quarantine_s": 35.0, "page_s": 40.0, "recovered_s": 100.0,
         "false_quarantines": [], "phases": {}, "nodes": 8, "fleet": "sim", "trace": t, "verdict": "v"}
    text = cli.summary_text(r)
    assert "trace azure-llm-inference-2023-conv.csv (azure), window 60-" in text and "source: Azure LLM" in text
    assert "trace " not in cli.summary_text({**r, "trace": None})


def test_the_membership_scenario_refuses_a_trace(capsys):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--scenario", "membership", "--trace", str(AZURE)])
    assert cli.run(args) == 2 and "--trace" in capsys.readouterr().err
