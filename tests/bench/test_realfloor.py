"""grayguard.bench.realfloor: the hindsight floor of threshold detectors on the real runs, computed right.

The figures themselves are a measurement (docs/realfleet.md, "The floor"); these tests check the arithmetic on
hand-built ticks whose answer is known, and that the command reads every committed run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from grayguard.bench.realfloor import Run, Tick, benign_floor, cut_after, leave_one_out, measure, onset, trailing_min

REPO = Path(__file__).resolve().parents[2]


def _run(itl: dict[str, list[float | None]], probe: dict[str, list[float | None]] | None = None,
         faulty: str = "n1", start_tick: int = 3, drained: dict[int, set[str]] | None = None) -> Run:
    n = len(next(iter(itl.values())))
    ticks = [Tick(100.0 + i, {node: (itl[node][i], (probe or {}).get(node, [None] * n)[i]) for node in itl},
                  frozenset(node for node in itl if node not in (drained or {}).get(i, ())))
             for i in range(n)]
    return Run("hand", ticks, faulty, 100.0 + start_tick)


def test_leave_one_out_divides_by_the_others_median_and_needs_two_others():
    assert leave_one_out({"a": 4.0, "b": 1.0, "c": 2.0, "d": 3.0}) == {"a": 2.0, "b": 1 / 3.0, "c": 2 / 3.0, "d": 1.5}
    assert leave_one_out({"a": 4.0, "b": 1.0}) == {}
    assert leave_one_out({"a": 4.0, "b": 1.0, "c": 2.0, "d": 3.0}, peers={"b", "c", "d"})["a"] == 2.0
    assert "b" not in leave_one_out({"a": 4.0, "b": 1.0, "c": 2.0}, peers={"b", "c"})  # one peer is not enough


def test_one_benign_tick_is_allowed_but_two_in_a_row_set_the_floor():
    run = _run({"n1": [1.0, 1.0, 1.0, 2.0, 6.0, 8.0, 8.0],
                "n2": [1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0],   # one tick at 9x: the target allows it
                "n3": [1.0, 1.0, 4.0, 4.0, 1.0, 1.0, 1.0]})  # two ticks at 4x: the floor is just above 4
    r = benign_floor(run, "itl", 1)
    assert 4.0 < r < 4.0001
    assert cut_after(run, "itl", 1, r) == 1.0  # the 6x tick, one second after the fault
    assert cut_after(run, "itl", 2, 6.0) == 2.0  # two ticks at >= 6x: 6 then 8
    assert onset(run, "itl", 1.5) == 0.0  # 2x at the fault's first tick


def test_the_faulty_node_counts_as_benign_before_its_fault_only():
    run = _run({"n1": [5.0, 5.0, 1.0, 9.0, 9.0], "n2": [1.0] * 5, "n3": [1.0] * 5})
    assert 5.0 < benign_floor(run, "itl", 1) < 5.001  # its two 5x ticks before the fault set the floor
    assert cut_after(run, "itl", 1, benign_floor(run, "itl", 1)) == 0.0


def test_a_drained_benign_node_sets_no_floor_but_a_drained_faulty_one_still_cuts():
    run = _run({"n1": [1.0, 1.0, 1.0, 7.0, 7.0], "n2": [1.0, 9.0, 9.0, 9.0, 9.0], "n3": [1.0] * 5},
               drained={1: {"n2"}, 2: {"n2"}, 3: {"n1", "n2"}, 4: {"n1", "n2"}})
    assert benign_floor(run, "itl", 1) < 1.001  # n2's 9x is a drained node's held window
    assert cut_after(run, "itl", 1, 2.0) == 0.0


def test_a_tick_without_a_value_breaks_a_run_of_d():
    run = _run({"n1": [1.0, 1.0, 1.0, 7.0, None, 7.0, 7.0], "n2": [1.0] * 7, "n3": [1.0] * 7})
    assert [t for _, t, _, _ in trailing_min(run, "itl", 2)["n1"]] == [101.0, 102.0, 103.0, 106.0]
    assert cut_after(run, "itl", 2, 7.0) == 3.0


def test_both_needs_the_two_witnesses_and_either_takes_the_larger():
    itl = {"n1": [1.0, 1.0, 1.0, 8.0, 8.0], "n2": [1.0, 5.0, 5.0, 1.0, 1.0], "n3": [1.0] * 5}
    probe = {"n1": [1.0, 1.0, 1.0, 1.0, 9.0], "n2": [1.0, 1.0, 1.0, 1.0, 1.0], "n3": [1.0, 3.0, 3.0, 1.0, 1.0]}
    run = _run(itl, probe)
    assert benign_floor(run, "both", 1) < 1.001  # no benign node is slow on both at once
    assert cut_after(run, "both", 1, 2.0) == 1.0  # the faulty node is, from its second tick
    assert 5.0 < benign_floor(run, "either", 1) < 5.001
    assert cut_after(run, "either", 1, benign_floor(run, "either", 1)) == 0.0


def test_a_fault_that_never_clears_the_benign_floor_has_no_cut():
    run = _run({"n1": [1.0, 1.0, 1.0, 3.0, 3.0], "n2": [1.0, 4.0, 4.0, 1.0, 1.0], "n3": [1.0] * 5})
    m = measure([run])
    assert m["itl/1"]["pooled_cut_s"]["hand"] is None and m["itl/1"]["own_cut_s"]["hand"] is None
    assert math.isclose(m["itl/1"]["pooled_r"], 4.0)


def test_the_command_measures_every_committed_run():
    p = subprocess.run([sys.executable, "-m", "grayguard.bench.realfloor", "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    runs = sorted(d.name for d in (REPO / "tests" / "fixtures" / "vllm" / "runs").iterdir()
                  if (d / "recording.jsonl.gz").exists())
    assert sorted(out["measure"]["itl/1"]["own_r"]) == runs
    assert set(out["best_own"]) == set(runs)  # every committed run has a faulty node
