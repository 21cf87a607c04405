"""The agent check: the pure verdict, the hang evidence, and the TCP server against well- and ill-behaved clients."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from grayguard.exporters.agent import Agent, Verdict, clean, verdict
from grayguard.exporters.engineload import EngineLoad, parse_engine_load
from grayguard.exporters.hang import Progress, token_progress
from grayguard.exporters.probe import RESULTS, ProbeState

INTERVAL, DEADLINE = 1.0, 2.0
NOW = 1000.0
HUNG = Progress(tokens=0, running=3, window=2.0)


def at(state: ProbeState, age: float = 0.5) -> Verdict:
    return verdict(state, NOW - age, NOW, interval=INTERVAL, deadline=DEADLINE)


# --- the pure verdict ----------------------------------------------------------------------------------
@pytest.mark.parametrize("result,down", [
    ("ok", False), ("slow", False), ("timeout", False), ("connect_error", False), ("http_error", False),
    ("starting", False), ("bad_response", True), ("cuda_error", True),
])
def test_verdict_for_every_probe_result(result, down):
    v = at(ProbeState(last_result=result))
    assert v.down is down
    assert v.text.startswith("down #probe " + result) if down else v.text == "up"
    assert v.cause == (result if down else None)


def test_every_probe_result_is_covered():
    assert set(RESULTS) == {"ok", "slow", "timeout", "connect_error", "http_error", "starting", "bad_response",
                            "cuda_error"}


def test_one_strike_names_the_probe_result_and_why():
    state = ProbeState(last_result="bad_response", last_detail="garbage text ' NaN'", consecutive_failures=1)
    assert at(state).text == "down #probe bad_response: garbage text ' NaN'"
    cuda = ProbeState(last_result="cuda_error", last_detail="CUDA error: an illegal memory access was encountered")
    assert at(cuda).text == "down #probe cuda_error: CUDA error: an illegal memory access was encountered"
    assert at(ProbeState(last_result="cuda_error")).text == "down #probe cuda_error"


def test_no_probe_yet_is_up():
    assert verdict(ProbeState(), None, NOW, interval=INTERVAL, deadline=DEADLINE).text == "up"
    assert verdict(ProbeState(), NOW, NOW, interval=INTERVAL, deadline=DEADLINE).text == "up"
    assert verdict(ProbeState(last_result="bad_response"), None, NOW, interval=INTERVAL,
                   deadline=DEADLINE).text == "up"


@pytest.mark.parametrize("age,down", [(0.0, True), (4.9, True), (5.0, True), (5.01, False), (600, False)])
def test_stale_state_is_up(age, down):
    """Older than 3 intervals + the deadline (5 s here): the prober is stuck, its last word is no evidence."""
    v = at(ProbeState(last_result="bad_response"), age=age)
    assert v.down is down
    if not down:
        assert "stale" in v.why


@pytest.mark.parametrize("progress,down", [
    (HUNG, True),
    (None, False),  # no evidence: /metrics missing, unparsable or the counter went back
    (Progress(tokens=17, running=3, window=2.0), False),  # tokens flow: an overload, not a hang
    (Progress(tokens=0, running=0, window=2.0), True),  # idle: it would have prefilled the probe
])
def test_timeout_is_down_only_with_hang_evidence(progress, down):
    v = at(ProbeState(last_result="timeout", last_progress=progress, consecutive_failures=1))
    assert v.down is down
    if down:
        others = f"{progress.running:g} other requests in the engine"
        assert v.text == f"down #hang: no token in 2.0s ({others})" and v.cause == "hang"


@pytest.mark.parametrize("result", [r for r in RESULTS if r != "timeout"])
def test_hang_evidence_counts_only_for_a_timeout(result):
    v = at(ProbeState(last_result=result, last_progress=HUNG))
    assert v.down is (result in ("bad_response", "cuda_error"))
    assert v.cause != "hang"


def test_stale_hang_is_up():
    assert at(ProbeState(last_result="timeout", last_progress=HUNG), age=60).text == "up"


@pytest.mark.parametrize("text,expected", [
    ("garbage text '\ufffd\u00c3'", "garbage text '??'"),
    ("line one\nline two\r\n", "line one line two"),
    ("tab\tand  spaces", "tab and spaces"),
    ("x" * 500, "x" * 157 + "..."),
])
def test_reason_is_one_line_of_printable_ascii(text, expected):
    assert clean(text) == expected


def test_a_multiline_detail_never_breaks_the_line():
    v = at(ProbeState(last_result="cuda_error", last_detail="CUDA error\nup\n\x00"))
    assert "\n" not in v.text and v.text.startswith("down #") and v.text.isascii()


# --- hang evidence ---------------------------------------------------------------------------------------
VLLM_METRICS = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
vllm:generation_tokens_total{engine="1",model_name="m"} 66.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 9.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="a b}c"} 5.0
"""


