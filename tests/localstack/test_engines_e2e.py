"""Each engine profile end to end: a stand-in speaking the engine's API and /metrics names (as on its fixture page,
tests/fixtures/engines/), the real exporter with --engine probing it, and a real Prometheus scraping both with the
recording rules rendered for a pool of that engine. What the engine gives reaches grayguard's per-node series; what it
cannot give stays absent (docs/engines.md).

The stand-in is no model: a ticker moves its counters as an engine serving two requests would (a token every 20 ms
each, a request finished every 0.1 s), and it answers the probe after 10 ms, counting it as a finished 1-token request.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from grayguard.config import parse_config
from grayguard.engines import profile
from grayguard.exporters.precheck import run_prechecks, vllm_version
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.httpserve import HttpServer, Request, Response
from grayguard.rules.render import render_recording
from tests.support.stack import prometheus_config, require, start_prometheus, static_job, wait_until

pytestmark = pytest.mark.e2e

ITL, TTFT, PROBE_TTFT = 0.02, 0.25, 0.01  # the stand-in's gap between tokens, its requests' and the probe's TTFT
TICK = 0.1  # s: each tick two running requests get 5 tokens each, one request finishes (20 prompt, 10 generated)
VERSIONS = {"sglang": ("/get_server_info", {"version": "0.5.4"}), "tgi": ("/info", {"version": "3.3.6"}),
            "llamacpp": ("/props", {"build_info": "b6990-0b1bad14f"}), "triton": ("/v2", {"version": "2.59.0"})}


class Engine:
    """The counters of a stand-in engine (cumulative, like the real ones)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.seconds = self.prompt = self.generated = 0.0  # finished requests and their sums
        self.itl_sum = self.itl_count = self.ttft_sum = self.ttft_count = self.steps = self.failures = 0.0
        self.running, self.waiting, self.kv = 2.0, 1.0, 0.25

    def tick(self):
        with self.lock:
            self.itl_sum, self.itl_count = self.itl_sum + 10 * ITL, self.itl_count + 10
            self.steps += 5
            self.finish(TTFT + 10 * ITL, 20, 10)
            self.ttft_sum, self.ttft_count = self.ttft_sum + TTFT, self.ttft_count + 1

    def finish(self, seconds: float, prompt: int, generated: int):
        self.requests, self.seconds = self.requests + 1, self.seconds + seconds
        self.prompt, self.generated = self.prompt + prompt, self.generated + generated

    def probe(self, prompt_tokens: int):
        with self.lock:
            self.finish(PROBE_TTFT, prompt_tokens, 1)
            self.ttft_sum, self.ttft_count = self.ttft_sum + PROBE_TTFT, self.ttft_count + 1
            self.steps += 1


