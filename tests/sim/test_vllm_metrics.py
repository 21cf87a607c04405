"""The simulated node speaks all of vLLM's metrics, with the counts vLLM's own metrics test checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from grayguard.sim.fleet import FleetThread
from grayguard.sim.metrics import ITERATION_TOKENS_BUCKETS, N_BUCKETS, VllmMetrics, build_1_2_5_buckets
from grayguard.sim.model import EngineModel, Finished, ModelParams, StepDone
from grayguard.sim.node import DEFAULT_MODEL

# EXPECTED_METRICS_V1 and HIDDEN_DEPRECATED_METRICS of vLLM's tests/entrypoints/openai/test_metrics.py
# (vllm-project/vllm, the V1-engine version with kv_cache_usage_perc and inter_token_latency_seconds).
EXPECTED_METRICS_V1 = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total",
    "vllm:cache_config_info",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_sum",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count",
    "vllm:request_params_n_sum",
    "vllm:request_params_n_bucket",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_sum",
    "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_sum",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_count",
]
# Shown by vLLM only with --show-hidden-metrics-for-version; its test skips them on a default server,
# and the simulator is a default server.
HIDDEN_DEPRECATED_METRICS = [
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
]

# vLLM's test_metrics_counts: 10 sequential requests, the same tokenized prompt, max_tokens 10
NUM_REQUESTS = 10
PROMPT_TOKENS = 11
MAX_TOKENS = 10

FAST = replace(ModelParams(), decode_s_base=0.003, decode_s_per_seq=0.0001, prefill_s_per_token=1e-5,
               jitter=0.0, emit_interval_s=0.02)


def expected_values(n: int, prompt: int, max_tokens: int) -> dict[str, list[tuple[str, float]]]:
    """{family: [(suffix, value)]}, vLLM's _get_expected_values (time_per_output_token, hidden, is
    replaced by its successor inter_token_latency), plus the prefix-cache counters of the sim."""
    return {
        "vllm:time_to_first_token_seconds": [("_count", n)],
        "vllm:inter_token_latency_seconds": [("_count", n * (max_tokens - 1))],
        "vllm:e2e_request_latency_seconds": [("_count", n)],
        "vllm:request_queue_time_seconds": [("_count", n)],
        "vllm:request_inference_time_seconds": [("_count", n)],
        "vllm:request_prefill_time_seconds": [("_count", n)],
        "vllm:request_decode_time_seconds": [("_count", n)],
        "vllm:request_prompt_tokens": [("_sum", n * prompt), ("_count", n)],
        "vllm:request_generation_tokens": [("_sum", n * max_tokens), ("_count", n)],
        "vllm:request_params_n": [("_sum", n), ("_count", n)],
        "vllm:request_params_max_tokens": [("_sum", n * max_tokens), ("_count", n)],
        "vllm:iteration_tokens_total": [("_sum", n * (prompt + max_tokens)), ("_count", n * max_tokens)],
        "vllm:prompt_tokens": [("_total", n * prompt)],
        "vllm:generation_tokens": [("_total", n * max_tokens)],
        "vllm:request_success": [("_total", n)],  # summed over finished_reason (all are "length")
        "vllm:num_preemptions": [("_total", 0)],
        "vllm:prefix_cache_queries": [("_total", n * prompt)],  # every prompt token looked up...
        "vllm:prefix_cache_hits": [("_total", 0)],  # ...and missed: the sim has no prefix reuse
    }


@pytest.fixture(scope="module")
def scraped():
    """Families of a node's /metrics after vLLM's known set of requests, sent one after another."""
    with FleetThread(n=1, seed=1, params=FAST) as ft:
        url = ft.nodes[0].url
        for _ in range(NUM_REQUESTS):
            r = requests.post(url + "/v1/completions", timeout=10, json={
                "model": DEFAULT_MODEL, "prompt": list(range(1, PROMPT_TOKENS + 1)), "max_tokens": MAX_TOKENS})
            assert r.status_code == 200, r.text
            assert r.json()["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS,
                                         "total_tokens": PROMPT_TOKENS + MAX_TOKENS}
        text = requests.get(url + "/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_series_of_vllms_metrics_test_is_exposed(scraped):
    names = set(scraped) | {s.name for f in scraped.values() for s in f.samples}
    missing = [m for m in EXPECTED_METRICS_V1 if m not in HIDDEN_DEPRECATED_METRICS and m not in names]
    assert not missing, missing
    shown = [m for m in HIDDEN_DEPRECATED_METRICS if m in names]
    assert not shown, shown


def test_counts_after_known_requests(scraped):
    for family, suffixes in expected_values(NUM_REQUESTS, PROMPT_TOKENS, MAX_TOKENS).items():
        assert family in scraped, family
        for suffix, want in suffixes:
            got = [s.value for s in scraped[family].samples if s.name == family + suffix]
            assert got, family + suffix
            assert sum(got) == want, (family + suffix, got, want)


def test_new_families_types_labels_buckets(scraped):
    kinds = {"vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
             "vllm:iteration_tokens_total": "histogram", "vllm:request_params_n": "histogram",
             "vllm:request_params_max_tokens": "histogram", "vllm:cache_config_info": "gauge"}
    for name, kind in kinds.items():
        assert scraped[name].type == kind, name
    for name in list(kinds)[:-1]:
        for s in scraped[name].samples:
            assert s.labels["model_name"] == DEFAULT_MODEL and s.labels["engine"] == "0", s

    def buckets(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in scraped[name].samples if s.name.endswith("_bucket")]

    assert buckets("vllm:iteration_tokens_total") == [*ITERATION_TOKENS_BUCKETS, float("inf")]
    assert buckets("vllm:request_params_n") == [*N_BUCKETS, float("inf")]
    assert buckets("vllm:request_params_max_tokens") == [*build_1_2_5_buckets(FAST.max_model_len), float("inf")]
    # every request asked for n=1: all in the first bucket
    first = next(s for s in scraped["vllm:request_params_n"].samples if s.name.endswith("_bucket"))
    assert first.labels["le"] == "1.0" and first.value == NUM_REQUESTS


def test_cache_config_info_describes_the_kv_cache(scraped):
    (info,) = scraped["vllm:cache_config_info"].samples
    assert info.value == 1
    labels = info.labels
    assert "model_name" not in labels and labels["engine"] == "0"
    assert labels["block_size"] == str(FAST.block_size)
    assert labels["num_gpu_blocks"] == str(FAST.kv_cache_tokens // FAST.block_size)
    assert labels["kv_cache_size_tokens"] == str(FAST.kv_cache_tokens)
    assert labels["enable_prefix_caching"] == "True"
    assert {"gpu_memory_utilization", "cache_dtype", "num_gpu_blocks_override", "sliding_window",
            "num_cpu_blocks"} <= set(labels)


@pytest.mark.parametrize(("n", "status"), [(1, 200), (2, 400), (0, 400), ("1", 400)])
def test_n_parameter(n, status):
    with FleetThread(n=1, seed=1, params=FAST) as ft:
        r = requests.post(ft.nodes[0].url + "/v1/completions", timeout=10,
                          json={"prompt": "hello", "max_tokens": 2, "n": n})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "n"


# -- virtual time: the engine model drives the metrics directly -------------------------------------
def run(params: ModelParams, requests_: list[tuple[int, int]], metrics: VllmMetrics) -> None:
    """Submit (prompt, max_tokens) requests at t=0, step the engine to the end, feed every event."""
    engine = EngineModel(params, seed=3)
    for i, (prompt, max_tokens) in enumerate(requests_):
        engine.submit(f"r{i}", prompt, max_tokens, 0.0)
    now, steps = 0.0, 0
    while (at := engine.next_event_time()) != float("inf"):
        now = max(now, at)
        for ev in engine.advance(now):
            if type(ev) is StepDone:
                metrics.observe_step(ev)
            elif type(ev) is Finished:
                metrics.observe_finished(ev, max_tokens=requests_[int(ev.req_id[1:])][1])
        steps += 1
        assert steps < 100_000


def value(m: VllmMetrics, name: str) -> float:
    v = m.registry.get_sample_value(name, {"model_name": "m", "engine": "0"})
    assert v is not None, name
    return v


def test_iteration_tokens_skip_a_step_without_output():
    """A prompt larger than the step budget prefills in chunks; only the step that samples counts."""
    params = replace(FAST, max_num_batched_tokens=512)
    m = VllmMetrics("m", params.max_model_len)
    run(params, [(1500, 4)], m)  # chunks 512, 512, 476 (first token), then 3 decodes
    assert value(m, "vllm:iteration_tokens_total_count") == 4
    assert value(m, "vllm:iteration_tokens_total_sum") == 1500 + 4
    assert value(m, "vllm:prefix_cache_queries_total") == 1500
    assert value(m, "vllm:prefix_cache_hits_total") == 0


def test_batched_iterations_add_up():
    """Concurrent requests share steps: fewer iterations, same token totals."""
    m = VllmMetrics("m", FAST.max_model_len)
    reqs = [(100, 8), (50, 3), (200, 5)]
    run(FAST, reqs, m)
    assert value(m, "vllm:iteration_tokens_total_sum") == sum(p + g for p, g in reqs)
    assert value(m, "vllm:iteration_tokens_total_count") == max(g for _, g in reqs)
    assert value(m, "vllm:request_params_max_tokens_sum") == sum(g for _, g in reqs)
    assert value(m, "vllm:request_params_n_count") == len(reqs)
    assert value(m, "vllm:prefix_cache_queries_total") == value(m, "vllm:prompt_tokens_total")


def test_a_finished_request_without_max_tokens_is_not_observed():
    m = VllmMetrics("m", 1024)
    run(FAST, [(10, 2)], m)
    assert value(m, "vllm:request_params_max_tokens_count") == 1
    m2 = VllmMetrics("m", 1024)
    engine = EngineModel(FAST)
    engine.submit("a", 10, 2, 0.0)
    events = [ev for t in (0.0, 1.0, 2.0) for ev in engine.advance(t)]
    (fin,) = [ev for ev in events if type(ev) is Finished]
    m2.observe_finished(fin)
    assert value(m2, "vllm:request_params_max_tokens_count") == 0
    assert value(m2, "vllm:request_params_n_count") == 1