def test_parse_engine_load_sums_label_sets():
    assert parse_engine_load(VLLM_METRICS) == EngineLoad(generation_tokens=1300.0, running=3.0, waiting=9.0)


def test_prefill_counts_as_progress_and_waiting_as_load():
    before = EngineLoad(generation_tokens=100, running=0, prompt_tokens=500, waiting=0)
    prefilling = EngineLoad(generation_tokens=100, running=1, prompt_tokens=8692, waiting=2)
    p = token_progress(before, prefilling, 2.0)
    assert p == Progress(8192, 3, 2.0) and not p.hung  # a long prefill steps: no hang
    restarted = EngineLoad(generation_tokens=100, running=1, prompt_tokens=10, waiting=0)
    assert token_progress(before, restarted, 2.0) is None  # a counter went back: no evidence


@pytest.mark.parametrize("text,expected", [
    ("", EngineLoad()),
    ("not prometheus at all\n<html>", EngineLoad()),
    ('vllm:num_requests_running{model_name="m"} 2\n', EngineLoad(running=2.0)),  # absent is not zero
    ("vllm:generation_tokens_total 5 1712000000000\nvllm:num_requests_running 1\n", EngineLoad(5.0, 1.0)),
    ('vllm:generation_tokens_total{x="1"} NaN\nvllm:num_requests_running 1\n', EngineLoad(running=1.0)),
    ('vllm:generation_tokens_total{x="1"} 5\nvllm:generation_tokens_total{x="2"} oops\n', EngineLoad()),
    ('vllm:generation_tokens_total{x="1"}\n', EngineLoad()),
    ('vllm:generation_tokens_total{model_name="has spaces } and braces"} 7\n', EngineLoad(generation_tokens=7.0)),
])
def test_parse_engine_load_missing_or_broken_is_none(text, expected):
    assert parse_engine_load(text) == expected


@pytest.mark.parametrize("before,after,expected", [
    (EngineLoad(100, 2), EngineLoad(100, 3), Progress(0, 3, 2.0)),
    (EngineLoad(100, 2), EngineLoad(130, 3), Progress(30, 3, 2.0)),
    (EngineLoad(100, 2), EngineLoad(100, 0), Progress(0, 0, 2.0)),
    (None, EngineLoad(100, 3), None),
    (EngineLoad(100, 2), None, None),
    (EngineLoad(None, 2), EngineLoad(100, 3), None),
    (EngineLoad(100, 2), EngineLoad(100, None), None),
    (EngineLoad(100, 2), EngineLoad(3, 1), None),  # counter went back: vLLM restarted in between
])
def test_token_progress(before, after, expected):
    assert token_progress(before, after, 2.0) == expected


def test_only_no_token_with_requests_running_is_a_hang():
    assert Progress(0, 1, 2.0).hung
    assert not Progress(1, 5, 2.0).hung and Progress(0, 0, 2.0).hung  # the probe itself waited for the engine


# --- the TCP server ---------------------------------------------------------------------------------------
class Source:
    """What the prober would say; the test sets it."""

    def __init__(self, state: ProbeState | None = None, last_at: float | None = None):
        self.state, self.last_at = state or ProbeState(), last_at

    def __call__(self) -> tuple[ProbeState, float | None]:
        return self.state, self.last_at


@pytest.fixture
def served():
    made: list[Agent] = []

    def make(source: Source, registry: CollectorRegistry | None = None) -> Agent:
        agent = Agent(source, interval=INTERVAL, deadline=DEADLINE, port=0, registry=registry,
                      clock=lambda: NOW)
        made.append(agent.start())
        return agent

    yield make
    for a in made:
        a.stop()


