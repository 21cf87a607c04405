"""The decision core's shortcuts give the very values of the plain code they replace: leave_one_out's three medians
by rank against median_without index by index, evolve's __dict__ copy against dataclasses.replace (fields, their
order, hash), and Score as a tuple. The decisions themselves: test_decisions_identical.py and
`python -m bench.scale --verify`."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from controller.live import LiveMemory
from controller.peers import Score
from controller.policy import NodeState
from controller.scoring import Baseline, _medians_without, leave_one_out, median, median_without
from controller.signals import SignalMemory, evolve


@pytest.mark.parametrize("size", range(2, 42))
def test_the_three_medians_are_median_without_at_every_index(size):
    vals = sorted(random.Random(size).uniform(-3, 3) for _ in range(size))
    mid = (size - 1) // 2
    table = _medians_without(vals)
    for i in range(size + 1):  # bisect can answer one past the end
        assert repr(table[(i >= mid) + (i > mid)]) == repr(median_without(vals, i))


def _loo_plain(values: dict[str, float], min_spread: float) -> dict[str, Baseline]:
    """Each node's peers sorted on their own, in the order leave_one_out gives its nodes (by log value, then name)."""
    order = sorted(values, key=lambda n: (math.log(values[n]), n))
    out = {}
    for n in order:
        rest = sorted(math.log(values[m]) for m in values if m != n)
        m = median(rest)
        mad = median(sorted(abs(v - m) for v in rest))
        out[n] = Baseline(m, max(1.4826 * mad, min_spread), len(rest))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_leave_one_out_is_each_nodes_peers_sorted_on_their_own(seed):
    rnd = random.Random(seed)
    for _ in range(50):
        size = rnd.randint(2, 64)
        # few distinct values half of the time: ties, equal medians and equal deviations
        pick = [0.01, 0.02, 0.03, 1.0] if rnd.random() < 0.5 else None
        vals = {f"n{i:02d}": rnd.choice(pick) if pick else rnd.lognormvariate(-4, 0.3) for i in range(size)}
        fast, plain = leave_one_out(vals, 0.05), _loo_plain(vals, 0.05)
        assert list(fast) == list(plain)  # the same nodes in the same order
        assert [repr(dataclasses.astuple(b)) for b in fast.values()] == \
            [repr(dataclasses.astuple(b)) for b in plain.values()]


MEMORIES = [NodeState(state="degraded", since=5.0, ema=0.02, reason="x", factors=(("live", 0.5, "y"),),
                      signals=SignalMemory(probe_good=3), live_itl=LiveMemory(cusum=1.5)),
            SignalMemory(probe_bad=1, kv_saturated=True), LiveMemory(hot=2, cut=True, z=3.0)]


@pytest.mark.parametrize("obj", MEMORIES)
def test_evolve_copies_the_fields_in_their_order(obj):
    names = [f.name for f in dataclasses.fields(obj)]
    for k in range(len(names)):
        changes = {n: -0.0 if j % 2 else None for j, n in enumerate(names[k:k + 3])}
        new, old = evolve(obj, **changes), dataclasses.replace(obj, **changes)
        assert list(vars(new)) == list(vars(old)) == names
        assert [repr(v) for v in vars(new).values()] == [repr(v) for v in vars(old).values()]
        assert new == old and hash(new) == hash(old) and new is not obj
    assert evolve(obj) == obj and evolve(obj) is not obj


def test_evolve_leaves_a_frozen_original_frozen():
    s = NodeState()
    new = evolve(s, reason="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.reason = "y"  # type: ignore[misc]
    assert s.reason == ""


def test_evolve_refuses_what_it_cannot_copy_by_dict():
    @dataclasses.dataclass(frozen=True)
    class Derived:
        a: int
        b: int = 0

        def __post_init__(self):
            object.__setattr__(self, "b", self.a * 2)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    for obj in (Derived(1), Slotted(1)):
        with pytest.raises(TypeError, match="evolve needs"):
            evolve(obj, a=2)


def test_score_keeps_its_names_and_its_equality():
    sc = Score(z=1.5, ratio=1.2, peer_median=0.02)
    assert (sc.z, sc.ratio, sc.peer_median) == (1.5, 1.2, 0.02)
    assert sc == Score(1.5, 1.2, 0.02) and hash(sc) == hash(Score(1.5, 1.2, 0.02))
    assert repr(sc) == "Score(z=1.5, ratio=1.2, peer_median=0.02)"
