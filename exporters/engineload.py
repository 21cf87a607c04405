"""An engine's /metrics text, pure: the few series the exporter reads, each summed over its label sets.

Which series depends on the engine (grayguard/engines.py: vLLM, SGLang, TGI, llama.cpp, Triton with TensorRT-LLM);
each is read into the same EngineLoad, so what the exporter derives from it is engine-neutral. Read once per probe
(exporters/probehttp.py) for three uses: the hang evidence (exporters/hang.py: token counters, engine steps and
queues), the live fast path (exporters/live.py: the same plus the sums and counts of the inter-token latency and
time-to-first-token histograms, which vLLM observes as tokens are produced, not when a request finishes) and the
node's own traffic (exporters/synthetic.py: the per-request sums the recording rules read, less the exporter's
probes). Absent is not zero: a series missing from the page, one the engine does not have, or one with an unreadable
sample, is None.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from grayguard.engines import DEFAULT_ENGINE, Pair, Read, Series, profile

# vLLM's names, kept for the readers that name them (the profile in grayguard/engines.py is what is read)
VLLM_TOKENS = "vllm:generation_tokens_total"  # counter: tokens generated (V0 and V1 engines)
VLLM_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch
VLLM_PROMPT = "vllm:prompt_tokens_total"  # counter: prefill tokens processed
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued for the batch
VLLM_ITL = "vllm:inter_token_latency_seconds"  # histogram: time between two tokens of a request, per token
VLLM_TPOT = "vllm:time_per_output_token_seconds"  # its name before vLLM 0.11 (hidden in 0.12, gone in 0.33)
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram: arrival to first token, observed at the first token
VLLM_KV = "vllm:kv_cache_usage_perc"  # gauge: KV-cache usage, 0-1 (1 = full)
VLLM_KV_OLD = "vllm:gpu_cache_usage_perc"  # its name before vLLM 0.10
VLLM_E2E = "vllm:e2e_request_latency_seconds"


@dataclass(frozen=True)
class EngineLoad:
    """Series of the local engine's /metrics, summed over their label sets; None: absent or unparsable."""

    generation_tokens: float | None = None
    running: float | None = None
    prompt_tokens: float | None = None
    waiting: float | None = None
    itl_sum: float | None = None  # seconds, inter-token latency histogram (or the old TPOT one, see below)
    itl_count: float | None = None  # inter-token gaps observed
    ttft_sum: float | None = None  # seconds, time-to-first-token histogram
    ttft_count: float | None = None  # first tokens observed
    kv_usage: float | None = None  # KV-cache usage 0-1, the fullest of its label sets (the new name, else the old)
    # finished requests as the engine's per-request series count them (what the recording rules read)
    requests: float | None = None  # e2e_request_latency_seconds_count
    request_seconds: float | None = None  # e2e_request_latency_seconds_sum
    request_prompt_tokens: float | None = None  # request_prompt_tokens_sum
    request_generation_tokens: float | None = None  # request_generation_tokens_sum
    steps: float | None = None  # engine steps (forward passes), where the engine counts them (not vLLM)
    itl_per_token: bool = True  # False: the ITL pair counts engine steps, not tokens (TGI): no decode batch from it
    # False: the engine counts finished requests and their seconds but no tokens of them (Triton): the traffic
    # counters are requests and seconds only (exporters/synthetic.py)
    request_tokens: bool = True


Sample = tuple[str, dict[str, str], float | None]


def parse_engine_load(text: str, engine: str = DEFAULT_ENGINE, model: str | None = None) -> EngineLoad:
    """The engine series of a /metrics text (absent is not zero), read as the engine's profile says; model: the
    probed model, whose per-model series are read where the engine counts per model (Triton; None: the profile's
    default model, `ensemble`).

    Of a profile's alternatives (vLLM's inter-token latency, then its older time_per_output_token name) the first
    with any of its series on the page is read, broken or not: a broken new name is no evidence, not a reason to
    read the old one.
    """
    p = profile(engine).for_model(model)
    page = _Page(list(_samples(text, p.prefixes)))
    itl = page.pair(p.itl)
    ttft = page.pair(p.ttft)
    kv = page.read(p.kv_usage, largest=True)
    if kv is _ABSENT and p.kv_ratio is not None:
        kv = page.ratio(p.kv_ratio.part, p.kv_ratio.whole)
    return EngineLoad(generation_tokens=_v(page.read(p.generation_tokens)), running=_v(page.read(p.running)),
                      prompt_tokens=_v(page.read(p.prompt_tokens)), waiting=_v(page.read(p.waiting)),
                      itl_sum=itl[0], itl_count=itl[1], ttft_sum=ttft[0], ttft_count=ttft[1], kv_usage=_v(kv),
                      requests=_v(page.read(p.requests)), request_seconds=_v(page.read(p.request_seconds)),
                      request_prompt_tokens=_v(page.read(p.request_prompt_tokens)),
                      request_generation_tokens=_v(page.read(p.request_generation_tokens)),
                      steps=_v(page.read(p.steps)), itl_per_token=p.itl_per_token,
                      request_tokens=not p.per_request)


