"""Pure probe core: classification of what a probe saw, the starting rule and the failure streak."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from grayguard.exporters.probe import (
    ANSWERED,
    FAILURES,
    RESULTS,
    Observation,
    ProbeState,
    ReadinessCheck,
    advance,
    classify,
    completion_request,
    event_usage,
    judge_event,
    may_be_starting,
    mentions_cuda,
    model_ids,
    not_ready_reason,
    pick_model,
    sane_text,
    settle,
    sse_payload,
)
from grayguard.exporters.prober import ProbeConfig, Prober


def chunk(text):
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                       "choices": [{"index": 0, "text": text, "finish_reason": None}]})


@pytest.mark.parametrize("obs,expected", [
    (Observation(status=200, first_event=chunk(" Paris"), ttft=0.05), "ok"),
    (Observation(status=200, first_event=chunk(" Paris"), ttft=0.3), "ok"),  # at the threshold: not slow
    (Observation(status=200, first_event=chunk(" Paris"), ttft=0.31), "slow"),
    (Observation(timed_out=True), "timeout"),
    (Observation(status=200, timed_out=True), "timeout"),  # hung after the headers
    (Observation(connect_error="ConnectionRefusedError"), "connect_error"),
    (Observation(status=500, body="Internal Server Error"), "http_error"),
    (Observation(status=404, body='{"message":"The model `x` does not exist."}'), "http_error"),
    (Observation(status=500, body='{"message":"CUDA error: an illegal memory access was encountered"}'),
     "cuda_error"),
    (Observation(status=500, body="torch.OutOfMemoryError: CUDA out of memory."), "cuda_error"),
    (Observation(status=500, body="NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus"), "cuda_error"),
    (Observation(status=500, body="Internal Server Error", timed_out=True), "http_error"),
    (Observation(status=200, first_event='{"error": {"message": "CUDA error: misaligned address"}}', ttft=0.01),
     "cuda_error"),
    (Observation(status=200, first_event='{"error": {"message": "prompt too long", "code": 400}}', ttft=0.01),
     "bad_response"),
    (Observation(status=200, first_event='{"object": "error", "message": "out of memory"}', ttft=0.01),
     "cuda_error"),
    (Observation(status=200, first_event="\x00\x13 not json", ttft=0.01), "bad_response"),
    (Observation(status=200, first_event="[DONE]", ttft=0.01), "bad_response"),
    (Observation(status=200, first_event=chunk(""), ttft=0.01), "bad_response"),
    (Observation(status=200, first_event=chunk("NaN"), ttft=0.01), "bad_response"),
    (Observation(status=200, first_event=chunk("\ufffd"), ttft=0.01), "bad_response"),
    (Observation(status=200, first_event='{"choices": [{"text": NaN}]}', ttft=0.01), "bad_response"),
    (Observation(status=200, first_event='{"choices": []}', ttft=0.01), "bad_response"),
    (Observation(status=200, first_event='{"choices": [{"text": 7}]}', ttft=0.01), "bad_response"),
    (Observation(status=200, first_event="[1, 2]", ttft=0.01), "bad_response"),
    (Observation(status=200), "bad_response"),  # the stream ended without a data event
])
def test_classify(obs, expected):
    assert classify(obs, slow_threshold=0.3) == expected


@pytest.mark.parametrize("text,ok", [
    (" Paris", True), ("\n", True), (" 42", True), ("é", True), ("", False), (None, False), ("nan", False),
    (" -Inf", False), ("\x00", False), ("a\x07b", False), ("\ufffd", False), ("\t", True),
])
def test_sane_text(text, ok):
    assert sane_text(text) is ok


@pytest.mark.parametrize("text,cuda", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("RuntimeError: CUDA out of memory", True),
    ("an illegal memory access was encountered", True),
    ("Xid 79", True),
    ("CUBLAS_STATUS_EXECUTION_FAILED", True),
    ("Internal Server Error", False),
    ("The model `foo` does not exist.", False),
    ("", False),
])
def test_mentions_cuda(text, cuda):
    assert mentions_cuda(text) is cuda


def test_starting_only_while_the_backend_says_it_is_not_ready():
    state = ProbeState()
    for raw in ("connect_error", "http_error", "timeout", "bad_response"):
        assert settle(raw, state, not_ready="/health answered 503", since_start=60, startup_grace=None) == "starting"
        assert settle(raw, state, not_ready=None, since_start=60, startup_grace=None) == raw  # ready: a fault
    assert settle("cuda_error", state, not_ready="/health answered 503", since_start=60,
                  startup_grace=None) == "cuda_error"
    state = advance(state, "starting", None)
    assert state.consecutive_failures == 0 and not state.ever_ready
    ready = advance(state, "timeout", None, ready=True)  # it said it is ready, then hung: a fault, and sticky
    assert ready.ever_ready and ready.consecutive_failures == 1
    assert not may_be_starting(ready, since_start=61, startup_grace=None)
    state = advance(state, "ok", 0.05)
    assert state.ever_ready and state.last_ttft == 0.05
    assert settle("connect_error", state, not_ready="ConnectionRefusedError", since_start=61,
                  startup_grace=None) == "connect_error"


def test_startup_grace_ends_the_cold_start():
    state = ProbeState()
    why = "ClientConnectorError: refused"
    assert settle("timeout", state, not_ready=why, since_start=10, startup_grace=30) == "starting"
    assert settle("timeout", state, not_ready=why, since_start=30, startup_grace=30) == "timeout"
    assert settle("slow", state, not_ready=why, since_start=0, startup_grace=30) == "slow"
    assert not may_be_starting(state, since_start=0, startup_grace=0)  # 0: never starting (canaries), never asked
    assert may_be_starting(state, since_start=10, startup_grace=30)
    assert not may_be_starting(state, since_start=30, startup_grace=30)
    assert may_be_starting(state, since_start=1e9, startup_grace=None)


MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "lora-a", "object": "model"}]}


@pytest.mark.parametrize("check,model,reason", [
    (ReadinessCheck(health_status=200, models_status=200, models=MODELS), None, None),
    (ReadinessCheck(health_status=200, models_status=200, models=MODELS), "lora-a", None),
    (ReadinessCheck(health_status=200, models_status=200, models=MODELS), "other", "/v1/models does not list other"),
    (ReadinessCheck(health_status=200, models_status=200, models={"object": "list", "data": []}), None,
     "/v1/models lists no model"),
    (ReadinessCheck(health_status=200, models_status=200, models=None), None, "/v1/models lists no model"),
    (ReadinessCheck(health_status=503), None, "/health answered 503"),
    (ReadinessCheck(health_status=200, models_status=503), None, "/v1/models answered 503"),
    (ReadinessCheck(health_status=200, models_status=401), "m", None),  # up, refuses the key: ready
    (ReadinessCheck(error="ClientConnectorError: refused"), None, "ClientConnectorError: refused"),
    (ReadinessCheck(error="/v1/models: no answer within 2s", health_status=200), None,
     "/v1/models: no answer within 2s"),
])
def test_not_ready_reason(check, model, reason):
    assert not_ready_reason(check, model) == reason


def test_model_ids():
    assert model_ids(MODELS) == ["m", "lora-a"]
    assert model_ids({"data": [{"name": "x"}, 3, {"id": "y"}]}) == ["y"]
    assert model_ids([]) == [] and model_ids({"data": None}) == []


def test_consecutive_failures_count_failures_only_and_reset_on_answers():
    state = ProbeState(ever_ready=True)
    for result, expected in [("timeout", 1), ("cuda_error", 2), ("http_error", 3), ("slow", 0),
                             ("bad_response", 1), ("connect_error", 2), ("ok", 0)]:
        state = advance(state, result, 0.5 if result in ANSWERED else None)
        assert state.consecutive_failures == expected
        assert state.last_result == result


def test_last_ttft_is_kept_through_failures():
    state = advance(ProbeState(), "ok", 0.04)
    state = advance(state, "timeout", None)
    assert state.last_ttft == 0.04 and state.last_result == "timeout"


observations = st.builds(
    Observation,
    connect_error=st.none() | st.text(max_size=20),
    timed_out=st.booleans(),
    status=st.none() | st.integers(100, 599),
    body=st.text(max_size=50),
    first_event=st.none() | st.text(max_size=80) | st.builds(chunk, st.text(max_size=10)),
    ttft=st.none() | st.floats(0, 20),
)


@given(observations, st.floats(0.001, 10))
def test_every_observation_gets_exactly_one_result_and_never_starting(obs, threshold):
    assert classify(obs, threshold) in set(RESULTS) - {"starting"}


@given(st.lists(st.sampled_from(RESULTS), max_size=30))
def test_failure_streak_equals_trailing_failures(results):
    state = ProbeState()
    for result in results:
        state = advance(state, result, 0.1)
    trailing = 0
    for result in reversed(results):
        if result in ANSWERED:
            break
        trailing += result in FAILURES
    assert state.consecutive_failures == trailing


def test_request_body_is_one_greedy_streamed_token_behind_the_prefix_with_usage_in_every_chunk():
    body = completion_request("m", "The capital of France is", "[00ff]")
    assert body == {"model": "m", "prompt": "[00ff] The capital of France is", "max_tokens": 1,
                    "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("payload, usage", [
    ('{"choices": [{"text": " Paris"}], "usage": {"prompt_tokens": 12, "completion_tokens": 1}}', (12, 1)),
    ('{"choices": [{"text": " Paris"}]}', (None, None)),  # a server that reports no usage: a token all the same
    ('{"choices": [{"text": "\ufffd"}], "usage": {"prompt_tokens": 9}}', (9, None)),  # garbage is a token too
    ('{"choices": [{"text": "x"}], "usage": {"prompt_tokens": -1, "completion_tokens": true}}', (None, None)),
    ('{"error": {"message": "CUDA error"}}', None),  # an error event: no token
    ('{"choices": [], "usage": {"prompt_tokens": 12}}', None),
    ("[DONE]", None),
    ("not json", None),
])
def test_event_usage_is_what_vllm_counted_for_a_probe_it_finished_with_a_token(payload, usage):
    assert event_usage(payload) == usage


@pytest.mark.parametrize("line,payload", [
    (b'data: {"a": 1}\n', '{"a": 1}'),
    (b"data:[DONE]\r\n", "[DONE]"),
    (b"\n", None),
    (b": keep-alive\n", None),
    (b"event: message\n", None),
    (b"\xff\xfegarbage\n", "\ufffd\ufffdgarbage"),
])
def test_sse_payload(line, payload):
    assert sse_payload(line) == payload


@pytest.mark.parametrize("models,model", [
    ({"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": 32768}]},
     "Qwen/Qwen2.5-0.5B-Instruct"),
    ({"object": "list", "data": []}, None),
    ([], None),
    ({"data": [{"name": "x"}]}, None),
])
def test_pick_model(models, model):
    assert pick_model(models) == model


def test_judge_event_ok_for_a_vllm_chunk():
    assert judge_event(chunk(" Paris")) == "ok"


def test_a_probe_waiting_past_the_slow_threshold_is_exported_slow_before_it_answers():
    now = [100.0]
    reg = CollectorRegistry()
    p = Prober("http://127.0.0.1:1", ProbeConfig(slow_threshold=0.3), registry=reg, clock=lambda: now[0],
               wall=lambda: 1.7e9)
    p._state = ProbeState(ever_ready=True, last_result="ok", last_ttft=0.05)
    p._inflight_since = 100.0
    now[0] = 100.2  # under the threshold: the last answer stands
    assert p.exported()[0].last_result == "ok" and p.exported()[0].last_ttft == 0.05
    now[0] = 100.7  # past it: slow already, TTFT at least what it waited
    state = p.exported()[0]
    assert state.last_result == "slow" and abs(state.last_ttft - 0.7) < 1e-9
    page = generate_latest(reg).decode()
    assert 'grayguard_probe_last_result{result="slow"} 1.0' in page and "grayguard_probe_last_ttft_seconds 0.7" in page
    assert p.state.last_result == "ok"  # only the gauges: the agent and the counters see finished probes
    p._state = ProbeState(ever_ready=True, consecutive_failures=1, last_result="timeout", last_ttft=0.05)
    assert p.exported()[0].last_result == "timeout"  # a failure stays the news; its streak goes on
    p._inflight_since = None
    p._state = ProbeState(ever_ready=True, last_result="ok", last_ttft=0.05)
    assert p.exported()[0].last_result == "ok"  # nothing in flight


def test_probe_results_has_ok_and_slow_from_the_start_and_a_failure_from_its_first_count():
    reg = CollectorRegistry()
    p = Prober("http://127.0.0.1:1", registry=reg, clock=lambda: 100.0, wall=lambda: 1.7e9)

    def counts() -> dict[str, float]:
        return {s.labels["result"]: s.value for m in reg.collect() for s in m.samples
                if s.name == "grayguard_probe_results_total"}
    assert counts() == {"ok": 0, "slow": 0}  # the failures are absent until counted (as grayguard_gpu_xid_errors)
    p._record(Observation(connect_error="refused"), "connect_error", 1.0, None, ready=False)
    assert counts() == {"ok": 0, "slow": 0, "connect_error": 1}  # at 1: increase() misses it, the alerts do not
    p._record(Observation(timed_out=True), "timeout", 2.0, None, ready=False)
    p._record(Observation(timed_out=True), "timeout", 3.0, None, ready=False)
    assert counts() == {"ok": 0, "slow": 0, "connect_error": 1, "timeout": 2}
