"""The exporter's own probes in vLLM's counters, pure: what they added, and the node's traffic without them.

vLLM counts each answered probe as a finished request (1 generated token, its prompt, e2e = its TTFT), so a node
whose only traffic is probes finishes about one request a second, and its normalized latency is the probes'.
The exporter reads vLLM's per-request histograms at every probe start (exporters/probehttp.py) and knows every
probe it sent, so between two readings it can take its own probes out: the node's **traffic** counters, vLLM's
finished requests, e2e seconds, prompt and generated tokens less the probes' (docs/exporters.md, "Own traffic").
Requests and tokens come out exactly (vLLM's usage says what it counted for each probe); seconds within the HTTP
overhead of a probe, which the exporter learns where vLLM finished only probes. Subtracting here, where the probe
tally and vLLM's counters are read together, is exact; subtracting in Prometheus would compare two targets
scraped at different moments, an error of about a probe per window (up to 0.08 req/s over 30 s: almost
3 requests a window). An engine that counts no tokens of its requests (Triton: successful requests
and their microseconds) gives a tally of requests and seconds: its tokens stay 0 on both sides and are not exported
(EngineLoad.request_tokens, Traffic.tokens). Time is a parameter, never read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grayguard.exporters.engineload import EngineLoad


@dataclass(frozen=True)
class Tally:
    """Finished requests and what they add to vLLM's per-request histograms' sums (counts since some start)."""

    requests: float = 0.0  # e2e_request_latency_seconds_count
    seconds: float = 0.0  # e2e_request_latency_seconds_sum
    prompt_tokens: float = 0.0  # request_prompt_tokens_sum
    generation_tokens: float = 0.0  # request_generation_tokens_sum

    def __add__(self, o: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(_values(self), _values(o), strict=True)))

    def __sub__(self, o: Tally) -> Tally:
        return Tally(*(a - b for a, b in zip(_values(self), _values(o), strict=True)))

    def __mul__(self, k: float) -> Tally:
        return Tally(*(a * k for a in _values(self)))


FIELDS = tuple(f.name for f in dataclasses.fields(Tally))
NONE = Tally()
GAP_ALPHA = 0.2  # EMA weight of each probe-only interval's measure of the gap (Traffic.gap)


def _values(t: Tally) -> tuple[float, ...]:
    return tuple(getattr(t, f) for f in FIELDS)


def probe_tally(ttft: float, prompt_tokens: int | None, generation_tokens: int | None, gap: float = 0.0) -> Tally:
    """What one answered probe added to vLLM's counters: one request whose e2e is its TTFT (max_tokens 1: vLLM
    finishes it with its first token) less gap, the HTTP overhead vLLM does not see (Traffic.gap), and its prompt
    and generated tokens as vLLM's usage reported them.

    Without a usage report the probe generated 1 token, and its prompt tokens are unknown: 0 is subtracted, so
    they stay in a loaded node's traffic (about 10 tokens a second, a fraction of a per cent of its tokens).
    """
    return Tally(1.0, max(ttft - gap, 0.0), float(prompt_tokens or 0),
                 float(1 if generation_tokens is None else generation_tokens))


def vllm_tally(load: EngineLoad) -> Tally | None:
    """vLLM's finished requests from a reading of its /metrics; None when any of the four series is absent (for an
    engine that counts no tokens, either of requests and seconds: its tokens are 0)."""
    if not load.request_tokens:
        values: tuple[float | None, ...] = (load.requests, load.request_seconds, 0.0, 0.0)
    else:
        values = (load.requests, load.request_seconds, load.request_prompt_tokens, load.request_generation_tokens)
    if any(v is None for v in values):
        return None
    return Tally(*values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Traffic:
    """The node's traffic counters (vLLM's finished requests less the probes) and what the next reading needs."""

    total: Tally = NONE  # the counters exported: monotonic, from 0 at the exporter's first usable reading
    vllm: Tally | None = None  # vLLM's tally at the last usable reading (None: none yet)
    probes: Tally = NONE  # the probes' cumulative tally at that reading
    # <= 0 per field: what the last readings subtracted beyond what vLLM had counted, repaid by the next ones
    # (a probe tallied on one side of a reading and counted by vLLM on the other); at most two probes' worth
    owed: Tally = NONE
    at: float | None = None  # when the last usable reading was taken (the exporter's monotonic clock)
    # s: how much longer the exporter's TTFT of a probe is than vLLM's e2e of it (connection, HTTP, the API
    # server's event loop), learned where vLLM finished only probes; new probes are tallied that much shorter
    gap: float = 0.0
    tokens: bool = True  # False: the engine counts no tokens (Triton): the token counters are not exported


def account(t: Traffic, load: EngineLoad, probes: Tally, at: float) -> Traffic:
    """The traffic once a reading of vLLM (load, at time at) is taken with the probes' cumulative tally then.

    Between two usable readings the traffic grows by vLLM's increase less the probes that ended in between, per
    field and never below 0. The probe sent with a reading (both start together) can land on either side of it in
    vLLM and in the probe tally, so vLLM's count less the tally is the real traffic give or take one probe: the
    counters follow its running maximum (what is subtracted beyond it is owed, and paid from the next increase),
    and a node with only probes stays flat while one with real requests counts them all. The debt is capped at
    twice the interval's probes, the most two such probes can owe: what is left of the difference between the
    exporter's TTFT and vLLM's e2e must not pile up into a debt that later requests would pay.

    In an interval in which vLLM finished as many requests and generated tokens as the probes, it finished only
    them: their seconds and prompt tokens are vLLM's (nothing is added, not even a prompt whose usage was not
    reported), and the difference with the tally teaches the gap (an EMA, per probe). A reading without the four
    series is not usable (nothing changes); a counter of vLLM that went back (a restart) starts a new base. For an
    engine that counts no tokens the probes' tokens are left out too (an interval of only probes is one in which it
    finished as many requests as the probes).
    """
    now = vllm_tally(load)
    if now is None:
        return t
    if not load.request_tokens:
        probes = Tally(probes.requests, probes.seconds, 0.0, 0.0)
    if t.vllm is None or any(n < o for n, o in zip(_values(now), _values(t.vllm), strict=True)):
        return dataclasses.replace(t, vllm=now, probes=probes, owed=NONE, at=at, tokens=load.request_tokens)
    vllm, own, gap = now - t.vllm, probes - t.probes, t.gap
    if own.requests > 0 and vllm.requests == own.requests and vllm.generation_tokens == own.generation_tokens:
        # only probes finished: vLLM's seconds and prompt tokens of the interval are theirs, to the last digit
        sample = t.gap + (own.seconds - vllm.seconds) / own.requests  # the tally had the old gap taken off already
        gap = max(0.0, t.gap + GAP_ALPHA * (sample - t.gap))
        own = Tally(own.requests, vllm.seconds, vllm.prompt_tokens, own.generation_tokens)
    grown, owed = [], []
    for d, p, debt in zip(_values(vllm), _values(own), _values(t.owed), strict=True):
        rest = d - p + debt
        grown.append(max(rest, 0.0))
        owed.append(min(0.0, max(rest, -2 * p) if p > 0 else rest))  # without a probe, rest >= debt: it only shrinks
    return Traffic(t.total + Tally(*grown), now, probes, Tally(*owed), at, gap, load.request_tokens)
