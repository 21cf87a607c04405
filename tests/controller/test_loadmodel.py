"""The load model (controller/loadmodel.py): what a node's peers predict for its live latency at its own load."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.controller import loadmodel as lm
from grayguard.controller.loadmodel import PRIOR_PREFILL_SLOPE, at_load, load_of, slopes

PRIOR_B = 0.028


def _pool(n: int, beta_b: float, beta_p: float, noise: float, seed: int, batch=(2.0, 24.0), prefill=(0.0, 6000.0)):
    """n healthy nodes of one engine at uneven loads: latency = c (1 + beta_b (b - 1) + beta_p P), P = rate x itl."""
    r = random.Random(seed)
    vals, load = {}, {}
    for i in range(n):
        b, rate = r.uniform(*batch), r.uniform(*prefill)
        c = 0.010 * (1 + beta_b * (b - 1))
        itl = c / (1 - beta_p * rate * 0.010)  # the step's own prompt tokens: s = c + 0.010 beta_p P, P = rate s
        vals[f"n{i:02d}"] = itl * math.exp(r.gauss(0, noise))
        load[f"n{i:02d}"] = load_of(b, rate)
    return vals, load


def factors(vals, load, prior=PRIOR_B, groups=None, others=None, noise=0.02):
    """g at the pool's noise (what the controller learns it to be: the _pool's noise)."""
    return at_load(vals, set(others or ()), load, prior, groups=groups, noise=noise)


def test_a_large_pool_with_uneven_loads_learns_its_own_slopes():
    vals, load = _pool(48, 0.09, 0.006, 0.03, 1)
    b, p = slopes(vals, load, PRIOR_B, noise=0.03)
    # the fit takes P as R x the step its own fit predicts at the node's load, not the node's own (a sick node's
    # own P would be its slowness): within a fifth of both slopes (the group's median step for all was a third off)
    assert b == pytest.approx(0.09, rel=0.2) and p == pytest.approx(0.006, rel=0.2)
    norm = {n: vals[n] / g for n, g in factors(vals, load).items()}
    raw_spread = max(vals.values()) / min(vals.values())
    assert raw_spread > 2.5 and max(norm.values()) / min(norm.values()) < 1.3  # the load explained, noise left


def test_a_small_evenly_loaded_pool_keeps_the_prior():
    vals, load = _pool(4, 0.5, 0.02, 0.05, 2, batch=(7.9, 8.1), prefill=(990.0, 1010.0))
    b, p = slopes(vals, load, PRIOR_B)
    assert b == pytest.approx(PRIOR_B, abs=0.01) and p == pytest.approx(PRIOR_PREFILL_SLOPE, abs=0.002)


def test_each_node_is_left_out_of_its_own_fit_exactly():
    """Sherman-Morrison's downdate equals refitting without the node (with the robust weights fixed), in each pool of
    a batch of pools fitted together."""
    pools = [_pool(12, 0.05, 0.004, 0.1, 3), _pool(7, 0.2, 0.002, 0.05, 4), _pool(20, 0.0, 0.008, 0.02, 5)]
    c = lm._Columns([lm.Request(vals, (), load, PRIOR_B) for vals, load in pools])
    feats = {(p, n): load[n][1] * vals[n] for p, (vals, load) in enumerate(pools) for n in vals}
    p = np.array([feats[(q, n)] for q, n in zip(c.pid.tolist(), c.names, strict=True)])
    saved = lm.ROBUST_K
    lm.ROBUST_K = math.inf  # no reweighting: the rows are the ones refitted below
    try:
        _, own = lm._fit(c, p, loo=True)
    finally:
        lm.ROBUST_K = saved
    rows = lm._rows(c, p)
    for j, entry in enumerate(rows.i):
        w = rows.w.copy()
        w[j] = 0.0  # the node's own row out of its pool's normal equations, nothing else
        a, v = lm._normal(c, rows, w)
        theta = np.linalg.solve(a, v[:, :, None])[:, :, 0]
        refit = lm._slopes(theta, rows.priors, rows.used)[rows.pid[j]]
        assert own[entry] == pytest.approx(refit, rel=1e-9)


def _peer_ratio(vals, g, who):
    peers = sorted(vals[n] / g[n] for n in vals if n != who)
    return vals[who] / g[who] / peers[len(peers) // 2]


def test_a_slow_node_at_a_high_batch_keeps_its_slowness():
    """Roundrobin keeps sending a slow node requests: it holds more (Little's law). Its own latency does not enter
    the fit that predicts it, so only its batch's share is taken out, not the slowdown."""
    beta_p = PRIOR_PREFILL_SLOPE  # an engine as the fleet prior says; its prompts 4 % of a step
    rate = 0.04 / (beta_p * 0.010)
    vals, load = _pool(8, 0.03, beta_p, 0.02, 4, batch=(7.0, 9.0), prefill=(0.9 * rate, 1.1 * rate))
    b = 20.0  # 2.5x the batch, 3x slower
    vals["slow"], load["slow"] = 3.0 * 0.010 * (1 + 0.03 * (b - 1)) / (1 - beta_p * rate * 0.010), load_of(b, rate)
    g = factors(vals, load)
    assert _peer_ratio(vals, g, "slow") == pytest.approx(3.0, rel=0.1)
    doubled = factors(dict(vals, slow=2 * vals["slow"]), load)  # its own value hardly moves its prediction
    assert doubled["slow"] == pytest.approx(g["slow"], rel=0.03)
    assert _peer_ratio(dict(vals, slow=2 * vals["slow"]), doubled, "slow") == pytest.approx(6.0, rel=0.15)


def test_a_node_prefilling_a_tenants_long_prompts_is_loaded_and_a_slow_one_stays_slow():
    """A healthy node at 5x its peers' prompt tokens/s spends a large share of its time prefilling: its ITL is
    what the model says (not cut). A node 2x slower at that rate holds twice the prompt tokens a step; judged at a
    healthy step's prompt tokens, its own P does not explain its slowness away."""
    beta_p, c = PRIOR_PREFILL_SLOPE, 0.010  # an engine as the fleet prior says
    rate = 0.4 / (beta_p * c)  # 40 % of a healthy node's time prefilling
    vals, load = _pool(8, 0.03, beta_p, 0.02, 6, batch=(7.0, 9.0), prefill=(0.15 * rate, 0.25 * rate))
    healthy = c * (1 + 0.03 * 7) / (1 - beta_p * c * rate)
    assert healthy / sorted(vals.values())[4] > 1.5  # compared raw, an outlier past the live cut ratio
    vals["tenant"], load["tenant"] = healthy, load_of(8.0, rate)
    assert _peer_ratio(vals, factors(vals, load), "tenant") == pytest.approx(1.0, abs=0.15)
    vals["tenant"] = 2.0 * c * (1 + 0.03 * 7) / (1 - 2.0 * beta_p * c * rate)  # 2x slower: twice the tokens a step
    assert _peer_ratio(vals, factors(vals, load), "tenant") > 2.0


def test_groups_differ_in_speed_not_in_how_load_slows_them():
    """Two GPU models, 1.7x apart: the slopes are fitted on each value over its group's median."""
    h, _ = _pool(16, 0.06, 0.004, 0.02, 7)
    a, _ = _pool(16, 0.06, 0.004, 0.02, 7)
    vals = {**{f"h{n}": v for n, v in h.items()}, **{f"a{n}": 1.7 * v for n, v in a.items()}}
    _, load1 = _pool(16, 0.06, 0.004, 0.02, 7)
    load = {**{f"h{n}": x for n, x in load1.items()}, **{f"a{n}": x for n, x in load1.items()}}
    groups = {n: n[0] for n in vals}
    b, _ = slopes(vals, load, PRIOR_B, groups=groups, noise=0.02)
    assert b == pytest.approx(0.06, rel=0.3)
    mixed_up, _ = slopes(vals, load, PRIOR_B, noise=0.02)  # one group: the speed gap taken for load
    assert abs(mixed_up - 0.06) > abs(b - 0.06)


def test_an_unknown_term_is_left_out_for_every_node():
    vals, load = _pool(6, 0.05, 0.004, 0.02, 5)
    g = factors(vals, load)
    assert set(g) == set(vals) and all(x > 1.0 for x in g.values())
    load["n00"] = (None, load["n00"][1])  # an older exporter: no batch
    only_prefill = {n: (None, x[1]) for n, x in load.items()}
    assert factors(vals, load) == factors(vals, only_prefill)
    assert factors(vals, {}) == dict.fromkeys(vals, 1.0)  # nothing known: raw
    assert at_load(vals, (), load, 0.0, 0.0) == dict.fromkeys(vals, 1.0)  # both priors 0: raw


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(10)]),
                       st.tuples(st.floats(1e-4, 10.0), st.floats(0.0, 512.0), st.floats(0.0, 1e5)), min_size=0,
                       max_size=10))
