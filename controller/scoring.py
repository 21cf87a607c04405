"""Peer statistics: how far is a node from its peers? Pure functions, no I/O.

The seeds' score, z = (x - mean) / std over the pool *including* the node, can never exceed
sqrt(M-1) (a 4-node pool caps at 1.73, below any useful threshold). grayguard scores each node
against its peers only (leave-one-out), with robust statistics on log latency:

    score = (ln x - median(ln peers)) / max(1.4826 * MAD(ln peers), min_spread)

Log space makes the score multiplicative (2x slower is the same distance in fast and slow pools);
median and MAD ignore a second sick node; the spread floor keeps a quiet pool from turning a 3 %
difference into a large score. The relative gap x / median(peers) is reported with the score so the
policy can require a minimum real-world slowdown as well.
"""

from __future__ import annotations

import bisect
import functools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from grayguard.config import DEGRADE_AT

_EXP_MAX = math.log(sys.float_info.max)  # math.exp of more overflows
MAD_SCALE = 1.4826  # MAD of a normal sample * 1.4826 estimates its standard deviation
EXACT_LOO_MAX = 64  # above this pool size one node cannot move the MAD: reuse the pool's own


def weight_factor(score: float) -> float:
    """The weight a peer score leaves a node: 2^-(score-DEGRADE_AT), the score rounded down to half points (so the
    weight does not churn every tick) and floored at DEGRADE_AT (an outlier keeps its whole weight there)."""
    q = max(DEGRADE_AT, math.floor(score * 2) / 2)
    return 2.0 ** -(q - DEGRADE_AT)


def usable(x: float | None) -> bool:
    """A latency sample that can be scored: finite and > 0 (NaN, Inf, 0 and None are not)."""
    return x is not None and 0 < x < math.inf  # NaN compares false: math.isfinite(x) and x > 0, without a call


def median(sorted_vals: list[float]) -> float:
    n = len(sorted_vals)
    mid = n // 2
    return sorted_vals[mid] if n % 2 else 0.5 * (sorted_vals[mid - 1] + sorted_vals[mid])


def median_without(sorted_vals: list[float], i: int) -> float:
    """median(sorted_vals without its i-th element), without building that list."""
    n = len(sorted_vals) - 1
    mid = n // 2
    upper = sorted_vals[mid + (mid >= i)]  # from index i on, the list without i is the list one further
    return upper if n % 2 else 0.5 * (sorted_vals[mid - 1 + (mid - 1 >= i)] + upper)


