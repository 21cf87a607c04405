"""The live fast path, pure: parsing the histogram series, the live window and the probe TTFT median."""

from __future__ import annotations

import pytest

from grayguard.exporters.engineload import EngineLoad, parse_engine_load
from grayguard.exporters.live import (
    Answer,
    LiveSignals,
    Reading,
    add_answer,
    add_reading,
    live_signals,
    probe_ttft_median,
)
from grayguard.exporters.synthetic import probe_tally

W = 5.0

PAGE = """\
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 12.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 500.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 2.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 100.0
vllm:inter_token_latency_seconds_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 20.0
vllm:generation_tokens_total{engine="0",model_name="m"} 620.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 9000.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 99.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 9.0
"""


def load(tokens=0.0, itl=(0.0, 0.0), ttft=(0.0, 0.0), running=1.0, waiting=0.0) -> EngineLoad:
    return EngineLoad(generation_tokens=tokens, running=running, waiting=waiting, itl_sum=itl[0], itl_count=itl[1],
                      ttft_sum=ttft[0], ttft_count=ttft[1])


def feed(*readings: tuple[float, EngineLoad], window: float = W) -> tuple[Reading, ...]:
    kept: tuple[Reading, ...] = ()
    for at, engine in readings:
        kept = add_reading(kept, Reading(at, engine), window)
    return kept


def steady(seconds: int, itl: float = 0.02, ttft: float = 0.1, tokens_per_s: float = 100.0,
           start: float = 100.0) -> list[tuple[float, EngineLoad]]:
    """One reading a second of a node generating tokens_per_s with the given per-token latencies."""
    out = []
    for i in range(seconds + 1):
        n = tokens_per_s * i
        out.append((start + i, load(n, (itl * n, n), (ttft * i, float(i)), running=4, waiting=2)))
    return out


# --- parsing --------------------------------------------------------------------------------------------------

def test_parse_reads_histogram_sums_and_counts_summed_over_label_sets():
    assert parse_engine_load(PAGE) == EngineLoad(generation_tokens=620, running=7, prompt_tokens=9000, waiting=1,
                                                 itl_sum=15.0, itl_count=600, ttft_sum=4.0, ttft_count=20)


