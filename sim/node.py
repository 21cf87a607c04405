"""One simulated vLLM node: the OpenAI-compatible API, /metrics and a fault admin endpoint (aiohttp).

The pure `EngineModel` (sim/model.py) is stepped in real time by loop timers: one timer per node, set to
the end of the engine step in progress, so the CPU cost is per step, not per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from grayguard.sim.faults import CUDA_ERROR_TEXT, Fault, FaultError, FaultState
from grayguard.sim.metrics import VllmMetrics, cache_config_info
from grayguard.sim.model import EngineModel, Finished, FirstToken, ModelParams, StepDone

log = logging.getLogger(__name__)

# faults of the catalogue that only the virtual-time benchmark models
BENCH_ONLY = frozenset({"refused"})

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VLLM_VERSION = "0.33.0"
NODE_HEADER = "X-Grayguard-Node"  # every response names the node that served it
_VOCAB = (" the", " model", " answers", " with", " a", " short", " story", " about", " GPU", " nodes",
          " that", " run", " fast", " and", " well", ".")
_GARBAGE = {"nan": " NaN", "bang": "!", "mojibake": "\ufffd\u00c3"}
_SHUTDOWN = object()
# on_fault_change(node_name, fault or None): runs in the fleet's event loop on every set and clear.
FaultCallback = Callable[[str, "Fault | None"], None]


def estimate_tokens(prompt: Any) -> int:
    """Prompt tokens: a list of token ids counts itself; text counts one token per 4 characters."""
    if isinstance(prompt, list):
        return max(1, len(prompt))
    return max(1, -(-len(prompt) // 4))


def error_body(message: str, code: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(message: str, code: int, kind: str, param: str | None = None,
           headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, code, kind, param), status=code, headers=headers)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """An OpenAI usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SimNode:
    """A vLLM look-alike on one port; `set_fault`/`clear_fault` change how it misbehaves.

    api_key: like vLLM's --api-key, /v1/ requests without `Authorization: Bearer <key>` get a 401.
    model_loaded = False: /v1/models lists no model (a server up before its model). Both may change at run time.
    """

    def __init__(self, name: str, *, params: ModelParams | None = None, speed: float = 1.0,
                 speed_class: str = "h100", seed: int = 0, model_name: str = DEFAULT_MODEL,
                 on_fault_change: FaultCallback | None = None, api_key: str | None = None) -> None:
        self.name = name
        self.api_key = api_key
        self.model_loaded = True
        self.params = params or ModelParams()
        self.speed_class = speed_class
        self.model_name = model_name
        self.on_fault_change = on_fault_change
        self.faults = FaultState()
        self.engine = EngineModel(self.params, speed=speed, seed=seed, slowdown=self.faults.slowdown)
        self.metrics = VllmMetrics(model_name, self.params.max_model_len,
                                   cache_config=cache_config_info(self.params))
        self.metrics.bind_engine_state(lambda: self.engine.num_running, lambda: self.engine.num_waiting,
                                       self.engine.kv_usage)
        self._rng = random.Random(seed ^ 0x5EED)
        self._ids = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._preemptions_seen = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._kick_handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def build_app(self) -> web.Application:
        """The aiohttp application (vLLM routes plus /admin/fault)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/fault", self._admin_get)
        app.router.add_post("/admin/fault", self._admin_post)
        app.router.add_delete("/admin/fault", self._admin_delete)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on host:port (0 picks a free port); returns the port."""
        self._loop = asyncio.get_running_loop()
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, shutdown_timeout=1.0,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.host, self.port = host, self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Answer every open request with a shutdown and close the listener."""
        for q in list(self._pending.values()):
            q.put_nowait(_SHUTDOWN)
        for handle in (self._timer, self._kick_handle):
            if handle is not None:
                handle.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- faults -------------------------------------------------------------------------------
    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else time.monotonic()

    def set_fault(self, fault: str, **params: Any) -> Fault:
        """Activate a fault now (replacing any other); raises FaultError on a bad name or parameter."""
        if fault in BENCH_ONLY:
            raise FaultError(f"{fault}: modelled by the benchmark only; a simulated node cannot refuse "
                             "connections yet (stop the fleet's node instead)")
        now = self._now()
        was_hang = self.faults.active is not None and self.faults.active.name == "hang"
        active = self.faults.set(fault, params, now)
        if active.name == "hang":
            self.engine.stall(now)
        elif was_hang:
            self.engine.resume(now)
        log.info("node %s: fault %s %s", self.name, active.name, dict(active.params))
        self._changed(active)
        return active

    def clear_fault(self) -> Fault | None:
        """Deactivate the fault (a slow one may keep decaying for recovery_s); returns the old one."""
        now = self._now()
        old = self.faults.clear(now)
        self.engine.resume(now)
        if old is not None:
            log.info("node %s: fault %s cleared", self.name, old.name)
            self._changed(None)
        return old

    def _changed(self, fault: Fault | None) -> None:
        self._kick()
        if self.on_fault_change is not None:
            try:
                self.on_fault_change(self.name, fault)
            except Exception:  # a broken demo hook must not break the node
                log.exception("on_fault_change hook failed for %s", self.name)

    # -- engine driver ------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._kick_handle is None and self._loop is not None:
            self._kick_handle = self._loop.call_soon(self._tick)

    def _on_timer(self) -> None:
        # asyncio may fire a timer a hair early; the loop says it is time, so it is.
        at, self._timer, self._timer_at = self._timer_at, None, float("inf")
        self._tick(at)

    def _tick(self, at_least: float = 0.0) -> None:
        self._kick_handle = None
        assert self._loop is not None
        now = max(self._loop.time(), at_least)
        m = self.metrics
        for ev in self.engine.advance(now):
            if type(ev) is StepDone:
                m.observe_step(ev)
                continue
            q = self._pending.get(ev.req_id)
            if type(ev) is Finished:
                m.observe_finished(ev, max_tokens=q.max_tokens if q is not None else None)
            elif type(ev) is FirstToken and q is not None:
                m.observe_first_token(ev.time - q.arrival)
            if q is not None:
                q.put_nowait(ev)
        if self.engine.num_preemptions != self._preemptions_seen:
            m.preemptions.inc(self.engine.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = self.engine.num_preemptions
        at = max(self.engine.next_event_time(), now)
        if at != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(at, self._on_timer) if at != float("inf") else None
            self._timer_at = at

    # -- OpenAI API ---------------------------------------------------------------------------
    def _parse(self, body: Any) -> tuple[int, int, bool, str | None]:
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise LookupError(model)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            pass
        elif not isinstance(prompt, str):
            raise _BadRequest("prompt must be a string or a list of token ids (batches are not simulated)",
                              "prompt")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _BadRequest(f"n must be at least 1, got {n}.", "n")
        if n > 1:  # one choice per request; n > 1 would also multiply the generated tokens
            raise _BadRequest("n > 1 is not simulated", "n")
        prompt_tokens = estimate_tokens(prompt)
        limit = self.params.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise _BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.", "prompt")
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        if opts and not stream:
            raise _BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        # like vLLM: include_usage adds a last chunk with the usage; continuous_usage_stats with it puts the usage so
        # far in every chunk (the exporter's probe reads its prompt tokens from its first chunk)
        usage = "every" if opts.get("include_usage") and opts.get("continuous_usage_stats") else \
            "last" if opts.get("include_usage") else None
        return prompt_tokens, max_tokens, stream, usage

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        headers = {NODE_HEADER: self.name}
        try:
            prompt_tokens, max_tokens, stream, usage = self._parse(await request.json())
        except _BadRequest as e:
            return _error(str(e), 400, "BadRequestError", e.param, headers)
        except LookupError as e:
            return _error(f"The model `{e.args[0]}` does not exist.", 404, "NotFoundError", "model", headers)
        except ValueError:
            return _error("request body is not valid JSON", 400, "BadRequestError", None, headers)
        fault = self.faults.active
        cuda_mode = garbage = None
        if fault is not None and fault.name == "cuda_error" and self._rng.random() < fault.params["rate"]:
            cuda_mode = fault.params["mode"]
        if fault is not None and fault.name == "garbage" and self._rng.random() < fault.params["rate"]:
            garbage = _GARBAGE[fault.params["style"]]
        if cuda_mode == "http":
            self.metrics.success["error"].inc()
            return _error(CUDA_ERROR_TEXT, 500, "InternalServerError", None, headers)
        rid = f"cmpl-{self.name}-{next(self._ids)}"
        q = _Pending(self._now(), max_tokens)
        self._pending[rid] = q
        self.engine.submit(rid, prompt_tokens, max_tokens, q.arrival)
        self._kick()
        gen = _Text(garbage)
        try:
            if stream:
                return await self._stream(request, rid, q, gen, prompt_tokens, usage, cuda_mode, headers)
            return await self._whole(rid, q, gen, prompt_tokens, cuda_mode, headers)
        finally:
            del self._pending[rid]
            if self.engine.abort(rid):  # client gone or error: free the slot, not counted as finished
                self._kick()

    def _chunk(self, rid: str, text: str, finish: str | None, usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                               "model": self.model_name,
                               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                            "stop_reason": None}]}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def _stream(self, request: web.Request, rid: str, q: _Pending, gen: _Text, prompt_tokens: int,
                      usage: str | None, cuda_mode: str | None, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)  # like vLLM: headers go out before the first token
        # a client that hangs up mid-stream (probes do, after one chunk) is not an error
        with contextlib.suppress(ConnectionResetError):
            await self._stream_body(resp, rid, q, gen, prompt_tokens, usage, cuda_mode)
        return resp

    async def _stream_body(self, resp: web.StreamResponse, rid: str, q: _Pending, gen: _Text,
                           prompt_tokens: int, usage: str | None, cuda_mode: str | None) -> None:
        sent = 0  # tokens streamed so far

        def chunk(text: str, n: int, finish: str | None) -> bytes:
            nonlocal sent
            sent += n
            return self._chunk(rid, text, finish, _usage(prompt_tokens, sent) if usage == "every" else None)

        while True:
            ev = await q.get()
            if ev is _SHUTDOWN:
                await resp.write(b"data: " + json.dumps(
                    error_body("server shutting down", 503, "ServiceUnavailableError")).encode() + b"\n\n")
                break
            if type(ev) is Finished:
                await resp.write(chunk(gen.take(ev.n), ev.n, "length"))
                if usage:
                    obj = {"id": rid, "object": "text_completion", "created": int(time.time()),
                           "model": self.model_name, "choices": [],
                           "usage": _usage(prompt_tokens, ev.stats.generation_tokens)}
                    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                break
            n = 1 if type(ev) is FirstToken else ev.n
            await resp.write(chunk(gen.take(n), n, None))
            if cuda_mode == "midstream":
                self.metrics.success["error"].inc()
                await resp.write(b"data: " + json.dumps(
                    error_body(CUDA_ERROR_TEXT, 500, "InternalServerError")).encode() + b"\n\n")
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def _whole(self, rid: str, q: _Pending, gen: _Text, prompt_tokens: int, cuda_mode: str | None,
                     headers: dict[str, str]) -> web.Response:
        while True:
            ev = await q.get()
            if ev is _SHUTDOWN:
                return _error("server shutting down", 503, "ServiceUnavailableError", None, headers)
            if cuda_mode is not None:  # midstream mode: fails once the first token exists
                self.metrics.success["error"].inc()
                return _error(CUDA_ERROR_TEXT, 500, "InternalServerError", None, headers)
            if type(ev) is Finished:
                break
        n = ev.stats.generation_tokens
        return web.json_response({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "text": gen.take(n), "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "prompt_logprobs": None}],
            "usage": _usage(prompt_tokens, n),
        }, headers=headers)

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        if not self.model_loaded:
            return web.json_response({"object": "list", "data": []})
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.model_name, "parent": None, "max_model_len": self.params.max_model_len}]})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)  # alive even when slow, hung or failing: that is a gray failure

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})  # any Prometheus parses it

    # -- admin --------------------------------------------------------------------------------
    def fault_status(self) -> dict[str, Any]:
        """The node's fault and current phase multipliers, as GET /admin/fault returns them."""
        now = self._now()
        sd = self.faults.slowdown(now)
        active = self.faults.active
        return {"node": self.name, "speed_class": self.speed_class, "speed": self.engine.speed,
                "fault": active.name if active else None, "params": dict(active.params) if active else {},
                "since_s": round(now - active.started_at, 3) if active else None,
                "slowdown": {"prefill": sd.prefill, "decode": sd.decode, "kv_fraction": sd.kv_fraction},
                "recovering": self.faults.residual is not None}

    async def _admin_get(self, _request: web.Request) -> web.Response:
        return web.json_response(self.fault_status())

    async def _admin_post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict) or "fault" not in body:
                raise FaultError('body must be {"fault": NAME, ...params}')
            params = dict(body.get("params") or {})
            params.update({k: v for k, v in body.items() if k not in ("fault", "params")})
            self.set_fault(str(body["fault"]), **params)
        except (FaultError, ValueError) as e:
            return _error(str(e), 400, "BadRequestError")
        return web.json_response(self.fault_status())

    async def _admin_delete(self, _request: web.Request) -> web.Response:
        self.clear_fault()
        return web.json_response(self.fault_status())


class _Pending(asyncio.Queue):
    """EngineModel events of one open request, in order; `arrival` is its submit time."""

    def __init__(self, arrival: float, max_tokens: int | None = None) -> None:
        super().__init__()
        self.arrival = arrival
        self.max_tokens = max_tokens  # the request's parameter, for vllm:request_params_max_tokens


class _Text:
    """Cheap deterministic completion text; garbage mode repeats a corrupt token."""

    __slots__ = ("_i", "_garbage")

    def __init__(self, garbage: str | None) -> None:
        self._i = 0
        self._garbage = garbage

    def take(self, n: int) -> str:
        if self._garbage is not None:
            return self._garbage * n
        i, self._i = self._i, self._i + n
        return "".join(_VOCAB[j % len(_VOCAB)] for j in range(i, i + n))
