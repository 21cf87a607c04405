"""HAProxy's own reflexes (grayguard/reflexes.py), for real: the shipped config says them, haproxy obeys them.

Small stdlib HTTP backends on 127.0.0.1 behind a real haproxy built by localstack's haproxy_config(reflexes=...):
retry + redispatch, the retry budget, observe layer7 error-limit, request buffering, server timeouts.
"""

from __future__ import annotations

import http.client
import subprocess
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grayguard.controller.haproxy import RuntimeClient
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import free_port, wait_until
from grayguard.reflexes import CHECK_STATUS_HANA, DEFAULT, Reflexes, backend_lines, global_lines

BE = "vllm_chat"
BEGIN, END = "# BEGIN grayguard reflexes", "# END grayguard reflexes"


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # haproxy closing idle keep-alive connections: no noise
        pass


class Backend:
    """One HTTP server: mode ok (200), 500, hang (headers and a first chunk, then silence) or trickle (a chunk
    every trickle_s, chunks times). /health always answers 200, as vLLM's does with a broken CUDA context."""

    def __init__(self, mode: str = "ok", trickle_s: float = 0.3, chunks: int = 8):
        self.mode, self.hits, self.stop_event = mode, 0, threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args):
                pass

            def do_GET(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/health":
                    return self._send(200, b"ok")
                outer.hits += 1
                if outer.mode in ("hang", "trickle"):
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self._chunk(b"data: first\n\n")
                    if outer.mode == "hang":  # bounded: the test ends it
                        outer.stop_event.wait(30)
                        return
                    for i in range(chunks):
                        time.sleep(trickle_s)
                        self._chunk(f"data: {i}\n\n".encode())
                    self._chunk(b"")
                    return
                self._send(500 if outer.mode == "500" else 200, b"CUDA error" if outer.mode == "500" else b"ok")

            do_POST = do_GET

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway(tmp_path):
    """gateway(modes, reflexes) -> (HaproxyProc, frontend port, [Backend]); all stopped after the test."""
    made: list = []

    def make(modes: list[str], reflexes: Reflexes = DEFAULT, **kw):
        backends = [Backend(m, **kw) for m in modes]
        made.extend(backends)
        port = free_port()
        d = tmp_path / f"hap{len(made)}"
        d.mkdir()
        servers = [(f"node{i}", b.addr, 100) for i, b in enumerate(backends)]
        hap = HaproxyProc(d, haproxy_config(d / "admin.sock", {BE: servers}, frontend_port=port, reflexes=reflexes))
        hap.start()
        made.append(hap)
        return hap, port, backends

    yield make
    for m in made:
        m.stop() if isinstance(m, HaproxyProc) else m.close()


def request(port: int, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def stat(hap: HaproxyProc) -> dict[str, dict[str, str]]:
    """Server name -> `show stat` fields of the backend's servers."""
    text = RuntimeClient(hap.endpoint).execute(["show stat"])[0]
    lines = [ln for ln in text.splitlines() if ln]
    cols = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(cols, ln.split(","), strict=False)) for ln in lines[1:]]
    return {r["svname"]: r for r in rows if r["pxname"] == BE and r["svname"] not in ("BACKEND", "FRONTEND")}


# -- the shipped config ---------------------------------------------------------------------------------------

def _blocks(text: str) -> list[list[str]]:
    out, cur = [], None
    for ln in text.splitlines():
        s = ln.strip()
        if s.startswith(BEGIN):
            cur = []
        elif s == END:
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(s)
    return out


def test_example_config_holds_exactly_the_rendered_reflexes_and_haproxy_accepts_it(tmp_path):
    text = Path("haproxy/haproxy.example.cfg").read_text()
    assert _blocks(text) == [global_lines(DEFAULT), backend_lines(DEFAULT)]
    text = text.replace("/run/haproxy/admin.sock", str(tmp_path / "admin.sock"))
    text = text.replace("/var/lib/haproxy/server-state", str(tmp_path / "state"))
    (tmp_path / "h.cfg").write_text(text)
    p = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_reflex_lines_follow_the_settings():
    r = Reflexes(retries=3, retry_budget=0.2, budget_window_s=30, error_limit=7, timeout_server_s=1.5,
                 bufsize=32768, agent_port=19401, agent_inter_s=0.5)
    lines = backend_lines(r)
    assert "retries 3" in lines and "timeout server 1500ms" in lines
    assert "http-request set-var(txn.gg_budget) sc_http_req_rate(0),mul(200)" in lines
    assert any("http_fail_rate(30s)" in ln for ln in lines)
    assert lines[-1].endswith("observe layer7 error-limit 7 on-error mark-down agent-check agent-port 19401 "
                              "agent-inter 500ms")
    assert "tune.bufsize 32768" in global_lines(r)


