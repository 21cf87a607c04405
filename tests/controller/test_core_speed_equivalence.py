"""The decision core's shortcuts give the very values of the plain code they replace: leave_one_out's three medians
by rank against median_without index by index, evolve's __dict__ copy against dataclasses.replace (fields, their
order, hash), Score as a tuple, peers.scores from leave_one_out's own logs against Baseline.score, at_equal_batch's
one pass, like_peers_now's branches, dict_init's __init__ (NodeInput, NodeDecision) against the one @dataclass
generates; replaced, score_of, usable, target_weight's shortcut and peer_medians of no values against what they
replace. The decisions themselves: test_decisions_identical.py and `python -m grayguard.bench.scale --verify`."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import pickle
import random

import pytest

from grayguard.controller import policy
from grayguard.controller.live import LiveMemory
from grayguard.controller.peers import Score, coefficients, peer_medians, score_of, scores
from grayguard.controller.policy import LIVE_ITL, LIVE_TTFT, PROBE_MEDIAN, NodeDecision, NodeInput, NodeState
from grayguard.controller.scoring import Baseline, _medians_without, leave_one_out, median, median_without, usable
from grayguard.controller.signals import SignalMemory, dict_init, evolve
from grayguard.frozen import replaced


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
                      signals=SignalMemory(probe_good=3), live_itl=LiveMemory(cut=True, xs=(0.5, 0.25))),
            SignalMemory(probe_bad=1, kv_saturated=True), LiveMemory(cut=True, z=3.0)]


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


def _scores_plain(values, groups, min_peers, min_spread, speed):
    """peers.scores as it was: each node's Baseline.score of its value, and the baseline's median property."""
    by: dict = {}
    for n in sorted(values):
        by.setdefault(groups.get(n), {})[n] = values[n]
    out, small = {}, []
    for g, members in by.items():
        if len(members) >= min_peers:
            for n, b in leave_one_out(members, min_spread).items():
                z, ratio = b.score(members[n])
                out[n] = Score(z, ratio, b.median)
        else:
            small.append(g)
    if small:
        coef = coefficients(values, groups, min_peers, speed)
        norm = {n: v / coef[groups.get(n)] for n, v in values.items() if groups.get(n) in coef}
        if len(norm) >= min_peers:
            loo = leave_one_out(norm, min_spread)
            for g in small:
                for n in by[g]:
                    if n in loo:
                        z, ratio = loo[n].score(norm[n])
                        out[n] = Score(z, ratio, loo[n].median * coef[g])
    return out


@pytest.mark.parametrize("seed", range(30))
def test_scores_from_leave_one_outs_logs_are_baseline_scores(seed):
    rnd = random.Random(seed)
    for _ in range(20):
        size = rnd.randint(1, 90)  # both leave_one_out branches (exact, and pool-wide MAD above 64)
        pick = [0.01, 0.02, 0.03, 1.0] if rnd.random() < 0.3 else None
        vals = {f"n{i:02d}": rnd.choice(pick) if pick else rnd.lognormvariate(-4, 0.5) for i in range(size)}
        groups = {n: rnd.choice(["a", "b", "c", None]) for n in vals}
        speed = {"c": 1.5} if rnd.random() < 0.5 else {}
        fast, plain = scores(vals, groups, 3, 0.05, speed), _scores_plain(vals, groups, 3, 0.05, speed)
        assert list(fast) == list(plain)
        assert [repr(x) for x in fast.values()] == [repr(x) for x in plain.values()]
        assert all(type(x) is Score for x in fast.values())


def _dataclass_twin(cls):
    """cls as @dataclass(frozen=True) alone makes it: the same fields and defaults, the generated __init__."""
    body = {"__annotations__": {f.name: f.type for f in dataclasses.fields(cls)},
            **{f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}}
    return dataclasses.dataclass(frozen=True)(type(cls.__name__, (), body))


VALUES = [None, True, False, 0, 7, -0.0, 1.5, math.nan, math.inf, "ok", NodeState(), ("a", 1.0)]


@pytest.mark.parametrize("cls", [NodeInput, NodeDecision])
def test_dict_init_builds_what_the_dataclass_init_builds(cls):
    twin, fields = _dataclass_twin(cls), dataclasses.fields(cls)
    params = list(inspect.signature(cls).parameters.values())
    assert [(p.name, p.kind, p.default) for p in params] == \
        [(p.name, p.kind, p.default) for p in inspect.signature(twin).parameters.values()]
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    rnd = random.Random(cls.__name__)
    for k in range(200):
        kw = {f.name: rnd.choice(VALUES) for f in fields if f.name in required or rnd.random() < 0.5}
        new, ref = cls(**kw), twin(**kw)
        assert repr(new) == repr(ref)
        assert list(vars(new)) == list(vars(ref)) == [f.name for f in fields]
        assert [repr(v) for v in vars(new).values()] == [repr(v) for v in vars(ref).values()]
        assert all(vars(new)[f.name] is f.default for f in fields if f.name not in kw)  # each default kept
        if k % 10 == 0:  # positional, as dataclass allows
            args = [kw.get(f.name, f.default) for f in fields]
            assert vars(cls(*args)) == vars(new) and cls(*args) == new
        # (a NaN field compares equal: the same object, and dataclass __eq__ compares tuples)
        assert new == cls(**kw) and hash(new) == hash(cls(**kw))
        assert dataclasses.replace(new) == new
        back = pickle.loads(pickle.dumps(new))  # a new NaN object after the round trip: compared by repr
        assert repr(back) == repr(new) and list(vars(back)) == list(vars(new))
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(new, fields[0].name, 1)
    with pytest.raises(TypeError):
        cls()  # a missing required argument is refused, as by the dataclass __init__
    with pytest.raises(TypeError):
        cls(*required, nonsense=1)


def test_dict_init_refuses_what_it_cannot_generate():
    @dataclasses.dataclass(frozen=True)
    class WithFactory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Derived:
        a: int

        def __post_init__(self):
            pass

    for cls in (WithFactory, Derived):
        with pytest.raises(TypeError):
            dict_init(cls)


def test_like_peers_now_is_the_list_and_min_it_was():
    def plain(live_sc, ratio):
        li, lt, pm = live_sc.get(LIVE_ITL), live_sc.get(LIVE_TTFT), live_sc.get(PROBE_MEDIAN)
        first = [x.ratio for x in (lt, pm) if x is not None]
        return not ((li is not None and li.ratio >= ratio) or not first or min(first) >= ratio)

    ratios = [None, 0.5, 1.0, 1.2, 1.5, 2.0, math.nan, math.inf]
    for a, b, c in itertools.product(ratios, repeat=3):
        sc = {k: Score(1.0, r, 0.02) for k, r in ((LIVE_ITL, a), (LIVE_TTFT, b), (PROBE_MEDIAN, c)) if r is not None}
        for ratio in (1.0, 1.2, 1.5):
            assert policy.like_peers_now(sc, ratio) == plain(sc, ratio), (a, b, c, ratio)


# The third round: a node's changes of a tick gathered in one dict (replaced), Score made by tuple.__new__, usable by
# one chained comparison, target_weight's shortcut for a node at full weight, peer_medians of no values.


@pytest.mark.parametrize("obj", MEMORIES)
def test_replaced_is_replace_and_leaves_its_changes_alone(obj):
    names = [f.name for f in dataclasses.fields(obj)]
    for k in range(len(names)):
        changes = {n: -0.0 if j % 2 else None for j, n in enumerate(names[k:k + 4])}
        before = dict(changes)
        new, old = replaced(obj, changes), dataclasses.replace(obj, **changes)
        assert changes == before  # the caller's dict is read, not kept or written
        assert list(vars(new)) == list(vars(old)) == names
        assert [repr(v) for v in vars(new).values()] == [repr(v) for v in vars(old).values()]
        assert new == old and hash(new) == hash(old) and new is not obj
        assert pickle.loads(pickle.dumps(new)) == old
    with pytest.raises(TypeError, match="no field 'nope'"):
        replaced(obj, {"nope": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        replaced(obj, {}).__setattr__(names[0], 1)


def test_score_of_is_the_namedtuple():
    for z, ratio, med in itertools.product((0.0, -1.5, math.inf, math.nan), (1.0, 2.5), (0.02, math.nan)):
        a, b = score_of(z, ratio, med), Score(z, ratio, med)
        assert type(a) is Score and repr(a) == repr(b) and a._fields == b._fields
        if not any(map(math.isnan, (z, med))):
            assert a == b and hash(a) == hash(b)


def test_usable_is_finite_and_positive():
    for x in (None, 0, 0.0, -0.0, 5e-324, 1e-300, 0.02, 1, True, False, 1e308, math.inf, -math.inf, math.nan, -1.0):
        assert usable(x) == (x is not None and math.isfinite(x) and x > 0), x


def _target_weight_plain(s, base, now, p, kv_zero=False):
    """target_weight without its shortcut, as it was."""
    base = max(0, min(256, base))
    if s.state in policy.EJECTED or kv_zero or base == 0:
        return 0
    product = math.prod(f for _, f, _ in s.factors)
    share = policy.slow_start_share(s, now, p.recovery) if s.state == policy.SLOW_START else 1.0
    w = base * share * product
    if product < 1.0:
        return max(1, min(base, round(w)))
    return max(1, math.ceil(w)) if s.state == policy.SLOW_START else min(base, round(w))


def test_target_weight_shortcut_is_the_formula():
    p = policy.Policy()
    factor_sets = [(), (("latency", 0.5, "x"),), (("probe", 1.0, ""),), (("live", 0.25, "y"), ("errors", 0.5, "z"))]
    states = ["healthy", "degraded", "slow_start", "quarantined", "canary"]
    for state, factors, base, kv_zero in itertools.product(states, factor_sets, (-3, 0, 1, 7, 100, 256, 257, 1000),
                                                           (False, True)):
        s = NodeState(state=state, since=10.0, factors=factors)
        for now in (10.0, 40.0, 400.0):
            got, want = policy.target_weight(s, base, now, p, kv_zero), _target_weight_plain(s, base, now, p, kv_zero)
            assert got == want and type(got) is type(want), (state, factors, base, kv_zero, now)


def test_peer_medians_of_no_values_is_none_for_each_node():
    nodes = ["a", "b", "c"]
    assert peer_medians(nodes, {}, {"a": "g1"}) == {"a": None, "b": None, "c": None}
    assert peer_medians([], {}, {}) == {}
    # and with values, a node without one still gets its group's median (the shortcut is for no values at all)
    assert peer_medians(nodes, {"a": 1.0, "b": 3.0}, {}) == {"a": 3.0, "b": 1.0, "c": 2.0}
