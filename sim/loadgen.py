"""Open-loop load generator: Poisson arrivals of streaming /v1/completions with heavy-tailed sizes.

Arrivals never wait for completions; a concurrency cap turns excess arrivals into `overflow` errors
instead of queueing them. Seeded: the same seed gives the same arrivals and request sizes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from grayguard.sim.loadstats import LoadResult, Phase, RequestRecord

log = logging.getLogger(__name__)

BACKEND_HEADERS = ("X-Grayguard-Node", "X-Served-By", "X-Backend-Server")  # first present one is recorded


@dataclass(frozen=True)
class LengthDist:
    """A lognormal token count with a given median and coefficient of variation, clipped to [lo, hi]."""

    median: float
    cv: float = 1.0
    lo: int = 1
    hi: int = 4096

    def __post_init__(self) -> None:
        if self.median <= 0 or self.cv < 0 or not 1 <= self.lo <= self.hi:
            raise ValueError(f"bad length distribution {self}")

    @property
    def sigma(self) -> float:
        return math.sqrt(math.log1p(self.cv**2))

    def sample(self, rng: random.Random) -> int:
        value = self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.cv else self.median
        return int(min(self.hi, max(self.lo, round(value))))


@dataclass
class LoadConfig:
    """A load run; stop at `duration_s` or after `count` arrivals, whichever comes first."""

    url: str  # base URL (HAProxy or a node); /v1/completions is appended unless present
    rate: float = 20.0  # mean arrivals per second (Poisson)
    duration_s: float | None = 60.0
    count: int | None = None
    max_concurrency: int = 512  # requests in flight; arrivals beyond it are counted as `overflow`
    timeout_s: float = 30.0  # per-request deadline, from the scheduled arrival
    seed: int = 0
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist(200, 1.0, 8, 4000))
    completion_tokens: LengthDist = field(default_factory=lambda: LengthDist(100, 1.0, 4, 1024))
    model: str | None = None  # None: the first model of GET /v1/models (omitted if that fails)
    stream: bool = True
    phases: tuple[Phase, ...] = ()
    backend_headers: tuple[str, ...] = BACKEND_HEADERS
    headers: Mapping[str, str] = field(default_factory=dict)  # extra request headers
    # a sim.traces.TracePlan: its arrivals and lengths replace the Poisson ones (rate and the length
    # distributions are then unused; duration_s and count still bound the run)
    trace: Any = None

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.duration_s is None and self.count is None and self.trace is None:  # a trace's window bounds it
            raise ValueError("set duration_s or count: a run must be bounded")
        if self.max_concurrency < 1 or self.timeout_s <= 0:
            raise ValueError("max_concurrency must be >= 1 and timeout_s > 0")

    @property
    def completions_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1/completions") else base + "/v1/completions"


# Prompt words: three letters and a space each, so the simulator (4 characters a token) and the real fleet's model
# (one token a word: localstack/vllm_model.py's vocabulary holds them all) count the same prompt tokens. Every
# request draws its own words: one prompt repeated ("lor lor ...") is one long shared prefix, which a real vLLM's
# prefix cache serves without prefilling it, so prompt length would cost the real engine nothing.
PROMPT_WORDS = tuple(a + b + c for a in "bdfgklmnprstvz" for b in "aeiou" for c in "bdfgklmnprstvz")


def make_prompt(tokens: int, seed: int = 0) -> str:
    """A prompt of `tokens` tokens for the simulator and the real fleet alike, its words drawn with `seed`."""
    rng = random.Random(seed)
    return "".join(f"{w} " for w in rng.choices(PROMPT_WORDS, k=tokens))


def looks_garbage(text: str) -> bool:
    """Output a healthy model does not produce: NaN tokens, replacement characters, runs of '!'."""
    return "NaN" in text or "\ufffd" in text or (len(text) >= 3 and not text.strip("! "))


async def _first_model(session: aiohttp.ClientSession, cfg: LoadConfig) -> str | None:
    base = cfg.completions_url.removesuffix("/v1/completions")
    try:
        async with asyncio.timeout(min(cfg.timeout_s, 5.0)):
            async with session.get(base + "/v1/models", headers=dict(cfg.headers)) as resp:
                data = await resp.json(content_type=None)
                return data["data"][0]["id"]
    except Exception as e:  # the run still works without a model name
        log.warning("could not read %s/v1/models (%s); sending requests without a model", base, e)
        return None


def arrival_plan(cfg: LoadConfig) -> Iterator[tuple[float, int, int]]:
    """The run's arrivals as (seconds from start, prompt tokens, max_tokens); a pure function of cfg."""
    if cfg.trace is not None:
        yield from _trace_plan(cfg)
        return
    rng_gap = random.Random(cfg.seed)
    rng_len = random.Random(cfg.seed + 1)  # separate stream: sizes do not shift when the rate changes
    t, i = 0.0, 0
    while cfg.count is None or i < cfg.count:
        t += rng_gap.expovariate(cfg.rate)
        if cfg.duration_s is not None and t >= cfg.duration_s:
            return
        yield t, cfg.prompt_tokens.sample(rng_len), cfg.completion_tokens.sample(rng_len)
        i += 1