def test_bare_haproxy_config_is_unchanged_without_reflexes(tmp_path):
    text = haproxy_config(tmp_path / "s", {BE: [("node0", "127.0.0.1:1", 100)]})
    assert "retry-on" not in text and "check" not in text and "tune.bufsize" not in text


# -- behaviour ------------------------------------------------------------------------------------------------

def test_a_500_is_retried_on_another_server(gateway):
    hap, port, (bad, *good) = gateway(["500", "ok", "ok"])
    codes = [request(port)[0] for _ in range(30)]
    assert codes == [200] * 30
    assert bad.hits >= DEFAULT.error_limit  # it was tried, and its 500 never reached a client
    row = stat(hap)["node0"]
    assert int(row["wredis"]) >= bad.hits
    # a retried 500 is invisible to observe layer7 (and to http_fail_rate): no mark-down, however many
    assert row["status"] == "UP" and int(row["hanafail"]) == 0 and int(row["hrsp_5xx"]) == 0


def test_a_refused_connection_is_retried_elsewhere(gateway):
    # checked UP at start (the first server is checked first), then it stops listening: no check sees it before
    # the requests do (inter 60s)
    hap, port, (gone, _ok) = gateway(["ok", "ok"], replace(DEFAULT, check_inter_s=60.0))
    wait_until(lambda: stat(hap)["node0"]["check_status"] == "L7OK", 10, what="node0's first check")
    gone.close()
    codes = [request(port)[0] for _ in range(10)]
    assert codes == [200] * 10
    row = stat(hap)["node0"]
    assert int(row["wretr"]) + int(row["wredis"]) > 0, row  # node0 was tried, refused, and the request moved on


def test_error_limit_consecutive_errors_mark_servers_down(gateway):
    # every server fails: the budget stops retrying, errors reach clients, observe layer7 counts them
    hap, port, _ = gateway(["500", "500", "500"])
    for _ in range(3 * DEFAULT.error_limit + 5):
        request(port)
    rows = stat(hap)
    for name, row in rows.items():
        assert row["status"].startswith("DOWN"), (name, row["status"])
        assert row["check_status"] == "HANA"
        assert int(row["hanafail"]) >= 1
        assert f"Detected {DEFAULT.error_limit} consecutive errors" in row["last_chk"]
    states = RuntimeClient(hap.endpoint).show_servers_state(BE)
    assert all(s.marked_down_for_errors and s.check_status == CHECK_STATUS_HANA for s in states)


@pytest.mark.parametrize("budget, bounded", [(DEFAULT.retry_budget, True), (1.0, False)])
def test_a_pool_wide_failure_is_not_multiplied(gateway, budget, bounded):
    # error_limit out of reach: what limits the load here is the budget alone (share 1.0: no budget, the control)
    r = replace(DEFAULT, retry_budget=budget, error_limit=1000)
    _hap, port, backends = gateway(["500", "500", "500"], r)
    n = 60
    assert all(request(port)[0] == 500 for _ in range(n))
    arrivals = sum(b.hits for b in backends)
    if bounded:
        assert arrivals <= 1.1 * n + 3, arrivals
    else:
        assert arrivals == n * (1 + r.retries)


def test_a_prompt_larger_than_the_buffer_is_not_retried(gateway):
    r = replace(DEFAULT, bufsize=16384)
    hap, port, (bad, _good) = gateway(["500", "ok"], r)
    small = [request(port, b"x" * 4096)[0] for _ in range(6)]
    assert small == [200] * 6 and bad.hits > 0  # small prompts reached the failing node and were retried
    before = bad.hits
    large = [request(port, b"x" * 32768)[0] for _ in range(6)]
    assert 500 in large and bad.hits > before  # a large one that reached it came back as its 500


def test_a_hung_stream_is_ended_and_a_slow_progressing_one_is_not(gateway):
    r = replace(DEFAULT, timeout_server_s=1.0)
    _hap, port, _ = gateway(["hang"], r)
    with pytest.raises(http.client.IncompleteRead):  # cut by haproxy (the client's own timeout is 10 s)
        request(port)
    _hap2, port2, _ = gateway(["trickle"], r, trickle_s=0.4, chunks=6)  # 2.4 s in all, never 1 s silent
    code, body = request(port2)
    assert code == 200 and body.count(b"data:") == 7
