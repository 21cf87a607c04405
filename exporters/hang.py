"""Hang evidence, pure: vLLM's token counter and running batch from its /metrics, before and after a probe timed out.

A probe that times out on a busy node may be an overload; one that times out while vLLM generated not one
token with requests running is a hang (docs/exporters.md, "Agent check"). Absent or broken series are no
evidence, never a hang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VLLM_TOKENS = "vllm:generation_tokens_total"  # counter: tokens generated (V0 and V1 engines)
VLLM_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch


@dataclass(frozen=True)
class EngineLoad:
    """Two series of the local vLLM's /metrics, summed over their label sets; None: absent or unparsable."""

    generation_tokens: float | None = None
    running: float | None = None


def parse_engine_load(text: str) -> EngineLoad:
    """The generation-token counter and the running-request gauge of a /metrics text (absent is not zero)."""
    sums: dict[str, float | None] = {VLLM_TOKENS: None, VLLM_RUNNING: None}
    broken: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, value = _sample(line)
        if name not in sums:
            continue
        if value is None:
            broken.add(name)  # one unreadable sample spoils the sum: no evidence rather than a wrong one
        else:
            sums[name] = (sums[name] or 0.0) + value
    tokens, running = (None if n in broken else sums[n] for n in (VLLM_TOKENS, VLLM_RUNNING))
    return EngineLoad(generation_tokens=tokens, running=running)


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


@dataclass(frozen=True)
class Progress:
    """Did vLLM generate tokens between two /metrics readings around a timed-out probe."""

    tokens: float  # generated between the readings
    running: float  # requests running at the second reading
    window: float  # seconds between the readings

    @property
    def hung(self) -> bool:
        """A hang, not an overload: not one token while requests were running (a busy engine still generates)."""
        return self.tokens == 0 and self.running > 0


def token_progress(before: EngineLoad | None, after: EngineLoad | None, window: float) -> Progress | None:
    """Progress over the window; None (no evidence) when a reading lacks a series or the counter went back."""
    if before is None or after is None or after.running is None:
        return None
    if before.generation_tokens is None or after.generation_tokens is None:
        return None
    tokens = after.generation_tokens - before.generation_tokens
    if tokens < 0:  # vLLM restarted between the readings
        return None
    return Progress(tokens=tokens, running=after.running, window=window)
