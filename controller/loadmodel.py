"""The load model: what a node's peers predict for a live latency at the node's own load. Pure.

A decode step's time is a base, a share per sequence in the batch and the prompt tokens chunked into it:

    step = c x g,   g = 1 + beta_b x (b - 1) + beta_p x P

and each live latency is a number of steps (the ITL one; a probe's first token the steps it waits and the one that
prefills it; a request's first token those of its prompt's chunks), so one g per node serves the three: each is
divided by its node's g. The slopes are the step's, fitted on the live ITL (the one latency that is a step); a fit
of its own on the probes' and first tokens' heavy-tailed values would mostly return the prior, at three times the
cost.

b: the node's mean decode batch over the live window; P: the prompt tokens prefilled per decode step, its prefill
rate R times its step time (in the fit, the step the model predicts at its load: see _features). A node running
twice its peers' sequences (a tenant of long completions pinned to it) or prefilling long prompts (a tenant of
8k-token prompts, a burst) is slower by g: load, not sickness.

The slopes are fitted across the pool, each node left out of its own fit: weighted least squares on the relative
error of each value over its peer group's median (groups differ in speed, not in how load slows them), one robust
reweighting (a node far from the fit, a sick one, counts less in its peers' fits), and the fleet's prior slopes as
pseudo-observations, worth the more of two: PRIOR_NODES nodes at the pool's own spread of load (in a small pool one
sick node among a few peers must not become a slope), and the prior's own precision (each slope known to within
PRIOR_CV of itself) against the pool's noise on the signal (what the comparison learned, scoring.Noise: in a noisy
pool a few nodes' values say little about a slope). A pool whose nodes carry alike loads, a small one or a noisy one
learns little from its data and keeps the prior; a large, quiet pool with uneven loads learns its own engine's
slopes. Slopes are never negative (more load never makes a step faster) and beta_b is at most 1 (a step of
b sequences costs at most b steps of one).

A node is judged at the load a healthy node would carry: its batch, and the prompt tokens a healthy step holds at
its prefill rate. Its own P (R x its own ITL) would count its slowness twice (a node k times slower holds k times
the prompt tokens a step), so its g is (1 + beta_b (b - 1)) / (1 - beta_p c R), the step time solved for P = R x
the step (c: its peers' level).

The level c is not fitted here: each node's latency divided by its g is compared with its peers' by peers.scores
(leave-one-out median and spread, peer groups), as every other signal is. When a node lacks its batch (an older
exporter) the batch term is left out for all, and so is the prefill term when one lacks its prefill rate: one model
per comparison. A node without a live ITL has no P of its own and teaches the prefill slope nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from grayguard.controller.scoring import MAD_SCALE, PRIOR_SPREAD

PRIOR_NOISE = PRIOR_SPREAD  # the pool's noise on a signal while none is known (scoring.pool_noise's prior)
PRIOR_NODES = 2.0  # the least the fleet's prior slopes are worth, in nodes of the pool at its own spread of load...
PRIOR_REACH = 0.5  # ...placed at least this share of the pool's mean load away from it
# the prior slopes' standard error, a share of each: the engines measured span 3x (the prefill slope below)
PRIOR_CV = 1.0
# the fleet prior for the prefill slope: a batch-1 step's share per prompt token chunked into it. The largest of the
# engines measured: the real vLLM CPU build with the test model (sim/model.py VLLM_CPU_TINY: 38.7 us a prompt token over
# a 3.5 ms step, 0.011), the simulator's shipped model (0.1 ms over 15 ms, 0.0067), published H100 runs
# (sim/calibrate.py: 25 us over 6.57 ms, 0.0038). A small pool cannot learn it (one node carries the long
# prompts), and the two errors differ: too low cuts a healthy node for its tenant's prompts; too high excuses only a
# node both sick and prefilling far more than its peers (a sick node under leastconn gets fewer prompts, not more)
PRIOR_PREFILL_SLOPE = 0.011
ROBUST_K = 2.5  # a node more than this many robust sigmas from the pool's fit counts less (Huber's weight)
BATCH_MAX = 1.0  # a step of b sequences costs at most b steps of one
# a healthy node at this share of its time prefilling is as loaded as the model says. Beyond, the prompts it is sent
# take a healthy node's whole time (the model's step grows without bound): its latencies cannot be told from a sick
# one's, and its g is infinite, "not judged at this load" (a sick node prefills less, not more: its prompts wait)
PREFILL_SHARE_MAX = 0.95
EXACT_LOO_MAX = 64  # above this pool size one node cannot move the fit: the pool's own fit serves every node

Load = tuple[float | None, float | None]  # (b - 1, prompt tokens/s) of one node; None: unknown


def load_of(batch: float | None, prefill_rate: float | None) -> Load:
    """(b - 1, R) of one node; None where unknown. A batch below one (the node idled part of the window) is one."""
    xb = max(0.0, batch - 1.0) if batch is not None and math.isfinite(batch) else None
    r = prefill_rate if prefill_rate is not None and math.isfinite(prefill_rate) and prefill_rate >= 0 else None
    return xb, r


class Request(NamedTuple):
    """One pool's question to the load model: at_load's arguments."""

    itl: Mapping[str, float]
    nodes: Iterable[str]
    load: Mapping[str, Load]
    batch_prior: float
    prefill_prior: float = PRIOR_PREFILL_SLOPE
    groups: Mapping[str, str | None] | None = None
    noise: float = PRIOR_NOISE


def at_load(itl: Mapping[str, float], nodes: Iterable[str], load: Mapping[str, Load], batch_prior: float,
            prefill_prior: float = PRIOR_PREFILL_SLOPE, groups: Mapping[str, str | None] | None = None,
            noise: float = PRIOR_NOISE) -> dict[str, float]:
    """g of every node of `nodes`: what its load makes a healthy node's decode step, over a step of one sequence with no
    prompt in it. Each live latency (the ITL, a probe's first token, the live TTFT: each a number of steps) divided by
    it is the node's latency at a batch of one, as its peers predict.

    itl: the live ITLs the slopes are fitted on (a node without one takes the pool's fit and its peers' level).
    load: each node's (b - 1, R) (load_of); a node absent or with None drops that term for all.
    batch_prior / prefill_prior: the fleet's slopes (0: that term is left out).
    noise: the pool's noise on the signal (the log-scale deviation of a healthy node from its peers): what one
    node's value is worth against the prior.

    The step at the node's load is c (1 + beta_b (b - 1)) / (1 - beta_p c R): the step time solved for P = R x the
    step, c its peers' level (a node without a level: its batch term alone). A node sent prompts at a rate that fills
    PREFILL_SHARE_MAX of a healthy node's time (beta_p c R) has g = math.inf: its load, by its peers' model, is at a
    healthy node's capacity, and no latency of its says whether it is sick (the caller leaves it unjudged).

    One pool of at_load_pools, which answers the pools of a tick at once.
    """
    return at_load_pools([Request(itl, nodes, load, batch_prior, prefill_prior, groups, noise)])[0]


def slopes(values: Mapping[str, float], load: Mapping[str, Load], batch_prior: float,
           prefill_prior: float = PRIOR_PREFILL_SLOPE, groups: Mapping[str, str | None] | None = None,
           noise: float = PRIOR_NOISE) -> tuple[float, float]:
    """The pool's own fit of the live ITL (every node in it): (beta_b, beta_p), a term left out 0. For reports and
    tests."""
    b, p = _fitted(_Columns([Request(values, (), load, batch_prior, prefill_prior, groups, noise)]))[0][0].tolist()
    return b, p


def at_load_pools(requests: Sequence[Request]) -> list[dict[str, float]]:
    """at_load of each pool, all at once: every node of every pool is an entry of one set of columns, and each pool's
    medians, normal equations and leave-one-out fits are sums and order statistics over its own entries, so one pass
    of array operations serves the fleet (a pool's fit on its own, in Python lists or in numpy, cost 0.3 ms: 150 ms
    a tick at 10,000 nodes)."""
    c = _Columns(requests)
    out: list[dict[str, float]] = [{} for _ in requests]
    if not c.names:
        return out
    with np.errstate(all="ignore"):  # IEEE's infinities and NaNs, as Python's floats give them, without a warning
        g = _steps(c)
    for p, n, x in zip(c.pid.tolist(), c.names, g.tolist(), strict=True):
        out[p][n] = x
    return out


def _steps(c: _Columns) -> np.ndarray:
    """Each node's g (at_load_pools; under np.errstate: the masked-out lanes may divide by zero)."""
    pool_slopes, own, p = _fitted(c)
    slope = np.where(own[:, :1] >= 0, own, pool_slopes[c.pid])  # its peers' fit where it has one, else its pool's
    level = _levels(c, pool_slopes, p)
    known = c.use_p[c.pid] & ~np.isnan(level)
    share = np.where(known, slope[:, 1] * level * c.r, 0.0)
    xb = np.where(c.use_b[c.pid], c.xb, 0.0)
    return np.where(share < PREFILL_SHARE_MAX, (1.0 + slope[:, 0] * xb) / (1.0 - share), math.inf)


class _Columns:
    """Every node of every pool, one entry each, the pools one after the other and each pool's nodes by name: its pool
    (pid), its peer group (seg: a pool's own group), its live ITL (v; NaN: none), its load (xb = b - 1, r = R; NaN:
    unknown); and per pool its priors, its noise and which terms its model uses."""

    def __init__(self, requests: Sequence[Request]) -> None:
        names: list[str] = []
        pid: list[int] = []
        seg: list[int] = []
        v: list[float] = []
        xb: list[float] = []
        r: list[float] = []
        nan, segments, unknown = math.nan, 0, (None, None)
        for p, q in enumerate(requests):
            groups, ns = q.groups or {}, sorted(set(q.nodes) | set(q.itl))
            local: dict[str | None, int] = {}
            seg.extend([segments + local.setdefault(groups.get(n), len(local)) for n in ns])
            segments += len(local)
            names.extend(ns)
            pid.extend([p] * len(ns))
            v.extend([q.itl.get(n, nan) for n in ns])
            loads = [q.load.get(n, unknown) for n in ns]
            xb.extend([nan if b is None else b for b, _ in loads])
            r.extend([nan if rate is None else rate for _, rate in loads])
        self.pools, self.segments, self.names = len(requests), segments, names
        self.pid, self.seg = np.array(pid, dtype=np.intp), np.array(seg, dtype=np.intp)
        self.v, self.xb, self.r = np.array(v), np.array(xb), np.array(r)
        self.batch_prior = np.array([q.batch_prior for q in requests], dtype=float)
        self.prefill_prior = np.array([q.prefill_prior for q in requests], dtype=float)
        self.noise = np.array([q.noise for q in requests], dtype=float)
        self.has = ~np.isnan(self.v)  # the nodes with a live ITL: the fit's rows
        self.n_itl = self.count(self.has)
        self.itl = np.flatnonzero(self.has)  # their entries, their pools and their groups
        self.itl_pid, self.itl_seg = self.pid[self.itl], self.seg[self.itl]
        # each one's group has another node with a live ITL (a node alone in its group takes its pool's level)
        self.in_group = np.bincount(self.itl_seg, minlength=self.segments)[self.itl_seg] >= 2
        # the terms each pool's model uses: a prior of 0, or a node without that load, leaves one out for all
        self.use_b = (self.batch_prior > 0) & (self.count(np.isnan(self.xb)) == 0)
        self.use_p = (self.prefill_prior > 0) & (self.n_itl >= 2) & (self.count(np.isnan(self.r)) == 0)

    def count(self, mask: np.ndarray) -> np.ndarray:
        """Per pool, its entries where mask."""
        return np.bincount(self.pid, weights=mask, minlength=self.pools)

    def within_group(self, x: np.ndarray, stat: Callable[[np.ndarray, np.ndarray, int], np.ndarray]) -> np.ndarray:
        """stat (_median_each or _medians_without) of x, one value a node with a live ITL, over its peer group, or
        over its pool where it is alone in its group."""
        out = stat(self.itl_seg, x, self.segments)
        if not self.in_group.all():
            out = np.where(self.in_group, out, stat(self.itl_pid, x, self.pools))
        return out


def _sorted_within(key: np.ndarray, x: np.ndarray, keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x sorted within each key (a segment): (the order, each segment's start and size in it, each entry's rank in
    its segment). One sort of x for its ranks, one of the key and that rank together (ties in x in any order: equal
    values give the same order statistics)."""
    rank_x = np.empty(len(x), dtype=np.intp)
    rank_x[np.argsort(x)] = np.arange(len(x))
    order = np.argsort(key * len(x) + rank_x)
    size = np.bincount(key, minlength=keys)
    start = np.cumsum(size) - size
    rank = np.empty(len(x), dtype=np.intp)
    rank[order] = np.arange(len(x)) - start[key[order]]
    return order, start, size, rank


def _medians(key: np.ndarray, x: np.ndarray, keys: int) -> np.ndarray:
    """The median of x within each key (scoring.median: the mean of the two middle values of an even count); NaN for
    a key without entries."""
    if not len(x):
        return np.full(keys, math.nan)
    order, start, size, _ = _sorted_within(key, x, keys)
    s, last = x[order], len(x) - 1
    lo = np.minimum(start + (size - 1) // 2, last)
    hi = np.minimum(start + size // 2, last)
    return np.where(size > 0, 0.5 * (s[lo] + s[hi]), math.nan)


def _median_each(key: np.ndarray, x: np.ndarray, keys: int) -> np.ndarray:
    """Each entry's median of its key's entries (itself among them)."""
    return _medians(key, x, keys)[key]


def _medians_without(key: np.ndarray, x: np.ndarray, keys: int) -> np.ndarray:
    """Each entry's median of the other entries of its key (scoring.median_without); NaN where it has no other."""
    order, start, size, rank = _sorted_within(key, x, keys)
    s, last = x[order], len(x) - 1
    n = size[key] - 1  # the others
    mid = n // 2
    upper = s[np.clip(start[key] + mid + (mid >= rank), 0, last)]
    lower = s[np.clip(start[key] + mid - 1 + (mid - 1 >= rank), 0, last)]
    return np.where(n >= 1, np.where(n % 2 == 1, upper, 0.5 * (lower + upper)), math.nan)


def _features(c: _Columns, at: np.ndarray) -> np.ndarray:
    """P of each node with a live ITL (NaN for the others, and in a pool whose model leaves the prefill term out):
    R x the step a healthy node's model predicts at its load (its group's level: the group's median ITL at the
    group's median load), so that the linear form the slopes are fitted in, step = c (1 + beta_b (b - 1) + beta_p P),
    is the one at_load solves. at: per pool the slopes that step is predicted with, (beta_b, beta_p).

    Not R x the group's median ITL (the same step for every node): the fit was then the secant of a curve, and with
    exact data from the prior's own model a pool at 4x the usual prompt tokens fitted beta_p 3x the prior and found
    a healthy node at half its peers' prompts 2.5x slower than predicted. Nor R x its own ITL: a sick node's
    slowness would make its own P (a node k times slower holds k times the prompt tokens a step), and in a small
    pool that one row is a slope its peers are judged by (a real vLLM throttled at 10 % of a core, 388 ms a token,
    made its three peers' g 3x and one's infinite)."""
    i, pid = c.itl, c.itl_pid
    use_b = c.use_b[pid]
    xb = np.where(use_b, c.xb[i], 0.0)
    r = np.where(c.use_p[pid], c.r[i], 0.0)
    m, b, rate = (c.within_group(x, _median_each) for x in (c.v[i], xb, r))
    sb, sp = at[pid, 0], at[pid, 1]
    lvl = m / (1.0 + sb * np.where(use_b, b, 0.0) + sp * rate * m)  # the linear form at the group's median node
    share = np.minimum(PREFILL_SHARE_MAX, sp * lvl * r)
    out = np.full(len(c.names), math.nan)
    out[i] = np.where(c.use_p[pid], r * (lvl * (1.0 + sb * xb) / (1.0 - share)), math.nan)
    return out


def _fitted(c: _Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pool's slopes (pools x (beta_b, beta_p), a term left out 0), each node's peers' fit (nodes x 2; -1
    where the node has none of its own and takes its pool's) and each node's P (_features). P at the priors' step
    first, then once more at the step the pool's own fit predicts (a pool whose engine is not the prior's: P at the
    prior's step biased its slope by 40 % in 48 nodes); the first fit serves only its pool slopes: no leave-one-out.
    """
    priors = np.stack((c.batch_prior, c.prefill_prior), axis=1)
    p = _features(c, priors)
    if c.use_p.any():
        first = _fit(c, p, loo=False)[0]
        again = c.use_p & (first[:, 1] > 0)
        if again.any():
            p = np.where(again[c.pid], _features(c, np.where(again[:, None], first, priors)), p)
    return (*_fit(c, p, loo=True), p)


class _Rows(NamedTuple):
    """The fit's rows, as columns over the nodes with a live ITL (i: their entries), and each pool's prior rows."""

    i: np.ndarray
    pid: np.ndarray  # their pools
    x: np.ndarray  # 3 x nodes: the intercept's, b - 1's and P's (a term the pool's model leaves out: 0)
    y: np.ndarray  # each value over its peer group's median
    w: np.ndarray  # its weight: its relative error (1 / y^2); a node alone in its group weighs 0
    prior: tuple[np.ndarray, np.ndarray, np.ndarray]  # _prior_rows
    used: np.ndarray  # pools x 2: the terms each pool's model uses
    priors: np.ndarray  # pools x 2: their prior slopes (0 for a term left out)
    active: np.ndarray  # pools: a model with a term and a node to fit


def _rows(c: _Columns, p: np.ndarray) -> _Rows:
    """The rows of each pool's fit, at the nodes' P (_features)."""
    i, pid = c.itl, c.itl_pid
    used = np.stack((c.use_b, c.use_p), axis=1)
    priors = np.where(used, np.stack((c.batch_prior, c.prefill_prior), axis=1), 0.0)
    x = np.stack((np.ones(len(i)), np.where(used[pid, 0], c.xb[i], 0.0), np.where(used[pid, 1], p[i], 0.0)))
    y = c.v[i] / _median_each(c.itl_seg, c.v[i], c.segments)
    w = np.where(c.in_group, 1.0 / (y * y), 0.0)
    return _Rows(i, pid, x, y, w, _prior_rows(c, pid, x, y, w, priors, used), used, priors,
                 used.any(axis=1) & (c.n_itl > 0))


def _log(x: np.ndarray) -> np.ndarray:
    """np.log(x) from the C library's log, value for value (zero: -inf; negative or NaN: NaN). numpy's own float64
    log runs a SIMD kernel on CPUs with AVX-512 whose results differ from it in the last bit, and a decision must not
    depend on the machine that makes it: the test trace's recorded decisions (tests/controller/
    test_decisions_identical.py) differed from tick 2 on such a CPU, and so would a replay of an incident's. One log a
    node with a live ITL, each tick: 1-2 ms at 10,000 nodes."""
    return np.fromiter((math.log(v) if v > 0 else -math.inf if v == 0 else math.nan for v in x.tolist()),
                       dtype=float, count=len(x))


def _fit(c: _Columns, p: np.ndarray, loo: bool) -> tuple[np.ndarray, np.ndarray]:
    """The slopes of the live ITL over each pool, each node's from its peers alone (leave-one-out, loo).

    Weighted least squares on the relative error of each value over its peer group's median (groups differ in speed,
    not in how load slows them), one robust reweighting (a node far from the fit, a sick one, counts less in its
    peers' fits), the fleet's prior slopes as pseudo-observations (_prior_rows), and each node's own row taken out
    of the fit (Sherman-Morrison). A term a pool's model leaves out is a unit row of its normal equations: its
    slope is 0. Returns (pools x 2, nodes x 2: -1 where a node keeps its pool's)."""
    rows = _rows(c, p)
    i, pid, x, y, w, _, used, priors, active = rows
    fit_of = _solve(*_normal(c, rows, w))
    # one robust reweighting: each node's weight by how far it sits from its pool's fit (none in a singular pool)
    pred = (fit_of[pid] * x.T).sum(axis=1)
    fits = (w > 0) & (pred > 0)  # a node the fit puts at or below zero is infinitely far from it
    res = _log(y / np.where(fits, pred, 1.0))
    finite = fits & np.isfinite(res)
    s = MAD_SCALE * np.nan_to_num(_medians(pid[finite], np.abs(res[finite]), c.pools))[pid]
    far = res != 0
    huber = np.minimum(1.0, ROBUST_K * s / np.where(far, np.abs(res), 1.0))
    w = np.where(s > 0, w * np.where(fits, np.where(far, huber, 1.0), 0.0), w)
    a, v = _normal(c, rows, w)
    inv = _inverse(a)
    theta = (inv @ v[:, :, None])[:, :, 0]
    singular = np.isnan(theta).any(axis=1)  # its prior's slopes, and no leave-one-out
    pool = np.where(active[:, None], np.where(singular[:, None], priors, _slopes(theta, priors, used)), 0.0)
    own = np.full((len(c.names), 2), -1.0)
    if not loo:
        return pool, own
    # each node's own row taken out of its pool's fit, all nodes at once: A^-1 x, its leverage w x^T A^-1 x, and
    # theta - A^-1 x k with k = w (y - theta^T x) / (1 - leverage); a node that weighs nothing, or is its fit alone,
    # or is of a pool above EXACT_LOO_MAX (one node cannot move its fit), keeps the pool's
    ax = np.einsum("nij,jn->in", inv[pid], x)
    lever = w * (x * ax).sum(axis=0)
    mine = (w > 0) & (lever < 1.0 - 1e-9) & active[pid] & ~singular[pid] & (c.n_itl[pid] <= EXACT_LOO_MAX)
    k = np.where(mine, w * (y - (theta[pid] * x.T).sum(axis=1)) / np.where(mine, 1.0 - lever, 1.0), 0.0)
    loo_slopes = _slopes(theta[pid] - (ax * k).T, priors[pid], used[pid])
    own[i] = np.where(mine[:, None], loo_slopes, -1.0)
    return pool, own


def _prior_rows(c: _Columns, pid: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray, priors: np.ndarray,
                used: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prior as pseudo-observations, 4 rows a pool (pools x 4 x 3, pools x 4, pools x 4; a term left out weighs
    0): for each term, two nodes at the pool's mean load plus and minus its spread of that term (at least PRIOR_REACH
    of its mean, and one sequence, or one prompt token, a step), with the latency the prior slopes predict at the
    pool's level, each worth the more of PRIOR_NODES / 2 nodes and what knows the term's slope to within PRIOR_CV of
    the prior against nodes of that noise (two rows at +-step, weight w each, give 2 w step^2 of information on it; a
    node's row, 1 / y^2 at a relative error `noise`). The reach matters where the nodes carry alike loads: their
    spread of load is then small, and a fit would take noise for a slope. The pool's mean, spread and level are over
    its weighted nodes (all of them where none weighs)."""
    keep = (w > 0) | (np.bincount(pid, weights=w > 0, minlength=c.pools) == 0)[pid]
    n = np.maximum(np.bincount(pid[keep], minlength=c.pools), 1)
    mean = np.stack([np.bincount(pid[keep], weights=col[keep], minlength=c.pools) / n for col in x[1:]], axis=1)
    sd = np.sqrt(np.stack([np.bincount(pid[keep], weights=(col[keep] - mean[pid[keep], k]) ** 2, minlength=c.pools)
                           for k, col in enumerate(x[1:])], axis=1) / n[:, None])
    g_mean = 1.0 + (priors * mean).sum(axis=1)
    level = _medians(pid[keep], (y / (1.0 + (priors[pid] * x[1:].T).sum(axis=1)))[keep], c.pools)
    step = np.maximum(np.maximum(sd, PRIOR_REACH * mean), 1.0)
    safe = np.where(used, priors, 1.0)
    by_nodes = (PRIOR_NODES / 2.0 / (level * g_mean) ** 2)[:, None]
    by_noise = (c.noise ** 2)[:, None] / (2.0 * step * step * (level[:, None] * PRIOR_CV * safe) ** 2)
    wk = np.where(used, np.maximum(by_nodes, by_noise), 0.0)
    rows = np.repeat(np.concatenate((np.ones((c.pools, 1)), mean), axis=1)[:, None, :], 4, axis=1)
    for k in range(2):  # term k's two rows: its mean -+ its step
        rows[:, 2 * k, k + 1] = np.maximum(0.0, mean[:, k] - step[:, k])
        rows[:, 2 * k + 1, k + 1] = np.maximum(0.0, mean[:, k] + step[:, k])
    ys = level[:, None] * (1.0 + (priors[:, None, :] * rows[:, :, 1:]).sum(axis=2))
    return rows, ys, np.repeat(wk, 2, axis=1)


def _normal(c: _Columns, r: _Rows, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pool's normal equations of the weighted least squares (sum w x x^T, sum w x y; pools x 3 x 3, pools x 3)
    over its nodes' rows (at the weights w) and its prior's; a term a pool leaves out, and a pool with nothing to
    fit, are unit rows."""
    pid, x, y, prior, used, active = r.pid, r.x, r.y, r.prior, r.used, r.active
    rows, ys, ws = prior
    ok = active[:, None, None]
    a = np.einsum("pr,pri,prj->pij", np.where(active[:, None], ws, 0.0), np.nan_to_num(rows), np.nan_to_num(rows))
    v = np.einsum("pr,pri,pr->pi", np.where(active[:, None], ws, 0.0), np.nan_to_num(rows), np.nan_to_num(ys))
    for j in range(3):
        v[:, j] += np.bincount(pid, weights=w * x[j] * y, minlength=c.pools)
        for k in range(3):
            a[:, j, k] += np.bincount(pid, weights=w * x[j] * x[k], minlength=c.pools)
    out = np.concatenate((np.zeros((c.pools, 1), dtype=bool), ~used), axis=1) | ~active[:, None]
    eye = np.eye(3)
    a = np.where(ok & ~(out[:, :, None] | out[:, None, :]), a, 0.0) + eye * out[:, :, None]
    return a, np.where(out, 0.0, v)


def _solve(a: np.ndarray, v: np.ndarray) -> np.ndarray:
    """theta of each pool's a theta = v (NaN for a singular one: its reweighting is skipped)."""
    return (_inverse(a) @ v[:, :, None])[:, :, 0]


def _inverse(a: np.ndarray) -> np.ndarray:
    """The inverse of each pool's normal matrix; NaN for a singular one."""
    try:
        return np.linalg.inv(a)
    except np.linalg.LinAlgError:  # one at a time, to tell which
        out = np.full(a.shape, math.nan)
        for p, m in enumerate(a):
            with contextlib.suppress(np.linalg.LinAlgError):
                out[p] = np.linalg.inv(m)
        return out


def _slopes(theta: np.ndarray, priors: np.ndarray, used: np.ndarray) -> np.ndarray:
    """The slopes of fits (rows of theta: intercept, b - 1, P): each term over the intercept, kept physical (never
    negative, beta_b at most 1), the prior where a fit has no intercept to speak of (a level at or below zero), 0 for
    a term left out."""
    t0 = theta[:, :1]
    kept = np.minimum(np.maximum(0.0, theta[:, 1:] / np.where(t0 > 0, t0, 1.0)), np.array([BATCH_MAX, math.inf]))
    return np.where(used, np.where(t0 > 0, kept, priors), 0.0)


def _levels(c: _Columns, pool_slopes: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Each node's peers' level c (seconds; NaN: none): the median over the other nodes of its group (of the pool when
    its group has no other) of their value over their own g at the pool's slopes; a node without a live ITL, the
    median of the pool's."""
    bb, bp = pool_slopes[c.pid, 0], pool_slopes[c.pid, 1]
    own = c.v / (1.0 + bb * np.where(c.use_b[c.pid], c.xb, 0.0) + bp * np.where(c.use_p[c.pid], p, 0.0))
    i = c.itl
    out = np.full(len(c.names), math.nan)
    out[i] = c.within_group(own[i], _medians_without)
    rest = np.flatnonzero(~c.has)
    out[rest] = _medians(c.itl_pid, own[i], c.pools)[c.pid[rest]]
    return out
