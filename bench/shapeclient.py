"""The streaming client of `python -m grayguard.bench.vllmshapes`: timed /v1/completions streams and vLLM's own
histograms.

One engine at a time, the same way for the real vLLM node and the simulated one: TTFT from the send to the first
SSE chunk, each later chunk's gap divided by the tokens it carries (vLLM says with `return_token_ids`; the
simulator, which coalesces its chunks every 75 ms and ignores that field, by counting its words and stops).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp

from grayguard.sim.loadgen import make_prompt

_WORDS = re.compile(r"\w+|[^\w\s]")  # the simulator's vocabulary: one token a word or punctuation mark
TIMEOUT_S = 180.0  # one request; a throttled (thermal k=10) CPU node takes ~10x a healthy one's time


@dataclass
class Stream:
    """One streamed request as the client saw it: chunk arrival times (perf_counter) and tokens per chunk."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps(self, since: float = float("-inf"), until: float = float("inf")) -> list[tuple[float, int]]:
        """(gap, tokens) for each chunk after the first whose gap lies within [since, until] (its end inside)."""
        return [(self.times[i] - self.times[i - 1], self.tokens[i]) for i in range(1, len(self.times))
                if since <= self.times[i] <= until]


def chunk_tokens(choice: dict) -> int:
    """Tokens in one streamed choice: vLLM's token_ids when present, else the text's words and stops."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return len(_WORDS.findall(choice.get("text") or ""))


def histogram_totals(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of a histogram over all its label sets in a Prometheus text page; None when absent."""
    total = {"_sum": 0.0, "_count": 0.0}
    seen = False
    for line in text.splitlines():
        for suffix in total:
            if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                total[suffix] += float(line.rsplit(None, 1)[1])
                seen = True
    return (total["_sum"], total["_count"]) if seen else None


class Client:
    """Streams to one engine (`url`, serving `model`); every prompt is distinct (no prefix-cache hit)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, seed: int = 0) -> None:
        self.session, self.url, self.model = session, url, model
        self._seed = seed * 1_000_000

    def prompt(self, tokens: int) -> str:
        self._seed += 1
        return make_prompt(tokens, self._seed)

    async def stream(self, prompt_tokens: int, max_tokens: int, out: Stream | None = None) -> Stream:
        """Send one streamed completion and time its chunks into `out` (a new Stream by default) as they come."""
        body = {"model": self.model, "prompt": self.prompt(prompt_tokens), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        s = out if out is not None else Stream(time.perf_counter())
        s.sent = time.perf_counter()
        try:
            async with self.session.post(self.url + "/v1/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
                if r.status != 200:
                    s.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return s
                async for raw in r.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        s.error = str(obj["error"])[:200]
                        return s
                    n = sum(chunk_tokens(c) for c in obj.get("choices") or [])
                    if n:
                        s.times.append(now)
                        s.tokens.append(n)
        except (aiohttp.ClientError, TimeoutError) as e:
            s.error = f"{type(e).__name__}: {e}"
        return s

    async def streams(self, n: int, prompt_tokens: int, max_tokens: int) -> list[Stream]:
        """n streams sent at once."""
        return list(await asyncio.gather(*(self.stream(prompt_tokens, max_tokens) for _ in range(n))))

    async def ttft(self, prompt_tokens: int) -> float | None:
        """The TTFT of a 1-token request (a probe when the prompt is short)."""
        return (await self.stream(prompt_tokens, 1)).ttft_s

    async def tokens_of(self, words: int) -> int | None:
        """How many tokens the engine's tokenizer makes of a prompt of `words` words (vLLM's /tokenize; None
        where the engine has no tokenizer, as the simulator, which counts 4 characters a token)."""
        try:
            async with self.session.post(self.url + "/tokenize", json={"model": self.model,
                                                                        "prompt": make_prompt(words, 0)},
                                         timeout=aiohttp.ClientTimeout(total=10)) as r:
                return (await r.json())["count"] if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            return None

    async def itl_totals(self) -> tuple[float, float] | None:
        """vLLM's own inter-token latency histogram (sum, count) from /metrics; None when absent."""
        try:
            async with self.session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return histogram_totals(await r.text(), "vllm:inter_token_latency_seconds")
        except (aiohttp.ClientError, TimeoutError):
            return None


async def model_id(session: aiohttp.ClientSession, url: str) -> str:
    """The served model's id (GET /v1/models)."""
    async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return (await r.json())["data"][0]["id"]