def page(engine: str, e: Engine) -> str:
    """The engine's /metrics, names and labels as on its fixture page."""
    with e.lock:
        if engine == "sglang":
            sched = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
            return "\n".join([
                f"sglang:num_running_reqs{{{sched}}} {e.running}", f"sglang:num_queue_reqs{{{sched}}} {e.waiting}",
                f"sglang:token_usage{{{sched}}} {e.kv}",
                f'sglang:realtime_tokens_total{{{sched[:22]}mode="decode",{sched[22:]}}} {e.generated}',
                f'sglang:realtime_tokens_total{{{sched[:22]}mode="prefill_compute",{sched[22:]}}} {e.prompt}',
                f'sglang:prompt_tokens_total{{model_name="m"}} {e.prompt}',
                f'sglang:generation_tokens_total{{model_name="m"}} {e.generated}',
                f'sglang:e2e_request_latency_seconds_sum{{model_name="m"}} {e.seconds}',
                f'sglang:e2e_request_latency_seconds_count{{model_name="m"}} {e.requests}',
                f'sglang:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {e.ttft_count}',
                f'sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {e.ttft_count}',
                f'sglang:time_to_first_token_seconds_sum{{model_name="m"}} {e.ttft_sum}',
                f'sglang:time_to_first_token_seconds_count{{model_name="m"}} {e.ttft_count}',
                f'sglang:inter_token_latency_seconds_sum{{model_name="m"}} {e.itl_sum}',
                f'sglang:inter_token_latency_seconds_count{{model_name="m"}} {e.itl_count}', ""])
        if engine == "tgi":
            return "\n".join([
                f"tgi_batch_current_size {e.running:g}", f"tgi_queue_size {e.waiting:g}",
                f"tgi_request_count {e.requests + e.failures:g}",
                f'tgi_request_failure{{err="generation"}} {e.failures:g}',
                f"tgi_request_duration_sum {e.seconds}", f"tgi_request_duration_count {e.requests:g}",
                f"tgi_request_input_length_sum {e.prompt:g}", f"tgi_request_input_length_count {e.requests:g}",
                f"tgi_request_generated_tokens_sum {e.generated:g}",
                f"tgi_request_generated_tokens_count {e.requests:g}",
                f'tgi_batch_inference_count{{method="decode"}} {e.steps:g}',
                f'tgi_batch_inference_duration_sum{{method="decode"}} {e.itl_sum / 2}',  # 2 running: a step per
                f'tgi_batch_inference_duration_count{{method="decode"}} {e.itl_count / 2:g}', ""])  # two tokens
        if engine == "llamacpp":
            return "\n".join([
                "# TYPE llamacpp:prompt_tokens_total counter", f"llamacpp:prompt_tokens_total {e.prompt:g}",
                f"llamacpp:tokens_predicted_total {e.itl_count:g}",
                f"llamacpp:prompt_seconds_total {e.seconds - e.itl_sum:g}",
                f"llamacpp:tokens_predicted_seconds_total {e.itl_sum:g}", f"llamacpp:n_decode_total {e.steps:g}",
                f"llamacpp:requests_processing {e.running:g}", f"llamacpp:requests_deferred {e.waiting:g}", ""])
        trt = 'model="tensorrt_llm",version="1"'
        return "\n".join([
            f'nv_trt_llm_request_metrics{{{trt},request_type="scheduled"}} {e.running:g}',
            f'nv_trt_llm_request_metrics{{{trt},request_type="waiting"}} {e.waiting:g}',
            f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="fraction",{trt}}} {e.kv}',
            f'nv_trt_llm_general_metrics{{general_type="iteration_counter",{trt}}} {e.steps:g}',
            f'nv_inference_request_success{{model="ensemble",version="1"}} {e.requests:g}',
            f'nv_inference_request_failure{{model="ensemble",reason="BACKEND",version="1"}} {e.failures:g}',
            f'nv_inference_first_response_histogram_ms_sum{{model="ensemble",version="1"}} {e.ttft_sum * 1000}',
            f'nv_inference_first_response_histogram_ms_count{{model="ensemble",version="1"}} {e.ttft_count:g}', ""])


class StandIn(HttpServer):
    """A stand-in engine on 127.0.0.1: its API for the probe, its /metrics, its readiness and version endpoints."""

    def __init__(self, engine: str):
        self.engine, self.state, self._stop = engine, Engine(), threading.Event()
        version_path, version = VERSIONS[engine]
        j = lambda obj: (200, "application/json", json.dumps(obj).encode())  # noqa: E731
        routes = {"GET /metrics": lambda r: (200, "text/plain; version=0.0.4", page(engine, self.state).encode()),
                  f"GET {version_path}": lambda r: j(version)}
        if engine == "triton":
            routes |= {"GET /v2/health/ready": lambda r: j({}), "GET /v2/models/ensemble/ready": lambda r: j({}),
                       "POST /v2/models/ensemble/generate_stream": self._generate}
        else:
            routes |= {"GET /health": lambda r: j({}), "GET /v1/models": lambda r: j({"data": [{"id": "m"}]}),
                       "POST /v1/completions": self._generate}
        super().__init__(("127.0.0.1", 0), routes, name=f"standin-{engine}")
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def _tick(self):
        while not self._stop.wait(TICK):
            self.state.tick()

    def _generate(self, req: Request) -> Response:
        body = json.loads(req.body)
        time.sleep(PROBE_TTFT)
        if self.engine == "triton":
            assert body["max_tokens"] == 1 and body["stream"] is True
            event = {"model_name": "ensemble", "model_version": "1", "text_output": " Paris"}
        else:
            assert body["model"] == "m" and body["max_tokens"] == 1
            event = {"object": "text_completion", "choices": [{"index": 0, "text": " Paris"}]}
            if "stream_options" in body:
                event["usage"] = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        self.state.probe(7)
        return 200, "text/event-stream", f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()

    def __enter__(self) -> StandIn:
        self.start()
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join(2)
        super().__exit__(*exc)


