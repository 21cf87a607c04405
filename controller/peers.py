"""Who a node is compared with: peer groups, per-group speed coefficients, scores. Pure.

A node is scored against the other nodes of its peer group (e.g. its GPU model) when the group
has at least min_peers nodes with data. A smaller group falls back to the whole pool, with every
node's latency divided by its group's speed coefficient: configured (pools[].group_speed), or the
group's fastest member relative to the pool (a sick node is slower, never faster, so the minimum
is robust to one sick member). A lone node of an unconfigured group cannot be told apart from its
hardware: it is not scored.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from functools import partial
from typing import NamedTuple

from grayguard.controller.scoring import (
    Baseline,
    baseline,
    leave_one_out,
    leave_one_out_logs,
    median,
    median_without,
    spread_of,
    usable,
)

Group = str | None


class Score(NamedTuple):
    """A node's score against its peers. A NamedTuple, not a frozen dataclass: every node gets one for each signal
    every tick, and a tuple is made at half the cost (the decision core never stores one)."""

    z: float
    ratio: float  # latency / peer median, both in the node's own units
    peer_median: float  # in the node's own units


def score_of(z: float, ratio: float, peer_median: float) -> Score:
    """Score(z, ratio, peer_median), made without the NamedTuple's own __new__ (a Python function around the same
    tuple.__new__): the score of every node for each signal, every tick."""
    return _score((z, ratio, peer_median))


_score = partial(tuple.__new__, Score)  # _score((z, ratio, peer_median)) is Score(z, ratio, peer_median)


def _groups(values: Mapping[str, float], groups: Mapping[str, Group]) -> dict[Group, dict[str, float]]:
    out: dict[Group, dict[str, float]] = {}
    for n in sorted(values):
        out.setdefault(groups.get(n), {})[n] = values[n]
    return out


def coefficients(values: Mapping[str, float], groups: Mapping[str, Group], min_peers: int,
                 speed: Mapping[str, float], min_members: int = 2,
                 noise: Mapping[str, float] | None = None) -> dict[Group, float]:
    """Speed coefficient per group (1.0 = the pool's reference speed); groups without one are left out.

    noise: each value's own noise width (log units; scoring.sampled_noise: a mean over few requests is noisy). A
    small group's speed is its fastest member's, each member counted at its value times its noise beyond the group's
    best-measured member's: a thin window fast by chance (a node back in slow start, a few short requests) does not
    set its group-mate's expectation. Without noise, the plain minimum."""
    by = _groups(values, groups)
    large = [v for g in by.values() if len(g) >= min_peers for v in g.values()]
    ref = statistics.median(large or list(values.values())) if values else 1.0
    out: dict[Group, float] = {}
    for g, members in by.items():
        if g is not None and g in speed:
            out[g] = speed[g]
        elif len(members) >= min_peers:
            out[g] = statistics.median(members.values()) / ref
        elif len(members) >= min_members:
            own = noise or {}  # none: every member at its value (exp(0)), the plain minimum
            least = min(own.get(n, 0.0) for n in members)
            out[g] = min(v * math.exp(own.get(n, 0.0) - least) for n, v in members.items()) / ref
    for g, c in speed.items():
        out.setdefault(g, c)
    # a coefficient of 0 or infinity (values a float cannot hold apart: 1e-300 s against 1e300 s, an exporter's
    # garbage) sets no speed: the group is not scored against the pool
    return {g: c for g, c in out.items() if 0.0 < c < math.inf}


def _normalized(values: Mapping[str, float], groups: Mapping[str, Group], coef: Mapping[Group, float]
                ) -> dict[str, float]:
    """Each value over its group's speed coefficient, for the nodes of a group with one; a quotient a float cannot
    score (0 or infinite: garbage values apart by more than a float holds) is no value."""
    return {n: x for n, v in values.items() if groups.get(n) in coef and usable(x := v / coef[groups.get(n)])}


def scores(values: Mapping[str, float], groups: Mapping[str, Group], min_peers: int, min_spread: float,
           speed: Mapping[str, float], noise: Mapping[str, float] | None = None) -> dict[str, Score]:
    """Leave-one-out score of every node that can be scored (noise: each value's own, for small groups' speeds)."""
    by = _groups(values, groups)
    out: dict[str, Score] = {}
    small = []
    for g, members in by.items():
        if len(members) >= min_peers:
            _score_against_peers(members, min_spread, out)
        else:
            small.append(g)
    if not small:
        return out
    coef = coefficients(values, groups, min_peers, speed, noise=noise)
    norm = _normalized(values, groups, coef)
    if len(norm) < min_peers:
        return out
    loo = leave_one_out(norm, min_spread)
    for g in small:
        for n in by[g]:
            if n in loo:
                z, ratio = loo[n].score(norm[n])
                out[n] = Score(z, ratio, loo[n].median * coef[g])
    return out


def spread(values: Mapping[str, float], groups: Mapping[str, Group], min_peers: int,
           speed: Mapping[str, float], noise: Mapping[str, float] | None = None) -> float | None:
    """The pool's spread this tick (scoring.spread_of) of the values as scores() compares them: each within its peer
    group when the group has min_peers, the others speed-normalized against the pool; None below min_peers values."""
    by = _groups(values, groups)
    devs: list[float] = []
    small: list[str] = []
    for members in by.values():
        if len(members) >= min_peers:
            logs = sorted(math.log(v) for v in members.values())
            m = median(logs)
            devs.extend(x - m for x in logs)
        else:
            small.extend(members)
    if small:
        coef = coefficients(values, groups, min_peers, speed, noise=noise)
        norm = sorted(map(math.log, _normalized({n: values[n] for n in small}, groups, coef).values()))
        if len(norm) >= min_peers:
            m = median(norm)
            devs.extend(x - m for x in norm)
    return spread_of(devs) if len(devs) >= min_peers else None


def _score_against_peers(members: Mapping[str, float], min_spread: float, out: dict[str, Score]) -> None:
    """out[n] = Score of each member against the others, from the log of each value leave_one_out took (the same
    math.log(x): Baseline.score_log), each shared baseline's median taken once."""
    logs, loo = leave_one_out_logs(members, min_spread)
    b = None
    for lx, n in logs:
        if loo[n] is not b:  # the nodes of a rank block share one Baseline (leave_one_out)
            b = loo[n]
            peer_median = b.median
        z, ratio = b.score_log(lx)
        out[n] = _score((z, ratio, peer_median))


def canary_baseline(node: str, values: Mapping[str, float], groups: Mapping[str, Group], min_peers: int,
                    min_spread: float, speed: Mapping[str, float]) -> tuple[Baseline, float] | None:
    """(baseline, the node's coefficient) to judge a canary of a drained node against its peers."""
    g = groups.get(node)
    same = [v for m, v in values.items() if groups.get(m) == g]
    if len(same) >= min_peers - 1:
        b = baseline(same, min_spread)
        return (b, 1.0) if b else None
    coef = coefficients(values, groups, min_peers, speed, min_members=1)
    if g not in coef:
        return None
    norm = list(_normalized(values, groups, coef).values())
    b = baseline(norm, min_spread) if len(norm) >= min_peers - 1 else None
    return (b, coef[g]) if b else None


def peer_median(node: str, values: Mapping[str, float], groups: Mapping[str, Group]) -> float | None:
    """Median of the other nodes' values in the node's group (the pool when the group has no others)."""
    same = [v for m, v in values.items() if m != node and groups.get(m) == groups.get(node)]
    pool = [v for m, v in values.items() if m != node]
    pick = same or pool
    return statistics.median(pick) if pick else None


def peer_medians(nodes: Iterable[str], values: Mapping[str, float], groups: Mapping[str, Group]
                 ) -> dict[str, float | None]:
    """peer_median of each node, the values sorted once per group instead of once per node."""
    if not values:  # nothing to take a median of: None for each node (what the code below gives)
        return dict.fromkeys(nodes)
    if any(v != v for v in values.values()):  # NaN: sorting depends on the order, so sort as peer_median does
        return {n: peer_median(n, values, groups) for n in nodes}
    by: dict[Group, list[float]] = {}
    for m, v in values.items():
        by.setdefault(groups.get(m), []).append(v)
    for vals in by.values():
        vals.sort()
    pool = sorted(values.values())
    if len(by) == 1:  # one group with values (no peer groups, most pools): its sorted values are the pool's
        # a node with a value is of that group: the median without it; a node without one gets the pool's median
        rest = len(pool) > 1
        everyone = median(pool)
        return {n: everyone if (own := values.get(n)) is None else
                median_without(pool, bisect.bisect_left(pool, own)) if rest else None for n in nodes}
    out: dict[str, float | None] = {}
    for n in nodes:
        same, own = by.get(groups.get(n), []), values.get(n)
        others = len(same) - (own is not None)
        pick = same if others else pool
        if own is None:
            out[n] = median(pick) if pick else None
        else:
            out[n] = median_without(pick, bisect.bisect_left(pick, own)) if len(pick) > 1 else None
    return out

