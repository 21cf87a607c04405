"""`grayguard loadgen --trace`: a production trace's arrivals and lengths against a simulated node, and its options."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from grayguard.cli import main
from grayguard.sim.fleet import FleetThread
from grayguard.sim.model import ModelParams
from grayguard.sim.traces import TraceLoad, plan_trace

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
FAST = replace(ModelParams(), decode_s_base=0.002, decode_s_per_seq=0.0001, prefill_s_per_token=1e-6,
               jitter=0.0, emit_interval_s=0.02)


@pytest.fixture(scope="module")
def node():
    ft = FleetThread(n=1, seed=3, params=FAST)
    ft.start()
    try:
        yield ft.nodes[0]
    finally:
        ft.stop()


def prompt_tokens_seen(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total"))


def test_loadgen_replays_the_trace_against_a_node_and_says_which(node, capsys, tmp_path):
    before = prompt_tokens_seen(node.url)
    records = tmp_path / "rec.csv"
    rc = main(["loadgen", "--url", node.url, "--trace", str(FIX / "mooncake.jsonl"), "--trace-speedup", "4",
               "--duration", "0", "--timeout", "10", "--json", "--records", str(records)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["all"]["requests"] == out["all"]["ok"] == 4
    assert out["trace"]["format"] == "mooncake" and out["trace"]["speedup"] == 4.0
    assert out["trace"]["attribution"].startswith("Mooncake trace")
    # the node prefilled exactly the trace's prompt lengths: one token a word on both engines
    assert prompt_tokens_seen(node.url) - before == 1100 + 700 + 600 + 1024
    starts = [float(line.split(",")[1]) for line in records.read_text().splitlines()[1:]]
    assert starts == pytest.approx([0.0, 0.125, 0.375, 0.75])  # 0, 0.5, 1.5, 3 s at x4


def test_the_table_names_the_trace_and_its_attribution(node, capsys):
    rc = main(["loadgen", "--url", node.url, "--trace", str(FIX / "azure.csv"), "--trace-rate", "8",
               "--trace-window", "0:5", "--trace-max-len", "2048", "--duration", "0", "--timeout", "10"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "trace " in out and "(azure): window 0-5 s x10" in out and "clipped to 2048 tokens" in out
    assert "Splitwise" in out and "CC-BY 4.0" in out


@pytest.mark.parametrize("argv, message", [
    (["--trace", str(FIX / "bad_not_a_number.csv")], "bad_not_a_number.csv:3:2: column 'ContextTokens'"),
    (["--trace", str(FIX / "azure.csv"), "--trace-window", "x"], "trace window 'x'"),
    (["--trace", str(FIX / "azure.csv"), "--trace-utilization", "0.5"], "needs the pool's capacity"),
    (["--trace-speedup", "2"], "--trace-speedup needs --trace"),
    (["--trace", str(FIX / "azure.csv"), "--trace-capacity-rps", "4"], "only with --trace-utilization"),
])
def test_a_bad_trace_or_option_exits_2_with_the_reason_not_a_traceback(argv, message, capsys):
    assert main(["loadgen", "--url", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_utilization_of_a_capacity_in_tokens_sets_the_pace():
    from argparse import ArgumentParser

    from grayguard.sim import cli_loadgen
    p = ArgumentParser()
    cli_loadgen.add_arguments(p)
    args = p.parse_args(["--url", "http://x", "--trace", str(FIX / "burstgpt.csv"), "--trace-utilization", "0.5",
                         "--trace-capacity-tps", "4000", "--trace-window", "0:3", "--duration", "0"])
    cfg = cli_loadgen.config_from_args(args)
    plan = plan_trace(TraceLoad(str(FIX / "burstgpt.csv"), duration_s=3.0, utilization=0.5), capacity_tps=4000)
    assert cfg.trace == plan and cfg.trace.meta["mean_tokens_per_s"] == pytest.approx(2000, rel=1e-3)
