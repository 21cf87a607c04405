"""`starting` means "vLLM says it is not ready yet", never "the exporter has not seen an answer yet".

An exporter (re)started beside a vLLM that is ready but already hangs or answers garbage must report the
fault from its first probe; only a backend that refuses connections, whose /health is not 200 or whose
/v1/models lacks the model is starting. The ready-but-broken cases run against the simulator (its /health
and /v1/models answer like vLLM's whatever the fault); the not-ready phases, which the simulator does not
model, against a small local backend.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from grayguard.exporters.prober import ProbeConfig, Prober
from grayguard.exporters.server import Exporter
from grayguard.localstack.procs import free_port
from grayguard.sim.fleet import FleetThread
from grayguard.sim.node import DEFAULT_MODEL

# The production startup grace (30 min): the old code called every failure `starting` for that long.
CFG = ProbeConfig(interval=0.1, jitter=0.1, slow_threshold=0.3, deadline=0.5, api_key_env=None)
assert CFG.startup_grace == ProbeConfig().startup_grace == 1800.0
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


class Backend:
    """A vLLM look-alike whose readiness is set by hand: /health status, /v1/models list, completion mode."""

    def __init__(self, port: int = 0, *, health: int | str = 200, models: tuple[str, ...] = (MODEL,),
                 mode: str = "ok", api_key: str | None = None):
        self.health, self.models, self.mode, self.api_key = health, models, mode, api_key
        self.release = threading.Event()
        self.hits: dict[str, int] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                fake.hits[self.path] = fake.hits.get(self.path, 0) + 1
                if self.path == "/health":  # vLLM's /health takes no key
                    if fake.health == "hang":
                        fake.release.wait(10)
                        return
                    return self.send(fake.health, b"")
                if not self.authorized():
                    return self.send(401, b'{"error": "Unauthorized"}')
                self.send(200, json.dumps({"object": "list", "data": [
                    {"id": m, "object": "model", "max_model_len": 32768} for m in fake.models]}).encode())

            def do_POST(self):  # noqa: N802
                fake.hits[self.path] = fake.hits.get(self.path, 0) + 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.authorized():
                    return self.send(401, b'{"error": "Unauthorized"}')
                if fake.health != 200 and fake.mode != "hang":  # no engine yet
                    return self.send(503, b'{"error": "Service Unavailable"}')
                if body.get("model") not in fake.models:
                    return self.send(404, b'{"message": "The model does not exist."}')
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", "100000")  # never all sent: the prober closes first
                self.end_headers()
                self.wfile.flush()
                if fake.mode == "hang":
                    fake.release.wait(10)
                    return
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": " Paris", "finish_reason": None}]}
                try:
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                except OSError:
                    pass
                self.close_connection = True

            def authorized(self) -> bool:
                return fake.api_key is None or self.headers.get("Authorization") == f"Bearer {fake.api_key}"

            def send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def backends():
    made: list[Backend] = []

    def make(*args, **kw) -> Backend:
        made.append(Backend(*args, **kw))
        return made[-1]
    yield make
    for b in made:
        b.close()


@pytest.fixture(scope="module")
def sim():
    with FleetThread(n=1, seed=3) as ft:
        yield ft


def first_results(url: str, n: int, **cfg) -> tuple[list[str], Prober]:
    """The first n results of a freshly started prober (the default cold-start grace unless overridden)."""
    p = Prober(url, ProbeConfig(**{**CFG.__dict__, **cfg}))
    return [p.run_once() for _ in range(n)], p


def scrape(url: str) -> str:
    with requests.Session() as s:
        s.trust_env = False
        return s.get(url + "/metrics", timeout=5).text


def sample(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


# --- ready but broken: the fault is reported at once ---------------------------------------------------
@pytest.mark.parametrize("fault,params,expected", [
    ("hang", {}, "timeout"),
    ("garbage", {"style": "nan"}, "bad_response"),
    ("garbage", {"style": "mojibake"}, "bad_response"),
])
def test_exporter_restarted_beside_a_ready_but_broken_vllm_reports_the_fault_at_once(sim, fault, params, expected):
    node = sim.nodes[0]
    sim.set_fault(node.name, fault, **params)
    try:
        # the simulator says it is ready, as vLLM does while its engine hangs or emits garbage
        assert requests.get(node.url + "/health", timeout=2).status_code == 200
        assert requests.get(node.url + "/v1/models", timeout=2).json()["data"][0]["id"] == DEFAULT_MODEL
        with Exporter(node.url, port=0, nvml=None, probe=CFG) as exporter:
            assert exporter.prober.wait_for_probes(2, 10)
            text = scrape(exporter.url)
            state = exporter.prober.state
        assert sample(text, f'grayguard_probe_last_result{{result="{expected}"}}') == 1
        assert sample(text, 'grayguard_probe_results_total{result="starting"}') is None  # never counted
        # a failure's series appears at its first count; ok and slow are there from the start, at 0
        assert sample(text, f'grayguard_probe_results_total{{result="{expected}"}}') >= 2
        assert sample(text, 'grayguard_probe_results_total{result="ok"}') == 0
        assert sample(text, 'grayguard_probe_results_total{result="slow"}') == 0
        assert sample(text, "grayguard_probe_consecutive_failures") >= 2
        assert state.ever_ready  # the backend said it is ready: later failures are not even asked about
    finally:
        sim.clear_fault(node.name)


def test_ready_backend_that_hangs_is_timeout_from_the_first_probe(backends):
    b = backends(mode="hang")
    results, p = first_results(b.url, 3)
    assert results == ["timeout"] * 3
    assert p.state.consecutive_failures == 3
    assert b.hits["/health"] == 1  # asked once: ready is sticky


def test_wrong_api_key_on_a_ready_backend_is_an_http_error_not_starting(backends):
    b = backends(api_key="s3cret")  # /v1/models answers 401: the server is up and refuses us
    results, _ = first_results(b.url, 2)
    assert results == ["http_error"] * 2


def test_simulator_without_a_fault_is_ok(sim):
    results, p = first_results(sim.nodes[0].url, 2)
    assert results == ["ok", "ok"] and p.state.consecutive_failures == 0


# --- not ready: starting ---------------------------------------------------------------------------------
def test_refused_connection_is_starting():
    results, p = first_results(f"http://127.0.0.1:{free_port()}", 2)
    assert results == ["starting", "starting"]
    assert p.state.consecutive_failures == 0


def test_health_503_is_starting(backends):
    b = backends(health=503, mode="hang")
    results, p = first_results(b.url, 2)
    assert results == ["starting", "starting"]
    assert p.state.consecutive_failures == 0


def test_health_that_does_not_answer_is_starting(backends):
    b = backends(health="hang", mode="hang")
    results, _ = first_results(b.url, 1)
    assert results == ["starting"]


def test_health_200_but_no_model_listed_is_starting(backends):
    b = backends(models=())
    results, p = first_results(b.url, 2)
    assert results == ["starting", "starting"]
    assert p.errors.labels("model_discovery")._value.get() == 2


def test_health_200_but_the_configured_model_missing_is_starting(backends):
    b = backends(models=("another/model",))
    results, _ = first_results(b.url, 2, model=MODEL)
    assert results == ["starting", "starting"]


def test_startup_grace_still_bounds_a_backend_that_never_gets_ready(backends):
    b = backends(health=503)
    assert first_results(b.url, 1, startup_grace=0)[0] == ["http_error"]  # 0: never starting (canaries)
    assert b.hits.get("/health", 0) == 0  # and nothing asked


def test_backend_that_becomes_ready_later_goes_from_starting_to_ok():
    port = free_port()
    with Exporter(f"http://127.0.0.1:{port}", port=0, nvml=None, probe=CFG) as exporter:
        p = exporter.prober
        assert p.wait_for_probes(2, 5)
        assert p.state.last_result == "starting"  # connection refused: vLLM not up yet
        loading = Backend(port, health=503, models=())
        try:
            n = p.count
            assert p.wait_for_probes(n + 2, 5)
            assert p.state.last_result == "starting"  # up, /health 503, no model yet: the model is loading
            loading.models = (MODEL,)  # the model, then /health: as vLLM turns ready
            loading.health = 200
            deadline = time.monotonic() + 5
            while p.state.last_result != "ok" and time.monotonic() < deadline:
                time.sleep(0.05)
            text = scrape(exporter.url)
        finally:
            loading.close()
    assert sample(text, 'grayguard_probe_last_result{result="ok"}') == 1
    assert sample(text, 'grayguard_probe_results_total{result="starting"}') >= 4
    assert sample(text, "grayguard_probe_consecutive_failures") == 0
    for fault in ("timeout", "connect_error", "http_error", "bad_response", "cuda_error"):
        assert sample(text, f'grayguard_probe_results_total{{result="{fault}"}}') is None  # never counted