def _trace_plan(cfg: LoadConfig) -> Iterator[tuple[float, int, int]]:
    plan = cfg.trace
    for i, t in enumerate(plan.t):
        if (cfg.count is not None and i >= cfg.count) or (cfg.duration_s is not None and t >= cfg.duration_s):
            return
        yield t, plan.prompt[i], plan.output[i]


def request_prompt(cfg: LoadConfig, index: int, tokens: int) -> str:
    """Request `index`'s prompt: its own words, or a trace's shared prefix blocks first (sim.traces)."""
    if cfg.trace is not None:
        return cfg.trace.prompt_text(index, tokens, cfg.seed)
    return make_prompt(tokens, cfg.seed * 1_000_003 + index)


def config_summary(cfg: LoadConfig) -> dict[str, Any]:
    """The config as the result records it: no headers (they may hold secrets), a trace as its metadata."""
    bare = copy.copy(cfg)
    bare.trace = None  # its metadata, not its arrivals
    d = {k: v for k, v in asdict(bare).items() if k != "headers"}
    d["trace"] = dict(cfg.trace.meta) if cfg.trace is not None else None
    return d


class _Run:
    def __init__(self, cfg: LoadConfig, session: aiohttp.ClientSession, model: str | None,
                 sink: list[RequestRecord] | None = None) -> None:
        self.cfg, self.session, self.model = cfg, session, model
        self.loop = asyncio.get_running_loop()
        self.records: list[RequestRecord] = sink if sink is not None else []
        self.inflight = 0

    async def one(self, rec: RequestRecord, due: float) -> None:
        cfg = self.cfg
        prompt = request_prompt(cfg, rec.index, rec.prompt_tokens)  # each request's own words (or a trace's prefix)
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": rec.max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": cfg.stream}
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if self.model:
            body["model"] = self.model
        try:
            async with asyncio.timeout_at(due + cfg.timeout_s):
                async with self.session.post(cfg.completions_url, json=body, headers=dict(cfg.headers)) as resp:
                    rec.http_status = resp.status
                    rec.backend = next((resp.headers[h] for h in cfg.backend_headers if h in resp.headers), None)
                    if resp.status >= 400:
                        rec.status = "http_5xx" if resp.status >= 500 else "http_4xx"
                        rec.error = (await resp.text())[:200]
                    elif cfg.stream:
                        await self._read_stream(resp, rec, due)
                    else:
                        data = await resp.json(content_type=None)
                        text = data["choices"][0]["text"]
                        rec.completion_tokens = data.get("usage", {}).get("completion_tokens")
                        rec.status = "garbage" if looks_garbage(text) else "ok"
        except TimeoutError:
            rec.status, rec.error = "timeout", f"no answer within {cfg.timeout_s}s"
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
            rec.status, rec.error = "connect", str(e)[:200]
        except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as e:
            rec.status, rec.error = "protocol", f"{type(e).__name__}: {e}"[:200]
        except RuntimeError as e:  # aiohttp's bare RuntimeError('Connection closed.'): the server died mid-stream
            rec.status, rec.error = "connect", f"{type(e).__name__}: {e}"[:200]
        finally:
            self.inflight -= 1
            rec.e2e_s = self.loop.time() - due

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, due: float) -> None:
        parts: list[str] = []
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                rec.status, rec.error = "stream_error", str(obj["error"].get("message"))[:200]
                return
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                if rec.ttft_s is None:
                    rec.ttft_s = self.loop.time() - due
                parts.append(choices[0]["text"])
            if obj.get("usage"):
                rec.completion_tokens = obj["usage"].get("completion_tokens")
        if not done:
            rec.status, rec.error = "protocol", "stream ended without [DONE]"
        elif looks_garbage("".join(parts)):
            rec.status = "garbage"
        else:
            rec.status = "ok"

    async def arrivals(self) -> None:
        cfg = self.cfg
        start = self.loop.time()
        tasks: set[asyncio.Task] = set()
        try:
            for i, (t, prompt, max_tokens) in enumerate(arrival_plan(cfg)):
                rec = RequestRecord(i, t, "pending", prompt, max_tokens)
                self.records.append(rec)
                delay = start + t - self.loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.inflight >= cfg.max_concurrency:
                    rec.status, rec.e2e_s, rec.error = "overflow", 0.0, f"{cfg.max_concurrency} requests in flight"
                    continue
                self.inflight += 1  # counted now, not when the task first runs: the cap must hold in a burst
                task = asyncio.create_task(self.one(rec, start + t))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # the run is stopped (Ctrl-C, SIGTERM): its requests end with it
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


async def run_load(cfg: LoadConfig, *, session: aiohttp.ClientSession | None = None,
                   sink: list[RequestRecord] | None = None) -> LoadResult:
    """Run the load and return every request's record (in arrival order) and the phases.

    sink: a list that receives each record as it is created and is updated in place as the request
    ends (status leaves "pending"), so a live view can read progress while the run goes on.
    """
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=None))
    try:
        model = cfg.model if cfg.model is not None else await _first_model(session, cfg)
        run = _Run(cfg, session, model, sink)
        wall, t0 = time.time(), run.loop.time()
        await run.arrivals()
        wall_s = run.loop.time() - t0
    finally:
        if own:
            await session.close()
    window = cfg.duration_s if cfg.duration_s is not None else (
        run.records[-1].start_s if run.records else 0.0)
    return LoadResult(run.records, tuple(cfg.phases), window, wall_s, wall, config_summary(cfg))
