"""The agent check end to end: a simulated vLLM, its exporter and a real HAProxy asking the exporter's agent.

Garbage text (HTTP 200: invisible to HAProxy's own checks) or a hang under load -> the probe sees it -> the agent
answers "down #why" -> `show stat` says "DOWN (agent)"; the fault cleared -> "up" -> UP again.
"""

from __future__ import annotations

import csv
import io
import json
import socket
import threading
import time
from collections.abc import Callable

import pytest
import requests

from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.localstack.haproxy import HaproxyProc
from grayguard.localstack.procs import wait_until
from grayguard.sim.fleet import FleetThread
from grayguard.sim.node import DEFAULT_MODEL

# fast probes; the deadline stays well above the simulator's healthy TTFT (tens of ms) on a loaded CI machine
CFG = ProbeConfig(interval=0.2, jitter=0.1, slow_threshold=0.3, deadline=0.6, api_key_env=None)
WAIT_S = 20.0  # generous: every wait polls and returns as soon as the condition holds


@pytest.fixture(scope="module")
def sim():
    with FleetThread(n=1, seed=5) as ft:
        yield ft


@pytest.fixture
def stack(sim, tmp_path):
    """(node, exporter, haproxy): the node's exporter answers the agent check of the one server of `pool`."""
    node = sim.nodes[0]
    with Exporter(node.url, port=0, nvml=None, probe=CFG, agent=("127.0.0.1", 0)) as exporter:
        agent_port = exporter.agent.address[1]
        hap = HaproxyProc(tmp_path, config(tmp_path / "admin.sock", node.port, agent_port))
        hap.start()
        try:
            yield node, exporter, hap
        finally:
            hap.stop()
            sim.clear_fault(node.name)


def config(sock, node_port: int, agent_port: int) -> str:
    return "\n".join([
        "global", f"  stats socket {sock} level admin",
        "defaults", "  mode http", "  timeout connect 2s", "  timeout client 30s", "  timeout server 30s",
        "backend pool", "  option httpchk GET /health",
        f"  server node1 127.0.0.1:{node_port} check inter 200ms agent-check agent-port {agent_port} agent-inter 200ms",
    ]) + "\n"


