"""/healthz and /readyz: is the loop alive, is the process ready. Pure decisions on times passed in, and the small
record (Beat) a loop keeps of its completed rounds; the controller's, the actuator's and the exporter's HTTP servers
answer with them (the exporter's loops: exporters/liveness.py).

/healthz (liveness) fails when the last completed tick is older than the stall limit: a loop wedged for good, which
only a restart cures. A tick that is merely slow, waiting out its own I/O deadlines (Prometheus, HAProxy, etcd), is
not a stall, so the limit never falls below the longest a healthy tick may take. /readyz fails until the first tick
has completed and, with a registry, until this replica knows whether it leads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grayguard.httpserve import Request, Response

MIN_STALL_S = 10.0  # a 1 s tick must not flap /healthz on a GC pause or a slow disk
STALL_TICKS = 10  # ticks missed in a row before the loop counts as stalled


@dataclass(frozen=True)
class Verdict:
    """A probe's answer: ok (200) or not (503), and the one-line reason served with it."""

    ok: bool
    reason: str


def stall_limit_s(tick_interval_s: float, tick_budget_s: float = 0.0) -> float:
    """How old the last completed tick may be before /healthz fails: max(10 s, 10 ticks, 2 x the tick's budget).

    tick_budget_s: the longest a healthy tick takes, every deadline it may wait on in turn (cmd_controller's
    tick_budget_s); twice it is also when run_loop stops renewing the leader lease, so a replica gives up the lead
    and fails its liveness at the same moment."""
    return max(MIN_STALL_S, STALL_TICKS * tick_interval_s, 2 * tick_budget_s)


def health(now: float, started: float, last_tick: float | None, limit_s: float, what: str = "tick") -> Verdict:
    """Liveness at now (monotonic seconds, as are started and last_tick): the loop started at `started` and last
    completed a `what` at last_tick (None: none yet)."""
    if last_tick is None:
        waited = now - started
        if waited > limit_s:
            return Verdict(False, f"stalled: no {what} has completed in the {waited:.0f}s since the loop started "
                           f"(stall limit {limit_s:g}s)")
        return Verdict(True, f"ok: starting, the first {what} has not completed yet ({waited:.1f}s)")
    age = now - last_tick
    if age > limit_s:
        return Verdict(False, f"stalled: the last {what} completed {age:.0f}s ago (stall limit {limit_s:g}s)")
    return Verdict(True, f"ok: the last {what} completed {age:.1f}s ago (stall limit {limit_s:g}s)")


def readiness(completed: int, knows_leadership: bool = True, what: str = "tick") -> Verdict:
    """Readiness: at least one completed `what` and, with a registry, the last one knew whether it leads."""
    if completed == 0:
        return Verdict(False, f"not ready: the first {what} has not completed yet")
    if not knows_leadership:
        return Verdict(False, "not ready: the registry has not answered, so this replica does not know whether it "
                       "leads")
    return Verdict(True, f"ready: {completed} {what}(s) completed")


def combined(verdicts: Sequence[Verdict], empty: Verdict) -> Verdict:
    """Several loops' verdicts as one line: the failing ones' reasons when any fails, else every one's; `empty` when
    there are none (a process with no loop switched on)."""
    failing = [v.reason for v in verdicts if not v.ok]
    if failing:
        return Verdict(False, "; ".join(failing))
    return Verdict(True, "; ".join(v.reason for v in verdicts)) if verdicts else empty


def probe(verdict: Callable[[], Verdict]) -> Callable[[Request], Response]:
    """A GET handler for a probe: 200 or 503 with the verdict's one-line reason."""
    def handler(_req: Request) -> Response:
        v = verdict()
        return 200 if v.ok else 503, "text/plain; charset=utf-8", (v.reason + "\n").encode()
    return handler


class Beat:
    """What a loop tells its probes: when it started and when it last completed a round (monotonic clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.last: float | None = None
        self.completed = 0

    def done(self) -> None:
        """A round completed (well or not: the loop is alive either way; failures have their own metrics)."""
        self.last = self.clock()
        self.completed += 1

    def health(self, limit_s: float, what: str = "tick") -> Verdict:
        return health(self.clock(), self.started, self.last, limit_s, what)
