"""Hang evidence, pure: vLLM's token counters and queues from its /metrics, around a probe that timed out.

A probe that times out on a busy node may be an overload; one that times out while vLLM processed not one
token, generated or prefilled, is a hang (docs/exporters.md, "Agent check"): a busy engine still steps, and an
idle one prefills the probe's few tokens at its next step. The probe itself was waiting for the engine the
whole time, so the rule needs no other request (an idle hung node is caught too). Absent or broken series are
no evidence, never a hang; the prompt-token series widens what counts as progress when present, and so do the
engine steps of the engines that count them (TGI, llama.cpp and Triton with TensorRT-LLM count tokens only when a
request ends or not at all: their forward passes are the progress, grayguard/engines.py).

An engine whose steps can themselves last seconds (a CPU build sharing its cores, a long prompt prefilled in one
step: vLLM counts its tokens only when the step ends) shows the same silence for a while, and recovers. So the node's
own stalls are learned (`Stalls`: the spans between readings that saw its counters move, up to STALL_CAP_S): a
probe's silence is a hang only once the engine has been silent for `HANG_MARGIN` x its longest recent span, and
always after STALL_CAP_S. A GPU engine's spans are the probe interval (it moves at every reading), shorter than the
deadline: its hang is called at the first timeout, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grayguard.exporters.engineload import EngineLoad


@dataclass(frozen=True)
class Progress:
    """Did vLLM process tokens between two /metrics readings around a timed-out probe."""

    tokens: float  # generated (and prefilled, when both readings have the series) between the readings
    running: float  # other requests in the engine at the second reading: running (and waiting, when known)
    window: float  # seconds between the readings
    silent_for: float | None = None  # seconds since the engine's counters last moved (None: unknown)
    hang_after: float | None = None  # the silence this node's own stalls allow before it is a hang (Stalls)

    @property
    def hung(self) -> bool:
        """A hang, not an overload: not one token while the probe waited (a busy engine still steps, an idle one
        prefills the probe), for longer than the node's own stalls last (when they are known)."""
        if self.tokens != 0:
            return False
        return self.hang_after is None or self.silent_for is None or self.silent_for >= self.hang_after


STALL_CAP_S = 10.0  # a silence longer than this is no stall to learn from (a hang that ended), and always a hang
HANG_MARGIN = 1.5  # a hang: silent for this many times the node's longest recent stall...
STALLS_KEPT = 30  # ...over its last this many stalls (about the last minute at one probe a second)


@dataclass(frozen=True)
class Stalls:
    """The spans a node's engine went without one token (generated or prefilled) between two readings of its
    /metrics, and when its counters last moved. Pure: observe() returns the next memory."""

    tokens: float | None = None  # generated + prompt tokens at the last reading
    moved_at: float | None = None  # when a reading last saw them move (or the first reading)
    recent: tuple[float, ...] = ()  # the last STALLS_KEPT silences that ended with tokens, in seconds

    def observe(self, load: EngineLoad | None, at: float) -> Stalls:
        """The memory after a reading at `at` (None or a reading without the token series: no evidence)."""
        if load is None or load.generation_tokens is None and load.steps is None:
            return self
        tokens = (load.generation_tokens or 0.0) + (load.prompt_tokens or 0.0) + (load.steps or 0.0)
        if self.tokens is None or self.moved_at is None or tokens < self.tokens:  # the first reading, or a restart
            return Stalls(tokens, at, self.recent)
        if tokens == self.tokens:
            return self
        span = at - self.moved_at
        recent = self.recent if span > STALL_CAP_S else (self.recent + (span,))[-STALLS_KEPT:]
        return Stalls(tokens, at, recent)

    def silent_for(self, now: float) -> float | None:
        return None if self.moved_at is None else now - self.moved_at

    def hang_after(self) -> float:
        """The silence that is a hang on this node: HANG_MARGIN x its longest recent stall, at most STALL_CAP_S. The
        readings come with the probes, so a healthy engine's spans are the probe interval: its hang is called at
        the first timeout (the deadline is longer), as before."""
        return min(STALL_CAP_S, HANG_MARGIN * max(self.recent, default=0.0))


def judged(progress: Progress | None, stalls: Stalls, now: float) -> Progress | None:
    """progress with the node's silence and the silence its stalls allow (Progress.hung then weighs both)."""
    if progress is None:
        return None
    return replace(progress, silent_for=stalls.silent_for(now), hang_after=stalls.hang_after())


def token_progress(before: EngineLoad | None, after: EngineLoad | None, window: float) -> Progress | None:
    """Progress over the window; None (no evidence) when a reading lacks a series or the counter went back."""
    if before is None or after is None or after.running is None:
        return None
    if before.generation_tokens is None or after.generation_tokens is None:
        if before.steps is None or after.steps is None:
            return None
        tokens = 0.0  # an engine that counts steps and no tokens (Triton with TensorRT-LLM): its steps are the evidence
    else:
        tokens = after.generation_tokens - before.generation_tokens
    for old, new in ((before.prompt_tokens, after.prompt_tokens), (before.steps, after.steps)):
        if old is not None and new is not None:
            moved = new - old
            tokens = tokens + moved if moved >= 0 and tokens >= 0 else -1.0
    if tokens < 0:  # the engine restarted between the readings
        return None
    return Progress(tokens=tokens, running=after.running + (after.waiting or 0.0), window=window)
