"""Pure core of the micro-probe: what one probe saw -> one result; results -> the prober's state."""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, replace
from typing import Any

from grayguard.exporters.hang import Progress
from grayguard.vocab import PROBE_ANSWERED, PROBE_FAULTS, PROBE_RESULTS, ProbeResult

RESULTS = PROBE_RESULTS  # every result, in the order the metrics list them
FAILURES = PROBE_FAULTS  # what the consecutive-failure streak counts (a CUDA error too)
ANSWERED = PROBE_ANSWERED

# Text that means the GPU, not the request, is broken: CUDA errors, OOM, illegal access, XIDs.
_CUDA = re.compile(r"cuda|out of memory|illegal memory access|\bxid\b|cublas|cudnn|nccl error|ecc error",
                   re.IGNORECASE)
_NAN_WORDS = frozenset({"nan", "-nan", "+nan", "inf", "-inf", "+inf", "infinity", "-infinity"})


@dataclass(frozen=True)
class Observation:
    """What the HTTP shell saw during one probe (no interpretation)."""

    connect_error: str | None = None  # no connection, or it broke before any HTTP answer
    timed_out: bool = False  # the deadline passed before the first data event
    status: int | None = None  # HTTP status of the last request made (models or completions)
    body: str = ""  # body of a non-2xx answer, truncated
    first_event: str | None = None  # payload of the first `data:` line of the stream
    ttft: float | None = None  # seconds from sending the completion request to the first data event


def mentions_cuda(text: str) -> bool:
    """True when an error text points at the GPU (CUDA error, out of memory, illegal access, Xid)."""
    return bool(_CUDA.search(text or ""))


