"""vLLM's /metrics text, pure: the few engine series the exporter reads, each summed over its label sets.

Read once per probe (exporters/probehttp.py) for three uses: the hang evidence (exporters/hang.py: token counters
and queues), the live fast path (exporters/live.py: the same plus the sums and counts of the inter-token
latency and time-to-first-token histograms, which vLLM observes as tokens are produced, not when a request
finishes) and the node's own traffic (exporters/synthetic.py: the per-request histograms the recording rules
read, less the exporter's probes). Absent is not zero: a series missing from the page, or with one unreadable
sample, is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VLLM_TOKENS = "vllm:generation_tokens_total"  # counter: tokens generated (V0 and V1 engines)
VLLM_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch
VLLM_PROMPT = "vllm:prompt_tokens_total"  # counter: prefill tokens processed
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued for the batch
VLLM_ITL = "vllm:inter_token_latency_seconds"  # histogram: time between two tokens of a request, per token
VLLM_TPOT = "vllm:time_per_output_token_seconds"  # its name before vLLM 0.11 (hidden in 0.12, gone in 0.33)
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram: arrival to first token, observed at the first token
VLLM_KV = "vllm:kv_cache_usage_perc"  # gauge: KV-cache usage, 0-1 (1 = full)
VLLM_KV_OLD = "vllm:gpu_cache_usage_perc"  # its name before vLLM 0.10
# per-request histograms, observed when a request finishes: the recording rules' normalized latency and request rate
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_REQ_PROMPT = "vllm:request_prompt_tokens"
VLLM_REQ_GENERATION = "vllm:request_generation_tokens"
_HISTOGRAMS = (VLLM_ITL, VLLM_TPOT, VLLM_TTFT)
_REQUESTS = (VLLM_E2E + "_count", VLLM_E2E + "_sum", VLLM_REQ_PROMPT + "_sum", VLLM_REQ_GENERATION + "_sum")
_MAXED = (VLLM_KV, VLLM_KV_OLD)  # a share, not a count: the fullest engine's (data parallel: one per engine)
_NAMES = (VLLM_TOKENS, VLLM_RUNNING, VLLM_PROMPT, VLLM_WAITING, *_MAXED,
          *(h + suffix for h in _HISTOGRAMS for suffix in ("_sum", "_count")), *_REQUESTS)


@dataclass(frozen=True)
class EngineLoad:
    """Series of the local vLLM's /metrics, summed over their label sets; None: absent or unparsable."""

    generation_tokens: float | None = None
    running: float | None = None
    prompt_tokens: float | None = None
    waiting: float | None = None
    itl_sum: float | None = None  # seconds, inter-token latency histogram (or the old TPOT one, see below)
    itl_count: float | None = None  # inter-token gaps observed
    ttft_sum: float | None = None  # seconds, time-to-first-token histogram
    ttft_count: float | None = None  # first tokens observed
    kv_usage: float | None = None  # KV-cache usage 0-1, the fullest of its label sets (the new name, else the old)
    # finished requests as vLLM's per-request histograms count them (what the recording rules read)
    requests: float | None = None  # e2e_request_latency_seconds_count
    request_seconds: float | None = None  # e2e_request_latency_seconds_sum
    request_prompt_tokens: float | None = None  # request_prompt_tokens_sum
    request_generation_tokens: float | None = None  # request_generation_tokens_sum


def parse_engine_load(text: str) -> EngineLoad:
    """The engine series of a /metrics text (absent is not zero).

    The inter-token latency pair is `vllm:inter_token_latency_seconds` when the page has either of its _sum and
    _count, else the older `vllm:time_per_output_token_seconds` (the same observations under the old name).
    """
    sums = _sums(text)
    new_itl = any(f"{VLLM_ITL}{s}" in sums for s in ("_sum", "_count"))
    itl = VLLM_ITL if new_itl else VLLM_TPOT
    return EngineLoad(generation_tokens=sums.get(VLLM_TOKENS), running=sums.get(VLLM_RUNNING),
                      prompt_tokens=sums.get(VLLM_PROMPT), waiting=sums.get(VLLM_WAITING),
                      itl_sum=sums.get(itl + "_sum"), itl_count=sums.get(itl + "_count"),
                      ttft_sum=sums.get(VLLM_TTFT + "_sum"), ttft_count=sums.get(VLLM_TTFT + "_count"),
                      kv_usage=sums.get(VLLM_KV) if VLLM_KV in sums else sums.get(VLLM_KV_OLD),
                      requests=sums.get(VLLM_E2E + "_count"), request_seconds=sums.get(VLLM_E2E + "_sum"),
                      request_prompt_tokens=sums.get(VLLM_REQ_PROMPT + "_sum"),
                      request_generation_tokens=sums.get(VLLM_REQ_GENERATION + "_sum"))


def _sums(text: str) -> dict[str, float | None]:
    """Name -> sum over label sets for the names read (the largest for a share: _MAXED); a name with an unreadable
    sample maps to None."""
    sums: dict[str, float | None] = {}
    broken: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, value = _sample(line)
        if name not in _NAMES:
            continue
        if value is None:
            broken.add(name)  # one unreadable sample spoils the sum: no evidence rather than a wrong one
        elif name in _MAXED:
            sums[name] = max(sums.get(name) or 0.0, value)
        else:
            sums[name] = (sums.get(name) or 0.0) + value
    for name in broken:
        sums[name] = None  # present but broken: still counts as present for the ITL name choice
    return sums


def _sample(line: str) -> tuple[str, float | None]:
    """(name, value) of one exposition line; value None when it is not a finite number."""
    brace = line.find("{")
    if brace >= 0:
        name, rest = line[:brace], line[line.rfind("}") + 1:]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    try:
        value = float(fields[0]) if fields else None
    except ValueError:
        value = None
    return name.strip(), value if value is not None and math.isfinite(value) else None