def show_stat(hap: HaproxyProc) -> dict[str, str]:
    """The `show stat` row of pool/node1."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(hap.sock))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    return next(r for r in rows if r["pxname"] == "pool" and r["svname"] == "node1")


def wait_for(what: str, cond: Callable[[], object], timeout: float = WAIT_S) -> object:
    return wait_until(cond, timeout, interval_s=0.05, what=what)


def status_is(hap: HaproxyProc, status: str) -> Callable[[], dict[str, str] | None]:
    def check():
        row = show_stat(hap)
        return row if row["status"] == status else None
    return check


def test_garbage_text_takes_the_server_down_through_the_agent_and_back(sim, stack):
    node, exporter, hap = stack
    wait_for("UP with the agent answering up", status_is(hap, "UP"))
    assert exporter.agent.current().text == "up"

    sim.set_fault(node.name, "garbage", style="nan")
    t0 = time.monotonic()
    row = wait_for("DOWN (agent)", status_is(hap, "DOWN (agent)"))
    took = time.monotonic() - t0
    # HAProxy shows the reason after '#' as the agent's last answer
    assert "down (probe bad_response: garbage text ' NaN')" in row["last_agt"], row["last_agt"]
    assert took < 5.0, f"{took:.1f}s from the fault to DOWN (agent)"  # ~ interval + agent-inter, with slack
    v = exporter.agent.current()
    assert v.down and v.cause == "bad_response"
    assert sample(exporter, "grayguard_agent_down") == 1
    assert sample(exporter, 'grayguard_agent_answers_total{verdict="down"}') >= 1

    sim.clear_fault(node.name)
    wait_for("UP again", status_is(hap, "UP"))
    assert sample(exporter, "grayguard_agent_down") == 0


def test_hang_under_load_takes_the_server_down_through_the_agent_and_back(sim, stack):
    node, exporter, hap = stack
    wait_for("UP", status_is(hap, "UP"))
    with LongStream(node.url) as stream:  # requests running when the engine freezes: a hang, not an idle node
        wait_for("the long request to stream", stream.started.is_set)
        sim.set_fault(node.name, "hang")
        row = wait_for("DOWN (agent)", status_is(hap, "DOWN (agent)"))
        assert "hang: no token in" in row["last_agt"] and "in the engine" in row["last_agt"], row["last_agt"]
        state = exporter.prober.state
        assert state.last_result == "timeout" and state.last_progress is not None and state.last_progress.hung
        sim.clear_fault(node.name)
        wait_for("UP again", status_is(hap, "UP"))
        assert exporter.agent.current().text == "up"


def test_hang_of_an_idle_node_is_caught_too(sim, stack):
    """Nothing running when the engine froze: the probe itself waits, and an idle engine that steps would have
    prefilled it. Not one token in the deadline is a hang."""
    node, exporter, hap = stack
    wait_for("UP", status_is(hap, "UP"))
    sim.set_fault(node.name, "hang")
    row = wait_for("DOWN (agent)", status_is(hap, "DOWN (agent)"))
    progress = exporter.prober.state.last_progress
    assert progress is not None and progress.tokens == 0 and progress.hung, progress
    assert "hang: no token in" in row["last_agt"], row["last_agt"]
    sim.clear_fault(node.name)
    wait_for("UP again", status_is(hap, "UP"))


def test_disable_agent_on_the_runtime_api_leaves_the_health_check_alone(sim, stack):
    """What the controller does when agents took out more than its cap: `disable agent` puts the server UP."""
    node, exporter, hap = stack
    sim.set_fault(node.name, "garbage", style="nan")
    wait_for("DOWN (agent)", status_is(hap, "DOWN (agent)"))
    runtime(hap, "disable agent pool/node1")
    wait_for("UP on its health check alone", status_is(hap, "UP"))
    runtime(hap, "enable agent pool/node1")
    wait_for("DOWN (agent) again", status_is(hap, "DOWN (agent)"))


def test_exporter_gone_leaves_the_server_as_it_was_until_the_controller_disables_the_agent(sim, stack):
    """An agent HAProxy cannot reach is no news: DOWN (agent) stays, even once the node heals."""
    node, exporter, hap = stack
    sim.set_fault(node.name, "garbage", style="nan")
    wait_for("DOWN (agent)", status_is(hap, "DOWN (agent)"))
    exporter.stop()
    sim.clear_fault(node.name)
    deadline = time.monotonic() + 2.0  # ten agent-inters and health checks: the node is healthy, nobody says up
    while time.monotonic() < deadline:
        assert show_stat(hap)["status"] == "DOWN (agent)"
        time.sleep(0.1)
    runtime(hap, "disable agent pool/node1")
    wait_for("UP on its health check alone", status_is(hap, "UP"))


def runtime(hap: HaproxyProc, cmd: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(hap.sock))
        s.sendall(cmd.encode() + b"\n")
        return s.recv(65536).decode()


def sample(exporter: Exporter, series: str) -> float | None:
    with requests.Session() as s:
        s.trust_env = False
        text = s.get(exporter.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


class LongStream:
    """One long streamed completion sent straight to the node in a thread, closed on exit."""

    def __init__(self, url: str):
        self.url, self.started = url, threading.Event()
        self._resp: requests.Response | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": DEFAULT_MODEL, "prompt": "Tell a long story", "max_tokens": 4000, "stream": True}
        with requests.Session() as s:
            s.trust_env = False
            try:
                self._resp = s.post(self.url + "/v1/completions", json=body, stream=True, timeout=60)
                for line in self._resp.iter_lines():
                    if line.startswith(b"data: {"):
                        json.loads(line[6:])
                        self.started.set()
            except (requests.RequestException, AttributeError, ValueError):
                pass  # closed by __exit__

    def __enter__(self) -> LongStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._resp is not None:
            self._resp.close()
        self._thread.join(5)
