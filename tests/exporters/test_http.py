"""Prober and exporter against a real local HTTP server that streams like vLLM."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.prober import ProbeConfig, Prober
from grayguard.exporters.server import Exporter

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# thresholds well above a loaded CI machine's own latency (it took past 0.15 s to answer locally)
FAST = ProbeConfig(interval=0.05, jitter=0.1, slow_threshold=0.5, deadline=1.0, startup_grace=0,
                   api_key_env=None)


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def text_chunk(text=" Paris"):
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}


class FakeVllm:
    """vLLM's /v1/models and streaming /v1/completions; `mode` picks the behaviour of the next request."""

    def __init__(self, mode: str = "fast"):
        self.mode = mode
        self.delay = 0.0
        self.api_key: str | None = None
        self.requests: list[tuple[dict, dict]] = []
        self.got_request = threading.Event()
        self.disconnected = threading.Event()  # the client closed the stream before its end
        self.release = threading.Event()  # ends hangs and delays at teardown
        self.models_status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    return self.plain(401, b'{"error": "Unauthorized"}')
                self.plain(fake.models_status, json.dumps(
                    {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 32768}]}).encode())

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((dict(self.headers), body))
                fake.got_request.set()
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    return self.plain(401, b'{"error": "Unauthorized"}')
                mode = fake.mode
                if mode == "cuda500":
                    return self.plain(500, json.dumps({"object": "error", "type": "InternalServerError", "code": 500,
                                                       "message": "CUDA error: an illegal memory access was "
                                                                  "encountered"}).encode())
                if mode == "http500":
                    return self.plain(500, b"Internal Server Error")
                if mode == "404":
                    return self.plain(404, b'{"message": "The model does not exist."}')
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                if mode == "hang":
                    fake.release.wait(10)
                elif mode == "slow":
                    fake.release.wait(fake.delay)
                first = {"fast": sse(text_chunk()), "slow": sse(text_chunk()), "hang": sse(text_chunk()),
                         "error_event": sse({"error": {"object": "error", "message": "prompt is too long",
                                                       "type": "BadRequestError", "code": 400}}),
                         "cuda_event": sse({"error": {"object": "error", "type": "InternalServerError",
                                                      "message": "CUDA out of memory. Tried to allocate 2.00 GiB"}}),
                         "garbage": b"\x00\x9f\x92garbage that is not SSE\n\n",
                         "nan": sse(b'{"choices": [{"index": 0, "text": NaN}]}'),
                         "empty": sse(text_chunk(""))}[mode]
                self.stream(first)

            def stream(self, first: bytes) -> None:
                # Keep streaming after the first event until the client goes away, as vLLM would with
                # max_tokens > 1: the test checks that the prober closed the connection.
                try:
                    self.chunk(first)
                    for _ in range(300):
                        if fake.release.wait(0.01) and fake.mode != "hang":
                            break
                        self.chunk(sse(text_chunk(" more")))
                    self.chunk(sse(b"[DONE]"))
                    self.chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    fake.disconnected.set()
                    self.close_connection = True

            def chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def plain(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def vllm():
    server = FakeVllm()
    yield server
    server.close()


@pytest.fixture
def session():
    with requests.Session() as s:
        s.trust_env = False  # no proxy from the environment for 127.0.0.1
        yield s


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


def prober(url, **kw) -> Prober:
    cfg = ProbeConfig(**{**FAST.__dict__, **kw})
    return Prober(url, cfg)


@pytest.mark.parametrize("mode,expected", [
    ("fast", "ok"),
    ("cuda500", "cuda_error"),
    ("http500", "http_error"),
    ("404", "http_error"),
    ("error_event", "bad_response"),
    ("cuda_event", "cuda_error"),
    ("garbage", "bad_response"),
    ("nan", "bad_response"),
    ("empty", "bad_response"),
])
def test_each_backend_behaviour_gets_its_result(vllm, mode, expected):
    vllm.mode = mode
    p = prober(vllm.url)
    assert p.run_once() == expected
    assert p.results.labels(expected)._value.get() == 1
    if mode in ("fast", "error_event", "cuda_event", "garbage", "nan", "empty"):
        assert vllm.disconnected.wait(2), "the prober must close the stream after the first event"


def test_slow_first_chunk_is_slow_and_its_ttft_is_measured(vllm):
    vllm.mode, vllm.delay = "slow", 0.6
    p = prober(vllm.url)
    assert p.run_once() == "slow"
    assert 0.6 <= p.state.last_ttft < 1.0
    assert vllm.disconnected.wait(2)


def test_the_probe_the_gauges_show_is_named_by_its_send_time_while_it_waits_and_once_it_ends(vllm):
    """The controller counts each probe once, however many ticks read it: the gauges name the probe they show by the
    wall time it was sent. A probe shown slow while it still waits is the same probe when it ends."""
    p = prober(vllm.url, slow_threshold=0.15, deadline=3.0)
    assert p.run_once() == "ok"
    state, ended, first = p.exported()
    assert state.last_result == "ok" and first is not None and first <= ended
    vllm.mode, vllm.delay = "slow", 1.0
    sent_after = time.time()
    waiting = threading.Thread(target=p.run_once)
    waiting.start()
    deadline = time.monotonic() + 5
    while p.exported()[0].last_result != "slow" and time.monotonic() < deadline:
        time.sleep(0.02)
    state, _, shown = p.exported()
    assert waiting.is_alive(), "the slow probe ended before its wait was seen"
    assert state.last_result == "slow" and shown is not None and shown >= sent_after > first  # the waiting one's
    waiting.join(5)
    state, _, ended_as = p.exported()
    assert state.last_result == "slow" and ended_as == shown  # the same probe, ended: not a new one
    vllm.mode = "fast"
    assert p.run_once() == "ok" and p.exported()[2] > shown  # the next probe is another


def test_hang_after_headers_times_out_at_the_deadline_and_closes(vllm):
    vllm.mode = "hang"
    p = prober(vllm.url, slow_threshold=0.15, deadline=0.3)
    start = time.monotonic()
    assert p.run_once() == "timeout"
    assert 0.3 <= time.monotonic() - start < 0.6
    vllm.release.set()  # the server wakes up and finds the client gone
    assert vllm.disconnected.wait(2)


def test_refused_connection_is_connect_error():
    assert prober(refused_url()).run_once() == "connect_error"


def test_cold_start_is_starting_until_the_first_answer_then_failures_count(vllm):
    p = prober(refused_url(), startup_grace=None)
    assert p.run_once() == "starting"
    assert p.state.consecutive_failures == 0
    p.client.base_url = vllm.url
    assert p.run_once() == "ok"
    p.client.base_url = refused_url()
    assert p.run_once() == "connect_error"
    assert p.state.consecutive_failures == 1


def test_probe_request_shape_model_discovery_and_random_prefix(vllm):
    p = prober(vllm.url)
    assert p.run_once() == "ok" and p.run_once() == "ok"
    (h1, b1), (h2, b2) = vllm.requests
    assert h1["X-LLM-Probe"] == "true" and "Authorization" not in h1
    assert b1["model"] == MODEL and b1["max_tokens"] == 1 and b1["temperature"] == 0 and b1["stream"] is True
    assert b1["prompt"].endswith("The capital of France is")
    assert b1["prompt"] != b2["prompt"]  # a new prefix every time: the prefix cache cannot answer


def test_api_key_from_env_and_from_file(vllm, tmp_path):
    vllm.api_key = "s3cret"
    assert prober(vllm.url).run_once() == "http_error"  # 401 from /v1/models
    p = Prober(vllm.url, ProbeConfig(**{**FAST.__dict__, "api_key_env": "MY_KEY"}), env={"MY_KEY": "s3cret"})
    assert p.run_once() == "ok"
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert prober(vllm.url, api_key_file=str(key_file)).run_once() == "ok"
    assert vllm.requests[-1][0]["Authorization"] == "Bearer s3cret"
    missing = prober(vllm.url, api_key_file=str(tmp_path / "nope"))
    missing.run_once()
    assert missing.errors.labels("api_key")._value.get() == 1


def test_model_not_found_triggers_rediscovery(vllm):
    p = prober(vllm.url)
    assert p.run_once() == "ok"
    vllm.mode = "404"
    assert p.run_once() == "http_error"
    assert p.client.model is None
    vllm.mode = "fast"
    assert p.run_once() == "ok" and p.client.model == MODEL


def test_models_endpoint_failure_is_counted(vllm):
    vllm.models_status = 503
    p = prober(vllm.url)
    assert p.run_once() == "http_error"
    assert p.errors.labels("model_discovery")._value.get() == 1


def scrape(session: requests.Session, exporter: Exporter) -> tuple[float, str]:
    start = time.perf_counter()
    r = session.get(f"{exporter.url}/metrics", timeout=5)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed, r.text


def sample(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_metrics_answers_fast_while_the_backend_hangs(vllm, session):
    vllm.mode = "hang"
    with Exporter(vllm.url, port=0, nvml=FakeNvml([healthy_h100(0)]), probe=FAST) as exporter:
        assert vllm.got_request.wait(2)  # a probe is now stuck inside the hung backend
        times = [scrape(session, exporter)[0] for _ in range(5)]
        assert max(times) < 0.1, times
        assert exporter.prober.wait_for_probes(1, 2)
        _, text = scrape(session, exporter)
        assert sample(text, 'grayguard_probe_last_result{result="timeout"}') == 1
        assert text.count("grayguard_probe_last_result{") == 1  # the last result's series alone
        assert sample(text, "grayguard_probe_consecutive_failures") >= 1


def test_without_nvml_the_probes_still_work(vllm, session):
    with Exporter(vllm.url, port=0, nvml=FakeNvml(available=False), probe=FAST) as exporter:
        assert exporter.prober.wait_for_probes(2, 5)
        _, text = scrape(session, exporter)
    assert sample(text, "grayguard_exporter_nvml_up") == 0
    assert sample(text, 'grayguard_probe_results_total{result="ok"}') >= 2
    assert sample(text, 'grayguard_probe_last_result{result="ok"}') == 1
    assert sample(text, "grayguard_probe_ttft_seconds_count") >= 2
    assert 0 < sample(text, "grayguard_probe_last_ttft_seconds") < FAST.slow_threshold
    assert sample(text, "grayguard_probe_last_timestamp_seconds") > 1.6e9
    assert 1.6e9 < sample(text, "grayguard_probe_last_sent_timestamp_seconds") \
        <= sample(text, "grayguard_probe_last_timestamp_seconds")
    assert sample(text, 'grayguard_exporter_probe_errors_total{kind="internal"}') == 0
    assert sample(text, 'grayguard_probe_results_total{result="slow"}') == 0  # ok and slow from the start
    for result in ("timeout", "connect_error", "http_error", "cuda_error", "bad_response", "starting"):
        assert sample(text, f'grayguard_probe_results_total{{result="{result}"}}') is None  # from its first count


def test_several_exporters_in_one_process_each_with_its_own_gpus_and_port(vllm, session):
    fakes = [FakeNvml([healthy_h100(i)]) for i in range(3)]
    exporters = [Exporter(vllm.url, port=0, nvml=f, probe=None).start() for f in fakes]
    try:
        fakes[1].gpus[0].temperature_c = 93
        texts = [scrape(session, e)[1] for e in exporters]
        assert len({e.address[1] for e in exporters}) == 3
        for i, text in enumerate(texts):
            assert healthy_h100(i).uuid in text
            assert all(healthy_h100(j).uuid not in text for j in range(3) if j != i)
        assert "grayguard_probe_" not in texts[0]
        assert f'grayguard_gpu_temperature_celsius{{gpu="0",uuid="{healthy_h100(1).uuid}"}} 93.0' in texts[1]
    finally:
        for e in exporters:
            e.stop()


def test_index_page_and_404(vllm, session):
    with Exporter(vllm.url, port=0, nvml=None, probe=None) as exporter:
        assert "/metrics" in session.get(exporter.url + "/", timeout=5).text
        assert session.get(exporter.url + "/nope", timeout=5).status_code == 404
        assert sample(scrape(session, exporter)[1], "grayguard_exporter_nvml_up") == 0


def test_stop_ends_the_prober_thread_even_mid_probe(vllm):
    vllm.mode = "hang"
    exporter = Exporter(vllm.url, port=0, nvml=None, probe=ProbeConfig(**{**FAST.__dict__, "deadline": 5})).start()
    assert vllm.got_request.wait(2)
    start = time.monotonic()
    exporter.stop()
    assert time.monotonic() - start < 1
    assert not exporter.prober._thread.is_alive()


def test_metrics_format_follows_the_accept_header(vllm, session):
    with Exporter(vllm.url, port=0, nvml=None, probe=None) as exporter:
        om = session.get(exporter.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")
        text = session.get(exporter.url + "/metrics", timeout=5)
        assert text.headers["Content-Type"].startswith("text/plain") and "# EOF" not in text.text
