"""Engine profiles, pure: how each inference engine's own /metrics maps to grayguard's per-node signals.

One profile per engine (`pools[].engine`, the exporter's `--engine`): the series the exporter reads into an
EngineLoad (exporters/engineload.py), the series the recording rules fall back to (rules/render.py), and the
engine's API for the probe and the pre-checks. Where an engine has no series for a signal the profile has none:
the exporter's reading of it is None and the rules have no branch for it (absent is not zero). docs/engines.md
says, per engine, which signals it cannot give and what the controller does without them; every name here comes
from the engine's own metric definitions, named in tests/fixtures/engines/<engine>.metrics.txt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

ENGINES = ("vllm", "sglang", "tgi", "llamacpp", "triton")
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True)
class Series:
    """One series of an engine's page: its sample name, the label values a sample must have, and the factor that
    turns its unit into grayguard's (seconds, tokens, 0-1)."""

    name: str
    match: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match)

    def matchers(self) -> str:
        """The label matchers as PromQL (`a="b", c="d"`)."""
        return ", ".join(f'{k}="{v}"' for k, v in self.match)


# A reading of one value: alternatives, the first with any series on the page wins (a new name before an old one);
# each alternative is the sum of its series (llama.cpp's prefill and decode seconds make its busy seconds).
Read = tuple[tuple[Series, ...], ...]


@dataclass(frozen=True)
class Pair:
    """A sum and a count read together (a histogram's _sum and _count, or two counters): a mean per observation."""

    sum: Series
    count: Series


@dataclass(frozen=True)
class Ratio:
    """A share as one gauge over another (TensorRT-LLM's used over max KV-cache blocks)."""

    part: Series
    whole: Series


def one(*names: str, match: tuple[tuple[str, str], ...] = (), scale: float = 1.0) -> Read:
    """A Read of alternatives, each one series."""
    return tuple((Series(n, match, scale),) for n in names)


@dataclass(frozen=True)
class Profile:
    """One engine: what the exporter reads, what the rules fall back to, how the probe and pre-checks ask it."""

    name: str
    prefixes: tuple[str, ...]  # the page's lines worth reading start with one of these
    # EngineLoad's fields (exporters/engineload.py); empty: the engine has no such series
    generation_tokens: Read = ()  # counter: tokens generated
    prompt_tokens: Read = ()  # counter: prompt tokens processed
    steps: Read = ()  # counter: engine steps (forward passes), progress evidence where tokens are counted late
    running: Read = ()  # gauge: requests in the running batch
    waiting: Read = ()  # gauge: requests queued
    kv_usage: Read = ()  # gauge: KV-cache usage 0-1, the largest of its label sets
    kv_ratio: Ratio | None = None  # else KV-cache usage as a ratio of two gauges
    itl: tuple[Pair, ...] = ()  # seconds between two tokens of a request: sum and count (alternatives)
    itl_per_token: bool = True  # False: one observation per engine step, not per token (no decode batch from it)
    ttft: tuple[Pair, ...] = ()  # arrival to first token: sum and count (alternatives)
    # finished requests: count, seconds, prompt and generated tokens, the four counting the same requests
    requests: Read = ()
    request_seconds: Read = ()
    request_prompt_tokens: Read = ()
    request_generation_tokens: Read = ()
    # the recording rules' error ratio: failed requests over all finished (empty: the engine does not say)
    errors: Read = ()
    finished: Read = ()
    ttft_bucket: str | None = None  # TTFT histogram's _bucket series in seconds (the rules' P99), None: none
    # the probe and the pre-checks
    dialect: str = "openai"  # "openai": POST /v1/completions; "triton": POST /v2/models/<model>/generate_stream
    usage_options: bool = False  # send stream_options with continuous_usage_stats (vLLM's, SGLang's)
    health_path: str = "/health"
    version_path: str = "/version"
    version_key: str = "version"
    default_model: str | None = None  # the model probed when --probe.model is not given and none is listed
    # the label naming the model in the engine's per-model series (Triton's `model`): the exporter reads the probed
    # model's (--probe.model) where the profile names default_model; None: the series are not per model
    model_label: str | None = None
    source: str = ""  # where the metric names come from
    lacks: tuple[str, ...] = field(default_factory=tuple)  # the grayguard signals it cannot give (docs/engines.md)

    @property
    def per_request(self) -> bool:
        """True when the engine counts finished requests and their seconds but no tokens of them (Triton): its
        normalized latency is seconds per request, not per token (docs/engines.md)."""
        return bool(self.requests and self.request_seconds) and not (self.request_prompt_tokens
                                                                     or self.request_generation_tokens)

    def for_model(self, model: str | None) -> Profile:
        """The profile reading `model`'s per-model series in place of default_model's (itself when the engine has
        no per-model series, or model is None)."""
        if model is None or self.model_label is None or model == self.default_model:
            return self
        key = self.model_label

        def series(s: Series) -> Series:
            return replace(s, match=tuple((k, model if k == key else v) for k, v in s.match))

        def read(r: Read) -> Read:
            return tuple(tuple(series(s) for s in alt) for alt in r)

        reads = ("requests", "request_seconds", "errors", "finished")
        return replace(self, **{f: read(getattr(self, f)) for f in reads},
                       ttft=tuple(Pair(series(p.sum), series(p.count)) for p in self.ttft))

    def names(self) -> frozenset[str]:
        """Every sample name the exporter reads for this engine."""
        out: set[str] = set()
        for read in (self.generation_tokens, self.prompt_tokens, self.steps, self.running, self.waiting,
                     self.kv_usage, self.requests, self.request_seconds, self.request_prompt_tokens,
                     self.request_generation_tokens):
            out |= {s.name for alt in read for s in alt}
        for pair in (*self.itl, *self.ttft):
            out |= {pair.sum.name, pair.count.name}
        if self.kv_ratio is not None:
            out |= {self.kv_ratio.part.name, self.kv_ratio.whole.name}
        return frozenset(out)


