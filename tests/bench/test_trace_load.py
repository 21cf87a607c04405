"""Trace load in the benchmark: the suite loader's `load: {trace: FILE, ...}`, its arrivals, its hottest tenant."""

from __future__ import annotations

from pathlib import Path

import pytest

from grayguard.bench.scenarios import SuiteError, expand, load_suite
from grayguard.bench.spec import DEFAULT_MIX_TOKENS, H100_CAPACITY_RPS, make_arrivals, trace_plan

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def suite(load: dict, benign: dict | None = None, size: int = 4) -> dict:
    return {"base": {"duration_s": 100, "seed": 3}, "pools": {"homogeneous": {size: [[size, "h100"]]}},
            "loads": {"tr": load}, "benign": benign or {"plain": {"load": "tr"}},
            "groups": [{"group": "benign", "matrix": {"benign": list(benign or {"plain": 0}), "size": [size]}}]}


AZURE_2023 = "azure-llm-inference-2023-conv.csv"
SUITES = Path(__file__).resolve().parents[2] / "bench" / "suites"


def test_a_trace_load_replays_the_trace_at_the_pools_token_utilization():
    [s] = expand(suite({"trace": f"traces/{AZURE_2023}", "window": "60:", "utilization": 0.4}), "t.yaml", SUITES)
    plan = trace_plan(s)
    assert plan.meta["window_s"][0] == 60.0 and plan.meta["format"] == "azure"
    capacity_tps = 4 * H100_CAPACITY_RPS * DEFAULT_MIX_TOKENS
    assert plan.meta["mean_tokens_per_s"] == pytest.approx(0.4 * capacity_tps, rel=0.01)
    arr = make_arrivals(s)
    assert arr.t == list(plan.t) and arr.prompt == list(plan.prompt) and set(arr.pin) == {-1}
    assert s.rate == pytest.approx(len(arr) / 100, rel=0.01)
    assert make_arrivals(s) == arr  # every policy sees the same traffic


def test_the_hottest_tenant_is_pinned_in_its_window_and_capped_at_its_rate():
    load = {"trace": str(SUITES / "traces" / AZURE_2023), "window": [60, None], "utilization": 0.4}
    benign = {"hot": {"load": "tr", "load_overrides": {"pin_hottest": {"node": 1, "start_s": 40, "end_s": 90}}},
              "capped": {"load": "tr", "load_overrides": {"pin_hottest": {"node": 1, "start_s": 40, "end_s": 90,
                                                                          "max_rate": 0.5}}}}
    hot, capped = expand(suite(load, benign), "t.yaml")
    arr, plan = make_arrivals(hot), trace_plan(hot)
    pinned = [i for i, p in enumerate(arr.pin) if p >= 0]
    assert set(arr.pin) == {-1, 1} and all(40 <= arr.t[i] < 90 for i in pinned)
    cut = sorted(plan.prompt)[int(0.9 * (len(plan) - 1))]  # Azure has no tenants: the longest-prompt decile
    assert all(arr.prompt[i] >= cut for i in pinned)
    assert len(pinned) == sum(1 for t, h in zip(plan.t, plan.hottest(), strict=True) if h and 40 <= t < 90)
    few = sum(p >= 0 for p in make_arrivals(capped).pin)
    assert few == 25 < len(pinned)  # 0.5 req/s over 50 s


def test_a_mooncake_trace_at_a_speedup_pins_its_most_shared_prefix(tmp_path):
    load = {"trace": str(FIX / "mooncake.jsonl"), "speedup": 0.5}
    benign = {"hot": {"load": "tr", "load_overrides": {"pin_hottest": {"node": "node2"}}}}
    [s] = expand(suite(load, benign), "t.yaml")
    arr = make_arrivals(s)
    assert arr.t == [0.0, 1.0, 3.0, 6.0] and arr.pin == [2, 2, -1, 2]  # hash id 0 opens three of the four


@pytest.mark.parametrize("load, field", [
    ({"trace": "nope.csv"}, "load.trace: no trace file"),
    ({"trace": str(FIX / "bad_not_a_number.csv")}, "load.trace: "),
    ({"trace": str(FIX / "azure.csv"), "window": "x:y"}, "load.window"),
    ({"trace": str(FIX / "azure.csv"), "speedup": 2, "utilization": 0.4}, "load.speedup"),
    ({"trace": str(FIX / "azure.csv"), "speedup": -1}, "load.speedup"),
    ({"trace": str(FIX / "azure.csv"), "prompt": {"median": 10}}, "load.prompt: not with a trace"),
    ({"trace": str(FIX / "azure.csv"), "format": "parquet"}, "load.format"),
    ({"trace": str(FIX / "azure.csv"), "window": "500:"}, "load.trace: .*no requests in the trace window"),
    ({"window": "0:10"}, "load.window: only with a trace"),
    ({"trace": str(FIX / "azure.csv"), "pin_hottest": {"nodes": 0}}, "load.pin_hottest"),
    ({"trace": str(FIX / "azure.csv"), "pin_hottest": {"node": 9}}, "load.pin_hottest: node 9 is not in a pool of 4"),
])
def test_a_bad_trace_load_is_refused_naming_the_field(load, field):
    with pytest.raises(SuiteError, match=field):
        expand(suite(load), "t.yaml")
    bad = str(FIX / "bad_not_a_number.csv")
    if load.get("trace") == bad:
        with pytest.raises(SuiteError, match=r"bad_not_a_number.csv:3:2: column 'ContextTokens'"):
            expand(suite(load), "t.yaml")


@pytest.mark.parametrize("name", ["smoke", "default"])
def test_the_shipped_suites_have_trace_scenarios_benign_and_faulted(name):
    scenarios, _ = load_suite(name)
    traced = [s for s in scenarios if s.load.trace is not None]
    benign = {s.name for s in traced if s.group == "benign"}
    faults = {s.tag["fault"] for s in traced if s.group == "fault"}
    assert benign and faults and all(Path(s.load.trace.path).is_file() for s in traced)
    if name == "default":
        assert {s.tag["size"] for s in traced if s.group == "benign"} == {4, 8, 32}
        assert any(s.load.trace_pin for s in traced if s.group == "benign")
        assert faults == {f for s in scenarios if s.group == "fault" and s.load.trace is None
                          for f in [s.tag["fault"]]}  # every fault type of the suite, under the trace too
