"""The controller's clock: wall time for what is persisted and compared, monotonic time for durations.

A wall-clock step (NTP correcting a drifted clock, an operator's `date -s`) must not change an in-process
timer: a +1 h step would end every slow start and quarantine at once, a -1 h step would freeze them for an
hour. SteadyClock reads the wall clock once, at start, and adds monotonic elapsed time: the times it
returns are Unix times (the state file and /status stay meaningful across restarts), but the difference
of two readings is exactly the monotonic time that passed. A step is logged once, not followed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("grayguard.clock")

STEP_WARN_S = 5.0  # a wall clock this far from ours has been stepped: say so (once per step size)


class SteadyClock:
    """A callable clock: Unix time at construction + monotonic time elapsed since."""

    def __init__(self, wall: Callable[[], float] | None = None, mono: Callable[[], float] | None = None):
        # looked up now, not at import, so a test can stand in for time.time and time.monotonic
        self._wall = wall or time.time
        self._mono = mono or time.monotonic
        self._wall0 = self._wall()
        self._mono0 = self._mono()
        self._warned_offset: float | None = None

    def __call__(self) -> float:
        now = self._wall0 + (self._mono() - self._mono0)
        self._check_step(now)
        return now

    def offset(self) -> float:
        """How far the wall clock is from this clock now (s): non-zero after a step."""
        return self._wall() - (self._wall0 + (self._mono() - self._mono0))

    def _check_step(self, now: float) -> None:
        off = self._wall() - now
        if abs(off) < STEP_WARN_S:
            return
        if self._warned_offset is not None and abs(off - self._warned_offset) < STEP_WARN_S:
            return
        self._warned_offset = off
        log.warning("the wall clock moved %+.0fs against the monotonic clock; timers (slow start, quarantine, "
                    "canary intervals) keep monotonic time, and persisted times stay %+.0fs off the wall clock "
                    "until the controller restarts", off, -off)
