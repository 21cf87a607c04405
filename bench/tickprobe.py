"""Timing the real Controller's tick from outside (bench/wholetick.py): its methods wrapped on one instance, its
runtime-API client subclassed; the controller code itself is unchanged."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterator

from grayguard.bench.scale import deep_size, rss_bytes
from grayguard.bench.tickresult import MemoryMark, TickSample
from grayguard.controller.haproxy import Command, CommandResult, RuntimeClient
from grayguard.controller.loop import Controller, TickResult
from grayguard.controller.ticker import next_slot


class Stopwatch:
    """Seconds per part of the tick under way, summed over its calls, and when each part last started and ended."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.spent: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.counts: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = self.started[name] = time.perf_counter()
        try:
            yield
        finally:
            self.ended[name] = time.perf_counter()
            self.spent[name] = self.spent.get(name, 0.0) + self.ended[name] - t0

    def timed(self, name: str, fn: Callable) -> Callable:
        """fn, its calls timed as part name."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)
        return call


class TimedRuntime(RuntimeClient):
    """The controller's runtime-API client: each write batch timed, its commands and refusals counted."""

    def __init__(self, endpoint: str, timeout_s: float, watch: Stopwatch):
        super().__init__(endpoint, timeout_s)
        self.watch = watch

    def apply(self, commands: list[Command]) -> list[CommandResult]:
        with self.watch.part("write"):
            out = super().apply(commands)
        self.watch.counts["commands"] += len(commands)
        self.watch.counts["batches"] += 1 if commands else 0
        self.watch.counts["refused"] += sum(1 for r in out if not r.ok)
        return out


def instrument(ctl: Controller, watch: Stopwatch) -> None:
    """Time the controller's own phases: its methods wrapped on this instance, the class untouched."""
    for attr, name in (("read_haproxy", "haproxy_read"), ("read_prometheus", "prometheus"),
                       ("read_optional", "prometheus"), ("check_pool_data", "pool_data"), ("observe", "observe"),
                       ("_write", "write_pool"), ("act", "act")):
        setattr(ctl, attr, watch.timed(name, getattr(ctl, attr)))


def sample(watch: Stopwatch, tick_s: float, cpu_s: float, result: TickResult) -> TickSample:
    """One tick's parts from the stopwatch: decide is the gap between observe's end and act's start."""
    s, sec = watch.spent, {"tick": tick_s}
    for key in ("haproxy_read", "prometheus", "pool_data"):
        if key in s:
            sec[key] = s[key]
    if "observe" in s:
        sec["observe_rest"] = s["observe"] - sum(s.get(k, 0.0) for k in ("haproxy_read", "prometheus", "pool_data"))
    if "act" in s:
        sec["decide"] = watch.started["act"] - watch.ended["observe"]
        sec["write"] = s.get("write", 0.0)
        sec["plan"] = s.get("write_pool", 0.0) - sec["write"]
        sec["export"] = s["act"] - s.get("write_pool", 0.0)
    sec["rest"] = tick_s - s.get("observe", 0.0) - s.get("act", 0.0) - sec.get("decide", 0.0)
    c = watch.counts
    return TickSample(sec, cpu_s, c["commands"], c["batches"], c["refused"], len(result.decisions), result.held)


def timed_tick(ctl: Controller, watch: Stopwatch) -> TickSample:
    """One Controller.tick(), its parts from the stopwatch, its wall and process CPU time."""
    watch.reset()
    c0, t0 = time.process_time(), time.perf_counter()
    result = ctl.tick()
    return sample(watch, time.perf_counter() - t0, time.process_time() - c0, result)


class LogCount(logging.Filter):
    """Counts the controller's log records by level and keeps them out of the benchmark's output."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        self.counts[record.levelname] += 1
        return False


def memory_mark(ctl: Controller, tick: int) -> MemoryMark:
    """The controller's memory now, after a collection: RSS, Python blocks, what it keeps between ticks."""
    gc.collect()
    kept = (ctl.states, ctl.last_decisions, ctl.metrics.registry, ctl.node_series.rows, ctl._no_data, ctl.warned)
    return MemoryMark(tick, rss_bytes(), sys.getallocatedblocks(), deep_size(kept))


class FixedRate:
    """Tick numbers 1..n on a fixed-rate schedule, as controller/ticker.py keeps it: each waits for its slot, and a
    tick that overran the next slots skips them (counted in `skipped`). `start`: when the first slot began."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.skipped, self.start = interval_s, 0, 0.0

    def ticks(self, n: int) -> Iterator[int]:
        self.start = due = time.monotonic()
        for k in range(1, n + 1):
            time.sleep(max(0.0, due - time.monotonic()))
            ran_at = due
            yield k
            due, skipped = next_slot(self.start, self.interval_s, time.monotonic(), ran_at)
            self.skipped += skipped
