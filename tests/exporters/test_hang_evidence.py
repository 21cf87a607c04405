"""The prober's hang evidence against a backend whose completions hang and whose /metrics the test controls."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grayguard.exporters.prober import ProbeConfig, Prober
from grayguard.exporters.server import Exporter

MODEL = "m"
CFG = ProbeConfig(interval=0.1, jitter=0.1, slow_threshold=0.2, deadline=0.4, startup_grace=0, api_key_env=None,
                  metrics_timeout=0.3)


def metrics(tokens: float, running: float) -> str:
    return (f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {tokens}\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {running}\n')


class HungVllm:
    """Ready, completions never answer; /metrics answers `metrics` (str), a status (int) or hangs ("hang")."""

    def __init__(self):
        self.metrics: str | int = metrics(100, 2)
        self.tokens_per_read = 0.0  # added to the counter at every /metrics read (a busy engine)
        self.reads = 0
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                if self.path == "/metrics":
                    fake.reads += 1
                    m = fake.metrics
                    if m == "hang":
                        fake.release.wait(10)
                        return
                    if isinstance(m, int):
                        return self.send(m, b"not found")
                    extra = fake.tokens_per_read * fake.reads
                    if extra:
                        m = metrics(100 + extra, 2)
                    return self.send(200, m.encode())
                self.send(200, json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode())

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                fake.release.wait(10)  # the engine is frozen

            def send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # the prober hangs up on a hung stream: routine

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def backend():
    b = HungVllm()
    yield b
    b.close()


def test_frozen_counter_with_requests_running_is_a_hang(backend):
    p = Prober(backend.url, CFG)
    assert p.run_once() == "timeout"
    progress = p.state.last_progress
    assert progress is not None and progress.hung
    assert progress.tokens == 0 and progress.running == 2 and 0.3 <= progress.window <= 1.5
    assert backend.reads == 2  # at the probe's start and at its timeout


def test_tokens_flowing_is_an_overload_not_a_hang(backend):
    backend.tokens_per_read = 10
    p = Prober(backend.url, CFG)
    assert p.run_once() == "timeout"
    assert p.state.last_progress is not None and not p.state.last_progress.hung
    assert p.state.last_progress.tokens == 10


@pytest.mark.parametrize("answer", [404, 500, "", "<html>not metrics</html>", metrics(100, 2).replace("2", "x")])
def test_missing_or_broken_metrics_is_no_evidence(backend, answer):
    backend.metrics = answer
    p = Prober(backend.url, CFG)
    assert p.run_once() == "timeout"
    assert p.state.last_progress is None


def test_hanging_metrics_is_no_evidence_and_costs_at_most_the_metrics_timeout(backend):
    backend.metrics = "hang"
    p = Prober(backend.url, CFG)
    t0 = time.monotonic()
    assert p.run_once() == "timeout"
    assert p.state.last_progress is None
    assert time.monotonic() - t0 < CFG.deadline + 2 * CFG.metrics_timeout + 1.0


def test_the_agent_answers_at_once_while_a_probe_hangs(backend):
    """The agent reads the prober's last state; it never waits for the probe in flight."""
    slow = ProbeConfig(**{**CFG.__dict__, "deadline": 3.0, "metrics_timeout": 1.0})
    with Exporter(backend.url, port=0, nvml=None, probe=slow, agent=("127.0.0.1", 0)) as exporter:
        assert exporter.prober.wait_for_probes(1, 10)  # the first hung probe has ended: a hang
        got = exporter.prober.state.last_progress
        assert got is not None and (got.tokens, got.running) == (0, 2) and got.hung
        for _ in range(10):  # a second probe is hanging now
            t0 = time.monotonic()
            with socket.create_connection(exporter.agent.address, timeout=5) as s:
                reply = s.recv(256)
            assert time.monotonic() - t0 < 0.5
            assert reply.startswith(b"down #hang: no token in ")
            time.sleep(0.05)
