"""Hang evidence, pure: vLLM's token counters and queues from its /metrics, around a probe that timed out.

A probe that times out on a busy node may be an overload; one that times out while vLLM processed not one
token, generated or prefilled, is a hang (docs/exporters.md, "Agent check"): a busy engine still steps, and an
idle one prefills the probe's few tokens at its next step. The probe itself was waiting for the engine the
whole time, so the rule needs no other request (an idle hung node is caught too). Absent or broken series are
no evidence, never a hang; the prompt-token series widens what counts as progress when present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VLLM_TOKENS = "vllm:generation_tokens_total"  # counter: tokens generated (V0 and V1 engines)
VLLM_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch
VLLM_PROMPT = "vllm:prompt_tokens_total"  # counter: prefill tokens processed
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued for the batch


@dataclass(frozen=True)
class EngineLoad:
    """Series of the local vLLM's /metrics, summed over their label sets; None: absent or unparsable."""

    generation_tokens: float | None = None
    running: float | None = None
    prompt_tokens: float | None = None
    waiting: float | None = None


def parse_engine_load(text: str) -> EngineLoad:
    """The token counters and request gauges of a /metrics text (absent is not zero)."""
    names = (VLLM_TOKENS, VLLM_RUNNING, VLLM_PROMPT, VLLM_WAITING)
    sums: dict[str, float | None] = dict.fromkeys(names)
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
    tokens, running, prompt, waiting = (None if n in broken else sums[n] for n in names)
    return EngineLoad(generation_tokens=tokens, running=running, prompt_tokens=prompt, waiting=waiting)


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
    """Did vLLM process tokens between two /metrics readings around a timed-out probe."""

    tokens: float  # generated (and prefilled, when both readings have the series) between the readings
    running: float  # other requests in the engine at the second reading: running (and waiting, when known)
    window: float  # seconds between the readings

    @property
    def hung(self) -> bool:
        """A hang, not an overload: not one token while the probe waited (a busy engine still steps, an idle one
        prefills the probe)."""
        return self.tokens == 0


def token_progress(before: EngineLoad | None, after: EngineLoad | None, window: float) -> Progress | None:
    """Progress over the window; None (no evidence) when a reading lacks a series or the counter went back."""
    if before is None or after is None or after.running is None:
        return None
    if before.generation_tokens is None or after.generation_tokens is None:
        return None
    tokens = after.generation_tokens - before.generation_tokens
    if before.prompt_tokens is not None and after.prompt_tokens is not None:
        prefilled = after.prompt_tokens - before.prompt_tokens
        tokens = tokens + prefilled if prefilled >= 0 else -1.0
    if tokens < 0:  # vLLM restarted between the readings
        return None
    return Progress(tokens=tokens, running=after.running + (after.waiting or 0.0), window=window)
