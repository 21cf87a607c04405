"""The controller's schedule runs on the monotonic clock: fixed rate, never overlapping, late runs skipped."""

from __future__ import annotations

import threading
import time

import pytest

from grayguard.controller.ticker import Periodic, next_slot
from grayguard.localstack.procs import wait_until


@pytest.mark.parametrize("now, after, want", [
    (0.3, 0.0, (1.0, 0)),   # on time: the next slot
    (1.0, 0.0, (1.0, 0)),   # finished exactly at the next slot: it runs now
    (2.0, 0.0, (2.0, 1)),   # overran slot 1: skipped, slot 2 runs now
    (2.5, 0.0, (3.0, 2)),   # overran slots 1 and 2
    (5.2, 5.0, (6.0, 0)),
])
def test_next_slot(now, after, want):
    assert next_slot(0.0, 1.0, now, after) == want


def test_runs_at_a_fixed_rate_until_stopped():
    stop, seen = threading.Event(), []
    p = Periodic("t", lambda: seen.append(time.monotonic()), 0.05, stop).start()
    wait_until(lambda: len(seen) >= 6, timeout_s=10, what="six runs")
    stop.set()
    p.join(5)
    assert not p.thread.is_alive()
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert min(gaps) > 0.02  # never a burst


def test_a_slow_run_never_overlaps_and_the_slots_it_covered_are_skipped():
    stop, active, most, skipped = threading.Event(), [0], [0], []

    def slow():
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.25)
        active[0] -= 1

    p = Periodic("t", slow, 0.1, stop, on_skip=skipped.append).start()
    wait_until(lambda: p.runs >= 3, timeout_s=10, what="three runs")
    stop.set()
    p.join(5)
    assert most[0] == 1
    assert sum(skipped) >= 2 * (p.runs - 1)  # each 0.25 s run covers at least two 0.1 s slots


def test_a_failing_run_does_not_end_the_schedule():
    stop, calls = threading.Event(), []

    def boom():
        calls.append(1)
        raise RuntimeError("bug")

    p = Periodic("t", boom, 0.02, stop).start()
    wait_until(lambda: len(calls) >= 3, timeout_s=10, what="runs after a failure")
    stop.set()
    p.join(5)


def test_the_wall_clock_is_never_read(monkeypatch):
    """A wall-clock step cannot move the schedule: it does not look at the wall clock at all."""
    def no_wall_clock():
        raise AssertionError("the schedule read the wall clock")

    stop, calls = threading.Event(), []
    p = Periodic("t", lambda: calls.append(1), 0.02, stop)
    monkeypatch.setattr(time, "time", no_wall_clock)
    p.start()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        stop.wait(0.01)
    stop.set()
    p.join(5)
    assert len(calls) >= 3


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be > 0"):
        Periodic("t", lambda: None, 0, threading.Event())
