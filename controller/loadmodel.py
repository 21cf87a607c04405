"""The load model: what a node's peers predict for a live latency at the node's own load. Pure.

A decode step's time is a base, a share per sequence in the batch and the prompt tokens chunked into it, so a
live latency (ITL, TTFT, a probe's first token) of a healthy node is

    latency = c x g,   g = 1 + beta_b x (b - 1) + beta_p x P

b: the node's mean decode batch over the live window; P: the prompt tokens prefilled per decode step, its prefill
rate R times its step time (in the fit, its group's median ITL: see _features). A node running twice its peers'
sequences (a tenant of long completions pinned to it) or prefilling long prompts (a tenant of 8k-token prompts, a
burst) is slower by g: load, not sickness.

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
the prompt tokens a step), so its ITL's g is (1 + beta_b (b - 1)) / (1 - beta_p c R), the step time solved for P =
R x the step (c: its peers' level), and the TTFT's and the probe median's g take P = R x that healthy step.

The level c is not fitted here: each node's latency divided by its g is compared with its peers' by peers.scores
(leave-one-out median and spread, peer groups), as every other signal is. When a node lacks its batch (an older
exporter) the batch term is left out for all, and so is the prefill term when one lacks its prefill rate: one model
per comparison. A node without a live ITL has no P of its own and teaches the prefill slope nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from controller.scoring import MAD_SCALE, PRIOR_SPREAD, median, median_without

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
# a healthy node at this share of its time prefilling is as loaded as the model says: beyond, its step is not told
# from a sick one's (a 20x step), and g stops growing
PREFILL_SHARE_MAX = 0.95
EXACT_LOO_MAX = 64  # above this pool size one node cannot move the fit: the pool's own fit serves every node

Load = tuple[float | None, float | None]  # (b - 1, prompt tokens/s) of one node; None: unknown


def load_of(batch: float | None, prefill_rate: float | None) -> Load:
    """(b - 1, R) of one node; None where unknown. A batch below one (the node idled part of the window) is one."""
    xb = max(0.0, batch - 1.0) if batch is not None and math.isfinite(batch) else None
    r = prefill_rate if prefill_rate is not None and math.isfinite(prefill_rate) and prefill_rate >= 0 else None
    return xb, r


def at_load(itl: Mapping[str, float], others: Mapping[str, Mapping[str, float]], load: Mapping[str, Load],
            batch_prior: float, prefill_prior: float = PRIOR_PREFILL_SLOPE,
            groups: Mapping[str, str | None] | None = None, noise: float = PRIOR_NOISE
            ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """g of every node for the live ITL (`itl`) and for each other live latency (`others`, by name): each value
    divided by its g is the node's latency at a batch of one with no prompt in its steps, as its peers predict.

    load: each node's (b - 1, R) (load_of); a node absent or with None drops that term for all.
    batch_prior / prefill_prior: the fleet's slopes (0: that term is left out).
    noise: the pool's noise on the signal (the log-scale deviation of a healthy node from its peers): what one
    node's value is worth against the prior.
    """
    groups = groups or {}
    nodes = set(itl).union(*others.values()) if others else set(itl)
    use_b, use_p, seen = _features(itl, nodes, load, batch_prior, prefill_prior, groups)
    fit = _Fit(itl, seen, use_b, use_p, batch_prior, prefill_prior, groups, noise)
    # the healthy step at each node's load: its peers' level c, the step time solved for P = R x the step
    level = fit.levels(itl, seen)
    step: dict[str, float] = {}
    g_itl: dict[str, float] = {}
    for n in nodes:
        bb, bp = fit.slopes_of(n)
        batch = 1.0 + bb * (seen[n][0] or 0.0)
        c = level.get(n)
        share = min(PREFILL_SHARE_MAX, bp * c * load[n][1]) if use_p and c is not None else 0.0
        if n in itl:
            g_itl[n] = batch / (1.0 - share)
        if c is not None:
            step[n] = c * batch / (1.0 - share)
    out = {}
    for name, values in others.items():
        f = _Fit(values, seen, use_b, use_p, batch_prior, prefill_prior, groups, noise)
        out[name] = {}
        for n in values:
            bb, bp = f.slopes_of(n)
            p = load[n][1] * step[n] if use_p and n in step else 0.0
            out[name][n] = 1.0 + bb * (seen[n][0] or 0.0) + bp * p
    return g_itl, out


class _Fit:
    """The slopes of one live latency over a pool, each node's from its peers alone (leave-one-out)."""

    def __init__(self, values: Mapping[str, float], seen: Mapping[str, tuple[float | None, float | None]],
                 use_b: bool, use_p: bool, batch_prior: float, prefill_prior: float,
                 groups: Mapping[str, str | None], noise: float = PRIOR_NOISE) -> None:
        self.cols = [k for k, on in ((0, use_b), (1, use_p)) if on]
        self.priors = [batch_prior if k == 0 else prefill_prior for k in self.cols]
        self.groups = groups
        self.names = sorted(values)
        self.rows = _rows(values, seen, self.cols, groups)
        self.pool = [0.0] * len(self.cols)
        self.loo: dict[str, list[float]] = {}
        if not self.cols or not self.names:
            return
        rows, prior_rows = self.rows, _prior_rows(self.rows, self.priors, noise)
        base = _solve(_normal(rows + prior_rows))
        if base is not None:  # one robust reweighting: each node's weight by how far it sits from the pool's fit
            res = [_log_residual(x, y, base) if w > 0 else 0.0 for x, y, w in rows]
            spread = sorted(abs(r) for r, (_, _, w) in zip(res, rows, strict=True) if w > 0 and math.isfinite(r))
            s = MAD_SCALE * median(spread) if spread else 0.0
            if s > 0:
                rows = [(x, y, w * (0.0 if not math.isfinite(r) else min(1.0, ROBUST_K * s / abs(r)) if r else 1.0))
                        for (x, y, w), r in zip(rows, res, strict=True)]
        self.rows = rows
        a, v = _normal(rows + prior_rows)
        inv = _inverse(a)
        if inv is None:
            self.pool = list(self.priors)
            return
        d = len(v)
        theta = [sum(inv[r][c] * v[c] for c in range(d)) for r in range(d)]
        self.pool = _slopes(theta, self.priors, self.cols)
        if len(self.names) > EXACT_LOO_MAX:
            return
        for n, (x, y, w) in zip(self.names, rows, strict=True):
            if w <= 0:
                continue
            ax = [sum(inv[r][c] * x[c] for c in range(d)) for r in range(d)]  # A^-1 x
            lever = w * sum(x[r] * ax[r] for r in range(d))
            if lever < 1.0 - 1e-9:  # its own row taken out of the fit (Sherman-Morrison): its peers' fit
                k = w * (y - sum(theta[r] * x[r] for r in range(d))) / (1.0 - lever)
                self.loo[n] = _slopes([theta[r] - ax[r] * k for r in range(d)], self.priors, self.cols)

    def slopes_of(self, n: str | None = None) -> tuple[float, float]:
        """(beta_b, beta_p) that judge node n: its peers' fit (None: the pool's; a term left out: 0)."""
        fit = self.pool if n is None else self.loo.get(n, self.pool)
        out = [0.0, 0.0]
        for k, b in zip(self.cols, fit, strict=True):
            out[k] = b
        return out[0], out[1]

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


