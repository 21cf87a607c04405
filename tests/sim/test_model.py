"""The pure latency model: continuous batching, chunked prefill, KV budget, slowdowns, speed classes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.sim.model import (
    SPEED_CLASSES,
    EngineModel,
    Finished,
    FirstToken,
    ModelParams,
    Slowdown,
    StepDone,
    Tokens,
)

EXACT = replace(ModelParams(), jitter=0.0)  # no jitter: exact timings


def run_to_end(engine: EngineModel, start: float = 0.0, limit: int = 1_000_000) -> list:
    """Step an engine in virtual time until it is idle; returns every event."""
    events: list = []
    now = start
    events += engine.advance(now)
    for _ in range(limit):
        t = engine.next_event_time()
        if math.isinf(t):
            return events
        now = max(now, t)
        events += engine.advance(now)
    raise AssertionError("engine did not go idle")


def finished(events) -> dict:
    return {e.req_id: e.stats for e in events if isinstance(e, Finished)}


def single(prompt: int, gen: int, params: ModelParams = EXACT, **kw):
    eng = EngineModel(params, **kw)
    eng.submit("r", prompt, gen, 0.0)
    return finished(run_to_end(eng))["r"]


def test_single_request_timings_match_calibration():
    s = single(1000, 10)
    # one step: decode base + 1000 prefill tokens, then 9 decode steps at batch 1
    assert s.ttft == pytest.approx(0.015 + 1000 * 1e-4)
    assert s.decode == pytest.approx(9 * 0.015)
    assert s.tpot == pytest.approx(0.015)
    assert s.generation_tokens == 10 and s.prompt_tokens == 1000
    assert s.queue == 0.0


@pytest.mark.parametrize("short,long", [(10, 500), (500, 2000), (2000, 8000)])
def test_prefill_grows_with_prompt_length(short, long):
    assert single(long, 2).ttft > single(short, 2).ttft


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    params = replace(EXACT, max_num_batched_tokens=1000)
    s = single(3500, 1, params)
    steps = 4  # 1000+1000+1000+500
    assert s.ttft == pytest.approx(steps * 0.015 + 3500 * 1e-4)


def decode_time_per_token(batch: int) -> float:
    eng = EngineModel(EXACT)
    for i in range(batch):
        eng.submit(f"r{i}", 10, 50, 0.0)
    stats = finished(run_to_end(eng))
    return stats["r0"].tpot


def test_decode_per_token_grows_with_batch_size():
    tpots = [decode_time_per_token(b) for b in (1, 8, 32, 64)]
    assert tpots == sorted(tpots) and tpots[0] < tpots[-1]
    assert tpots[0] == pytest.approx(0.015)
    assert tpots[-1] == pytest.approx(0.030)


def test_max_num_seqs_queues_the_rest():
    params = replace(EXACT, max_num_seqs=4)
    eng = EngineModel(params)
    for i in range(10):
        eng.submit(f"r{i}", 10, 20, 0.0)
    eng.advance(0.0)
    assert eng.num_running == 4 and eng.num_waiting == 6
    stats = finished(run_to_end(eng))
    assert len(stats) == 10
    assert stats["r0"].queue == 0.0
    assert stats["r9"].queue > 0.0
    assert stats["r9"].ttft > stats["r0"].ttft


def test_kv_budget_limits_admission():
    params = replace(EXACT, kv_cache_tokens=4096, block_size=16)
    eng = EngineModel(params)
    for i in range(8):
        eng.submit(f"r{i}", 1500, 4, 0.0)  # ~1504 tokens each: only two fit in 4096
    eng.advance(0.0)
    assert eng.num_running == 2 and eng.num_waiting == 6
    assert len(finished(run_to_end(eng))) == 8


def test_kv_usage_reports_fraction_of_cache():
    params = replace(EXACT, kv_cache_tokens=16_000, block_size=16)
    eng = EngineModel(params)
    eng.submit("r", 4000, 100, 0.0)
    eng.advance(0.0)
    assert eng.kv_usage() == 0.0  # prefill not yet computed
    eng.advance(eng.next_event_time())
    assert eng.kv_usage() == pytest.approx(4000 / 16_000, abs=0.002)


def test_shrunk_cache_reports_usage_against_what_is_left():
    eng = EngineModel(replace(EXACT, kv_cache_tokens=16_000), slowdown=lambda _t: Slowdown(kv_fraction=0.25))
    eng.submit("r", 3000, 100, 0.0)
    eng.advance(0.0)
    eng.advance(eng.next_event_time())
    assert eng.kv_usage() == pytest.approx(3008 / 4000, abs=0.002)


def test_full_cache_preempts_and_recomputes():
    # Tiny KV with growing decodes: the newest sequences are preempted, everything still finishes.
    params = replace(EXACT, kv_cache_tokens=1024, block_size=16)
    eng = EngineModel(params)
    for i in range(4):
        eng.submit(f"r{i}", 200, 200, 0.0)
    stats = finished(run_to_end(eng))
    assert len(stats) == 4
    assert eng.num_preemptions > 0
    assert all(s.generation_tokens == 200 for s in stats.values())


def test_huge_request_runs_alone_rather_than_deadlocking():
    params = replace(EXACT, kv_cache_tokens=512)
    assert single(2000, 3, params).generation_tokens == 3


@pytest.mark.parametrize("k", [2.0, 6.0])
def test_thermal_slowdown_multiplies_every_phase(k):
    base = single(800, 30)
    slow = single(800, 30, slowdown=lambda _t: Slowdown(prefill=k, decode=k))
    assert slow.ttft == pytest.approx(k * base.ttft)
    assert slow.decode == pytest.approx(k * base.decode)
    assert slow.e2e == pytest.approx(k * base.e2e)


def test_pcie_slowdown_hits_decode_and_prefill_separately():
    base_prefill = single(5000, 1)  # prefill-dominated first step
    slow_prefill = single(5000, 1, slowdown=lambda _t: Slowdown(prefill=2.0, decode=4.0))
    # first step = 4 x decode base + 2 x prefill
    assert slow_prefill.ttft == pytest.approx(4 * 0.015 + 2 * (base_prefill.ttft - 0.015))
    base = single(10, 40)
    slow = single(10, 40, slowdown=lambda _t: Slowdown(prefill=1.0, decode=4.0))
    assert slow.decode == pytest.approx(4 * base.decode)


@pytest.mark.parametrize("cls", sorted(SPEED_CLASSES))
def test_speed_class_scales_all_phases(cls):
    speed = SPEED_CLASSES[cls]
    base = single(600, 20)
    s = single(600, 20, speed=speed)
    assert s.e2e == pytest.approx(speed * base.e2e)
    assert SPEED_CLASSES["a100"] == pytest.approx(1.6) and SPEED_CLASSES["h100"] == 1.0


def test_tokens_are_coalesced_into_chunks():
    eng = EngineModel(replace(EXACT, emit_interval_s=0.075))
    eng.submit("r", 10, 100, 0.0)
    events = run_to_end(eng)
    toks = [e for e in events if isinstance(e, Tokens)]
    assert [type(e) for e in events if not isinstance(e, StepDone)][0] is FirstToken
    assert 1 < len(toks) < 30  # 99 tokens in far fewer chunks
    fin = next(e for e in events if isinstance(e, Finished))
    assert 1 + sum(t.n for t in toks) + fin.n == 100


def test_abort_frees_the_slot_and_emits_nothing():
    params = replace(EXACT, max_num_seqs=1)
    eng = EngineModel(params)
    eng.submit("a", 10, 1000, 0.0)
    eng.submit("b", 10, 5, 0.0)
    eng.advance(0.0)
    assert eng.num_waiting == 1
    assert eng.abort("a")
    stats = finished(run_to_end(eng, start=0.001))
    assert set(stats) == {"b"}
    assert not eng.abort("a")


def test_stall_freezes_until_resume():
    eng = EngineModel(EXACT)
    eng.submit("r", 10, 5, 0.0)
    eng.advance(0.0)
    eng.stall(0.005)
    assert eng.next_event_time() == math.inf
    assert not [e for e in eng.advance(100.0) if not isinstance(e, StepDone)]
    eng.submit("q", 10, 5, 100.0)
    eng.resume(100.0)
    stats = finished(run_to_end(eng, start=100.0))
    assert stats["r"].ttft == pytest.approx(100.0 + 0.015 - 0.005 + 0.001, abs=0.002)
    assert set(stats) == {"r", "q"}


def test_seeded_jitter_is_reproducible_and_small():
    a = single(500, 50, ModelParams(), seed=7)
    b = single(500, 50, ModelParams(), seed=7)
    c = single(500, 50, ModelParams(), seed=8)
    assert a == b and a != c
    assert a.e2e == pytest.approx(single(500, 50).e2e, rel=0.1)


def test_duplicate_and_bad_requests_are_rejected():
    eng = EngineModel(EXACT)
    eng.submit("r", 1, 1, 0.0)
    with pytest.raises(ValueError):
        eng.submit("r", 1, 1, 0.0)
    with pytest.raises(ValueError):
        eng.submit("s", 0, 1, 0.0)


requests_st = st.lists(
    st.tuples(st.floats(0, 2.0), st.integers(1, 3000), st.integers(1, 60)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(reqs=requests_st, max_seqs=st.integers(1, 16), kv=st.integers(256, 20_000),
       k=st.floats(1.0, 8.0), seed=st.integers(0, 5))
def test_invariants_under_random_load(reqs, max_seqs, kv, k, seed):
    """Caps hold at every step, every request finishes with all its tokens, times are ordered."""
    params = replace(ModelParams(), max_num_seqs=max_seqs, kv_cache_tokens=kv, max_num_batched_tokens=2048)
    eng = EngineModel(params, seed=seed, slowdown=lambda _t: Slowdown(k, k))
    arrivals = sorted((t, i, p, g) for i, (t, p, g) in enumerate(reqs))
    events: list = []
    now = 0.0
    pending = list(arrivals)
    while pending or not math.isinf(eng.next_event_time()):
        nxt = eng.next_event_time()
        if pending and pending[0][0] <= max(nxt, now):
            t, i, p, g = pending.pop(0)
            now = max(now, t)
            events += eng.advance(now)
            eng.submit(f"r{i}", p, g, now)
            events += eng.advance(now)
        else:
            now = max(now, nxt)
            events += eng.advance(now)
        assert eng.num_running <= max_seqs
        if eng.num_running > 1 and not math.isinf(eng.next_event_time()):  # a step is in progress
            assert eng.kv_reserved_blocks() <= eng.kv_capacity_blocks(now)
    stats = finished(events)
    assert len(stats) == len(reqs)
    for _, i, p, g in arrivals:
        s = stats[f"r{i}"]
        assert s.generation_tokens == g and s.prompt_tokens == p
        assert s.arrival <= s.scheduled <= s.first_token <= s.last_token
        assert s.ttft > 0
    steps = [e for e in events if isinstance(e, StepDone)]
    assert all(e.duration > 0 for e in steps)
    assert all(x > 0 for e in steps for x in e.itls)
