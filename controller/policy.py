"""The node state machine: one pure function from (previous states, observations, now) to decisions.

healthy -> degraded (weight = base * 2^-(score-2)) -> quarantined (drained, weight 0, once the outlier
has been sustained) -> canary (synthetic 1-token requests straight to the node) -> slow_start
(initial share of the base weight, ramped per minute) -> healthy. No I/O, no clock: `now` is a
parameter, so the live loop, replay and the benchmark engine run exactly this code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from controller.config import RecoveryConfig, ThresholdsConfig
from controller.scoring import Baseline, baseline, ema, leave_one_out, usable

HEALTHY, DEGRADED, QUARANTINED, CANARY, SLOW_START = (
    "healthy", "degraded", "quarantined", "canary", "slow_start")
EJECTED = frozenset({QUARANTINED, CANARY})
IN_ROTATION = frozenset({HEALTHY, DEGRADED, SLOW_START})


@dataclass(frozen=True)
class Policy:
    """The knobs of the state machine."""

    thresholds: ThresholdsConfig = field(default_factory=ThresholdsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)


@dataclass(frozen=True)
class NodeInput:
    """What the controller observed about one node this tick."""

    base_weight: int  # the server's configured HAProxy weight
    latency: float | None = None  # normalized latency; None, NaN or Inf: no data this tick
    request_rate: float | None = None  # req/s; None: unknown (not checked)
    peer_group: str | None = None
    canary: float | None = None  # a canary ran this tick: its latency estimate (inf: it failed)
    hold: bool = False  # operator maintenance (MAINT): leave the node alone


@dataclass(frozen=True)
class NodeState:
    """What the controller remembers about one node between ticks (persisted)."""

    state: str = HEALTHY
    since: float = 0.0
    ema: float | None = None
    score: float | None = None
    ratio: float | None = None
    hot_ticks: int = 0  # consecutive scored ticks at or above quarantine_score
    calm_ticks: int = 0  # consecutive scored ticks clearly below degrade_score
    canary_ok: int = 0
    last_canary: float | None = None
    weight: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class NodeDecision:
    state: NodeState
    previous: str
    weight: int | None  # None: leave HAProxy as it is
    drain: bool
    peer_median: float | None = None

    @property
    def changed(self) -> bool:
        return self.state.state != self.previous


@dataclass(frozen=True)
class PoolDecision:
    nodes: dict[str, NodeDecision]
    max_ejected: int
    ejected: int
    safeguard: bool


def max_ejected(n_nodes: int, fraction: float) -> int:
    """How many nodes of a pool may be drained: 0 below 3 nodes, else at least one."""
    if n_nodes < 3:
        return 0
    return max(1, math.floor(fraction * n_nodes + 1e-9))


def canary_due(s: NodeState, now: float, r: RecoveryConfig) -> bool:
    """Whether the shell should send this node a canary now."""
    return s.state == CANARY and (s.last_canary is None or now - s.last_canary >= r.canary_interval_s - 1e-9)


def slow_start_share(s: NodeState, now: float, r: RecoveryConfig) -> float:
    return min(1.0, r.slow_start_initial + r.slow_start_step_per_min * max(0.0, now - s.since) / 60.0)


def target_weight(s: NodeState, base: int, now: float, p: Policy) -> int:
    """The HAProxy weight for a node in state s (0..256)."""
    t = p.thresholds
    base = max(0, min(256, base))
    if s.state in EJECTED:
        return 0
    if s.state == SLOW_START:
        return max(1, math.ceil(base * slow_start_share(s, now, p.recovery))) if base else 0
    if s.state == DEGRADED:
        if s.score is None:  # no fresh data: hold the weight we last chose
            return base if s.weight is None else min(s.weight, base)
        q = max(2.0, math.floor(s.score * 2) / 2)  # half-point steps: the weight does not churn every tick
        w = round(base * 2.0 ** -(q - 2.0))
        return max(min(t.min_degraded_weight, base), min(base, w))
    return base


def _move(s: NodeState, to: str, now: float, reason: str) -> NodeState:
    return replace(s, state=to, since=now, reason=reason, hot_ticks=0, calm_ticks=0)


def _scores(fresh: dict[str, float], groups: Mapping[str, str | None], min_peers: int,
            min_spread: float) -> dict[str, Baseline]:
    """Leave-one-out baseline per scored node: within its peer group, or the pool when the group is small."""
    pool_loo = leave_one_out(fresh, min_spread) if len(fresh) >= min_peers else {}
    by_group: dict[str | None, dict[str, float]] = {}
    for n, v in fresh.items():
        by_group.setdefault(groups.get(n), {})[n] = v
    out: dict[str, Baseline] = {}
    for members in by_group.values():
        loo = leave_one_out(members, min_spread) if len(members) >= min_peers else pool_loo
        out.update({n: loo[n] for n in members if n in loo})
    return out


def _canary_baseline(n: str, fresh: dict[str, float], groups: Mapping[str, str | None],
                     min_peers: int, min_spread: float) -> Baseline | None:
    same = [v for m, v in fresh.items() if groups.get(m) == groups.get(n)]
    if len(same) >= min_peers - 1:
        return baseline(same, min_spread)
    return baseline(list(fresh.values()), min_spread) if len(fresh) >= min_peers - 1 else None


def decide_pool(prev: Mapping[str, NodeState], inputs: Mapping[str, NodeInput], policy: Policy,
                now: float) -> PoolDecision:
    """Decide every node of one pool for this tick. Nodes absent from inputs are forgotten."""
    t, r = policy.thresholds, policy.recovery
    names = sorted(inputs)
    st = {n: prev.get(n) or NodeState(since=now) for n in names}
    groups = {n: inputs[n].peer_group for n in names}

    # 1. Smooth fresh latency of the nodes that carry traffic.
    fresh: dict[str, float] = {}
    for n in names:
        i, s = inputs[n], st[n]
        if i.hold or s.state in EJECTED or not usable(i.latency):
            continue
        if i.request_rate is not None and i.request_rate < t.min_request_rate:
            continue
        st[n] = replace(s, ema=ema(s.ema, i.latency, t.ema_alpha))  # type: ignore[arg-type]
        fresh[n] = st[n].ema  # type: ignore[assignment]

    # 2. Score each against its peers.
    base_of = _scores(fresh, groups, t.min_peers, t.min_spread)
    calm_gap = 1.0 + (t.min_relative_gap - 1.0) / 2.0  # gap hysteresis: calm well below the entry gap

    # 3. Per-node transitions.
    candidates: list[tuple[float, str]] = []
    for n in names:
        s, i = st[n], inputs[n]
        if i.hold:
            continue
        if s.state in IN_ROTATION:
            b = base_of.get(n)
            if b is None:
                s = replace(s, score=None, ratio=None)
            else:
                z, ratio = b.score(fresh[n])
                outlier = ratio >= t.min_relative_gap and z >= t.degrade_score
                hot = ratio >= t.min_relative_gap and z >= t.quarantine_score
                calm = ratio < calm_gap or z < t.degrade_score - t.hysteresis
                s = replace(s, score=z, ratio=ratio, hot_ticks=s.hot_ticks + 1 if hot else 0,
                            calm_ticks=s.calm_ticks + 1 if calm else 0)
                why = f"latency {ratio:.2f}x peer median, score {z:.1f}"
                if s.state in (HEALTHY, SLOW_START) and outlier:
                    s = replace(_move(s, DEGRADED, now, why), hot_ticks=s.hot_ticks)
                elif s.state == DEGRADED and s.calm_ticks >= t.recover_ticks:
                    s = _move(s, HEALTHY, now, f"latency back to {ratio:.2f}x peer median "
                                                 f"for {s.calm_ticks} ticks")
                elif s.state == DEGRADED:
                    s = replace(s, reason=why)
                if s.hot_ticks >= t.sustain_ticks:
                    candidates.append((z, n))
            if s.state == SLOW_START and slow_start_share(s, now, r) >= 1.0:
                s = _move(s, HEALTHY, now, "slow start complete")
        elif s.state == QUARANTINED and now - s.since >= r.min_quarantine_s - 1e-9:
            s = replace(_move(s, CANARY, now, f"drained {now - s.since:.0f}s; probing with canaries"),
                        canary_ok=0, last_canary=None)
        elif s.state == CANARY and i.canary is not None:
            b = _canary_baseline(n, fresh, groups, t.min_peers, t.min_spread)
            if b is not None:
                z, ratio = b.score(i.canary) if usable(i.canary) else (math.inf, math.inf)
                good = ratio < t.min_relative_gap and z < t.degrade_score
                ok = s.canary_ok + 1 if good else 0
                what = "failed" if not usable(i.canary) else f"{ratio:.2f}x peer median"
                s = replace(s, score=z if math.isfinite(z) else None, ratio=ratio if math.isfinite(ratio)
                            else None, canary_ok=ok, last_canary=now,
                            reason=f"canary {'good' if good else 'bad'} ({what}), {ok}/{r.canary_successes}")
                if ok >= r.canary_successes:
                    s = replace(_move(s, SLOW_START, now, f"{ok} good canaries in a row; slow start at "
                                      f"{r.slow_start_initial:.0%}"), ema=i.canary, canary_ok=0)
            else:
                s = replace(s, last_canary=now, reason="canary ran but no peers with data to compare")
        st[n] = s

    # 4. Quarantine the sustained outliers, worst first, within the safeguard cap.
    cap = max_ejected(len(names), t.max_ejected_fraction)
    ejected = sum(1 for n in names if st[n].state in EJECTED)
    safeguard = False
    for z, n in sorted(candidates, key=lambda c: (-c[0], c[1])):
        s = st[n]
        if ejected < cap:
            st[n] = replace(_move(s, QUARANTINED, now, f"latency {s.ratio:.2f}x peer median, score {z:.1f} "
                                  f"for {s.hot_ticks} ticks"), canary_ok=0, last_canary=None)
            ejected += 1
        else:
            safeguard = True
            st[n] = replace(s, reason=f"latency {s.ratio:.2f}x peer median, score {z:.1f}; quarantine "
                            f"withheld: safeguard cap of {cap} drained node(s) of {len(names)} reached")
    if ejected > cap:  # the pool shrank or the cap was lowered: release the nodes closest to recovery
        drained = sorted((n for n in names if st[n].state in EJECTED),
                         key=lambda n: (st[n].state != CANARY, -st[n].canary_ok, st[n].since, n))
        for n in drained[:ejected - cap]:
            st[n] = _move(st[n], SLOW_START, now, f"released: safeguard cap of {cap} drained node(s)")
        ejected = cap

    # 5. Weights.
    out = {}
    for n in names:
        s, i = st[n], inputs[n]
        prev_state = prev[n].state if n in prev else HEALTHY
        if i.hold:
            out[n] = NodeDecision(replace(s, reason="operator maintenance (MAINT): left alone"),
                                  prev_state, None, False)
            continue
        w = target_weight(s, i.base_weight, now, policy)
        b = base_of.get(n)
        out[n] = NodeDecision(replace(s, weight=w), prev_state, w, s.state in EJECTED,
                              b.median if b else None)
    return PoolDecision(out, cap, ejected, safeguard)
