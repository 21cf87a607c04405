"""Hang evidence, pure: vLLM's token counters and queues from its /metrics, around a probe that timed out.

A probe that times out on a busy node may be an overload; one that times out while vLLM processed not one
token, generated or prefilled, is a hang (docs/exporters.md, "Agent check"): a busy engine still steps, and an
idle one prefills the probe's few tokens at its next step. The probe itself was waiting for the engine the
whole time, so the rule needs no other request (an idle hung node is caught too). Absent or broken series are
no evidence, never a hang; the prompt-token series widens what counts as progress when present.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporters.engineload import EngineLoad


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