def ask(agent: Agent, send: bytes = b"") -> bytes:
    with socket.create_connection(agent.address, timeout=5) as s:
        if send:
            s.sendall(send)
        data = b""
        while chunk := s.recv(1024):
            data += chunk
    return data


def test_answers_up_then_down_with_why(served):
    source = Source()
    agent = served(source)
    assert ask(agent) == b"up\n"
    source.state, source.last_at = ProbeState(last_result="bad_response", last_detail="garbage text ' NaN'"), NOW
    assert ask(agent) == b"down #probe bad_response: garbage text ' NaN'\n"
    source.state = ProbeState(last_result="ok")
    assert ask(agent) == b"up\n"


def test_a_client_that_sends_a_line_gets_the_answer(served):
    """HAProxy's agent-send text (or anything) is read and ignored."""
    agent = served(Source(ProbeState(last_result="cuda_error"), NOW))
    assert ask(agent, b"hello agent\n") == b"down #probe cuda_error\n"
    assert ask(agent, b"\x00\xff" * 5000) == b"down #probe cuda_error\n"


def test_a_client_that_sends_nothing_and_stays_is_answered_and_let_go(served):
    agent = served(Source(ProbeState(last_result="ok"), NOW))
    with socket.create_connection(agent.address, timeout=5) as s:
        assert s.recv(64) == b"up\n"
        t0 = time.monotonic()
        assert s.recv(64) == b""  # end of answer; we keep our side open
    assert time.monotonic() - t0 < 3


def test_survives_resets_and_half_open_clients(served):
    agent = served(Source(ProbeState(last_result="ok"), NOW))
    linger_rst = struct.pack("ii", 1, 0)
    for _ in range(20):  # connect and reset at once
        s = socket.create_connection(agent.address, timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_rst)
        s.close()
    idle = [socket.create_connection(agent.address, timeout=5) for _ in range(20)]  # never read, never close
    try:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(ask(agent, b"x\n"))) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert answers == [b"up\n"] * 20
    finally:
        for s in idle:
            s.close()
    assert ask(agent) == b"up\n"


def test_counts_answers_and_exports_the_verdict(served):
    registry = CollectorRegistry()
    source = Source(ProbeState(last_result="ok"), NOW)
    agent = served(source, registry)
    assert registry.get_sample_value("grayguard_agent_answers_total", {"verdict": "down"}) == 0
    assert registry.get_sample_value("grayguard_agent_down") == 0
    ask(agent)
    source.state = ProbeState(last_result="timeout", last_progress=HUNG)
    ask(agent)
    ask(agent)
    assert registry.get_sample_value("grayguard_agent_answers_total", {"verdict": "up"}) == 1
    assert registry.get_sample_value("grayguard_agent_answers_total", {"verdict": "down"}) == 2
    assert registry.get_sample_value("grayguard_agent_down") == 1
    families = {f.name for c in list(registry._collector_to_names) for f in c.describe()}
    assert {"grayguard_agent_answers", "grayguard_agent_down"} <= families


def test_logs_a_warning_when_the_verdict_changes(served, caplog):
    source = Source(ProbeState(last_result="ok"), NOW)
    agent = served(source)
    with caplog.at_level(logging.INFO, logger="grayguard.exporters.agent"):
        caplog.clear()
        ask(agent)
        source.state = ProbeState(last_result="bad_response", last_detail="garbage text ' NaN'")
        ask(agent)
        ask(agent)
        source.state = ProbeState(last_result="cuda_error")
        ask(agent)
        source.state = ProbeState(last_result="ok")
        ask(agent)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["agent check: down (probe bad_response: garbage text ' NaN')",
                        "agent check: down (probe cuda_error)", "agent check: up (probe ok)"]


def test_taken_port_raises_and_stop_is_idempotent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        agent = Agent(Source(), interval=INTERVAL, deadline=DEADLINE, port=s.getsockname()[1])
        with pytest.raises(OSError):
            agent.start()
    agent.stop()
    agent.stop()

