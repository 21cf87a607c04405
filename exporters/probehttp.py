"""HTTP adapter of the micro-probe: find the model, stream one completion, stop at the first event; read /metrics.

The engine's profile (grayguard/engines.py) says how: the OpenAI completions API (vLLM, SGLang, TGI, llama.cpp) or
Triton's generate_stream endpoint, its readiness endpoint, and which /metrics series to read."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from grayguard.engines import DEFAULT_ENGINE, profile
from grayguard.exporters.engineload import EngineLoad, parse_engine_load
from grayguard.exporters.probe import (
    Observation,
    ReadinessCheck,
    completion_request,
    pick_model,
    sse_payload,
    triton_event,
    triton_request,
)

log = logging.getLogger(__name__)
METRICS_LIMIT = 16 * 1024 * 1024  # bytes of vLLM's /metrics read at most (a few hundred kB in practice)


class VllmClient:
    """One engine's API as the prober sees it (vLLM's OpenAI API unless engine says otherwise); observe() never
    raises for what the backend does."""

    def __init__(self, base_url: str, *, model: str | None = None, prompt: str = "The capital of France is",
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 on_discovery_error: Callable[[], None] = lambda: None, engine: str = DEFAULT_ENGINE):
        self.base_url = base_url.rstrip("/")
        self.engine = profile(engine)
        self.configured_model = model  # --probe.model; None: ask /v1/models (Triton: its profile's default model)
        if model is None and self.engine.dialect == "triton":
            self.configured_model = self.engine.default_model
        self.model = self.configured_model  # the model probed (discovered once, again after a 404)
        self._prompt, self._rng, self._clock = prompt, rng or random.Random(), clock
        self._on_discovery_error = on_discovery_error

    async def observe(self, session: aiohttp.ClientSession, headers: dict[str, str],
                      deadline: float) -> Observation:
        """One probe within deadline seconds: discover the model if needed, stream, close at the first event."""
        status: int | None = None
        try:
            async with asyncio.timeout(deadline):
                if self.model is None:
                    failed = await self._discover(session, headers)
                    if failed is not None:
                        return failed
                prefix = f"[{self._rng.getrandbits(64):016x}]"  # unseen prefix: no prefix-cache hit
                url, body = self._request(prefix)
                sent = self._clock()
                async with session.post(url, headers=headers, json=body) as resp:
                    status = resp.status
                    if not 200 <= status < 300:
                        if status == 404 and self.configured_model is None:
                            self.model = None  # vLLM restarted with another model: discover again
                        return Observation(status=status, body=await _read_some(resp))
                    async for line in resp.content:
                        payload = sse_payload(line)
                        if payload is not None and self.engine.dialect == "triton":
                            payload = triton_event(payload)
                        if payload is not None:
                            ttft = self._clock() - sent
                            resp.close()  # disconnect: vLLM aborts the request and frees its slot
                            return Observation(status=status, first_event=payload, ttft=ttft)
                    return Observation(status=status)  # the stream ended without a data event
        except TimeoutError:
            return Observation(status=status, timed_out=True)
        except (aiohttp.ClientConnectionError, OSError) as e:
            if status is None:
                return Observation(connect_error=f"{type(e).__name__}: {e}")
            return Observation(status=status)  # broke mid-stream: a bad response
        except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError, ValueError):
            return Observation(status=status)

    def _request(self, prefix: str) -> tuple[str, dict]:
        """The probe's URL and body in the engine's dialect."""
        assert self.model is not None
        if self.engine.dialect == "triton":
            return f"{self.base_url}/v2/models/{self.model}/generate_stream", triton_request(self._prompt, prefix)
        body = completion_request(self.model, self._prompt, prefix, usage_options=self.engine.usage_options)
        return f"{self.base_url}/v1/completions", body

    async def _discover(self, session: aiohttp.ClientSession, headers: dict[str, str]) -> Observation | None:
        """Set self.model from /v1/models; on failure, the Observation that classifies it."""
        async with session.get(f"{self.base_url}/v1/models", headers=headers) as resp:
            if not 200 <= resp.status < 300:
                self._on_discovery_error()
                return Observation(status=resp.status, body=await _read_some(resp))
            try:
                model = pick_model(await resp.json(content_type=None))
            except ValueError:
                model = None
            if model is None:
                self._on_discovery_error()
                return Observation(status=resp.status)  # no data event: a bad response
            self.model = model
            log.info("probing model %s at %s", model, self.base_url)
            return None

    async def readiness(self, session: aiohttp.ClientSession, headers: dict[str, str],
                        deadline: float) -> ReadinessCheck:
        """Ask the backend whether it is ready within deadline seconds: GET /health (the engine's readiness path),
        then GET /v1/models (Triton: GET /v2/models/<model>/ready)."""
        health: int | None = None
        try:
            async with asyncio.timeout(deadline):
                async with session.get(f"{self.base_url}{self.engine.health_path}", headers=headers) as resp:
                    health = resp.status
                if health != 200:
                    return ReadinessCheck(health_status=health)
                if self.engine.dialect == "triton":
                    return await self._triton_ready(session, headers, health)
                async with session.get(f"{self.base_url}/v1/models", headers=headers) as resp:
                    if not 200 <= resp.status < 300:
                        return ReadinessCheck(health_status=health, models_status=resp.status)
                    try:
                        models = await resp.json(content_type=None)
                    except ValueError:
                        models = None
                    return ReadinessCheck(health_status=health, models_status=resp.status, models=models)
        except TimeoutError:
            where = "/health" if health is None else "/v1/models"
            return ReadinessCheck(error=f"{where}: no answer within {deadline:g}s", health_status=health)
        except (aiohttp.ClientError, OSError) as e:
            return ReadinessCheck(error=f"{type(e).__name__}: {e}", health_status=health)

    async def _triton_ready(self, session: aiohttp.ClientSession, headers: dict[str, str],
                            health: int) -> ReadinessCheck:
        """Triton lists no models the OpenAI way: its model's own ready endpoint answers 200 once it is loaded."""
        async with session.get(f"{self.base_url}/v2/models/{self.model}/ready", headers=headers) as resp:
            listed = {"data": [{"id": self.model}]} if resp.status == 200 else None
            return ReadinessCheck(health_status=health, models_status=resp.status, models=listed)

    async def engine_load(self, session: aiohttp.ClientSession, headers: dict[str, str],
                          timeout: float) -> EngineLoad | None:
        """The engine's series from its /metrics (exporters/engineload.py) within timeout s; None on failure."""
        plain = {k: v for k, v in headers.items() if k.lower() not in ("accept", "x-llm-probe")}
        try:
            async with asyncio.timeout(timeout):
                async with session.get(f"{self.base_url}/metrics", headers=plain) as resp:
                    if resp.status != 200:
                        return None
                    body = await resp.content.read(METRICS_LIMIT + 1)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        if len(body) > METRICS_LIMIT:  # cut short: its last line could be a wrong number
            return None
        return parse_engine_load(body.decode("utf-8", errors="replace"), self.engine.name, self.model)


async def _read_some(resp: aiohttp.ClientResponse, limit: int = 4096) -> str:
    return (await resp.content.read(limit)).decode("utf-8", errors="replace")
