"""vLLM's Prometheus metrics (V1 engine names, types, labels, buckets) in a node's own registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grayguard.sim.model import Finished, ModelParams, StepDone

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # all pre-created, as in vLLM
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default, only reported


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def cache_config_info(params: ModelParams) -> dict[str, str]:
    """Labels of vllm:cache_config_info: vLLM's CacheConfig.metrics_info(), every value a string.

    Prefix caching is on (vLLM V1's default); the sim's prompts carry no shared content, so it never hits.
    """
    blocks = params.kv_cache_tokens // params.block_size
    return {"block_size": str(params.block_size), "gpu_memory_utilization": str(GPU_MEMORY_UTILIZATION),
            "cache_dtype": "auto", "is_attention_free": "False", "num_gpu_blocks_override": "None",
            "sliding_window": "None", "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
            "num_gpu_blocks": str(blocks), "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(blocks * params.block_size)}


class VllmMetrics:
    """The `vllm:` families of one engine (labels model_name, engine="0") in `registry`."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 engine: str = "0", cache_config: Mapping[str, str] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        names, lv = ["model_name", "engine"], [model_name, engine]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(*lv)

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._lv = lv
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=reg)
        self.success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                               token_buckets)
        self.req_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                   token_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", token_buckets)
        # an info metric as vLLM writes it: a gauge set to 1, labels = the cache config plus engine (no model_name)
        info = {**(cache_config if cache_config is not None else cache_config_info(ModelParams())),
                "engine": engine}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=reg).labels(**info).set(1)

    def bind_engine_state(self, running: Callable[[], float], waiting: Callable[[], float],
                          kv_usage: Callable[[], float]) -> None:
        """Gauges read the engine when scraped, so they are never stale."""
        self._running.labels(*self._lv).set_function(running)
        self._waiting.labels(*self._lv).set_function(waiting)
        self._kv.labels(*self._lv).set_function(kv_usage)

    def observe_step(self, ev: StepDone) -> None:
        """Token counters, prefix-cache lookups, tokens per iteration, and one ITL per decoding sequence."""
        if ev.prompt_tokens:
            self.prompt_tokens.inc(ev.prompt_tokens)
        if ev.prefill_tokens:
            # every prefilled token (prompt, or recompute after a preemption) was looked up and missed:
            # queries - hits = tokens computed, and the sim never hits (prefix_cache_hits stays 0)
            self.prefix_cache_queries.inc(ev.prefill_tokens)
        if ev.generated:
            self.generation_tokens.inc(ev.generated)
            # like vLLM, only a step with outputs records iteration stats: prompts whose first token
            # came in this step plus the tokens sampled
            self.iteration_tokens.observe(ev.prompt_tokens + ev.generated)
        if ev.itls:
            observe = self.itl.observe
            for itl in ev.itls:
                observe(itl)

    def observe_first_token(self, ttft: float) -> None:
        """Time to first token, observed when the token is ready (like vLLM, before the finish)."""
        self.ttft.observe(ttft)

    def observe_finished(self, ev: Finished, max_tokens: int | None = None, n: int = 1) -> None:
        """Per-request histograms of a request the engine finished (`max_tokens`, `n`: its parameters)."""
        s = ev.stats
        self.success[s.finished_reason].inc()
        self.e2e.observe(s.e2e)
        self.queue.observe(s.queue)
        self.prefill.observe(s.prefill)
        self.decode.observe(s.decode)
        self.inference.observe(s.inference)
        if s.tpot is not None:
            self.tpot.observe(s.tpot)
        self.req_prompt.observe(s.prompt_tokens)
        self.req_generation.observe(s.generation_tokens)
        self.params_n.observe(n)
        if max_tokens:  # vLLM skips a request without the parameter
            self.params_max_tokens.observe(max_tokens)