def samples(url: str) -> dict[str, float]:
    with requests.Session() as s:
        s.trust_env = False
        text = s.get(url, timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def recorded(prom, name: str) -> float | None:
    res = prom.query(f'{name}{{pool="p"}}')
    return float(res[0]["value"][1]) if res else None


# What each engine gives on grayguard's per-node recorded series and the exporter's live path (None: absent).
GIVES = {
    "sglang": {"traffic": True, "latency": True, "rate": True, "kv": 0.25, "live_itl": True, "live_ttft": True},
    "tgi": {"traffic": True, "latency": True, "rate": True, "kv": None, "live_itl": True, "live_ttft": False},
    # the slots' busy seconds over their tokens, probes in (no request count: no traffic counters, no request rate)
    "llamacpp": {"traffic": False, "latency": True, "rate": False, "kv": None, "live_itl": True, "live_ttft": False},
    "triton": {"traffic": False, "latency": False, "rate": False, "kv": 0.25, "live_itl": False, "live_ttft": True},
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
        fast = wait_until(lambda: (f := samples(exp.url + "/metrics/fast")).get("grayguard_live_requests_running")
                          is not None and f, 20, interval_s=0.2, what="the live running count")
        assert fast["grayguard_live_requests_running"] == 2.0
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

        scrape = [static_job("engine", [node.netloc], {"pool": "p"}),
                  static_job("grayguard-exporter", [exp.url.split("//", 1)[1]], {"pool": "p", "instance": node.netloc})]
        with start_prometheus(prometheus_config(scrape, interval="1s"), [rules], workdir=tmp_path / "prom") as prom:
            prom.wait_for('instance:vllm_num_requests_running:sum{pool="p"}', timeout_s=30)
            assert recorded(prom, "instance:vllm_num_requests_running:sum") == 2.0
            assert recorded(prom, "instance:vllm_num_requests_waiting:sum") == 1.0
            assert recorded(prom, "instance:vllm_kv_cache_usage_ratio:max") == gives["kv"]
            if gives["latency"]:
                # the exporter's traffic counters (the probes left out): every finished request is 0.45 s for
                # 20 prompt and 10 generated tokens -> 0.45 / (0.25 * 20 + 10) = 0.03 s per token. TGI's probe gets
                # no usage report: its 7 prompt tokens stay in (at most 5 probes/s: 35 of 235 prompt tokens/s, -6 %);
                # llama.cpp has no traffic counters: the rule reads its own series, probes in (-5 %)
                # Until Prometheus has two scrapes of the exporter the rule reads the engine's own series, probes
                # in: 4.55 / 163.75 = 0.0278 for SGLang; then the exporter's.
                want, rel = (TTFT + 10 * ITL) / 15, 0.02 if profile(engine).usage_options else 0.1
                prom.wait_for('instance:vllm_normalized_latency_seconds_per_token:rate30s{pool="p"}',
                              lambda r: r and float(r[0]["value"][1]) == pytest.approx(want, rel=rel), timeout_s=30)
            if gives["rate"]:  # present and positive (its size while the 30 s window fills is extrapolation)
                prom.wait_for('instance:vllm_request_rate:rate30s{pool="p"} > 0', timeout_s=30)
            else:  # no finished-request count: absent, never 0, once Prometheus has a rate of the engine's counters
                steps = profile(engine).steps[0][0]
                prom.wait_for(f'rate({steps.name}[30s]) > 0', timeout_s=30)
                since = time.time()  # then a rule evaluation after that (the recorded sample's timestamp)
                prom.wait_for('instance:vllm_num_requests_running:sum{pool="p"}',
                              lambda r: r and float(r[0]["value"][0]) > since + 1, timeout_s=30)
                if not gives["latency"]:
                    assert recorded(prom, "instance:vllm_normalized_latency_seconds_per_token:rate30s") is None
                assert recorded(prom, "instance:vllm_request_rate:rate30s") is None