def _features(itl: Mapping[str, float], nodes: set[str], load: Mapping[str, Load], batch_prior: float,
              prefill_prior: float, groups: Mapping[str, str | None]
              ) -> tuple[bool, bool, dict[str, tuple[float | None, float | None]]]:
    """Which terms the model uses (a prior of 0, or a node without that load, leaves one out for all) and each
    node's features (b - 1, R x its group's median ITL) where known. Not R x its own ITL: a sick node's slowness would
    make its own P (a node k times slower holds k times the prompt tokens a step), and in a small group that one
    node's P is a slope its peers are judged by."""
    use_b = batch_prior > 0 and all(load.get(n, (None, None))[0] is not None for n in nodes)
    use_p = prefill_prior > 0 and len(itl) >= 2 and all(load.get(n, (None, None))[1] is not None for n in nodes)
    step_of = _group_medians(itl, groups)
    seen = {n: (load[n][0] if use_b else None,
                load[n][1] * step_of[n] if use_p and n in itl and n in step_of else None) for n in nodes}
    return use_b, use_p, seen


def _group_medians(values: Mapping[str, float], groups: Mapping[str, str | None]) -> dict[str, float]:
    """Each node's group's median value (the pool's where its group has no other node)."""
    by: dict[str | None, list[float]] = {}
    for n, v in values.items():
        by.setdefault(groups.get(n), []).append(v)
    pool = median(sorted(values.values())) if values else None
    meds = {g: median(sorted(v)) for g, v in by.items() if len(v) >= 2}
    return {n: meds.get(groups.get(n), pool) for n in values}


