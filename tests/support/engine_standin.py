"""A stand-in for an inference engine other than vLLM, on 127.0.0.1: its API for the probe (OpenAI's completions,
or Triton's generate_stream), its readiness and version endpoints, and its /metrics with the names and labels of its
fixture page (tests/fixtures/engines/). Used by tests/localstack/test_engines_e2e.py (each profile through the exporter
and Prometheus), tests/localstack/test_engine_controller_e2e.py (the controller cutting a slow one) and
tests/exporters/test_registration_engines.py (the registration's pre-checks).

The stand-in is no model: a ticker moves its counters as an engine serving two requests would (a token every 20 ms
each, a request finished every 0.1 s), and it answers the probe after 10 ms, counting it as a finished 1-token request.
slow=k makes every latency it reports and every answer it gives k times longer (the same counts, k times the seconds):
a gray-failed node.
"""

from __future__ import annotations

import json
import threading
import time

from grayguard.httpserve import HttpServer, Request, Response

ITL, TTFT, PROBE_TTFT = 0.02, 0.25, 0.01  # the stand-in's gap between tokens, its requests' and the probe's TTFT
TICK = 0.1  # s: each tick two running requests get 5 tokens each, one request finishes (20 prompt, 10 generated)
VERSIONS = {"sglang": ("/get_server_info", {"version": "0.5.4"}), "tgi": ("/info", {"version": "3.3.6"}),
            "llamacpp": ("/props", {"build_info": "b6990-0b1bad14f"}), "triton": ("/v2", {"version": "2.59.0"})}


class Engine:
    """The counters of a stand-in engine (cumulative, like the real ones); slow: the factor on every latency."""

    def __init__(self, slow: float = 1.0):
        self.slow = slow
        self.lock = threading.Lock()
        self.requests = self.seconds = self.prompt = self.generated = 0.0  # finished requests and their sums
        self.itl_sum = self.itl_count = self.ttft_sum = self.ttft_count = self.steps = self.failures = 0.0
        self.running, self.waiting, self.kv = 2.0, 1.0, 0.25

    def tick(self):
        with self.lock:
            k = self.slow
            self.itl_sum, self.itl_count = self.itl_sum + 10 * ITL * k, self.itl_count + 10
            self.steps += 5
            self.finish((TTFT + 10 * ITL) * k, 20, 10)
            self.ttft_sum, self.ttft_count = self.ttft_sum + TTFT * k, self.ttft_count + 1

    def finish(self, seconds: float, prompt: int, generated: int):
        self.requests, self.seconds = self.requests + 1, self.seconds + seconds
        self.prompt, self.generated = self.prompt + prompt, self.generated + generated

    def probe(self, prompt_tokens: int):
        with self.lock:
            self.finish(PROBE_TTFT * self.slow, prompt_tokens, 1)
            self.ttft_sum, self.ttft_count = self.ttft_sum + PROBE_TTFT * self.slow, self.ttft_count + 1
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
            f'nv_inference_request_duration_us{{model="ensemble",version="1"}} {round(e.seconds * 1e6)}',
            f'nv_inference_first_response_histogram_ms_sum{{model="ensemble",version="1"}} {e.ttft_sum * 1000}',
            f'nv_inference_first_response_histogram_ms_count{{model="ensemble",version="1"}} {e.ttft_count:g}', ""])


class StandIn(HttpServer):
    """A stand-in engine on 127.0.0.1: its API for the probe, its /metrics, its readiness and version endpoints."""

    def __init__(self, engine: str, slow: float = 1.0):
        self.engine, self.state, self._stop = engine, Engine(slow), threading.Event()
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
        time.sleep(PROBE_TTFT * self.state.slow)
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
