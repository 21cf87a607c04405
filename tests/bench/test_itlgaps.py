"""grayguard.bench.itlgaps: the token gaps a live ITL is a mean of. The figures are a measurement of the real vLLM
(docs/benchmarks.md, sixteenth round); these tests check the arithmetic on hand-built token times whose answer is
known, and the command's refusal of a bad argument."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from grayguard.bench.itlgaps import gap_stats


def _stream(rid: str, start: float, gaps: list[float]) -> list[tuple[str, float]]:
    """A request's token times: a first token at start, a prefill-sized second one 0.5 s later, then the gaps."""
    t = [start, start + 0.5]
    for g in gaps:
        t.append(t[-1] + g)
    return [(rid, x) for x in t]


def test_even_gaps_have_no_spread_and_the_first_gap_after_the_prefill_is_left_out():
    stamps = _stream("a", 0.0, [0.01] * 2000)
    m = gap_stats(reversed(stamps))  # any order
    assert m["gaps"] == 2000 and m["mean_s"] == pytest.approx(0.01) and m["cv"] == pytest.approx(0.0, abs=1e-6)
    assert m["windows"] == 4 and m["gaps_per_window"] == pytest.approx(500, abs=1)
    assert m["window_cv_median"] == pytest.approx(0.0, abs=1e-6)
    assert m["window_mean_log_sd"] == pytest.approx(0.0, abs=1e-6)


def test_alternating_gaps_have_the_cv_of_their_two_values_and_a_slow_window_shows_as_a_stray():
    fast = [0.01, 0.03] * 250  # mean 0.02, cv 0.5: 10 s
    slow = [0.04, 0.04] * 125  # twice the mean: the next 10 s
    m = gap_stats(_stream("a", 0.0, fast + slow))
    assert m["window_cv_min"] == pytest.approx(0.0, abs=1e-6) and m["window_cv_max"] == pytest.approx(0.5, rel=0.02)
    # two windows at 0.02, two at 0.04: the log of the windows' mean strays by ln(2) / 2
    assert m["window_mean_log_sd"] == pytest.approx(math.log(2) / 2, rel=0.02)
    assert m["sampling_predicts"] == pytest.approx(m["window_cv_median"] / math.sqrt(m["gaps_per_window"]))


def test_too_few_gaps_say_nothing():
    with pytest.raises(ValueError, match="too few"):
        gap_stats(_stream("a", 0.0, [0.01] * 5))


def test_a_bad_argument_exits_2_before_starting_anything():
    p = subprocess.run([sys.executable, "-m", "grayguard.bench.itlgaps", "--streams", "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--streams must be >= 1" in p.stderr
