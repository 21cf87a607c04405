"""The live fast path, pure: per-node signals over the last few seconds, from the exporter's own readings.

vLLM observes inter-token latency and time to first token as tokens are produced, so the deltas of those
histograms' _sum and _count between two readings of its /metrics a few seconds apart say how slow the node is
now, not how slow the requests that finished in the last half minute were. The exporter reads that page at every
probe's start (about every second) and when a probe times out; each reading is kept here with the exporter's
monotonic time, and with the tally of the exporter's own probes at that moment: vLLM observes each probe's first
token too, and the live TTFT leaves those out (exporters/synthetic.py). docs/exporters.md, "Live fast path",
defines every value; time is a parameter, never read.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from grayguard.exporters.engineload import EngineLoad
from grayguard.exporters.synthetic import NONE, Tally

LIVE_WINDOW_S = 5.0  # W: the span the live values are measured over (--live.window)
MEDIAN_PROBES = 5  # the probe median takes the last this many answered probes ...
MEDIAN_MIN_PROBES = 3  # ... that ended within 2 W, and needs at least this many of them
_COUNTERS = ("generation_tokens", "prompt_tokens", "itl_sum", "itl_count", "ttft_sum", "ttft_count",
             "requests", "request_seconds", "request_prompt_tokens", "request_generation_tokens", "steps")


@dataclass(frozen=True)
class Reading:
    """One read of vLLM's /metrics: when it ended (the exporter's monotonic clock) and what it said."""

    at: float
    load: EngineLoad  # a failed read is EngineLoad(): every series absent
    probes: Tally = NONE  # the exporter's answered probes so far (cumulative) when the reading was recorded


@dataclass(frozen=True)
class Answer:
    """One answered probe (ok or slow): when it ended (monotonic clock) and its time to first token."""

    at: float
    ttft: float


@dataclass(frozen=True)
class LiveSignals:
    """The live values of one node; None: no data (absent is not zero)."""

    itl: float | None = None  # s: mean gap between two tokens of a request over the span
    ttft: float | None = None  # s: mean time to first token of the first tokens produced over the span, the
    # exporter's own probes left out
    tokens_per_second: float | None = None  # tokens generated per second over the span
    prompt_tokens_per_second: float | None = None  # prompt tokens prefilled per second over the span (the load
    # that inflates the ITL of the decodes sharing its steps: the controller does not count a prefill-heavy node's ITL)
    running: float | None = None  # requests in the running batch at the newest reading
    decode_batch: float | None = None  # mean sequences decoding over the span: delta(ITL sum) / span (Little's
    # law: every decoding sequence adds one second of gaps per second), the batch its ITL was measured at
    waiting: float | None = None  # requests waiting at the newest reading
    kv_usage: float | None = None  # vLLM's KV-cache usage (0-1) at the newest reading
    span: float | None = None  # s between the two readings the deltas are taken over
    probe_ttft_median: float | None = None  # s: median TTFT of the last answered probes


def went_back(old: EngineLoad, new: EngineLoad) -> bool:
    """True when a counter present in both readings is lower in the new one: vLLM restarted in between."""
    for field in _COUNTERS:
        a, b = getattr(old, field), getattr(new, field)
        if a is not None and b is not None and b < a:
            return True
    return False


def add_reading(readings: tuple[Reading, ...], reading: Reading, window: float) -> tuple[Reading, ...]:
    """The readings kept once reading is added (oldest first).

    A counter that went back drops every earlier reading (vLLM restarted: no delta spans the restart). Of the
    rest, only the latest reading at least window older than the new one and those after it are kept, so the
    oldest kept reading is the base of the next window. A reading not newer than the newest kept is ignored.
    """
    if readings and reading.at <= readings[-1].at:
        return readings
    if any(went_back(r.load, reading.load) for r in readings):
        readings = ()
    kept = (*readings, reading)
    base = _at_least_window_old(kept, window)
    return kept[base:] if base is not None else kept


def add_answer(answers: tuple[Answer, ...], answer: Answer) -> tuple[Answer, ...]:
    """The last MEDIAN_PROBES answered probes once answer is added (oldest first)."""
    return (*answers, answer)[-MEDIAN_PROBES:]


def probe_ttft_median(answers: tuple[Answer, ...], now: float, window: float) -> float | None:
    """Median TTFT of the last MEDIAN_PROBES answered probes that ended within 2 window of now; None with fewer
    than MEDIAN_MIN_PROBES of them (the mean of the middle two with an even count)."""
    recent = [a.ttft for a in answers[-MEDIAN_PROBES:] if now - a.at <= 2 * window]
    return statistics.median(recent) if len(recent) >= MEDIAN_MIN_PROBES else None


def live_signals(readings: tuple[Reading, ...], answers: tuple[Answer, ...], now: float,
                 window: float = LIVE_WINDOW_S) -> LiveSignals:
    """The live values at now from the kept readings (add_reading) and answered probes (add_answer).

    The newest reading is compared with the base: the latest reading at least window older than it, else the
    oldest reading when that one is at least window / 2 older (a window still filling), else there is no base
    and only running, waiting and the KV-cache usage are known. Nothing from the readings when the newest is more
    than window old at now (a stuck prober says nothing).
    """
    median = probe_ttft_median(answers, now, window)
    if not readings or now - readings[-1].at > window:
        return LiveSignals(probe_ttft_median=median)
    new = readings[-1]
    i = _at_least_window_old(readings, window)
    if i is None and len(readings) > 1 and new.at - readings[0].at >= window / 2:
        i = 0
    if i is None:
        return LiveSignals(running=new.load.running, waiting=new.load.waiting, kv_usage=new.load.kv_usage,
                           probe_ttft_median=median)
    old = readings[i]
    span = new.at - old.at
    tokens = _delta(old.load.generation_tokens, new.load.generation_tokens)
    prompt = _delta(old.load.prompt_tokens, new.load.prompt_tokens)
    itl = _mean(old.load, new.load, "itl")
    gaps = _delta(old.load.itl_sum, new.load.itl_sum)
    return LiveSignals(itl=itl, ttft=_ttft(old, new),
                       tokens_per_second=tokens / span if tokens is not None else None,
                       prompt_tokens_per_second=prompt / span if prompt is not None else None,
                       running=new.load.running, waiting=new.load.waiting, kv_usage=new.load.kv_usage,
                       decode_batch=gaps / span if gaps is not None and itl is not None and new.load.itl_per_token
                       else None,
                       span=span, probe_ttft_median=median)


def _at_least_window_old(readings: tuple[Reading, ...], window: float) -> int | None:
    """Index of the latest reading at least window older than the newest; None when there is none."""
    newest = readings[-1].at
    for i in range(len(readings) - 2, -1, -1):
        if newest - readings[i].at >= window:
            return i
    return None


def _delta(old: float | None, new: float | None) -> float | None:
    """new - old of a counter; None when either is absent or it went back."""
    if old is None or new is None or new < old:
        return None
    return new - old


def _mean(old: EngineLoad, new: EngineLoad, histogram: str) -> float | None:
    """delta(_sum) / delta(_count) of a histogram; None when a series is absent, went back, or nothing was
    observed in between (no token is no data, not zero)."""
    total = _delta(getattr(old, f"{histogram}_sum"), getattr(new, f"{histogram}_sum"))
    count = _delta(getattr(old, f"{histogram}_count"), getattr(new, f"{histogram}_count"))
    if total is None or count is None or count == 0:
        return None
    return total / count


def _ttft(old: Reading, new: Reading) -> float | None:
    """The mean TTFT between two readings of the first tokens that were not the exporter's probes: vLLM's delta of
    the TTFT histogram less the probes that ended in between (each one first token, its TTFT as the exporter
    measured it); None when no other request got its first token, or a series is absent or went back."""
    total = _delta(old.load.ttft_sum, new.load.ttft_sum)
    count = _delta(old.load.ttft_count, new.load.ttft_count)
    if total is None or count is None:
        return None
    own = new.probes - old.probes
    count -= own.requests
    if count <= 0:
        return None
    return max(total - own.seconds, 0.0) / count
