"""The node's own traffic end to end: a simulated vLLM node, its exporter probing it, real requests beside.

vLLM (and the simulator, its look-alike) counts every answered probe as a finished request; the exporter's
grayguard_traffic_* counters are vLLM's per-request histograms without them, so an idle node reads 0 and a node
with real requests reads exactly those, and its live TTFT leaves the probes out.
"""

from __future__ import annotations

import time

import pytest
import requests

from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.localstack.procs import wait_until
from grayguard.sim.fleet import FleetThread
from grayguard.sim.node import DEFAULT_MODEL
from tests.support.scrape import samples

CFG = ProbeConfig(interval=0.1, jitter=0.1, slow_threshold=0.5, deadline=3.0, api_key_env=None, live_window=1.0)
TRAFFIC = ("grayguard_traffic_requests_total", "grayguard_traffic_request_seconds_total",
           "grayguard_traffic_prompt_tokens_total", "grayguard_traffic_generation_tokens_total")


@pytest.fixture(scope="module")
def node():
    with FleetThread(n=1, seed=5) as ft:
        yield ft.nodes[0]


def vllm_count(node_url: str) -> float:
    page = samples(node_url + "/metrics")
    return sum(v for k, v in page.items() if k.startswith("vllm:e2e_request_latency_seconds_count"))


def test_probes_stay_out_of_the_nodes_traffic_and_real_requests_are_all_in(node):
    with Exporter(node.url, port=0, nvml=None, probe=CFG, agent=None) as exp:
        # an idle node: vLLM counts the probes as finished requests, the traffic counters do not
        start = vllm_count(node.url)
        wait_until(lambda: vllm_count(node.url) >= start + 15, 20, interval_s=0.1, what="15 probes counted by vLLM")
        page = samples(exp.url + "/metrics")
        assert [page[n] for n in TRAFFIC] == [0.0, 0.0, 0.0, 0.0], page
        assert "grayguard_live_ttft_seconds" not in samples(exp.url + "/metrics/fast")  # only probes got one
        assert "grayguard_traffic_requests_total" not in samples(exp.url + "/metrics/fast")

        # five real requests of 40 prompt tokens (10 in the simulator's count) and 20 generated tokens each
        took = 0.0
        with requests.Session() as s:
            s.trust_env = False
            for _ in range(5):
                t0 = time.monotonic()
                r = s.post(node.url + "/v1/completions", timeout=30,
                           json={"model": DEFAULT_MODEL, "prompt": "y" * 40, "max_tokens": 20})
                took += time.monotonic() - t0
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
        wait_until(lambda: samples(exp.url + "/metrics")["grayguard_traffic_requests_total"] >= 5, 10,
                   interval_s=0.1, what="the five requests in the traffic")
        time.sleep(1.0)  # more probes: they must add nothing
        page = samples(exp.url + "/metrics")
        assert page["grayguard_traffic_requests_total"] == 5.0
        assert page["grayguard_traffic_prompt_tokens_total"] == 50.0
        assert page["grayguard_traffic_generation_tokens_total"] == 100.0
        # vLLM's e2e of the five, under what the client waited (by the client's own HTTP time, which a loaded machine
        # stretches: 0.77 of it in one fresh-clone run): the probes' overhead, which the exporter learned while the
        # node was idle, is not taken from them
        assert 0.5 * took < page["grayguard_traffic_request_seconds_total"] <= took, (page, took)
