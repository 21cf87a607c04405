"""Run a job every N seconds on the monotonic clock: never overlapping itself, late runs skipped, not queued.

The controller's tick and its alert re-render each run in a thread of their own. The schedule is fixed-rate
(start + k x interval) on `time.monotonic`, so a wall-clock step (NTP at boot, a VM resumed, an operator's
`date -s`) neither fires a burst of ticks nor stops them for the length of the step. APScheduler 3, which
ran the loop before, schedules on wall-clock time: a -1 h step froze its ticks for an hour.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("grayguard.ticker")


def next_slot(start: float, interval_s: float, now: float, after: float) -> tuple[float, int]:
    """The first slot start + k*interval_s at or after `now` and after `after`, and how many slots in between
    were passed over (a run that overran them). Pure."""
    k = max(0, int((after - start) / interval_s + 1e-9) + 1)  # the slot right after the one that just ran
    due = start + k * interval_s
    if now <= due:
        return due, 0
    late = int((now - due) / interval_s + 1e-9)  # slots that went by while the previous run still ran
    due += late * interval_s
    if due < now:
        due += interval_s
        late += 1
    return due, late


def next_read(last_due: float | None, now: float, every_s: float, slot: int, slots: int) -> float:
    """When a signal read once in every_s (the hardware signals, signals.hardware_every_s), read at `now`, is due
    again: one interval on from its last due time, the phase kept; at its first read, or after a whole interval
    without one, spread: the slot-th of `slots` signals due (slot + 1) / slots of an interval from now, so that no
    tick sends them all. The controller's schedule (loop.read_optional) and the benchmark's model of it
    (bench.engine). Pure."""
    if last_due is not None and now - last_due < every_s:
        return last_due + every_s
    return now + every_s * (slot + 1) / slots


class Periodic:
    """fn() every interval_s in a daemon thread until stop is set; on_skip(n) for slots passed over."""

    def __init__(self, name: str, fn: Callable[[], None], interval_s: float, stop: threading.Event,
                 on_skip: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"{name}: interval must be > 0, got {interval_s!r}")
        self.name, self.fn, self.interval_s, self.stop = name, fn, interval_s, stop
        self.on_skip, self.clock = on_skip, clock
        self.runs = 0
        self.thread = threading.Thread(target=self._run, name=f"grayguard-{name}", daemon=True)

    def start(self) -> Periodic:
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        start = due = self.clock()
        while not self.stop.is_set():
            wait = due - self.clock()
            if wait > 0 and self.stop.wait(wait):  # Event.wait times out on the monotonic clock
                break
            ran_at = due
            try:
                self.fn()
            except Exception:  # a bug must not end the schedule; the caller's fn logs and counts its own
                log.exception("%s failed", self.name)
            self.runs += 1
            due, skipped = next_slot(start, self.interval_s, self.clock(), ran_at)
            if skipped and self.on_skip is not None:
                self.on_skip(skipped)
