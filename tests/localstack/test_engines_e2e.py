"""Each engine profile end to end: a stand-in speaking the engine's API and /metrics names (as on its fixture page,
tests/fixtures/engines/), the real exporter with --engine probing it, and a real Prometheus scraping both with the
recording rules rendered for a pool of that engine. What the engine gives reaches grayguard's per-node series; what it
cannot give stays absent (docs/engines.md).

The stand-in (tests/support/engine_standin.py) is no model: a ticker moves its counters as an engine serving two
requests would (a token every 20 ms each, a request finished every 0.1 s), and it answers the probe after 10 ms,
counting it as a finished 1-token request.
"""

from __future__ import annotations

import time

import pytest
import requests

from grayguard.config import parse_config
from grayguard.engines import profile
from grayguard.exporters.precheck import run_prechecks, vllm_version
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.rules.render import EngineSeries, render_recording
from tests.support.engine_standin import ITL, TTFT, VERSIONS, StandIn
from tests.support.scrape import samples
from tests.support.stack import prometheus_config, require, start_prometheus, static_job, wait_until

pytestmark = pytest.mark.e2e

def recorded(prom, name: str) -> float | None:
    res = prom.query(f'{name}{{pool="p"}}')
    return float(res[0]["value"][1]) if res else None


# What each engine gives on grayguard's per-node recorded series and the exporter's live path (None: absent).
GIVES = {
    "sglang": {"traffic": True, "latency": True, "rate": True, "kv": 0.25, "live_itl": True, "live_ttft": True},
    "tgi": {"traffic": True, "latency": True, "rate": True, "kv": None, "live_itl": True, "live_ttft": False},
    # the slots' busy seconds over their tokens, probes in (no request count: no traffic counters, no request rate)
    "llamacpp": {"traffic": False, "latency": True, "rate": False, "kv": None, "live_itl": True, "live_ttft": False},
    # no tokens: seconds per request from the ensemble's successes and their microseconds (traffic counters of
    # requests and seconds only, the probes left out)
    "triton": {"traffic": True, "latency": True, "rate": True, "kv": 0.25, "live_itl": False, "live_ttft": True},
}


