"""The controller in the loop on a non-vLLM engine: four stand-ins of Text Generation Inference
(tests/support/engine_standin.py), one 4x slower in every latency it reports and every answer it gives; the real
exporter with --engine tgi beside each; a real Prometheus with the rules rendered for a TGI pool; a real HAProxy with
the four as servers of one backend; the real controller with the shipped thresholds, ticking once a second.

TGI rather than SGLang: it is the engine that still gives a latency while lacking the most signals (no KV usage, no
live TTFT, an inter-token latency per engine step and so no decode batch, no usage report in the probe), so this runs
the controller on the reduced signal set docs/engines.md promises it handles; SGLang's signals are vLLM's own.

With the shipped defaults a 4x node is cut within a few ticks (its 30 s window's score rises past the 2 noise widths
at which a cut starts) and drained: its score passes quarantine_score (3.5; 5.9 when it was drained in a run here)
and its probes' TTFT median is 4x its peers', above live_probe_confirm (1.2); max_ejected_fraction 0.3 lets one node
of four go.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from grayguard.config import parse_config
from grayguard.controller.haproxy import DRAIN_MASK, RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.promclient import PrometheusClient
from grayguard.rules.render import render_recording
from tests.support.engine_standin import StandIn
from tests.support.stack import prometheus_config, require, start_prometheus, static_job

pytestmark = pytest.mark.e2e

ENGINE, SLOW, N = "tgi", 4.0, 4
BACKEND = "tgi_chat"


def job(name: str, targets: list[tuple[str, str]], path: str = "/metrics") -> dict:
    """One scrape job, a static config per node: each target's instance is its engine's address (HAProxy's)."""
    sc = static_job(name, [])
    sc["static_configs"] = [{"targets": [t], "labels": {"pool": "chat", "instance": inst}} for t, inst in targets]
    sc["metrics_path"] = path
    return sc


def servers(hap) -> dict:
    return {s.name: s for s in RuntimeClient(hap.endpoint).show_servers_state(BACKEND)}


def test_a_slow_tgi_node_is_cut_then_drained_through_haproxy_by_the_controller(tmp_path, haproxy_factory):
    require("prometheus", "haproxy")
    doc = {"pools": [{"name": "chat", "backend": BACKEND, "engine": ENGINE}],
           # the rules evaluated every second (the shipped windows: 30 s control, 5 m human); thresholds as shipped
           "rules": {"control_interval": "1s", "human_interval": "1s"}}
    rules = tmp_path / "recording.rules.yml"
    rules.write_text(render_recording(parse_config(doc)))
    probe = ProbeConfig(interval=0.25, jitter=0.1, slow_threshold=0.5, deadline=3.0, api_key_env=None,
                        live_window=2.0, engine=ENGINE)
    with ExitStack() as stack:
        nodes = [stack.enter_context(StandIn(ENGINE, slow=SLOW if i == 0 else 1.0)) for i in range(N)]
        exps = [stack.enter_context(Exporter(n.url, port=0, nvml=None, probe=probe, agent=None)) for n in nodes]
        names = {n.netloc: f"node{i}" for i, n in enumerate(nodes)}
        hap = haproxy_factory({BACKEND: [(names[n.netloc], n.netloc, 100) for n in nodes]})
        exp_targets = [(e.url.removeprefix("http://"), n.netloc) for e, n in zip(exps, nodes, strict=True)]
        scrape = [job("tgi", [(n.netloc, n.netloc) for n in nodes]), job("grayguard-exporter", exp_targets),
                  job("grayguard-exporter-fast", exp_targets, "/metrics/fast")]
        prom = stack.enter_context(start_prometheus(prometheus_config(scrape, interval="1s"), [rules],
                                                    workdir=tmp_path / "prom"))
        cfg = parse_config({**doc, "prometheus": {"url": prom.url, "timeout_s": 5},
                            "haproxy": {"endpoints": [hap.endpoint]}})
        ctl = Controller(cfg, PrometheusClient(cfg.prometheus),
                         [RuntimeClient(e, 1.0) for e in cfg.haproxy.endpoints], metrics=ControllerMetrics.create())

        def tick_until(done, timeout_s: float, what: str):
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                started = time.monotonic()
                ctl.tick()
                state = servers(hap)
                if done(state):
                    return state
                time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
            raise AssertionError(f"{what} within {timeout_s}s: HAProxy has "
                                 f"{ {k: (s.weight, s.admin_state) for k, s in servers(hap).items()} }, the "
                                 f"controller {ctl.states.get('chat')}")

        healthy = [f"node{i}" for i in range(1, N)]

        def cut(state) -> bool:
            return state["node0"].weight < min(state[n].weight for n in healthy)

        state = tick_until(cut, 30, "node0 cut below its peers")
        assert all(state[n].weight == 100 and not state[n].admin_state & DRAIN_MASK for n in healthy)
        # the latency it was cut on: TGI's request duration over its tokens, 4x its peers' (the recorded series)
        q = 'instance:vllm_normalized_latency_seconds_per_token:rate30s{pool="chat"}'
        rows = prom.wait_for(q, lambda r: r and len(r) == N, timeout_s=20)
        lat = {r["metric"]["instance"]: float(r["value"][1]) for r in rows}
        slow_lat, peer_lat = lat[nodes[0].netloc], [lat[n.netloc] for n in nodes[1:]]
        assert slow_lat > 3 * max(peer_lat), lat

        state = tick_until(lambda s: s["node0"].admin_state & DRAIN_MASK, 30, "node0 drained")
        assert all(state[n].weight == 100 and not state[n].admin_state & DRAIN_MASK for n in healthy)
        assert ctl.states["chat"]["node0"].state == "quarantined"
