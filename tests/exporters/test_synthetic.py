"""The node's own traffic, pure: vLLM's finished requests less the exporter's probes, reading by reading."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.exporters.engineload import EngineLoad, parse_engine_load
from grayguard.exporters.synthetic import NONE, Tally, Traffic, account, probe_tally, vllm_tally

PROBE = probe_tally(0.02, 12, 1)  # one answered probe: 20 ms, 12 prompt tokens, 1 generated


def page(t: Tally) -> EngineLoad:
    """A reading of vLLM whose per-request histograms hold t."""
    return EngineLoad(requests=t.requests, request_seconds=t.seconds, request_prompt_tokens=t.prompt_tokens,
                      request_generation_tokens=t.generation_tokens)


def close(a: Tally, b: Tally, tol: float = 1e-9) -> bool:
    return all(abs(getattr(a, f) - getattr(b, f)) <= tol for f in ("requests", "seconds", "prompt_tokens",
                                                                   "generation_tokens"))


def run(intervals: list[tuple[Tally, Tally]], start: Tally = NONE) -> Traffic:
    """Feed one reading per interval: (what vLLM counted since the last reading, what the probe tally grew by)."""
    vllm, probes = start, NONE
    t = account(Traffic(), page(vllm), probes, 0.0)
    for i, (counted, tallied) in enumerate(intervals, 1):
        vllm, probes = vllm + counted, probes + tallied
        t = account(t, page(vllm), probes, float(i))
    return t


def test_parse_reads_the_per_request_histograms_the_rules_read():
    text = """\
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 30.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 12.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="m"} 1.5
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 4000.0
vllm:request_prompt_tokens_bucket{engine="0",le="1.0",model_name="m"} 0.0
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 900.0
"""
    load = parse_engine_load(text)
    assert vllm_tally(load) == Tally(15.0, 32.0, 4000.0, 900.0)
    assert vllm_tally(parse_engine_load(text.replace("request_generation_tokens_sum", "x"))) is None  # absent


def test_probe_tally_without_usage_is_one_generated_token_and_no_prompt():
    assert probe_tally(0.5, None, None) == Tally(1.0, 0.5, 0.0, 1.0)
    assert probe_tally(0.5, 9, 1) == Tally(1.0, 0.5, 9.0, 1.0)


def test_a_node_whose_only_traffic_is_probes_has_none():
    t = run([(PROBE, PROBE)] * 30)
    assert t.total == NONE


def test_real_requests_are_counted_whole_beside_the_probes():
    real = Tally(2.0, 7.0, 900.0, 300.0)  # two requests in an interval
    t = run([(real + PROBE, PROBE)] * 10)
    assert close(t.total, Tally(20.0, 70.0, 9000.0, 3000.0))


def test_the_first_reading_is_the_base_and_counts_nothing():
    t = account(Traffic(), page(Tally(1000.0, 5000.0, 1e6, 2e5)), NONE, 0.0)
    assert t.total == NONE and t.vllm is not None and t.at == 0.0


def test_a_probe_tallied_before_vllm_counted_it_is_owed_not_lost():
    # interval 1: the exporter tallied the probe sent with the reading, vLLM counts it in interval 2
    real = Tally(1.0, 3.0, 500.0, 100.0)
    t = run([(real, PROBE), (real + PROBE, NONE), (real + PROBE, PROBE)])
    assert close(t.total, Tally(3.0, 9.0, 1500.0, 300.0))


def test_a_probe_vllm_counted_before_the_exporter_tallied_it_is_repaid_later():
    t = run([(PROBE, NONE), (NONE, PROBE)] + [(PROBE, PROBE)] * 5)  # only probes: at most one shows, once
    assert t.total.requests <= 1.0
    t = run([(PROBE, NONE), (NONE, PROBE), (PROBE, NONE), (NONE, PROBE), (PROBE, PROBE)])
    assert t.total.requests <= 1.0  # the second one is paid by the debt of the first: no pile-up


def test_the_exporters_longer_ttft_does_not_pile_up_a_debt():
    # vLLM's e2e of each probe is 2 ms shorter than the TTFT the exporter measured: an hour of idle probes
    served = Tally(1.0, 0.018, 12.0, 1.0)
    t = run([(served, PROBE)] * 3600 + [(served + Tally(1.0, 2.0, 100.0, 50.0), PROBE)])
    assert t.total.requests == 1.0
    # the request's 2 s less at most two probes' and its own interval's 2 ms: not 2 s less 7.2 s of drift
    assert 2.0 - 2 * PROBE.seconds - 0.002 - 1e-9 <= t.total.seconds <= 2.0


def prober_loop(intervals: list[Tally], overhead: float, server_e2e: float = 0.02,
                prompt: int | None = 12) -> Traffic:
    """As the prober does it: each interval vLLM finishes the real requests given and one probe (server_e2e s,
    12 prompt tokens), which the exporter measured overhead s longer and tallies with the gap learned so far."""
    vllm = probes = NONE
    t = account(Traffic(), page(vllm), probes, 0.0)
    for i, real in enumerate(intervals, 1):
        vllm = vllm + real + Tally(1.0, server_e2e, 12.0, 1.0)
        probes = probes + probe_tally(server_e2e + overhead, prompt, 1, gap=t.gap)
        t = account(t, page(vllm), probes, float(i))
    return t


def test_the_exporters_http_overhead_is_learned_from_probe_only_intervals():
    idle = prober_loop([NONE] * 40, overhead=0.09)
    assert idle.gap == pytest.approx(0.09, rel=0.01) and idle.total == NONE
    real = Tally(1.0, 1.0, 300.0, 100.0)
    t = prober_loop([NONE] * 40 + [real] * 5, overhead=0.09)
    assert t.total.requests == 5.0 and t.total.prompt_tokens == 1500.0 and t.total.generation_tokens == 500.0
    assert t.total.seconds == pytest.approx(5.0, abs=0.01)  # not 5 s less 5 x 90 ms of HTTP overhead
    busy = prober_loop([real] * 45, overhead=0.09)  # never a probe-only interval: the overhead stays in
    assert busy.total.seconds == pytest.approx(45.0 - 45 * 0.09, abs=0.01)


def test_a_probe_whose_usage_was_not_reported_leaves_no_prompt_on_an_idle_node():
    t = prober_loop([NONE] * 20, overhead=0.0, prompt=None)
    assert t.total == NONE
    t = prober_loop([NONE] * 20 + [Tally(1.0, 1.0, 300.0, 100.0)], overhead=0.0, prompt=None)
    assert t.total.prompt_tokens == 312.0  # beside a real request its prompt stays: 12 tokens of 300


def test_a_vllm_restart_starts_a_new_base_and_keeps_the_counters():
    t = run([(Tally(1.0, 2.0, 10.0, 5.0) + PROBE, PROBE)] * 3)
    before = t.total
    t = account(t, page(Tally(0.0, 0.0, 0.0, 0.0)), t.probes, 10.0)  # counters went back
    assert t.total == before
    t = account(t, page(Tally(1.0, 2.0, 10.0, 5.0) + PROBE), t.probes + PROBE, 11.0)
    assert close(t.total, before + Tally(1.0, 2.0, 10.0, 5.0))


def test_a_reading_without_the_series_changes_nothing_and_the_probes_wait_for_the_next():
    t = run([(PROBE, PROBE)])
    later = account(t, EngineLoad(requests=5.0), t.probes + PROBE, 2.0)  # failed or partial read
    assert later == t
    vllm = t.vllm + PROBE + PROBE + Tally(1.0, 1.0, 1.0, 1.0)  # type: ignore[operator]
    t = account(later, page(vllm), t.probes + PROBE + PROBE, 3.0)
    assert close(t.total, Tally(1.0, 1.0, 1.0, 1.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_traffic_is_the_real_traffic_give_or_take_a_probe(steps):
    """Each interval: r real requests, one probe that vLLM counts before or after the reading, and that the
    exporter tallies before or after it. The counters never go back and stay within a probe of the real ones."""
    req = Tally(1.0, 2.5, 400.0, 120.0)
    vllm = probes = real = NONE
    late_v = late_e = False  # the previous interval's probe is still to come, in vLLM / in the tally
    t = account(Traffic(), page(vllm), probes, 0.0)
    for i, (r, counted_now, tallied_now) in enumerate(steps, 1):
        new = req * r
        real = real + new
        vllm = vllm + new + (PROBE if late_v else NONE) + (PROBE if counted_now else NONE)
        probes = probes + (PROBE if late_e else NONE) + (PROBE if tallied_now else NONE)
        late_v, late_e = not counted_now, not tallied_now
        before = t.total
        t = account(t, page(vllm), probes, float(i))
        for f in ("requests", "seconds", "prompt_tokens", "generation_tokens"):
            got, want, one = getattr(t.total, f), getattr(real, f), getattr(PROBE, f)
            assert got >= getattr(before, f)
            assert want - one - 1e-9 <= got <= want + one + 1e-9, (f, got, want)


@pytest.mark.parametrize("field", ["requests", "seconds", "prompt_tokens", "generation_tokens"])
def test_tally_arithmetic(field):
    a, b = Tally(1.0, 2.0, 3.0, 4.0), Tally(0.5, 0.5, 0.5, 0.5)
    assert getattr(a + b, field) == getattr(a, field) + 0.5
    assert getattr(a - b, field) == getattr(a, field) - 0.5
    assert getattr(a * 3, field) == getattr(a, field) * 3