def slopes(values: Mapping[str, float], load: Mapping[str, Load], batch_prior: float,
           prefill_prior: float = PRIOR_PREFILL_SLOPE, groups: Mapping[str, str | None] | None = None,
           noise: float = PRIOR_NOISE) -> tuple[float, float]:
    """The pool's own fit of the live ITL (every node in it): (beta_b, beta_p), a term left out 0. For reports and
    tests."""
    use_b, use_p, seen = _features(values, set(values), load, batch_prior, prefill_prior, groups or {})
    return _Fit(values, seen, use_b, use_p, batch_prior, prefill_prior, groups or {}, noise).slopes_of()


def _rows(values: Mapping[str, float], seen: Mapping[str, tuple[float | None, float | None]], cols: list[int],
          groups: Mapping[str, str | None]) -> list:
    """The fit's rows (x, y, weight), by node name: y is each value over its group's median, weighted by its
    relative error (1 / y^2); a node alone in its group, or without a feature of the model, weighs 0."""
    names = sorted(values)
    by: dict[str | None, list[float]] = {}
    for n in names:
        by.setdefault(groups.get(n), []).append(values[n])
    level = {g: median(sorted(v)) for g, v in by.items()}
    rows = []
    for n in names:
        g = groups.get(n)
        y = values[n] / level[g]
        x = [1.0] + [seen[n][k] for k in cols]
        ok = len(by[g]) >= 2 and all(xi is not None for xi in x)
        rows.append(([xi or 0.0 for xi in x], y, 1.0 / (y * y) if ok else 0.0))
    return rows


def _prior_rows(rows: list, priors: list[float], noise: float = PRIOR_NOISE) -> list:
    """The prior as pseudo-observations: for each term, two nodes at the pool's mean load plus and minus its spread
    of that term (at least PRIOR_REACH of its mean, and one sequence, or one prompt token, a step), with the latency
    the prior slopes predict at the pool's level, each worth the more of PRIOR_NODES / 2 nodes and what knows the
    term's slope to within PRIOR_CV of the prior against nodes of that noise (two rows at +-step, weight w each, give
    2 w step^2 of information on it; a node's row, 1 / y^2 at a relative error `noise`). The reach matters
    where the nodes carry alike loads: their spread of load is then small, and a fit would take noise for a slope."""
    rows = [r for r in rows if r[2] > 0] or rows
    n = len(rows)
    mean = [sum(x[k] for x, _, _ in rows) / n for k in range(len(rows[0][0]))]
    g_mean = 1.0 + sum(b * m for b, m in zip(priors, mean[1:], strict=True))
    level = median(sorted(y / (1.0 + sum(b * xi for b, xi in zip(priors, x[1:], strict=True))) for x, y, _ in rows))
    out = []
    for k in range(1, len(priors) + 1):
        sd = math.sqrt(sum((x[k] - mean[k]) ** 2 for x, _, _ in rows) / n)
        step = max(sd, PRIOR_REACH * mean[k], 1.0)
        w = max(PRIOR_NODES / 2.0 / (level * g_mean) ** 2,
                noise * noise / (2.0 * step * step * (level * PRIOR_CV * priors[k - 1]) ** 2))
        for sign in (-1.0, 1.0):
            x = list(mean)
            x[k] = max(0.0, mean[k] + sign * step)
            y = level * (1.0 + sum(b * xi for b, xi in zip(priors, x[1:], strict=True)))
            out.append((x, y, w))
    return out


def _normal(rows: list) -> tuple[list[list[float]], list[float]]:
    """The weighted least squares' normal equations: sum w x x^T, sum w x y."""
    d = len(rows[0][0])
    a = [[0.0] * d for _ in range(d)]
    v = [0.0] * d
    for x, y, w in rows:
        for r in range(d):
            v[r] += w * x[r] * y
            for c in range(d):
                a[r][c] += w * x[r] * x[c]
    return a, v


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


def _slopes(theta: list[float] | None, priors: list[float], cols: list[int]) -> list[float]:
    """(beta per term) = theta's slopes over its intercept, kept physical: never negative, beta_b at most 1; the
    prior where the fit has no intercept to speak of (singular, or a level at or below zero)."""
    if theta is None or not theta[0] > 0:
        return list(priors)
    return [min(max(0.0, t / theta[0]), BATCH_MAX if k == 0 else math.inf)
            for t, k in zip(theta[1:], cols, strict=True)]


def _log_residual(x: list[float], y: float, theta: list[float]) -> float:
    pred = sum(t * xi for t, xi in zip(theta, x, strict=True))
    return math.log(y / pred) if pred > 0 else math.inf
