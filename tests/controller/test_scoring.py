import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.controller.scoring import baseline, leave_one_out, sampled_noise, usable


def seeds_z(values, i):
    """The seeds' score: population z-score with the node inside its own baseline."""
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / len(values))
    return (values[i] - m) / sd


@pytest.mark.parametrize("m", [3, 4, 8, 13])
def test_seeds_score_has_a_ceiling_ours_does_not(m):
    values = [1.0] * (m - 1) + [5.0]
    assert seeds_z(values, m - 1) <= math.sqrt(m - 1) + 1e-9  # the flaw the seeds have
    assert seeds_z(values, m - 1) < 3.5 or m >= 14
    b = leave_one_out({f"n{i}": v for i, v in enumerate(values)}, min_spread=0.1)[f"n{m - 1}"]
    z, ratio = b.score(5.0)
    assert ratio == pytest.approx(5.0)
    assert z > 10  # ln 5 / 0.1 = 16: far past the quarantine threshold in every pool size


def test_leave_one_out_excludes_the_node():
    loo = leave_one_out({"a": 1.0, "b": 1.0, "c": 1.0, "d": 9.0}, 0.1)
    assert loo["d"].median == pytest.approx(1.0)
    assert loo["a"].median == pytest.approx(1.0)  # median of 1, 1, 9
    assert loo["d"].n == 3


def test_spread_floor_keeps_quiet_pool_calm():
    # identical peers have zero MAD: the floor keeps a 3 % difference small
    b = baseline([1.0, 1.0, 1.0], min_spread=0.1)
    z, ratio = b.score(1.03)
    assert z == pytest.approx(math.log(1.03) / 0.1)
    assert z < 0.5


def test_usable():
    for bad in (None, math.nan, math.inf, 0.0, -1.0):
        assert not usable(bad)
    assert usable(0.01)


@given(st.lists(st.floats(0.001, 10.0), min_size=66, max_size=120), st.randoms())
def test_large_pool_median_matches_exact(values, rnd):
    vals = {f"n{i}": v for i, v in enumerate(values)}
    fast = leave_one_out(vals, 0.1)
    name = rnd.choice(sorted(vals))
    exact = baseline([v for k, v in vals.items() if k != name], 0.1)
    assert fast[name].log_median == pytest.approx(exact.log_median, abs=1e-9)


def test_large_pool_still_isolates_one_slow_node():
    rnd = random.Random(3)
    vals = {f"n{i}": 0.02 * (1 + rnd.gauss(0, 0.05)) for i in range(200)}
    vals["n7"] = 0.04
    loo = leave_one_out(vals, 0.1)
    z, ratio = loo["n7"].score(vals["n7"])
    assert ratio == pytest.approx(2.0, rel=0.1) and z > 5


def test_a_mean_over_few_requests_is_scored_with_its_own_noise():
    z = math.log(1.45) / 0.1  # 1.45x the peers at the spread floor: 3.7
    thin = math.log(1.45) / sampled_noise(0.05, 0.1, 30.0, 1.0)  # a window of 30 requests: +/-18 %
    assert thin == pytest.approx(math.log(1.45) / math.hypot(0.1, 1 / math.sqrt(30)))
    assert thin < 2.0 < math.log(1.45) / sampled_noise(0.05, 0.1, 300.0, 1.0) < z  # a busy node keeps most of it
    assert math.log(3) / sampled_noise(0.05, 0.1, 30.0, 1.0) > 3.5  # a 3x node is an outlier all the same
    assert sampled_noise(0.3, 0.1, 30.0, 1.0) == pytest.approx(math.hypot(0.3, 1 / math.sqrt(30)))  # learned noise
    for off in ((0.05, 0.1, None, 1.0), (0.05, 0.1, 30.0, 0.0)):
        assert sampled_noise(*off) == 0.1  # unknown count, or off: the comparison's noise, floored