def _medians_without(sorted_vals: list[float]) -> tuple[float, float, float]:
    """median_without(sorted_vals, i) for i below the middle, at it and above it: the only three values it takes
    (below the middle both middle elements move up one place, at it only the upper one, above it neither).
    Indexed by (i >= mid) + (i > mid), mid = (len(sorted_vals) - 1) // 2; each is computed by median_without
    itself: the same floats. Needs at least two values."""
    k = len(sorted_vals) - 1
    return median_without(sorted_vals, 0), median_without(sorted_vals, k // 2), median_without(sorted_vals, k)


@dataclass(frozen=True)
class Baseline:
    """Location and spread of a set of peers, in log space."""

    log_median: float
    spread: float  # robust sigma in log units, floored at min_spread
    n: int

    @property
    def median(self) -> float:
        return math.exp(self.log_median)

    def score(self, x: float) -> tuple[float, float]:
        """(score, ratio to the median) of latency x against this baseline."""
        return self.score_log(math.log(x))

    def score_log(self, lx: float) -> tuple[float, float]:
        """score() of a latency whose log is lx (a caller that has the log already). A ratio past the largest float (a
        value of 1e300 s among peers of milliseconds: an exporter's garbage) is infinite, not an OverflowError: the
        detectors take an infinite ratio for no value (live.assess), and the tick goes on."""
        d = lx - self.log_median
        return d / self.spread, math.exp(d) if d < _EXP_MAX else math.inf


def _from_sorted_logs(logs: list[float], min_spread: float) -> Baseline:
    m = median(logs)
    mad = median(sorted(abs(v - m) for v in logs))
    return Baseline(m, max(MAD_SCALE * mad, min_spread), len(logs))


def baseline(values: list[float], min_spread: float) -> Baseline | None:
    """Baseline of positive latencies; None when empty."""
    if not values:
        return None
    return _from_sorted_logs(sorted(math.log(v) for v in values), min_spread)


def leave_one_out(values: Mapping[str, float], min_spread: float) -> dict[str, Baseline]:
    """For each node, the baseline of the *other* nodes (needs at least 2 values)."""
    return leave_one_out_logs(values, min_spread)[1]


def leave_one_out_logs(values: Mapping[str, float], min_spread: float
                       ) -> tuple[list[tuple[float, str]], dict[str, Baseline]]:
    """leave_one_out, with the (math.log(value), name) pairs it sorted, in the order of its nodes: a caller scoring
    each node against its baseline has the node's log already (Baseline.score would take it again)."""
    if len(values) < 2:
        return [], {}
    logs = sorted(zip(map(math.log, values.values()), values, strict=True))  # (log, name): by value, then name
    lv = [v for v, _ in logs]
    k = len(lv) - 1  # size of each leave-one-out set
    if len(values) > EXACT_LOO_MAX:
        # Large pool: exact leave-one-out median from the sorted array, pool-wide MAD (one point of >64
        # moves the MAD by at most one rank; it has no sqrt(M-1) ceiling since it is not a mean).
        full = baseline(list(values.values()), min_spread)
        assert full is not None
        return logs, {n: Baseline(median_without(lv, i), full.spread, k) for i, (_, n) in enumerate(logs)}
    # Exact. Dropping one value keeps the list sorted and moves its median by at most one rank: the nodes below the
    # middle rank share one median, the middle node has its own, the nodes above share a third (_medians_without).
    # For each median, the deviations of every value from it are sorted once, and a node's MAD is their median
    # without its own deviation: again one of three, by the rank of that deviation. The same numbers as sorting each
    # node's peers on its own; nodes with the same median and MAD share one (frozen) Baseline.
    deviations: dict[float, tuple[list[float], tuple[float, float, float]]] = {}
    shared: dict[tuple[float, float], Baseline] = {}
    out = {}
    lv_medians, mid = _medians_without(lv), k // 2
    for rank, (lo, hi) in enumerate(((0, mid), (mid, mid + 1), (mid + 1, k + 1))):  # below, at, above the middle
        if lo == hi:
            continue
        m = lv_medians[rank]  # median_without(lv, i) for each i in range(lo, hi)
        known = deviations.get(m)
        if known is None:
            dev = sorted([abs(v - m) for v in lv])
            known = deviations[m] = dev, _medians_without(dev)
        dev, dev_medians = known
        by_rank: list[Baseline | None] = [None, None, None]  # this median's baselines, by the rank of the deviation
        for x, n in logs[lo:hi]:
            j = bisect.bisect_left(dev, abs(x - m))
            r = (j >= mid) + (j > mid)  # median_without(dev, j) is dev_medians[r]
            b = by_rank[r]
            if b is None:
                mad = dev_medians[r]
                b = shared.get((m, mad))
                if b is None:
                    b = shared[m, mad] = Baseline(m, max(MAD_SCALE * mad, min_spread), k)
                by_rank[r] = b
            out[n] = b
    return logs, out


NOISE_S = 60.0  # a learned noise's memory: a minute
NOISE_CLIP = 3.0  # a sample's spread counted at most this (log units): one wild sample does not set the pool's noise
FIRST_DT_S = 1.0  # what a node's first sample is worth, in seconds (one tick at the shipped 1 s)
# What a controller assumes before it has seen its fleet: a spread of 0.375 (healthy nodes 1.45x apart), worth three
# seconds of its own. Its first ticks are careful, its own samples take over within seconds (a quiet simulated fleet
# is at min_spread within fifteen); the state file keeps what it learned across restarts. Chosen on the four
# committed real-vLLM runs (tests/fixtures/vllm/runs): without a prior each run's first 20 s cut healthy nodes (2-5
# cuts over one tick); with it, none. Worth one second only, a calm first window (tests/controller/test_noise.py's
# noisy pool) taught a noise 2.4x too low and a healthy node was cut.
PRIOR_SPREAD = 0.375
PRIOR_S = 3.0


@dataclass(frozen=True)
class Noise:
    """How far a pool's healthy nodes stray from each other on one signal: its spread (spread_of: a robust sigma of
    the log values, which a minority of sick nodes does not move) averaged over time (a running mean over the first
    NOISE_S seconds from the prior, then an EWMA of that span; each sample weighs the seconds since the last). A real
    fleet's healthy nodes differ by 1.5-2x from window to window (CPU contention, decode steps shared with prefills,
    a few requests of mixed lengths), a simulated one's by a few per cent: one tick of three peers cannot tell which,
    and one fixed spread cannot serve both. Each node keeps the pool's (pool_noise takes the median of those that
    learned), learned when its 30 s window's sample is new (every rule evaluation, 5 s shipped: about one live
    window, so a sample is new evidence, and the node's state is written then anyway)."""

    dev: float = PRIOR_SPREAD
    seconds: float = 0.0  # seconds learned (at most NOISE_S); 0: nothing learned yet
    at: float | None = None  # when it last learned

    def learn(self, spread: float | None, now: float) -> Noise:
        """The noise once this sample's spread is counted (None: none this time)."""
        if spread is None or not spread >= 0:
            return self
        return _learned(self, spread, now)


@functools.lru_cache(maxsize=1 << 14)
def _learned(noise: Noise, spread: float, now: float) -> Noise:
    """Noise.learn of a spread: the pool's nodes learn its spread at the same times, so most of them hold equal
    memories and learn the same one, which is made once a pool and shared (at 10,000 nodes, one Noise a pool
    instead of one a node, every sample)."""
    dt = FIRST_DT_S if noise.at is None else min(now - noise.at, NOISE_S)
    if not dt > 0:
        return noise
    seconds = min(noise.seconds + dt, NOISE_S)
    weight = min(1.0, dt / min(seconds + PRIOR_S, NOISE_S))
    return Noise(noise.dev + (min(spread, NOISE_CLIP) - noise.dev) * weight, seconds, now)


def spread_of(devs: list[float]) -> float | None:
    """The noise of one value against the median of the others, from the values' log deviations from their median
    (or their groups'): MAD_SCALE x their median absolute deviation, a robust sigma that a minority of outliers
    does not move, corrected for a small sample (x n / (n - 0.8): four values' MAD is 0.74 of their sigma), times
    sqrt(1 + pi / (2 (n - 1))) for the noise of the peers' own median (three peers: 1.2x). Measured on normal
    samples: within 6 % of the leave-one-out comparison's spread from 3 values to 32. None for fewer than three."""
    n = len(devs)
    if n < 3:
        return None
    m = median(sorted(devs))
    sigma = MAD_SCALE * median(sorted(abs(v - m) for v in devs)) * n / (n - 0.8)
    return sigma * math.sqrt(1.0 + math.pi / (2.0 * (n - 1)))


def pool_noise(noises: list[Noise]) -> float:
    """The pool's noise on a signal: the median of what its nodes learned (the prior while none has)."""
    devs = sorted(n.dev for n in noises if n.seconds > 0)
    return median(devs) if devs else PRIOR_SPREAD


def against_noise(z: float, ratio: float, noise: float | None, min_spread: float) -> float:
    """The score of a node `ratio` times its peer median, against the comparison's learned noise (floored at
    min_spread) instead of the tick's own peer spread (z as it is while the noise is not known): judged by how far
    its healthy peers stray, not by how close three of them happen to be this tick."""
    if noise is None or not (ratio > 0 and math.isfinite(ratio)):
        return z
    return math.log(ratio) / max(noise, min_spread)


def sampled_noise(noise: float, min_spread: float, samples: float | None, cv: float) -> float:
    """The noise of a node's value against its peers' when that value is a mean over `samples` observations of
    per-observation variability cv: the comparison's noise (floored at min_spread) and that mean's own noise (about
    cv / sqrt(samples), in log units) added in quadrature. A node whose 30 s window holds few requests is compared
    with the patience its few samples deserve (30 requests: +/-18 %). Unknown samples or cv 0: the comparison's."""
    sigma = max(noise, min_spread)
    if cv <= 0 or samples is None:
        return sigma
    return math.hypot(sigma, cv / math.sqrt(max(samples, 1.0)))