def test_the_factors_are_physical_whatever_the_data(nodes):
    """Never below one (load never makes a step faster), below what a step at PREFILL_SHARE_MAX and one step a
    sequence make, or infinite (at capacity: not judged) exactly when its prompts fill PREFILL_SHARE_MAX of a healthy
    step's time; for a node with no live ITL of its own (a probe only) too."""
    vals = {n: v for n, (v, _, _) in nodes.items()}
    load = {n: load_of(b, rate) for n, (_, b, rate) in nodes.items()}
    itl = dict(list(vals.items())[: len(vals) // 2 + 1])
    g = at_load(itl, set(vals), load, PRIOR_B)
    assert set(g) == set(vals)
    for n, x in g.items():
        assert x == math.inf or 1.0 <= x < (1.0 + load[n][0]) / (1.0 - lm.PREFILL_SHARE_MAX) + 1e-9
        if x == math.inf:  # only its prefill rate makes a step infinite: without it the node is judged
            assert at_load(itl, set(vals), {**load, n: (load[n][0], 0.0)}, PRIOR_B)[n] < math.inf
    b, p = slopes(vals, load, PRIOR_B)
    assert 0.0 <= b <= 1.0 and p >= 0.0


def test_exact_data_from_a_loaded_pool_finds_every_node_at_its_load():
    """Eight nodes whose ITLs are exactly the model's (an engine at 0.6 or 1.0 of the prior's prefill slope), the
    pool prefilling 1-5x a usual rate and one node at half or twice its peers' prompts: every node is within 11 %
    of its peers at its load (with P from the group's median step, a healthy node at half its peers' prompts in a pool
    at 4x was 2.5x slower than predicted, and cut)."""
    worst = 1.0
    for true in (0.6 * PRIOR_PREFILL_SLOPE, PRIOR_PREFILL_SLOPE):
        for peers in (1.0, 3.0, 5.0):
            for own in (0.5, 2.0):
                vals, load = {}, {}
                for i in range(8):
                    rate = (own if i == 0 else peers) * 1000.0 * (1 + 0.1 * math.sin(1.7 * i))
                    c = 0.010 * (1 + PRIOR_B * 7)
                    vals[f"n{i}"] = c / (1 - true * 0.010 * rate)
                    load[f"n{i}"] = load_of(8.0, rate)
                for noise in (0.1, 0.3):
                    g = at_load(vals, (), load, PRIOR_B, noise=noise)
                    at = {n: vals[n] / g[n] for n in vals}
                    for n in at:
                        others = sorted(v for m, v in at.items() if m != n)
                        worst = max(worst, at[n] / others[len(others) // 2], others[len(others) // 2] / at[n])
    assert worst < 1.11, worst


def test_a_noisy_pool_keeps_the_prior_where_a_quiet_one_learns_from_its_nodes():
    """Four real CPU vLLMs on two cores: a node's live ITL strays 30-40 % from its peers' by chance, and three peers
    at slightly different prompt rates say nothing about the prefill slope. Weighed against the pool's noise, the
    prior holds; the same values from a quiet pool (2 %) would be believed."""
    far = 0
    for seed in range(20):
        vals, load = _pool(4, 0.0, PRIOR_PREFILL_SLOPE, 0.35, 100 + seed, batch=(1.0, 1.0), prefill=(80.0, 320.0))
        _, noisy = slopes(vals, load, PRIOR_B, noise=0.375)
        _, quiet = slopes(vals, load, PRIOR_B, noise=0.02)
        assert noisy == pytest.approx(PRIOR_PREFILL_SLOPE, rel=0.5)
        far += abs(quiet - PRIOR_PREFILL_SLOPE) > abs(noisy - PRIOR_PREFILL_SLOPE)
    assert far >= 15  # the quiet pool's fit follows its data


_node = st.tuples(st.one_of(st.none(), st.floats(1e-3, 1.0)), st.one_of(st.none(), st.floats(0.0, 64.0)),
                  st.one_of(st.none(), st.floats(0.0, 5e4)), st.sampled_from([None, "a", "b"]), st.booleans())
_pool_st = st.tuples(st.dictionaries(st.sampled_from([f"n{i}" for i in range(12)]), _node, max_size=12),
                     st.sampled_from([0.0, PRIOR_B, 0.3]), st.sampled_from([0.0, PRIOR_PREFILL_SLOPE]),
                     st.sampled_from([0.02, 0.3]))


@settings(max_examples=150, deadline=None)
@given(st.lists(_pool_st, max_size=6))
def test_pools_answered_together_are_answered_as_each_alone(pools):
    """at_load_pools answers every pool of a tick in one pass over one set of columns: each pool's answer is the one
    it gets alone, whatever the other pools hold (peer groups, unknown loads, nodes without a live ITL, terms left
    out), to the bit: a pool's sums and order statistics are over its own entries."""
    reqs = []
    for nodes, batch_prior, prefill_prior, noise in pools:
        itl = {n: v for n, (v, *_, with_itl) in nodes.items() if v is not None and with_itl}
        load = {n: load_of(b, r) for n, (_, b, r, _, _) in nodes.items()}
        groups = {n: g for n, (*_, g, _) in nodes.items()}
        reqs.append(lm.Request(itl, set(nodes), load, batch_prior, prefill_prior, groups, noise))
    together = lm.at_load_pools(reqs)
    assert together == [lm.at_load_pools([q])[0] for q in reqs]
    assert [set(g) for g in together] == [set(q.nodes) | set(q.itl) for q in reqs]
