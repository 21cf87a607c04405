"""The exporter's /healthz and /readyz (exporters/liveness.py): the loops' stall limits and verdicts, a probe loop
wedged in-process with the clock injected, real `grayguard exporter` processes, and the sidecar's Kubernetes probes."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from grayguard.exporters import liveness
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.registration import RegistrationConfig
from grayguard.exporters.server import Exporter
from grayguard.health import Beat, Verdict
from grayguard.localstack.procs import free_port, start_process, wait_until
from grayguard.sim.fleet import FleetThread

REPO = Path(__file__).resolve().parents[2]
SIDECAR = REPO / "deploy" / "kubernetes" / "components" / "exporter-sidecar" / "exporter.yaml"


def get(url: str) -> tuple[int, str]:
    with requests.Session() as s:
        s.trust_env = False  # the local exporter, never through a proxy
        r = s.get(url, timeout=5)
        return r.status_code, r.text


@pytest.fixture(scope="module")
def sim():
    with FleetThread(n=1, seed=7) as ft:
        yield ft


# ---- the pure decisions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,limit", [
    (ProbeConfig(), 12.0),  # the defaults: 10 intervals of 1.2 s, and 2 x (2 x 2 s + 2 x 1 s)
    (ProbeConfig(interval=0.1, jitter=0.0, deadline=0.5, metrics_timeout=0.5), 10.0),  # never under 10 s
    (ProbeConfig(interval=5.0, jitter=0.2), 60.0),  # 10 intervals
    (ProbeConfig(deadline=10.0), 44.0),  # twice a round that waits out its deadlines: 2 x (20 + 2)
])
def test_the_probe_loops_stall_limit(cfg, limit):
    assert liveness.probe_stall_limit_s(cfg) == pytest.approx(limit)
    assert liveness.probe_stall_limit_s(cfg) >= 2 * liveness.probe_round_budget_s(cfg)  # a slow round is no stall


def test_the_registry_loops_stall_limit():
    cfg = RegistrationConfig(url="http://127.0.0.1:2379", pool="chat", node="n1", advertise="10.0.0.1:8000")
    assert liveness.registry_stall_limit_s(cfg) == 32.0  # 2 x 8 calls of the 2 s --registry.timeout
    assert liveness.registry_stall_limit_s(dataclasses.replace(cfg, heartbeat=5.0)) == 50.0  # 10 heartbeats


def loops(t: list[float]) -> tuple[Beat, Beat, Beat, list[liveness.Loop]]:
    rounds, reads, registry = (Beat(clock=lambda: t[0]) for _ in range(3))
    return rounds, reads, registry, [liveness.Loop(liveness.PROBE_ROUND, rounds, 12.0),
                                     liveness.Loop(liveness.FAST_READ, reads, 12.0),
                                     liveness.Loop(liveness.REGISTRY_ROUND, registry, 32.0, gates_readiness=False)]


def test_ready_once_the_first_probe_round_and_fast_path_read_completed_whatever_the_registry_did():
    t = [100.0]
    rounds, reads, _registry, watched = loops(t)
    assert liveness.ready(watched) == Verdict(False, "not ready: the first probe round has not completed yet; "
                                                     "not ready: the first fast-path read has not completed yet")
    reads.done()
    assert liveness.ready(watched) == Verdict(False, "not ready: the first probe round has not completed yet")
    rounds.done()
    assert liveness.ready(watched) == Verdict(True, "ready: 1 probe round(s) completed; ready: 1 fast-path read(s) "
                                                    "completed")  # the registry round: not one yet, not asked
    assert liveness.ready([]) == Verdict(True, "ready: probing is off, nothing to wait for")


def test_one_stalled_loop_fails_health_and_is_named_alone():
    t = [100.0]
    rounds, reads, registry, watched = loops(t)
    assert liveness.health(watched).ok  # starting: within every limit
    t[0] = 105.0
    for b in (rounds, reads, registry):
        b.done()
    t[0] = 115.0
    rounds.done()
    registry.done()  # the probe rounds go on while the fast path's reads stopped 10 s ago (a read that raises)
    assert liveness.health(watched).ok
    t[0] = 117.5
    assert liveness.health(watched) == Verdict(False, "stalled: the last fast-path read completed 12s ago (stall limit "
                                                      "12s)")
    t[0] = 160.0
    assert liveness.health(watched).reason.split("; ") == [
        "stalled: the last probe round completed 45s ago (stall limit 12s)",
        "stalled: the last fast-path read completed 55s ago (stall limit 12s)",
        "stalled: the last registry round completed 45s ago (stall limit 32s)"]
    assert liveness.health([]) == Verdict(True, "ok: no loop to watch (probing and registration are off)")


def test_the_exporter_watches_its_probe_loop_and_registry_loop_and_only_the_probe_gates_readiness():
    t = [0.0]
    reg = RegistrationConfig(url="http://127.0.0.1:9", pool="chat", node="n1", advertise="127.0.0.1:8000")
    ex = Exporter(port=0, nvml=None, probe=ProbeConfig(), registration=reg, clock=lambda: t[0])  # not started
    assert [(lp.what, lp.limit_s, lp.gates_readiness) for lp in ex.loops()] == [
        ("probe round", 12.0, True), ("fast-path read", 12.0, True), ("registry round", 32.0, False)]
    ex.prober.rounds.done()
    ex.prober.reads.done()
    assert ex.ready().ok
    t[0] = 20.0
    assert ex.health() == Verdict(False, "stalled: the last probe round completed 20s ago (stall limit 12s); "
                                         "stalled: the last fast-path read completed 20s ago (stall limit 12s)")
    t[0] = 33.0
    assert "stalled: no registry round has completed in the 33s since the loop started (stall limit 32s)" in \
        ex.health().reason
    assert [lp.what for lp in Exporter(port=0, nvml=None, probe=None).loops()] == []  # NVML has no loop of its own


# ---- a probe loop wedged in-process, the clock injected -----------------------------------------------------------
def _writer(path: Path) -> int | None:
    """A write end of the FIFO at path once a reader holds it open (the probe loop, blocked in its read)."""
    return os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open: "not yet"


def test_a_wedged_probe_loop_fails_healthz_naming_the_loop_and_recovers_when_it_moves(tmp_path, sim):
    """The probe loop blocks in a synchronous read (its API key file turned into a FIFO nobody writes: a secret on a
    hung mount): no round and no fast-path read completes, and past the stall limit /healthz is 503 with the reason,
    while /readyz stays 200 (a stall is liveness' business). The read returning makes /healthz 200 again."""
    key = tmp_path / "api-key"
    key.write_text("k\n")
    cfg = ProbeConfig(interval=0.05, jitter=0.0, api_key_env=None, api_key_file=str(key))
    limit = liveness.probe_stall_limit_s(cfg)
    assert limit == 12.0
    t = [1000.0]
    with Exporter(sim.nodes[0].url, port=0, nvml=FakeNvml([healthy_h100(0)]), xid_events=False, probe=cfg,
                  clock=lambda: t[0]) as ex:
        assert get(ex.url + "/readyz")[0] in (200, 503)  # served from the start
        wait_until(lambda: get(ex.url + "/readyz")[0] == 200, 20, what="/readyz 200 after the first round and read")
        assert get(ex.url + "/healthz") == (200, "ok: the last probe round completed 0.0s ago (stall limit 12s); "
                                                 "ok: the last fast-path read completed 0.0s ago (stall limit 12s)\n")
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, key)  # the next round opens it and blocks
        fd = wait_until(lambda: _writer(key), 10, 0.01, what="the probe loop blocked reading the key file")
        try:
            t[0] += limit - 1  # wedged, within the limit
            assert get(ex.url + "/healthz")[0] == 200
            t[0] += 2
            assert get(ex.url + "/healthz") == (503, "stalled: the last probe round completed 13s ago (stall limit "
                                                     "12s); stalled: the last fast-path read completed 13s ago "
                                                     "(stall limit 12s)\n")
            assert get(ex.url + "/readyz")[0] == 200
            plain = tmp_path / "plain"
            plain.write_text("k\n")
            os.replace(plain, key)  # the rounds after the blocked one read a plain file again
        finally:
            os.write(fd, b"k\n")
            os.close(fd)  # the blocked read returns
        wait_until(lambda: get(ex.url + "/healthz")[0] == 200, 10, what="/healthz 200 once a round completes")


