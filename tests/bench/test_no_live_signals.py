"""Pools whose engine gives no live fast path in the benchmark (`Scenario.live_signals`, `grayguard bench
--no-live-signals`): Triton's profile (docs/engines.md), whose nodes the probes and the 30 s window judge alone."""

from __future__ import annotations

import json
from dataclasses import replace

import grayguard.bench.policies as policies
from grayguard.bench import engine
from grayguard.bench.scenarios import load_suite
from grayguard.cli import main

LIVE = ("live_itl", "live_ttft", "live_prefill_rate", "live_decode_batch")


def _inputs_seen(scn, monkeypatch) -> list:
    seen: list = []
    real = policies.decide_pool

    def spy(prev, inputs, policy, now):
        seen.extend(inputs.values())
        return real(prev, inputs, policy, now)
    monkeypatch.setattr(policies, "decide_pool", spy)
    engine.run(scn, "grayguard")
    return seen


def _thermal():
    scn = next(s for s in load_suite("smoke")[0] if s.name == "thermal/n4/homog/steady")
    return replace(scn, duration_s=50.0)


def test_without_live_signals_the_controller_sees_no_live_value_and_still_its_probes(monkeypatch):
    seen = _inputs_seen(replace(_thermal(), live_signals=False), monkeypatch)
    assert seen and all(getattr(i, f) is None for i in seen for f in LIVE)
    assert sum(i.probe_result is not None for i in seen) > len(seen) // 2
    assert sum(i.latency is not None for i in seen) > len(seen) // 2


def test_with_them_it_does(monkeypatch):
    seen = _inputs_seen(_thermal(), monkeypatch)
    assert all(sum(getattr(i, f) is not None for i in seen) > len(seen) // 2 for f in ("live_itl", "live_ttft"))


def test_the_cli_flag_runs_every_scenario_without_them_and_says_so(tmp_path):
    rc = main(["bench", "--suite", "smoke", "--filter", "refused/n4", "--policies", "grayguard", "--no-live-signals",
               "--report-dir", str(tmp_path), "--workers", "1"])
    assert rc == 0
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert meta["suite"] == "smoke (no live signals)" and meta["runs"] >= 1
    assert "no live signals" in (tmp_path / "report.md").read_text()
