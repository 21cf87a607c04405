"""Probes and canaries out of the request rate, end to end: simulated vLLM nodes, their exporters probing them,
canaries counted by the controller's metrics, a real Prometheus scraping the three jobs at different moments and
evaluating the rendered rules. An idle node and a drained one (probes and canaries only) read about 0 requests a
second while vLLM counts several; a busy node reads its own requests."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from grayguard.config import parse_config
from grayguard.controller.metrics import ControllerMetrics
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.rules.render import render_all
from grayguard.sim.fleet import FleetThread
from grayguard.sim.node import DEFAULT_MODEL
from tests.support.stack import prometheus_config, require, serve_registry, start_prometheus, static_job, wait_until

pytestmark = pytest.mark.e2e

PROBES = ProbeConfig(interval=0.2, jitter=0.2, slow_threshold=0.5, deadline=3.0, api_key_env=None)
CANARY_S, REAL_S = 0.5, 0.25  # a canary to the drained node every 0.5 s; a real request to the busy one every 0.25 s


def netloc(url: str) -> str:
    return url.split("://", 1)[1]


class Every(threading.Thread):
    """Calls fn every period_s until stopped; notes when each call returned (monotonic)."""

    def __init__(self, period_s: float, fn) -> None:
        super().__init__(daemon=True)
        self.period_s, self.fn, self.stop = period_s, fn, threading.Event()
        self.done: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.fn()
            self.done.append(time.monotonic())

    def rate(self, lo: float, hi: float) -> float:
        """Calls returned in [lo, hi) a second."""
        return sum(1 for t in self.done if lo <= t < hi) / (hi - lo)


def complete(session: requests.Session, url: str, max_tokens: int) -> None:
    session.post(url + "/v1/completions", timeout=10,
                 json={"model": DEFAULT_MODEL, "prompt": "z" * 40, "max_tokens": max_tokens}).raise_for_status()


def test_idle_and_drained_nodes_finish_no_request_of_their_own(tmp_path):
    require("prometheus")
    cfg = parse_config({"pools": [{"name": "chat", "backend": "chat"}],
                        "rules": {"control_window": "10s", "control_interval": "1s"}})
    rules = []
    for name, text in render_all(cfg).items():
        (tmp_path / name).write_text(text)
        rules.append(tmp_path / name)
    m = ControllerMetrics.create()
    with FleetThread(n=3, seed=9) as fleet, serve_registry(m.registry) as ctl, requests.Session() as s:
        s.trust_env = False
        idle, drained, busy = fleet.nodes
        exporters = [Exporter(n.url, port=0, nvml=None, probe=PROBES, agent=None).start() for n in fleet.nodes]
        canaries = Every(CANARY_S, lambda: (complete(s, drained.url, 1),  # the controller's, straight to the node
                                            m.canary_sent("chat", "drained", (netloc(drained.url), "drained:8000"))))
        load = Every(REAL_S, lambda: complete(s, busy.url, 8))
        beside = [{"targets": [netloc(e.url)], "labels": {"pool": "chat", "instance": netloc(n.url)}}
                  for n, e in zip(fleet.nodes, exporters, strict=True)]  # instance: the vLLM beside it
        jobs = [static_job("vllm", [netloc(n.url) for n in fleet.nodes], {"pool": "chat"}),
                {"job_name": "grayguard-exporter", "static_configs": beside},
                static_job("grayguard-controller", [ctl.target])]  # no honor_labels: instance -> exported_instance
        try:
            canaries.start()
            load.start()
            with start_prometheus(prometheus_config(jobs, interval="1s"), rules) as prom:
                def rates() -> dict[str, tuple[float, float]] | None:
                    """instance -> (recorded request rate, vLLM's own rate) once both exist for every node."""
                    rec = {r["metric"]["instance"]: float(r["value"][1])
                           for r in prom.query("instance:vllm_request_rate:rate10s")}
                    raw = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query(
                        "sum by (instance) (rate(vllm:e2e_request_latency_seconds_count[10s]))")}
                    if len(rec) < 3 or len(raw) < 3:
                        return None
                    return {i: (rec[i], raw[i]) for i in rec}

                wait_until(rates, 60, interval_s=0.5, what="every node's request rate")
                time.sleep(12)  # one whole window of probes, canaries and requests
                seen = []
                for _ in range(6):  # several evaluations: the scrapes of the three jobs do not line up
                    t = time.monotonic()
                    got = rates()
                    assert got is not None
                    # the busy node's own requests a second over the window the recorded rate covers (10 s, read up
                    # to a scrape and an evaluation late): one every 0.25 s plus its own time, which a loaded machine
                    # stretches (0.91/s was seen beside the real-vLLM tier), and unevenly: measured over the six
                    # seconds after the window, not in it, 2.29/s once stood against a recorded 1.11/s in CI
                    seen.append((got, load.rate(t - 12.0, t - 2.0)))
                    time.sleep(1.0)
        finally:
            canaries.stop.set()
            load.stop.set()
            for e in exporters:
                e.stop()
    for got, sent in seen:
        (idle_rate, idle_raw), (drained_rate, drained_raw), (busy_rate, busy_raw) = (
            got[netloc(n.url)] for n in (idle, drained, busy))
        # vLLM counts the probes (5/s nominal; fewer when the machine is loaded: 1.75/s was seen beside the real-vLLM
        # tier) and the canaries (2/s)
        assert idle_raw > 1 and drained_raw > 1
        assert idle_rate == 0.0  # the exporter takes its probes out exactly
        assert drained_rate < 0.5, got  # its canaries: one or two of the 20 a window either side of a scrape
        # the probes are gone from the busy node's rate too: about as many as vLLM counted on the idle node
        assert busy_raw - busy_rate > 0.6 * idle_raw, got
        assert 0.5 * sent < busy_rate < 1.2 / REAL_S, (got, sent)  # and its own requests are there