def test_parse_old_vllm_tpot_name_when_the_new_one_is_absent():
    old = PAGE.replace("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
    parsed = parse_engine_load(old)
    assert (parsed.itl_sum, parsed.itl_count) == (15.0, 600)
    both = PAGE + 'vllm:time_per_output_token_seconds_sum{engine="0"} 77\n'  # vLLM 0.11 shows both: the new wins
    assert parse_engine_load(both).itl_sum == 15.0


@pytest.mark.parametrize("text, expected", [
    ("vllm:inter_token_latency_seconds_count 5\n", EngineLoad(itl_count=5.0)),  # sum absent: None, not 0
    ("vllm:inter_token_latency_seconds_sum 1\nvllm:inter_token_latency_seconds_count NaN\n"
     "vllm:time_per_output_token_seconds_count 3\n", EngineLoad(itl_sum=1.0)),  # new name broken: no fallback
    ('vllm:time_to_first_token_seconds_sum{a="1"} 2\nvllm:time_to_first_token_seconds_sum{a="2"} x\n', EngineLoad()),
    ("", EngineLoad()),
])
def test_parse_missing_or_broken_histogram_series_is_none(text, expected):
    assert parse_engine_load(text) == expected


def test_parse_kv_cache_usage_is_the_fullest_engines_new_name_first():
    page = ('vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.75\n'
            'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n')
    assert parse_engine_load(page).kv_usage == 0.75  # a share: the fullest engine's, never a sum over engines
    assert parse_engine_load('vllm:gpu_cache_usage_perc{engine="0"} 0.4\n').kv_usage == 0.4  # vLLM before 0.10
    assert parse_engine_load(PAGE).kv_usage is None  # absent is not zero
    assert parse_engine_load('vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} NaN\n'
                             ).kv_usage is None  # one unreadable engine: no evidence


def test_live_kv_usage_is_the_newest_readings_with_or_without_a_span():
    one = feed((100.0, EngineLoad(running=2, kv_usage=0.3)))
    assert live_signals(one, (), 100.5).kv_usage == 0.3  # no span yet: known like running and waiting
    many = feed(*steady(6), (106.5, EngineLoad(generation_tokens=700, running=4, waiting=2, itl_sum=14.0,
                                                 itl_count=700, ttft_sum=0.6, ttft_count=6, kv_usage=0.6)))
    assert live_signals(many, (), 107.0).kv_usage == 0.6
    assert live_signals(many, (), 120.0).kv_usage is None  # a stuck prober says nothing


# --- the live window ------------------------------------------------------------------------------------------

def test_normal_flow_uses_the_latest_reading_at_least_w_older():
    readings = feed(*steady(12))
    assert [r.at for r in readings] == [107.0, 108.0, 109.0, 110.0, 111.0, 112.0]  # the base and what follows
    s = live_signals(readings, (), now=112.3)
    assert s.span == 5.0
    assert s.itl == pytest.approx(0.02) and s.ttft == pytest.approx(0.1)
    assert s.tokens_per_second == pytest.approx(100.0)
    assert (s.running, s.waiting) == (4, 2)


def test_irregular_readings_span_at_least_w():
    times = [100.0, 101.1, 102.3, 103.2, 104.4, 105.3, 106.0]
    readings = feed(*[(t, load(10 * (t - 100), (0.5 * (t - 100), 10 * (t - 100)))) for t in times])
    s = live_signals(readings, (), now=106.0)
    assert s.span == pytest.approx(6.0)  # 106.0 - 101.1 < W: the base is 100.0, the latest reading >= W older
    assert s.itl == pytest.approx(0.05) and s.tokens_per_second == pytest.approx(10.0)


def test_no_token_in_the_window_is_no_data_not_zero():
    frozen = [(100.0 + i, load(500, (10.0, 500), (3.0, 30), running=3)) for i in range(8)]
    s = live_signals(feed(*frozen), (), now=107.0)
    assert s.itl is None and s.ttft is None
    assert s.tokens_per_second == 0.0  # a measured rate: nothing generated
    assert s.running == 3 and s.span == 5.0


def test_ttft_none_when_no_first_token_while_itl_known():
    readings = feed((100.0, load(0, (0, 0), (1.0, 4))), (105.0, load(100, (2.0, 100), (1.0, 4))))
    s = live_signals(readings, (), now=105.0)
    assert s.itl == pytest.approx(0.02) and s.ttft is None


def probe_readings(real: tuple[float, int], probes_per_s: int = 1, probe_ttft: float = 0.02,
                   seconds: int = 10) -> tuple[Reading, ...]:
    """One reading a second of a node whose TTFT histogram gets real first tokens (sum, count a second) and the
    exporter's probes, each reading with the tally of the probes that ended before it."""
    kept: tuple[Reading, ...] = ()
    for i in range(seconds + 1):
        n = probes_per_s * i
        engine = load(100 * i, (2.0 * i, 100 * i), (real[0] * i + probe_ttft * n, float(real[1] * i + n)))
        kept = add_reading(kept, Reading(100.0 + i, engine, probe_tally(probe_ttft, 12, 1) * n), W)
    return kept


def test_live_ttft_leaves_the_exporters_own_probes_out():
    # 2 real first tokens a second at 0.5 s each, and one probe a second at 20 ms
    s = live_signals(probe_readings((1.0, 2)), (), now=110.0)
    assert s.ttft == pytest.approx(0.5)
    with_probes = feed(*[(r.at, r.load) for r in probe_readings((1.0, 2))])  # without the tally: probes included
    assert live_signals(with_probes, (), now=110.0).ttft == pytest.approx(1.02 / 3)


def test_live_ttft_of_a_node_with_only_probes_is_no_data():
    s = live_signals(probe_readings((0.0, 0)), (), now=110.0)
    assert s.ttft is None
    assert s.itl == pytest.approx(0.02)  # a 1-token probe has no inter-token gap: the ITL never saw one
    assert s.tokens_per_second == pytest.approx(100.0)  # load signals stay vLLM's: the probes' work is work


def test_counter_reset_drops_the_older_readings():
    before = steady(6)
    restarted = [(107.0 + i, load(10 * i, (0.1 * i, 10 * i), (0.5 * i, i))) for i in range(5)]
    readings = feed(*before, *restarted)
    assert readings[0].at == 107.0  # nothing from before the restart
    assert live_signals(readings[:1], (), now=107.0).itl is None  # right after the restart: no span yet
    s = live_signals(readings, (), now=111.0)  # 4 s of the restarted vLLM >= W/2: the fallback span
    assert s.span == 4.0 and s.itl == pytest.approx(0.01) and s.tokens_per_second == pytest.approx(10)
    one = feed(*before, (107.0, load(700, (0.5, 5), (99.0, 99))))  # the token counter went on, ITL went back
    assert [r.at for r in one] == [107.0]


def test_a_counter_gone_back_between_base_and_newest_is_none():
    readings = (Reading(100.0, load(500, (10, 500))), Reading(105.0, load(40, (1, 40))))  # not via add_reading
    s = live_signals(readings, (), now=105.0)
    assert s.itl is None and s.tokens_per_second is None and s.running == 1


@pytest.mark.parametrize("missing", ["itl_sum", "itl_count", "ttft_sum", "generation_tokens"])
def test_a_missing_series_makes_its_value_none(missing):
    start, end = load(0, (0, 0), (0, 0)), load(100, (2.0, 100), (0.5, 5))
    for at_end in (True, False):
        a = start if at_end else EngineLoad(**{**start.__dict__, missing: None})
        b = EngineLoad(**{**end.__dict__, missing: None}) if at_end else end
        s = live_signals(feed((100.0, a), (105.0, b)), (), now=105.0)
        values = {"itl_sum": s.itl, "itl_count": s.itl, "ttft_sum": s.ttft, "generation_tokens": s.tokens_per_second}
        assert values[missing] is None
        assert sum(v is not None for v in (s.itl, s.ttft, s.tokens_per_second)) == 2


def test_a_failed_read_is_a_reading_without_series():
    readings = feed(*steady(6), (107.0, EngineLoad()))
    assert live_signals(readings, (), now=107.0) == LiveSignals(span=5.0)
    assert live_signals(feed(*steady(6), (107.0, EngineLoad()), *steady(6, start=108.0)[:1]), (), 108.0).itl is None


def test_fallback_span_needs_half_a_window():
    early = steady(2)  # 100, 101, 102
    s = live_signals(feed(*early), (), now=102.0)
    assert s.span is None and s.itl is None and (s.running, s.waiting) == (4, 2)  # the gauges are known at once
    s = live_signals(feed(*steady(3)), (), now=103.0)  # 3 s >= W/2: the oldest reading is the base
    assert s.span == 3.0 and s.itl == pytest.approx(0.02) and s.tokens_per_second == pytest.approx(100)
    s = live_signals(feed(*steady(2)[:1], (102.5, steady(3)[3][1])), (), now=102.5)  # exactly W/2
    assert s.span == 2.5


def test_a_single_reading_has_no_span_whatever_the_window():
    one = (Reading(100.0, load(5, (1, 5))),)
    assert live_signals(one, (), now=100.0, window=0.0) == LiveSignals(running=1, waiting=0)


def test_a_stale_newest_reading_says_nothing():
    readings = feed(*steady(6))
    assert live_signals(readings, (), now=106.0 + W).itl is not None
    assert live_signals(readings, (), now=106.0 + W + 0.1) == LiveSignals()


def test_window_is_a_parameter():
    readings = feed(*steady(6), window=2.0)
    assert [r.at for r in readings] == [104.0, 105.0, 106.0]
    assert live_signals(readings, (), now=106.0, window=2.0).span == 2.0


def test_an_out_of_order_reading_is_ignored():
    readings = feed(*steady(3))
    assert add_reading(readings, Reading(102.5, load()), W) == readings


# --- the probe median -----------------------------------------------------------------------------------------

def answers(*pairs: tuple[float, float]) -> tuple[Answer, ...]:
    out: tuple[Answer, ...] = ()
    for at, ttft in pairs:
        out = add_answer(out, Answer(at, ttft))
    return out


def test_probe_median_of_the_last_five():
    a = answers((100, 9.0), (101, 0.1), (102, 0.3), (103, 0.2), (104, 0.5), (105, 0.4))
    assert len(a) == 5 and a[0].ttft == 0.1
    assert probe_ttft_median(a, now=105.0, window=W) == 0.3
    assert live_signals((), a, now=105.0).probe_ttft_median == 0.3  # known without any vLLM reading


def test_probe_median_needs_three_recent_probes():
    assert probe_ttft_median(answers((100, 0.1), (101, 0.2)), now=101.0, window=W) is None
    three = answers((100, 0.1), (101, 0.2), (102, 0.9))
    assert probe_ttft_median(three, now=102.0, window=W) == 0.2
    assert probe_ttft_median(answers((100, 0.1), (101, 0.2), (102, 0.9), (103, 0.3)), 103.0, W) == 0.25


def test_stale_probes_are_dropped_from_the_median():
    a = answers((90, 5.0), (95, 5.0), (100, 0.1), (101, 0.2), (102, 0.3))
    assert probe_ttft_median(a, now=102.0, window=W) == pytest.approx(0.25)  # 90 ended more than 2 W ago
    assert probe_ttft_median(a, now=105.0, window=W) == pytest.approx(0.25)  # 95 ended exactly 2 W ago: kept
    assert probe_ttft_median(a, now=105.5, window=W) == pytest.approx(0.2)  # 0.1 0.2 0.3
    assert probe_ttft_median(a, now=110.5, window=W) is None  # only 101 and 102 left
