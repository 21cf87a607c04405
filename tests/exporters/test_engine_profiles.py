"""Engine profiles, pure: each engine's fixture page (tests/fixtures/engines/, from its own metric definitions) read by
the exporter's parser into EngineLoad, what each engine cannot give absent (not zero), and the probe's dialects."""

from __future__ import annotations

from pathlib import Path

import pytest

from grayguard.engines import ENGINES, PROFILES, profile
from grayguard.exporters.engineload import EngineLoad, parse_engine_load
from grayguard.exporters.hang import token_progress
from grayguard.exporters.live import Reading, add_reading, live_signals
from grayguard.exporters.probe import (
    Observation,
    ProbeResult,
    classify,
    completion_request,
    triton_event,
    triton_request,
)
from grayguard.exporters.synthetic import NONE, Tally, Traffic, account, probe_tally
from grayguard.exporters.traffic import TrafficCollector

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def page(engine: str) -> str:
    return (FIXTURES / f"{engine}.metrics.txt").read_text()


EXPECTED = {
    "sglang": EngineLoad(generation_tokens=52000.0, running=6.0, prompt_tokens=90000.0, waiting=2.0, itl_sum=1000.0,
                         itl_count=50000.0, ttft_sum=60.0, ttft_count=400.0, kv_usage=0.42, requests=400.0,
                         request_seconds=1200.0, request_prompt_tokens=88000.0, request_generation_tokens=50000.0),
    # no TTFT, no KV usage; the decode step time stands for the inter-token latency (per step, not per token)
    "tgi": EngineLoad(generation_tokens=50000.0, running=6.0, prompt_tokens=88000.0, waiting=2.0, itl_sum=180.0,
                      itl_count=9000.0, requests=400.0, request_seconds=1200.0, request_prompt_tokens=88000.0,
                      request_generation_tokens=50000.0, steps=9350.0, itl_per_token=False),
    # no finished-request count, no TTFT, no KV usage in this (late-2025) build; 6 significant digits as printed;
    # the slots' busy seconds (prefill + decode) and tokens stand for the per-request sums
    "llamacpp": EngineLoad(generation_tokens=50000.0, running=4.0, prompt_tokens=1234570.0, waiting=1.0,
                           itl_sum=1000.0, itl_count=50000.0, steps=9500.0, request_seconds=1617.0,
                           request_prompt_tokens=1234570.0, request_generation_tokens=50000.0),
    # no tokens at all: steps, queues, KV usage, the ensemble's TTFT (ms -> s), its successful requests and their
    # seconds (us -> s)
    "triton": EngineLoad(running=6.0, waiting=2.0, ttft_sum=60.0, ttft_count=400.0, kv_usage=0.42, steps=9500.0,
                         requests=400.0, request_seconds=1200.0, request_tokens=False),
}


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_the_parser_reads_each_engines_fixture_page(engine):
    assert parse_engine_load(page(engine), engine) == EXPECTED[engine]


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_each_fixture_names_the_source_it_was_taken_from(engine):
    header = "\n".join(line for line in page(engine).splitlines() if line.startswith("# ") and "HELP" not in line
                       and "TYPE" not in line)
    repo = profile(engine).source.split()[0]
    assert repo in header and ("commit" in header or "build" in header or "releases" in header), header


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_another_engines_page_reads_as_nothing(engine):
    """An exporter started with the wrong --engine reads no series (absent), never zeros."""
    other = "tgi" if engine != "tgi" else "sglang"
    assert parse_engine_load(page(other), engine) == EngineLoad(itl_per_token=profile(engine).itl_per_token,
                                                                request_tokens=not profile(engine).per_request)
    assert parse_engine_load(page(engine), "vllm") == EngineLoad()


def test_every_name_a_profile_reads_is_on_its_fixture_page_or_an_older_builds():
    older = {"sglang": {"sglang:time_per_output_token_seconds_sum", "sglang:time_per_output_token_seconds_count"},
             "llamacpp": {"llamacpp:kv_cache_usage_ratio"}, "tgi": set(), "triton": set()}
    for engine in EXPECTED:
        text = page(engine)
        missing = {n for n in profile(engine).names() if f"\n{n}{{" not in text and f"\n{n} " not in text}
        assert missing <= older[engine], (engine, missing)


def test_sglang_before_realtime_tokens_reads_its_per_request_token_counters():
    text = "\n".join(line for line in page("sglang").splitlines() if "realtime_tokens" not in line)
    load = parse_engine_load(text, "sglang")
    assert (load.generation_tokens, load.prompt_tokens) == (50000.0, 88000.0)