def sane_text(text: Any) -> bool:
    """False for missing, empty, NaN-like or garbage text (replacement or control characters)."""
    if not isinstance(text, str) or text == "":
        return False
    if "\ufffd" in text or text.strip().lower() in _NAN_WORDS:
        return False
    return not any(unicodedata.category(ch) == "Cc" and ch not in "\t\n\r" for ch in text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in JSON")


def judge_event(payload: str) -> str:
    """Result for the first stream event: ok, cuda_error (an error event about the GPU) or bad_response."""
    if payload.strip() == "[DONE]":
        return ProbeResult.BAD_RESPONSE  # the stream ended without producing any text
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except ValueError:
        return ProbeResult.BAD_RESPONSE
    if not isinstance(obj, dict):
        return ProbeResult.BAD_RESPONSE
    if "error" in obj or obj.get("object") == "error":  # vLLM: {"error": {...}}; older: a bare ErrorResponse
        err = obj.get("error", obj)
        gpu = mentions_cuda(err if isinstance(err, str) else json.dumps(err))
        return ProbeResult.CUDA_ERROR if gpu else ProbeResult.BAD_RESPONSE
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ProbeResult.BAD_RESPONSE
    return ProbeResult.OK if sane_text(choices[0].get("text")) else ProbeResult.BAD_RESPONSE


def event_usage(payload: str) -> tuple[int | None, int | None] | None:
    """(prompt tokens, generated tokens) of a first stream event that carries a completion (a token vLLM generated,
    good text or garbage), as its usage reports them (None: not reported); None when it carries none (an error
    event, [DONE], an unparsable line): vLLM did not finish that probe with a token."""
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list) or not obj["choices"]:
        return None
    usage = obj.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _count(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def classify(obs: Observation, slow_threshold: float) -> str:
    """Classify one probe; never returns `starting` (see settle())."""
    if obs.connect_error is not None:
        return ProbeResult.CONNECT_ERROR
    if obs.status is not None and not 200 <= obs.status < 300:
        return ProbeResult.CUDA_ERROR if mentions_cuda(obs.body) else ProbeResult.HTTP_ERROR
    if obs.first_event is None:  # a stream that ended without data
        return ProbeResult.TIMEOUT if obs.timed_out else ProbeResult.BAD_RESPONSE
    verdict = judge_event(obs.first_event)
    if verdict != ProbeResult.OK:
        return verdict
    return ProbeResult.SLOW if obs.ttft is None or obs.ttft > slow_threshold else ProbeResult.OK


def failure_detail(obs: Observation) -> str | None:
    """Why a probe failed, in a few words for logs and the agent check (None when there is nothing to add)."""
    if obs.connect_error:
        return obs.connect_error
    if obs.body:
        return _error_message(obs.body)
    if obs.first_event is not None:
        return event_detail(obs.first_event)
    return None if obs.timed_out else "stream ended without data"


def event_detail(payload: str) -> str | None:
    """What is wrong with a first stream event: its error message, its garbage text or its raw start."""
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except ValueError:
        return f"unparsable event {payload[:60]!r}"
    if isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error"):
        return _error_message(obj.get("error", obj))
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        text = choices[0].get("text")
        return f"garbage text {text[:40]!r}" if isinstance(text, str) and text else "no text"
    return f"unexpected event {payload[:60]!r}"


def _error_message(err: Any) -> str:
    """The message of a vLLM error object or body (JSON or not), else the text itself."""
    if isinstance(err, str):
        try:
            err = json.loads(err)
        except ValueError:
            return err[:200]
    if isinstance(err, dict):
        inner = err.get("error", err)
        msg = inner.get("message") if isinstance(inner, dict) else inner
        if isinstance(msg, str):
            return msg[:200]
    return json.dumps(err)[:200]


@dataclass(frozen=True)
class ProbeState:
    """What the prober remembers between probes."""

    ever_ready: bool = False  # has the backend said it is ready, or answered ok or slow, since the start
    consecutive_failures: int = 0
    last_result: str | None = None
    last_ttft: float | None = None  # TTFT of the last ok/slow probe
    last_detail: str | None = None  # why the last probe failed (failure_detail), None after an answer
    last_progress: Progress | None = None  # vLLM's token progress during the last probe, when it timed out


@dataclass(frozen=True)
class ReadinessCheck:
    """What asking the backend whether it is ready saw (no interpretation)."""

    error: str | None = None  # no connection, no answer within the deadline, or a broken answer
    health_status: int | None = None  # status of GET /health
    models_status: int | None = None  # status of GET /v1/models; None: not asked (/health was not 200)
    models: Any = None  # the JSON body of a 2xx /v1/models answer


def not_ready_reason(check: ReadinessCheck, model: str | None) -> str | None:
    """Why the backend is not ready yet (a model still loading), or None when it says it is ready.

    Ready, as vLLM says it: /health answers 200 and /v1/models lists the model (any model when none is
    configured). A 401/403 from /v1/models is a server that is up and refuses our key: ready, so the
    probe's failure counts.
    """
    if check.error is not None:
        return check.error
    if check.health_status != 200:
        return f"/health answered {check.health_status}"
    if check.models_status in (401, 403):
        return None
    if check.models_status is None or not 200 <= check.models_status < 300:
        return f"/v1/models answered {check.models_status}"
    ids = model_ids(check.models)
    if model is None:
        return None if ids else "/v1/models lists no model"
    return None if model in ids else f"/v1/models does not list {model}"


def may_be_starting(state: ProbeState, *, since_start: float, startup_grace: float | None) -> bool:
    """True while a failure may still be a cold start: the shell then asks the backend whether it is ready.

    False once the backend was seen ready (or answered) since the start, and after startup_grace
    (s; None: no bound; 0: never, failures count at once).
    """
    return not state.ever_ready and (startup_grace is None or since_start < startup_grace)


def settle(result: str, state: ProbeState, *, not_ready: str | None, since_start: float,
           startup_grace: float | None) -> str:
    """`starting` for a failure while the backend says it is not ready (not_ready: why); else the result.

    Once the backend is ready, a timeout is a timeout and garbage is garbage, answered before or not.
    A CUDA error stays a CUDA error: a GPU that breaks while loading is a fault, not a cold start.
    """
    if result not in FAILURES or result == ProbeResult.CUDA_ERROR or not_ready is None:
        return result
    if may_be_starting(state, since_start=since_start, startup_grace=startup_grace):
        return ProbeResult.STARTING
    return result


def advance(state: ProbeState, result: str, ttft: float | None, *, ready: bool = False,
            detail: str | None = None, progress: Progress | None = None) -> ProbeState:
    """The state after a probe with this (settled) result; ready: the backend said it is ready.

    detail: why it failed (failure_detail); progress: vLLM's token progress while it timed out.
    """
    if result in ANSWERED:
        return ProbeState(ever_ready=True, consecutive_failures=0, last_result=result, last_ttft=ttft)
    failures = state.consecutive_failures + 1 if result in FAILURES else state.consecutive_failures
    return replace(state, ever_ready=state.ever_ready or ready, consecutive_failures=failures,
                   last_result=result, last_detail=detail, last_progress=progress)


def completion_request(model: str, prompt: str, prefix: str, usage_options: bool = True) -> dict[str, Any]:
    """Body of the probe: one token, greedy, streamed, behind a prefix the prefix cache has never seen.

    With usage_options (vLLM, SGLang) it asks for usage in every chunk (continuous_usage_stats), so the first one
    says how many prompt tokens the engine counted for it: the exporter takes exactly that out of the node's traffic
    (exporters/synthetic.py). TGI and llama.cpp get the plain OpenAI body (grayguard/engines.py).
    """
    body: dict[str, Any] = {"model": model, "prompt": f"{prefix} {prompt}", "max_tokens": 1, "temperature": 0,
                            "stream": True}
    if usage_options:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def triton_request(prompt: str, prefix: str) -> dict[str, Any]:
    """Body of the probe for Triton's generate_stream endpoint (TensorRT-LLM's ensemble inputs): one token, greedy."""
    return {"text_input": f"{prefix} {prompt}", "max_tokens": 1, "temperature": 0.0, "stream": True}


def triton_event(payload: str) -> str:
    """A generate_stream event in the OpenAI completion shape judge_event() reads: `text_output` becomes the first
    choice's text; an error event, [DONE] or anything unparsable is returned as it is (judged as such)."""
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except ValueError:
        return payload
    if not isinstance(obj, dict) or "error" in obj or "text_output" not in obj:
        return payload
    return json.dumps({"choices": [{"text": obj["text_output"]}]})


def sse_payload(line: bytes) -> str | None:
    """The payload of an SSE `data:` line; None for lines to skip (blank, comment, event/id/retry).

    Any other line is not SSE at all: it is returned whole, so that judge_event() rejects it.
    """
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    if text.startswith("data:"):
        return text[5:].lstrip(" ")
    if text == "" or text.startswith(":") or text.split(":", 1)[0] in ("event", "id", "retry"):
        return None
    return text


def model_ids(models: Any) -> list[str]:
    """Every model id a `/v1/models` answer lists."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def pick_model(models: Any) -> str | None:
    """The first model id of a `/v1/models` answer, None when there is none."""
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]["id"]
    return None