# ---- real `grayguard exporter` processes ----------------------------------------------------------------------
def exporter(tmp_path: Path, vllm_url: str, *flags: str):
    port = free_port()
    argv = [sys.executable, "-m", "grayguard.cli", "exporter", "--vllm.url", vllm_url,
            "--web.listen-address", f"127.0.0.1:{port}", "--agent.listen-address", f"127.0.0.1:{free_port()}",
            "--no-collector.nvml", *flags]  # no GPU here: NVML has no loop of its own to watch anyway
    proc = start_process(argv, tmp_path / "exporter.log", ready_url=f"http://127.0.0.1:{port}/metrics", timeout_s=30,
                         cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def test_an_exporter_beside_a_serving_vllm_is_ready_and_healthy(tmp_path, sim):
    proc, url = exporter(tmp_path, sim.nodes[0].url)
    try:
        wait_until(lambda: get(url + "/readyz")[0] == 200, 30, what="/readyz 200")
        status, text = get(url + "/healthz")
        assert status == 200 and text.startswith("ok: the last probe round completed"), text
        assert "ok: the last fast-path read completed" in text and text.count("(stall limit 12s)") == 2, text
        assert text.count("\n") == 1  # one line
        assert get(url + "/metrics")[0] == 200  # beside what was served before
    finally:
        proc.stop()


class _HeldVllm(BaseHTTPRequestHandler):
    """A vLLM stand-in whose /health answers only once the test releases it, and then 503 (still loading)."""

    asked: threading.Event
    release: threading.Event

    def do_GET(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        if self.path == "/health":
            self.asked.set()
            self.release.wait(60)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def held_vllm():
    handler = type("Held", (_HeldVllm,), {"asked": threading.Event(), "release": threading.Event()})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{srv.server_address[1]}"
    handler.release.set()
    srv.shutdown()
    srv.server_close()


def test_an_exporter_is_not_ready_until_it_has_looked_at_its_vllm_then_ready_whatever_it_saw(tmp_path, held_vllm):
    """The first round waits on vLLM's /health (within --probe.deadline): until it completes, /readyz is 503 and
    /healthz 200 (starting); a vLLM still loading (503) is the probe's finding, and the exporter is ready."""
    held, vllm_url = held_vllm
    proc, url = exporter(tmp_path, vllm_url, "--probe.deadline", "30s")
    try:
        assert held.asked.wait(20), "the exporter never asked vLLM's /health"
        assert get(url + "/readyz") == (503, "not ready: the first probe round has not completed yet; not ready: the "
                                             "first fast-path read has not completed yet\n")
        status, text = get(url + "/healthz")
        limit = liveness.probe_stall_limit_s(ProbeConfig(deadline=30.0))
        assert status == 200 and text.startswith("ok: starting, the first probe round has not completed yet"), text
        held.release.set()
        wait_until(lambda: get(url + "/readyz")[0] == 200, 20, what="/readyz 200 after the first round")
        status, text = get(url + "/healthz")
        assert status == 200 and f"(stall limit {limit:g}s)" in text, text  # 124 s: 2 x (2 x 30 s + 2 x 1 s)
        assert "grayguard_probe_last_result{result=\"starting\"} 1.0" in get(url + "/metrics")[1]
    finally:
        proc.stop()


# ---- the Kubernetes sidecar ------------------------------------------------------------------------------------
def test_the_sidecars_probes_ask_the_loops_not_the_metrics_page():
    """Liveness restarts an exporter whose loops stalled; readiness waits for its first look at vLLM. /metrics would
    answer from the HTTP server's own thread while the probe loop is dead."""
    doc = yaml.safe_load(SIDECAR.read_text())
    c = next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "grayguard-exporter")
    port = next(p for p in c["ports"] if p["name"] == "exporter")
    assert f"--web.listen-address=:{port['containerPort']}" in c["args"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "exporter"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "exporter"}
    # a restart only after the loops have been stalled past their limit and 3 failed probes more
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 30