class _Absent:
    """No sample of the series on the page (distinct from None: present but unreadable)."""


_ABSENT = _Absent()
Value = float | None | _Absent


def _v(x: Value) -> float | None:
    return None if isinstance(x, _Absent) else x


class _Page:
    """The samples of one page, read as Series."""

    def __init__(self, samples: list[Sample]):
        self._by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self._by_name.setdefault(s[0], []).append(s)

    def series(self, s: Series, largest: bool = False) -> Value:
        """Sum (or largest) of s's samples times its scale; _ABSENT without one; None when one is unreadable."""
        values = [v for _, labels, v in self._by_name.get(s.name, ()) if s.matches(labels)]
        if not values:
            return _ABSENT
        if any(v is None for v in values):
            return None  # one unreadable sample spoils the sum: no evidence rather than a wrong one
        total = max(values) if largest else sum(values)  # type: ignore[type-var, arg-type]
        return total * s.scale

    def read(self, read: Read, largest: bool = False) -> Value:
        """The first alternative with any series on the page: the sum of its series (None when one is absent or
        unreadable); _ABSENT when no alternative has one."""
        for alt in read:
            values = [self.series(s, largest) for s in alt]
            if all(isinstance(v, _Absent) for v in values):
                continue
            if any(v is None or isinstance(v, _Absent) for v in values):
                return None
            return sum(values)  # type: ignore[arg-type]
        return _ABSENT

    def pair(self, pairs: tuple[Pair, ...]) -> tuple[float | None, float | None]:
        """(sum, count) of the first pair with either on the page."""
        for p in pairs:
            total, count = self.series(p.sum), self.series(p.count)
            if isinstance(total, _Absent) and isinstance(count, _Absent):
                continue
            return _v(total), _v(count)
        return None, None

    def ratio(self, part: Series, whole: Series) -> Value:
        a, b = self.series(part), self.series(whole)
        if isinstance(a, _Absent) and isinstance(b, _Absent):
            return _ABSENT
        if a is None or b is None or isinstance(a, _Absent) or isinstance(b, _Absent) or b <= 0:
            return None
        return a / b


def _samples(text: str, prefixes: tuple[str, ...]) -> Iterator[Sample]:
    """(name, labels, value) of every sample line that starts with one of prefixes; value None when it is not a
    finite number."""
    for line in text.splitlines():
        if line.startswith(prefixes):
            yield _sample(line)


def _sample(line: str) -> Sample:
    """(name, labels, value) of one exposition line; value None when it is not a finite number."""
    brace = line.find("{")
    space = line.find(" ")
    labels: dict[str, str] = {}
    if brace >= 0 and (space < 0 or brace < space):
        name = line[:brace]
        labels, end = _labels(line, brace + 1)
        rest = line[end:]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    try:
        value = float(fields[0]) if fields else None
    except ValueError:
        value = None
    return name.strip(), labels, value if value is not None and math.isfinite(value) else None


def _labels(line: str, i: int) -> tuple[dict[str, str], int]:
    """The label set starting at line[i] (just after `{`) and the index after its `}`."""
    labels: dict[str, str] = {}
    n = len(line)
    while i < n:
        while i < n and line[i] in " ,":
            i += 1
        if i < n and line[i] == "}":
            return labels, i + 1
        eq = line.find("=", i)
        if eq < 0 or eq + 1 >= n or line[eq + 1] != '"':
            break
        key, i = line[i:eq].strip(), eq + 2
        value = []
        while i < n and line[i] != '"':
            if line[i] == "\\" and i + 1 < n:
                value.append({"n": "\n"}.get(line[i + 1], line[i + 1]))
                i += 2
            else:
                value.append(line[i])
                i += 1
        labels[key] = "".join(value)
        i += 1
    end = line.rfind("}")
    return labels, (end + 1 if end >= 0 else n)
