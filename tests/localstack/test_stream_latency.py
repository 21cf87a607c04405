"""The gateway does not hold a streamed first token: through a real HAProxy, as the project renders its config, the
first SSE chunk of a streamed completion from the simulated fleet's node comes as soon as it does directly.

Without `option http-no-delay` (grayguard/reflexes.py, stream_lines) HAProxy sent an unfinished response with
MSG_MORE and the kernel held each small chunk up to 200 ms: every streamed first token came ~200 ms late (vLLM:
183-422 ms against 4-24 ms direct). The control case renders the reflexes without it and must see that hold, so
the test still tells the two apart.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import replace

import pytest

from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import free_port
from grayguard.reflexes import DEFAULT
from grayguard.sim.fleet import FleetThread

BE = "vllm_chat"
REQUESTS = 7  # per path, interleaved: one median each, robust to a few requests delayed on a loaded machine
WITHIN_S = 0.05  # the unheld gateway's median first chunk may trail the node's by this much
HELD_S = 0.1  # the held one trailed by ~0.2 s: the control must trail by more than this


@pytest.fixture(scope="module")
def node():
    with FleetThread(n=1, seed=3) as ft:
        yield ft.nodes[0]


def first_chunk_s(port: int) -> float:
    """Seconds from sending a streamed completion to the arrival of its first SSE chunk (`data: `) on the socket."""
    body = json.dumps({"prompt": "hello world " * 20, "max_tokens": 16, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(head + body)
        got = b""
        while b"data: " not in got:
            data = s.recv(65536)
            if not data:
                raise AssertionError(f"the stream on :{port} ended without an SSE chunk: {got[:200]!r}")
            got += data
        return time.monotonic() - t0


@pytest.mark.parametrize("reflexes, held", [
    (DEFAULT, False),  # the shipped reflexes: haproxy/haproxy.example.cfg, the local stack, the gateway tier
    (None, False),  # the bare local config (no checks, no retries) streams unheld too
    (replace(DEFAULT, no_delay=False), True),  # the control: the reflexes without option http-no-delay
], ids=["shipped", "bare", "control-without-no-delay"])
def test_a_streamed_first_token_through_haproxy_is_not_held(node, tmp_path, reflexes, held):
    port = free_port()
    hap = HaproxyProc(tmp_path, haproxy_config(tmp_path / "admin.sock", {BE: [("node0", node.address, 100)]},
                                               frontend_port=port, reflexes=reflexes))
    hap.start()
    try:
        first_chunk_s(node.port), first_chunk_s(port)  # warm-up: the first request of each path is not measured
        direct, gateway = [], []
        for _ in range(REQUESTS):  # interleaved, so both paths see the same load
            direct.append(first_chunk_s(node.port))
            gateway.append(first_chunk_s(port))
    finally:
        hap.stop()
    lag = statistics.median(gateway) - statistics.median(direct)
    ms = f"direct {[round(t * 1000) for t in direct]} ms, through haproxy {[round(t * 1000) for t in gateway]} ms"
    if held:
        assert lag > HELD_S, f"the control saw no hold ({lag * 1000:.0f} ms): the test cannot see the bug; {ms}"
    else:
        assert lag < WITHIN_S, f"haproxy held the first chunk {lag * 1000:.0f} ms; {ms}"