@pytest.mark.parametrize("engine", sorted(GIVES))
def test_an_engines_node_through_the_exporter_and_prometheus(engine, tmp_path):
    require("prometheus")
    gives = GIVES[engine]
    cfg = parse_config({"pools": [{"name": "p", "backend": "p", "engine": engine}],
                        "rules": {"control_interval": "1s", "human_interval": "1s"}})
    rules = tmp_path / "recording.rules.yml"
    rules.write_text(render_recording(cfg))
    probe = ProbeConfig(interval=0.2, jitter=0.1, slow_threshold=0.5, deadline=3.0, api_key_env=None,
                        live_window=1.0, engine=engine)
    with StandIn(engine) as node, Exporter(node.url, port=0, nvml=None, probe=probe, agent=None) as exp:
        # the pre-checks ask the engine's own endpoints
        with requests.Session() as s:
            s.trust_env = False
            pre = run_prechecks(nvml_snapshot=None, advertise=node.netloc, vllm_url=node.url, api_key=None,
                                model=None, session=s, timeout=5, engine=engine)
            assert pre.ok and pre.model == ("ensemble" if engine == "triton" else "m"), pre
            assert pre.version == next(iter(VERSIONS[engine][1].values()))
            assert vllm_version(s, node.url, {}, 5, "vllm") == ""  # vLLM's /version: not this engine's

        # the probe speaks its API: answered, ok
        wait_until(lambda: samples(exp.url + "/metrics").get('grayguard_probe_results_total{result="ok"}', 0) >= 5,
                   20, interval_s=0.1, what=f"5 ok probes of the {engine} stand-in")
        # the live running count is on the full page only (issue 34: the fast page carries what the controller reads)
        full = wait_until(lambda: (f := samples(exp.url + "/metrics")).get("grayguard_live_requests_running")
                          is not None and f, 20, interval_s=0.2, what="the live running count")
        assert full["grayguard_live_requests_running"] == 2.0
        def live_as_given():
            f = samples(exp.url + "/metrics/fast")
            itl, ttft = "grayguard_live_itl_seconds" in f, "grayguard_live_ttft_seconds" in f
            return f if (itl, ttft) == (gives["live_itl"], gives["live_ttft"]) else None

        live = wait_until(live_as_given, 20, interval_s=0.2, what="the live ITL and TTFT the engine gives, only those")
        if gives["live_itl"]:
            assert live["grayguard_live_itl_seconds"] == pytest.approx(ITL, rel=0.01)
        if gives["live_ttft"]:  # the probes' first tokens are left out: the stand-in's own requests' TTFT
            assert live["grayguard_live_ttft_seconds"] == pytest.approx(TTFT, rel=0.05)
        assert ("grayguard_live_kv_cache_usage_ratio" in live) == (gives["kv"] is not None)
        assert ("grayguard_live_decode_batch" in live) == (gives["live_itl"] and engine != "tgi")
        traffic = samples(exp.url + "/metrics")
        assert ("grayguard_traffic_requests_total" in traffic) == gives["traffic"]
        assert ("grayguard_traffic_request_seconds_total" in traffic) == gives["traffic"]
        counts_tokens = gives["traffic"] and not profile(engine).per_request  # Triton's: requests and seconds only
        assert ("grayguard_traffic_generation_tokens_total" in traffic) == counts_tokens
        assert ("grayguard_traffic_prompt_tokens_total" in traffic) == counts_tokens

        scrape = [static_job("engine", [node.netloc], {"pool": "p"}),
                  static_job("grayguard-exporter", [exp.url.split("//", 1)[1]], {"pool": "p", "instance": node.netloc})]
        with start_prometheus(prometheus_config(scrape, interval="1s"), [rules], workdir=tmp_path / "prom") as prom:
            # not recorded: the running requests the GPU alerts' "under load" computes inline (rules/render.py gs)
            series = EngineSeries("vllm:", [engine], "pool, instance")
            running = prom.wait_for(series.gs("running"), timeout_s=30)
            assert [float(s["value"][1]) for s in running] == [2.0]
            prom.wait_for('instance:vllm_normalized_latency_seconds_per_token:rate30s{pool="p"}', timeout_s=30)
            # not recorded (only people read it): the runbook's query, for this engine
            waiting = prom.query(series.gs("waiting"))
            assert [float(s["value"][1]) for s in waiting] == [1.0]
            assert recorded(prom, "instance:vllm_kv_cache_usage_ratio:max") == gives["kv"]
            if gives["latency"]:
                # the exporter's traffic counters (the probes left out): every finished request is 0.45 s for
                # 20 prompt and 10 generated tokens -> 0.45 / (0.25 * 20 + 10) = 0.03 s per token. TGI's probe gets
                # no usage report: its 7 prompt tokens stay in (at most 5 probes/s: 35 of 235 prompt tokens/s, -6 %);
                # llama.cpp has no traffic counters: the rule reads its own series, probes in (-5 %)
                # Until Prometheus has two scrapes of the exporter the rule reads the engine's own series, probes
                # in: 4.55 / 163.75 = 0.0278 for SGLang; then the exporter's.
                want, rel = (TTFT + 10 * ITL) / 15, 0.02 if profile(engine).usage_options else 0.1
                if profile(engine).per_request:  # Triton: seconds per request, not per token (0.45 s; the
                    # engine's own series, probes in, would give (4.5 + 5 x 0.01) / 15 = 0.30 s)
                    want, rel = TTFT + 10 * ITL, 0.02
                prom.wait_for('instance:vllm_normalized_latency_seconds_per_token:rate30s{pool="p"}',
                              lambda r: r and float(r[0]["value"][1]) == pytest.approx(want, rel=rel), timeout_s=30)
            if gives["rate"]:  # present and positive (its size while the 30 s window fills is extrapolation)
                prom.wait_for('instance:vllm_request_rate:rate30s{pool="p"} > 0', timeout_s=30)
            else:  # no finished-request count: absent, never 0, once Prometheus has a rate of the engine's counters
                steps = profile(engine).steps[0][0]
                prom.wait_for(f'rate({steps.name}[30s]) > 0', timeout_s=30)
                since = time.time()  # then a rule evaluation after that (the recorded sample's timestamp)
                prom.wait_for('instance:vllm_normalized_latency_seconds_per_token:rate30s{pool="p"}',
                              lambda r: r and float(r[0]["value"][0]) > since + 1, timeout_s=30)
                if not gives["latency"]:
                    assert recorded(prom, "instance:vllm_normalized_latency_seconds_per_token:rate30s") is None
                assert recorded(prom, "instance:vllm_request_rate:rate30s") is None
