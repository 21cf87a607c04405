"""The decision core decides exactly as it did before it was made fast: every tick of a large recorded trace
(bench/trace_large.py: 1,000 nodes in 50 pools for 300 s, every signal, faults coming and going) gives the
digest recorded from the unchanged code, and the fast peer statistics and copies give the very values of the plain
ones. The full trace (10,000 nodes, 1,000 ticks) is `python -m grayguard.bench.scale --verify --full`."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grayguard.bench.scale import load, verify
from grayguard.controller.live import LiveMemory
from grayguard.controller.peers import peer_median, peer_medians
from grayguard.controller.policy import NodeState
from grayguard.controller.scoring import Baseline, leave_one_out, median
from grayguard.controller.signals import SignalMemory, evolve

FIXTURE = load()


def test_every_tick_decides_as_recorded():
    first, diffs = verify(FIXTURE["traces"]["test"], FIXTURE["samples"])
    shown = [f"tick {s['tick']} {s['pool']}:\n recorded {json.dumps(s['decision'], sort_keys=True)[:2000]}\n"
             f" now      {json.dumps(now, sort_keys=True)[:2000]}" for s, now in diffs]
    assert first is None and not diffs, f"decisions differ from tick {first}\n" + "\n".join(shown)


def _loo_plain(values: dict[str, float], min_spread: float) -> dict[str, Baseline]:
    """leave_one_out as it was: every node's peers sorted on their own (the large-pool branch aside)."""
    logs = sorted((math.log(values[n]), n) for n in sorted(values))
    lv = [v for v, _ in logs]
    out = {}
    for i, (_, n) in enumerate(logs):
        rest = lv[:i] + lv[i + 1:]
        m = median(rest)
        mad = median(sorted(abs(v - m) for v in rest))
        out[n] = Baseline(m, max(1.4826 * mad, min_spread), len(rest))
    return out


# few distinct values, so that ties (and equal medians) are common
VALUE = st.one_of(st.sampled_from([0.01, 0.02, 0.03, 1.0]), st.floats(1e-4, 100.0))


@given(st.lists(VALUE, min_size=2, max_size=64), st.sampled_from([0.0, 0.1, 0.5]))
def test_leave_one_out_gives_the_same_floats_as_sorting_each_nodes_peers(values, min_spread):
    vals = {f"n{i}": v for i, v in enumerate(values)}
    assert leave_one_out(vals, min_spread) == _loo_plain(vals, min_spread)


@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(12)]),
                       st.one_of(VALUE, st.just(0.0), st.just(math.inf), st.just(math.nan)), max_size=12),
       st.dictionaries(st.sampled_from([f"n{i}" for i in range(14)]), st.sampled_from([None, "a", "b"])))
def test_peer_medians_are_each_nodes_peer_median(values, groups):
    nodes = [f"n{i}" for i in range(14)]  # some with no value of their own, some in no group
    fast = peer_medians(nodes, values, groups)
    for n in nodes:
        plain = peer_median(n, values, groups)
        assert repr(fast[n]) == repr(plain), n  # the same float (NaN included), not merely a close one


def test_peer_medians_use_statistics_median_arithmetic():
    # an even count: (a + b) / 2 as statistics.median computes it
    vals = {"a": 0.1, "b": 0.2, "c": 0.7, "d": 0.3, "e": 0.9}
    assert peer_medians(["a"], vals, {})["a"] == statistics.median([0.2, 0.7, 0.3, 0.9])


MEMORIES = [NodeState(state="degraded", since=5.0, ema=0.02, reason="x", factors=(("live", 0.5, "y"),),
                      signals=SignalMemory(probe_good=3), live_itl=LiveMemory(cut=True, xs=(0.5, 0.25))),
            SignalMemory(probe_bad=1, kv_saturated=True), LiveMemory(cut=True, z=3.0)]


# a draw can wait on a garbage collection of the large trace above (3 s once, on a busy machine): not slow input
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(MEMORIES), st.data())
def test_evolve_makes_what_replace_makes(obj, data):
    names = [f.name for f in dataclasses.fields(obj)]
    changed = data.draw(st.lists(st.sampled_from(names), unique=True))
    changes = {n: data.draw(st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=3)))
               for n in changed}
    before = dataclasses.astuple(obj)
    new, old = evolve(obj, **changes), dataclasses.replace(obj, **changes)
    assert type(new) is type(old) and new == old and hash(new) == hash(old)
    assert [repr(getattr(new, n)) for n in names] == [repr(getattr(old, n)) for n in names]
    assert dataclasses.astuple(obj) == before  # the original is left as it was


def test_evolve_refuses_an_unknown_field_as_replace_does():
    with pytest.raises(TypeError):
        dataclasses.replace(NodeState(), sate="healthy")
    with pytest.raises(TypeError, match="sate"):
        evolve(NodeState(), sate="healthy")
