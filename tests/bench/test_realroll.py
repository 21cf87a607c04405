"""bench/realroll.py's pure part: the clients' TTFT over the three phases of a real rolling restart with a slowdown
in it (the run itself takes 10 minutes on real vLLM servers: a measurement, docs/benchmarks.md "twenty-fifth round")."""

from __future__ import annotations

import json

import pytest

from grayguard.bench.realroll import FAULT_WINDOW_S, TIMEOUT_S, main, phases

EVENTS = [{"t": 33.0, "kind": "controller", "node": None}, {"t": 60.0, "kind": "restart", "node": "node1"},
          {"t": 190.0, "kind": "serving", "node": "node1"}, {"t": 195.0, "kind": "restart", "node": "node2"},
          {"t": 320.0, "kind": "serving", "node": "node2"}, {"t": 325.0, "kind": "thermal", "node": "node3"}]


def _req(start: float, ttft: float | None, status: str = "ok") -> dict:
    return {"start_s": start, "status": status, "ttft_s": ttft, "e2e_s": None, "backend": "node1"}


def test_each_request_falls_in_its_phase_and_a_failed_one_counts_as_the_timeout():
    records = [_req(1.0, 0.2), _req(59.9, 0.4),  # before the first restart
               _req(60.0, 0.1), _req(200.0, 0.5, "stream_error"), _req(324.9, None, "protocol"),  # the restarts
               _req(325.0, 0.3), _req(325.0 + FAULT_WINDOW_S - 0.1, 1.0, "timeout"),  # the fault's 90 s
               _req(325.0 + FAULT_WINDOW_S, 9.0)]  # after them: in no phase
    ph = phases(records, EVENTS)
    assert {k: v["n"] for k, v in ph.items()} == {"before": 2, "restarts": 3, "fault": 2}
    assert {k: v["failed"] for k, v in ph.items()} == {"before": 0, "restarts": 2, "fault": 1}
    assert ph["before"]["mean_s"] == pytest.approx(0.3)
    assert ph["restarts"]["mean_s"] == pytest.approx((0.1 + 2 * TIMEOUT_S) / 3)  # a first token, then a failure
    assert ph["fault"]["p99_s"] == TIMEOUT_S and ph["fault"]["p90_s"] == TIMEOUT_S


def test_a_run_stopped_before_its_slowdown_has_no_fault_phase():
    ph = phases([_req(1.0, 0.2), _req(100.0, 0.3)], EVENTS[:3])
    assert set(ph) == {"before"}  # no slowdown yet: where the restarts end is not known
    assert phases([], EVENTS) == {}


def test_summary_prints_runs_already_made_and_a_missing_one_exits_2(tmp_path, capsys):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"policy": "off", "k": 10.0, "rate": 1.5, "events": EVENTS,
                                              "records": [_req(1.0, 0.2), _req(330.0, 0.4)]}))
    assert main(["--summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("r1 (off, k=10): before n=1 mean=0.20") and "fault n=1 mean=0.40" in out
    assert main(["--summary", str(tmp_path / "none")]) == 2
    assert "no readable run.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--k", "0.5", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