def test_sglang_with_the_older_tpot_histogram_reads_it_as_the_itl():
    text = page("sglang").replace("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
    assert parse_engine_load(text, "sglang").itl_sum == 1000.0


def test_llamacpp_builds_with_the_kv_gauge_give_kv_usage():
    text = page("llamacpp") + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.63\n"
    assert parse_engine_load(text, "llamacpp").kv_usage == 0.63


def test_triton_without_the_fraction_gauge_divides_used_by_max_blocks():
    text = "\n".join(line for line in page("triton").splitlines() if 'kv_cache_block_type="fraction"' not in line)
    assert parse_engine_load(text, "triton").kv_usage == 2620 / 6240
    no_max = "\n".join(line for line in text.splitlines() if 'kv_cache_block_type="max"' not in line)
    assert parse_engine_load(no_max, "triton").kv_usage is None  # half a ratio is no evidence


def test_triton_counts_the_ensembles_first_responses_not_its_composing_models():
    extra = 'nv_inference_first_response_histogram_ms_sum{model="postprocessing",version="1"} 999\n'
    assert parse_engine_load(page("triton") + extra, "triton").ttft_sum == 60.0


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_an_unreadable_sample_spoils_its_series_only(engine):
    series = profile(engine).running[0][0]
    lines = page(engine).splitlines()
    broken = [(ln.rsplit(" ", 1)[0] + " NaN") if ln.startswith(series.name) and all(
        f'{k}="{v}"' in ln for k, v in series.match) else ln for ln in lines]
    load = parse_engine_load("\n".join(broken), engine)
    assert load.running is None
    assert load.waiting == EXPECTED[engine].waiting


def test_label_values_with_escapes_and_commas_are_read():
    text = 'tgi_request_failure{err="a,b=\\"c\\"}"} 2\ntgi_request_duration_count{le="x"} 1\n'
    assert parse_engine_load(text, "tgi").requests == 1.0
    assert parse_engine_load('tgi_queue_size{x="}"} 3\n', "tgi").waiting == 3.0


def test_profiles_cover_every_engine_and_unknown_names_are_refused():
    assert set(PROFILES) == set(ENGINES)
    with pytest.raises(KeyError, match="known: vllm, sglang"):
        profile("ollama")


# --- what the readings feed --------------------------------------------------------------------------------------

def test_engine_steps_are_progress_where_tokens_are_counted_late():
    """TGI counts generated tokens when a request ends: a long generation still moves its forward passes."""
    before = EngineLoad(generation_tokens=100, prompt_tokens=50, running=1, waiting=0, steps=10)
    stepping = EngineLoad(generation_tokens=100, prompt_tokens=50, running=1, waiting=0, steps=14)
    stuck = EngineLoad(generation_tokens=100, prompt_tokens=50, running=1, waiting=0, steps=10)
    assert not token_progress(before, stepping, 2.0).hung
    assert token_progress(before, stuck, 2.0).hung
    restarted = EngineLoad(generation_tokens=100, prompt_tokens=50, running=1, waiting=0, steps=3)
    assert token_progress(before, restarted, 2.0) is None


def test_triton_steps_alone_are_evidence():
    assert token_progress(EngineLoad(running=1, steps=5), EngineLoad(running=1, steps=9), 2.0).tokens == 4
    assert token_progress(EngineLoad(running=1), EngineLoad(running=1), 2.0) is None  # nothing counted: no evidence


def test_tgi_step_times_give_a_live_itl_but_no_decode_batch():
    def reading(at, n):
        return Reading(at, EngineLoad(itl_sum=0.02 * n, itl_count=float(n), running=4, itl_per_token=False))
    kept = ()
    for i in range(7):
        kept = add_reading(kept, reading(100.0 + i, 50 * i), 5.0)
    live = live_signals(kept, (), 106.0, 5.0)
    assert live.itl == pytest.approx(0.02)
    assert live.decode_batch is None
    assert live.ttft is None and live.kv_usage is None  # TGI has neither


def test_an_engine_whose_steps_went_back_restarted():
    """Triton counts no tokens: its iteration counter going back is the restart that drops the older readings."""
    kept = ()
    for at, steps in ((100.0, 50.0), (101.0, 60.0), (102.0, 3.0)):
        kept = add_reading(kept, Reading(at, EngineLoad(running=1, steps=steps, ttft_sum=0.0, ttft_count=0.0)), 5.0)
    assert [r.at for r in kept] == [102.0]


def test_the_openai_probe_asks_usage_only_of_engines_that_take_continuous_usage_stats():
    assert "stream_options" in completion_request("m", "p", "[x]", usage_options=profile("sglang").usage_options)
    for engine in ("tgi", "llamacpp"):
        body = completion_request("m", "p", "[x]", usage_options=profile(engine).usage_options)
        assert body == {"model": "m", "prompt": "[x] p", "max_tokens": 1, "temperature": 0, "stream": True}


def test_the_triton_probe_and_its_events():
    assert triton_request("p", "[x]") == {"text_input": "[x] p", "max_tokens": 1, "temperature": 0.0, "stream": True}
    ok = triton_event('{"model_name":"ensemble","model_version":"1","sequence_end":false,"text_output":" Paris"}')
    assert classify(Observation(status=200, first_event=ok, ttft=0.05), 0.3) == ProbeResult.OK
    garbage = triton_event('{"model_name":"ensemble","text_output":"\\ufffd"}')
    assert classify(Observation(status=200, first_event=garbage, ttft=0.05), 0.3) == ProbeResult.BAD_RESPONSE
    err = triton_event('{"error":"CUDA error: an illegal memory access was encountered"}')
    assert classify(Observation(status=200, first_event=err, ttft=0.05), 0.3) == ProbeResult.CUDA_ERROR
    assert classify(Observation(status=200, first_event=triton_event("not json"), ttft=0.05), 0.3) \
        == ProbeResult.BAD_RESPONSE


# --- Triton: seconds per request ---------------------------------------------------------------------------------

def test_only_triton_counts_requests_without_tokens():
    assert [e for e in ENGINES if profile(e).per_request] == ["triton"]


def test_triton_reads_the_probed_models_requests_when_probe_model_names_another():
    extra = ('nv_inference_request_success{model="llama",version="1"} 7\n'
             'nv_inference_request_duration_us{model="llama",version="1"} 3500000\n'
             'nv_inference_request_failure{model="llama",reason="BACKEND",version="1"} 1\n')
    load = parse_engine_load(page("triton") + extra, "triton", model="llama")
    assert (load.requests, load.request_seconds) == (7.0, 3.5)
    assert load.ttft_sum is None  # the ensemble's first responses are not this model's
    assert parse_engine_load(page("triton") + extra, "triton", model="ensemble") == EXPECTED["triton"]
    assert parse_engine_load(page("sglang"), "sglang", model="llama") == EXPECTED["sglang"]  # not per model


def _triton(requests: float, us: float) -> EngineLoad:
    return parse_engine_load(f'nv_inference_request_success{{model="ensemble",version="1"}} {requests:g}\n'
                             f'nv_inference_request_duration_us{{model="ensemble",version="1"}} {us:g}\n', "triton")


def test_tritons_traffic_is_its_requests_and_seconds_less_the_probes_without_tokens():
    t = account(Traffic(), _triton(100, 50_000_000), NONE, 0.0)
    probe = probe_tally(0.1, None, None)  # no usage report: 1 generated token, which Triton never counted
    assert probe.generation_tokens == 1.0
    # in the next second: 4 requests of 0.5 s and 2 probes of 0.1 s
    t = account(t, _triton(106, 52_200_000), probe * 2, 1.0)
    assert t.total == Tally(4.0, pytest.approx(2.0), 0.0, 0.0) and not t.tokens
    assert t.owed == NONE  # the probes' token never counted is not a debt
    fams = {f.name: f.samples[0].value for f in TrafficCollector(lambda: t).collect()}
    assert fams == {"grayguard_traffic_requests": 4.0, "grayguard_traffic_request_seconds": pytest.approx(2.0)}


def test_an_interval_of_only_probes_leaves_tritons_traffic_flat_and_teaches_the_gap():
    t = account(Traffic(), _triton(100, 50_000_000), NONE, 0.0)
    probe = probe_tally(0.12, None, None)
    t = account(t, _triton(102, 50_200_000), probe * 2, 1.0)  # two probes, Triton saw 0.1 s of each
    assert t.total == NONE and t.gap == pytest.approx(0.2 * 0.02)


def test_vllms_traffic_keeps_its_four_counters():
    load = EngineLoad(requests=1.0, request_seconds=0.5, request_prompt_tokens=10.0, request_generation_tokens=5.0)
    t = account(account(Traffic(), load, NONE, 0.0), EngineLoad(requests=3.0, request_seconds=1.5,
                request_prompt_tokens=30.0, request_generation_tokens=15.0), NONE, 1.0)
    assert t.tokens and len(list(TrafficCollector(lambda: t).collect())) == 4
    assert account(Traffic(), EngineLoad(requests=1.0, request_seconds=0.5), NONE, 0.0).vllm is None  # tokens absent