def _hist(base: str, *, match: tuple[tuple[str, str], ...] = (), scale: float = 1.0) -> Pair:
    return Pair(Series(base + "_sum", match, scale), Series(base + "_count", match))


VLLM = Profile(
    name="vllm", prefixes=("vllm:",),
    generation_tokens=one("vllm:generation_tokens_total"), prompt_tokens=one("vllm:prompt_tokens_total"),
    running=one("vllm:num_requests_running"), waiting=one("vllm:num_requests_waiting"),
    kv_usage=one("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the new name, else the old (< 0.10)
    itl=(_hist("vllm:inter_token_latency_seconds"), _hist("vllm:time_per_output_token_seconds")),
    ttft=(_hist("vllm:time_to_first_token_seconds"),),
    requests=one("vllm:e2e_request_latency_seconds_count"), request_seconds=one("vllm:e2e_request_latency_seconds_sum"),
    request_prompt_tokens=one("vllm:request_prompt_tokens_sum"),
    request_generation_tokens=one("vllm:request_generation_tokens_sum"),
    errors=one("vllm:request_success_total", match=(("finished_reason", "error"),)),
    finished=one("vllm:request_success_total"), ttft_bucket="vllm:time_to_first_token_seconds_bucket",
    usage_options=True, source="vllm-project/vllm vllm/v1/metrics/loggers.py (docs/metrics.md, "
                               "/work/shared/reference/vllm-nvml-metrics.md)")

SGLANG = Profile(
    name="sglang", prefixes=("sglang:",),
    # realtime_tokens_total moves as the scheduler steps (each log interval); the older builds only have the
    # per-request counters, which move when a request finishes
    generation_tokens=(*one("sglang:realtime_tokens_total", match=(("mode", "decode"),)),
                       *one("sglang:generation_tokens_total")),
    prompt_tokens=(*one("sglang:realtime_tokens_total", match=(("mode", "prefill_compute"),)),
                   *one("sglang:prompt_tokens_total")),
    running=one("sglang:num_running_reqs"), waiting=one("sglang:num_queue_reqs"),
    kv_usage=one("sglang:token_usage"),
    itl=(_hist("sglang:inter_token_latency_seconds"), _hist("sglang:time_per_output_token_seconds")),
    ttft=(_hist("sglang:time_to_first_token_seconds"),),
    # prompt_tokens_total and generation_tokens_total grow when a request finishes, with its e2e latency
    requests=one("sglang:e2e_request_latency_seconds_count"),
    request_seconds=one("sglang:e2e_request_latency_seconds_sum"),
    request_prompt_tokens=one("sglang:prompt_tokens_total"),
    request_generation_tokens=one("sglang:generation_tokens_total"),
    ttft_bucket="sglang:time_to_first_token_seconds_bucket", usage_options=True,
    version_path="/get_server_info",
    source="sgl-project/sglang python/sglang/srt/metrics/collector.py",
    lacks=("error ratio",))

TGI = Profile(
    name="tgi", prefixes=("tgi_",),
    # the token histograms are observed when a request ends; the forward passes count every step
    generation_tokens=one("tgi_request_generated_tokens_sum"), prompt_tokens=one("tgi_request_input_length_sum"),
    steps=one("tgi_batch_inference_count"),
    running=one("tgi_batch_current_size"), waiting=one("tgi_queue_size"),
    # one decode step gives every running request its next token: the step's duration is their inter-token gap
    itl=(_hist("tgi_batch_inference_duration", match=(("method", "decode"),)),), itl_per_token=False,
    requests=one("tgi_request_duration_count"), request_seconds=one("tgi_request_duration_sum"),
    request_prompt_tokens=one("tgi_request_input_length_sum"),
    request_generation_tokens=one("tgi_request_generated_tokens_sum"),
    errors=one("tgi_request_failure"), finished=one("tgi_request_count"),
    version_path="/info",
    source="huggingface/text-generation-inference router/src/server.rs, router/src/infer/v3/scheduler.rs, "
           "router/src/validation.rs",
    lacks=("time to first token", "KV-cache usage", "decode batch"))

LLAMACPP = Profile(
    name="llamacpp", prefixes=("llamacpp:",),
    # counted when a slot ends its prompt (prompt) or its generation (tokens): n_decode_total counts every step
    generation_tokens=one("llamacpp:tokens_predicted_total"), prompt_tokens=one("llamacpp:prompt_tokens_total"),
    steps=one("llamacpp:n_decode_total"),
    running=one("llamacpp:requests_processing"), waiting=one("llamacpp:requests_deferred"),
    kv_usage=one("llamacpp:kv_cache_usage_ratio"),  # removed from later builds: then absent
    # the slots' decode seconds over the tokens they generated: seconds per token, per slot
    itl=(Pair(Series("llamacpp:tokens_predicted_seconds_total"), Series("llamacpp:tokens_predicted_total")),),
    # no finished-request count; the slots' prefill and decode seconds, added when a slot ends its prompt and its
    # generation, over the tokens they processed: the normalized latency without the queue time (no request rate,
    # so no traffic counters: the exporter's probes stay in)
    request_seconds=((Series("llamacpp:prompt_seconds_total"), Series("llamacpp:tokens_predicted_seconds_total")),),
    request_prompt_tokens=one("llamacpp:prompt_tokens_total"),
    request_generation_tokens=one("llamacpp:tokens_predicted_total"),
    version_path="/props", version_key="build_info",
    source="ggml-org/llama.cpp tools/server/server.cpp (examples/server/server.cpp before 2025)",
    lacks=("time to first token", "finished requests (request rate, error ratio; the normalized latency leaves the "
           "queue out and keeps the probes in)", "KV-cache usage in builds after the unified KV cache"))

ENSEMBLE = (("model", "ensemble"),)
TRITON = Profile(
    name="triton", prefixes=("nv_trt_llm_", "nv_inference_"),
    steps=one("nv_trt_llm_general_metrics", match=(("general_type", "iteration_counter"),)),
    running=one("nv_trt_llm_request_metrics", match=(("request_type", "scheduled"),)),
    waiting=one("nv_trt_llm_request_metrics", match=(("request_type", "waiting"),)),
    kv_usage=one("nv_trt_llm_kv_cache_block_metrics", match=(("kv_cache_block_type", "fraction"),)),
    kv_ratio=Ratio(Series("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "used"),)),
                   Series("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "max"),))),
    # Triton counts per model, and every model of the ensemble counts (postprocessing once per streamed response):
    # the request series are the ensemble's, the model the probe asks (tensorrtllm_backend's all_models layout)
    # decoupled (streaming) models: time to the first response, when Triton runs with histogram_latencies=true
    ttft=(_hist("nv_inference_first_response_histogram_ms", match=ENSEMBLE, scale=0.001),),
    # successful requests and their duration, arrival to the last response, in whole microseconds (core's
    # InferenceStatsAggregator::UpdateSuccess adds both; a failure adds neither): no tokens, so the normalized
    # latency is seconds per request (per_request), compared only between the nodes of one pool
    requests=one("nv_inference_request_success", match=ENSEMBLE),
    request_seconds=one("nv_inference_request_duration_us", match=ENSEMBLE, scale=1e-6),
    errors=one("nv_inference_request_failure", match=ENSEMBLE),
    finished=((Series("nv_inference_request_success", ENSEMBLE), Series("nv_inference_request_failure", ENSEMBLE)),),
    dialect="triton", health_path="/v2/health/ready", version_path="/v2", default_model="ensemble",
    model_label="model",
    source="triton-inference-server/core src/metric_model_reporter.cc, src/infer_stats.cc, "
           "triton-inference-server/tensorrtllm_backend "
           "inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc",
    lacks=("tokens (tokens per second; the normalized latency is seconds per request, not per token)",
           "inter-token latency", "time to first token unless histogram_latencies is on"))

PROFILES: dict[str, Profile] = {p.name: p for p in (VLLM, SGLANG, TGI, LLAMACPP, TRITON)}


def profile(name: str) -> Profile:
    """The profile of an engine name; KeyError names the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})") from None
