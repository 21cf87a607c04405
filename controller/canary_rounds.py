"""Canary rounds off the tick: started on a bounded pool of daemon threads, taken back by a later tick.

A canary to a hung engine answers nothing for recovery.canary_timeout_s; a tick that waited for it would be
blind to the rest of the fleet meanwhile (on a 1 s tick, a 5 s hang skipped 9 ticks of 30). So the tick only
starts a round (`Workers.submit` per target) and, on each later tick, takes the rounds whose every target has
answered, failed, or run past the timeout (`Rounds.take`): the tick never waits on a canary's network I/O.
Which peers a round goes to and what its answers mean stay in controller/canary.py and controller/decide.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from grayguard.controller.policy import CANARY, NodeState

WORKERS = 32  # canary requests running at once; more wait their turn (a healthy one answers in well under a second)
CLOSE_WAIT_S = 1.0  # close() waits this long at most for the workers (daemon threads: a hung one never holds exit)


class Probe:
    """One canary request (one URL) as sent: when it started, its TTFT (None: failed) or what it raised."""

    __slots__ = ("url", "started", "finished", "ttft", "error", "done")

    def __init__(self, url: str):
        self.url = url
        self.started: float | None = None  # on the controller's clock; None: still queued (not sent yet)
        self.finished: float | None = None
        self.ttft: float | None = None
        self.error: BaseException | None = None
        self.done = False  # set last, after the result: a reader that sees it sees the result

    def run(self, fn: Callable[[str], float | None], clock: Callable[[], float]) -> None:
        self.started = clock()
        try:
            self.ttft = fn(self.url)
        except Exception as e:  # a canary that raises is a failed canary, never a failed worker
            self.error = e
        finally:
            self.finished = clock()
            self.done = True

    def outcome(self, now: float, timeout_s: float) -> tuple[bool, str | None]:
        """(over, why it failed): over once it answered, failed or ran timeout_s since it was sent; why is None
        for an answer (ttft holds it), "timeout" or "raised" otherwise. A queued canary was not sent: not over."""
        if self.done:
            if self.error is not None:
                return True, "raised"
            if self.ttft is not None and self.finished - self.started > timeout_s:  # type: ignore[operator]
                return True, "timeout"  # it answered, but after the deadline: a hung engine's canary is a failure
            return True, None  # an answer (ttft), or a failure the canary reported itself (None)
        if self.started is not None and now - self.started >= timeout_s - 1e-9:
            return True, "timeout"
        return False, None

    def value(self, why: str | None) -> float | None:
        """The TTFT a finished outcome stands for: None unless it answered in time."""
        return None if why else self.ttft


class Workers:
    """A bounded pool of daemon threads running fn(url); threads start as work needs them, up to `size`."""

    def __init__(self, fn: Callable[[str], float | None], clock: Callable[[], float], size: int = WORKERS):
        self._fn, self._clock, self._size = fn, clock, size
        self._queue: deque[Probe] = deque()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._unfinished = 0  # probes submitted and not done (queued ones included)
        self.closed = False

    def submit(self, url: str) -> Probe:
        """Queue one canary; it runs as soon as a worker is free."""
        p = Probe(url)
        with self._cv:
            if self.closed:
                p.error, p.done = RuntimeError("the controller is stopping"), True
                return p
            self._queue.append(p)
            self._unfinished += 1
            if len(self._queue) > self._idle and len(self._threads) < self._size:
                t = threading.Thread(target=self._work, name=f"canary-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify_all()
        return p

    def in_flight(self) -> int:
        """Canaries submitted and not done yet (running or queued)."""
        with self._cv:
            return self._unfinished

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every canary submitted so far is done; False if some still run after timeout_s."""
        with self._cv:
            return self._cv.wait_for(lambda: self._unfinished == 0, timeout_s)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Take no more canaries, drop the queued ones, and join the workers for at most timeout_s in all."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            while self._queue:
                p = self._queue.popleft()
                p.error, p.done = RuntimeError("the controller is stopping"), True
                self._unfinished -= 1
            self._cv.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout_s
        for t in threads:  # a worker stuck in a canary that ignores its deadline is a daemon: it never holds exit
            t.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                self._cv.wait_for(lambda: self._queue or self.closed)
                self._idle -= 1
                if self.closed:
                    return
                p = self._queue.popleft()
            p.run(self._fn, self._clock)
            with self._cv:
                self._unfinished -= 1
                self._cv.notify_all()


@dataclass(frozen=True)
class Pending:
    """A round in flight: the node, the canary stage it was sent in, its peers and their EMAs then, each probe."""

    pool: str
    node: str
    since: float  # the node's NodeState.since when sent: a round answers for that canary stage only
    at: float  # the tick time it was sent (the node's last_canary once it is applied)
    peers: tuple[str, ...]
    emas: Mapping[str, float]  # each peer's window latency when sent: the estimate scales the TTFT ratio of that moment
    probes: Mapping[str, Probe]  # target (the node and each peer) -> its request

    def over(self, now: float, timeout_s: float) -> bool:
        """Every target answered, failed, or ran past timeout_s since it was sent."""
        return all(p.outcome(now, timeout_s)[0] for p in self.probes.values())


def discard_reason(r: Pending, prev: Mapping[str, NodeState], servers: Mapping[str, object], now: float,
                   max_age_s: float) -> str | None:
    """Why a completed round no longer answers for its node (None: apply it): the node left the pool, left the
    canary stage it was sent in (slow start, released, drained anew), or the answer is older than max_age_s."""
    s = prev.get(r.node)
    if r.node not in servers or s is None:
        return "the node left the pool"
    if s.state != CANARY or s.since != r.since:
        return f"the node left the canary stage it was sent in (now {s.state} since {s.since:.0f})"
    if now - r.at > max_age_s:
        return f"sent {now - r.at:.0f}s ago, older than stale_after_s={max_age_s:g}s"
    return None


class Rounds:
    """The rounds in flight, by pool; the tick takes the completed ones and starts new ones, never waiting."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Pending]] = {}

    def add(self, r: Pending) -> None:
        self._pending.setdefault(r.pool, []).append(r)

    def nodes(self, pool: str) -> set[str]:
        """The pool's nodes with a round in flight (completed or not)."""
        return {r.node for r in self._pending.get(pool, ())}

    def take(self, pool: str, now: float, timeout_s: float) -> list[Pending]:
        """Remove and return the pool's completed rounds, in the order they were sent."""
        rs = self._pending.get(pool)
        if not rs:
            return []
        done = [r for r in rs if r.over(now, timeout_s)]
        if done:
            left = [r for r in rs if r not in done]
            if left:
                self._pending[pool] = left
            else:
                del self._pending[pool]
        return done

    def discard(self, pool: str) -> int:
        """Forget the pool's rounds (this replica no longer leads it); their requests end on their own deadline."""
        return len(self._pending.pop(pool, ()))

    def pools(self) -> list[str]:
        return sorted(self._pending)
