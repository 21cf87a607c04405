"""The per-node series of the controller's metrics, written as differences.

Every tick the controller shows each node's state, weight, factors, score and reason (about 17 series a
node). Setting them all again each tick costs a `labels()` call each (a lock, a label check, a tuple
key): at 10,000 nodes some 170,000 calls, about a second of every tick. Most of them do not change from one
tick to the next, so each node's last exported row is kept and only the series whose value changed are
written. What Prometheus scrapes is the same: a series is set to the same value, removed when its value is
absent (absent is not zero), and every series of a node goes when the controller stops tracking it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import Gauge

from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeDecision, NodeState
from grayguard.vocab import EJECTED, STATES, Signal, State

# node_factor's `signal` values (KV saturation last: it is the decision's weight 0, not a factor of the state)
FACTOR_SIGNALS = (Signal.LATENCY, Signal.PROBE, Signal.ERRORS, Signal.LIVE, Signal.KV_CACHE)


@dataclass(frozen=True)
class NodeRow:
    """What one node's series show; two equal rows write nothing."""

    state: str
    base_weight: int
    info: tuple[str, str]  # node_info's backend and series key
    factors: tuple[float, ...]  # in FACTOR_SIGNALS order
    weight: int | None  # None: the decision left HAProxy alone, the last weight shown stays
    score: float | None
    ema: float | None
    peer_median: float | None
    reason: tuple[str, str]  # node_reason_info's state and reason code
    # what the detectors in shadow mode ask for: (detector, weight factor or None for no cut, asks a quarantine)
    shadow: tuple[tuple[str, float | None, bool], ...] = ()


def node_row(d: NodeDecision, base_weight: int, backend: str, series_key: str) -> NodeRow:
    """One node's row from its decision (pure)."""
    s = d.state
    active = {k: f for k, f, _ in s.factors}
    kv_zero = d.weight == 0 and not d.drain and base_weight > 0
    factors = tuple(active.get(k, 1.0) for k in FACTOR_SIGNALS[:-1]) + (0.0 if kv_zero else 1.0,)
    shadow = tuple((f.detector, f.factor if "cut" in f.asks() else None, "quarantine" in f.asks()) for f in d.shadow)
    return NodeRow(s.state, base_weight, (backend, series_key), factors, d.weight, s.score, s.ema, d.peer_median,
                   (s.state, reason_code(s, kv_zero)), shadow)


def reason_code(s: NodeState, kv_zero: bool) -> str:
    """A low-cardinality summary of why a node is where it is: the signals in force, or its stage."""
    if s.state in EJECTED:
        return s.cause or "latency"
    parts = [k for k, _, _ in s.factors]
    if kv_zero:
        parts.append(Signal.KV_CACHE)
    if s.state == State.SLOW_START:
        parts.insert(0, "recovery")
    return ",".join(parts) or "none"


def write_shadow(m: ControllerMetrics, p: str, n: str, old: tuple, new: tuple) -> None:
    """Show what the shadowed detectors ask for now: a series for each cut and quarantine asked, none for the rest
    (absent: it asks nothing)."""
    def series(rows: tuple) -> tuple[dict[str, float], dict[str, float]]:
        return {d: f for d, f, _ in rows if f is not None}, {d: 1.0 for d, _, q in rows if q}

    for gauge, before, now in zip((m.node_shadow_factor, m.node_shadow_quarantine), series(old), series(new),
                                  strict=True):
        for d in set(before) - set(now):
            with contextlib.suppress(KeyError):
                gauge.remove(p, n, d)
        for d, v in now.items():
            gauge.labels(p, n, d).set(v)


class NodeSeries:
    """Each tracked node's last exported row, per pool; writes only what changed."""

    def __init__(self, metrics: ControllerMetrics):
        self.metrics = metrics
        self.rows: dict[str, dict[str, NodeRow]] = {}  # pool -> node -> the row its series show
        # pool -> (node, gauge) -> the labelled child of a value that moves most ticks (score, EMA, peer median):
        # set without a labels() call; dropped with its series
        self.children: dict[str, dict[tuple[str, int], Gauge]] = {}

    def export(self, pool: str, rows: dict[str, NodeRow], tracked: set[str]) -> None:
        """Show this tick's rows; drop every series of the pool's nodes no longer tracked (their page resolves)."""
        shown = self.rows.setdefault(pool, {})
        for n, row in rows.items():
            old = shown.get(n)
            if row != old:
                self._write(pool, n, old, row)
                shown[n] = row
        for gone in sorted(set(shown) - tracked):
            self.metrics.forget_node(pool, gone)
            del shown[gone]
            for k in (0, 1, 2):
                self.children.get(pool, {}).pop((gone, k), None)

    def forget_pool(self, pool: str) -> None:
        """Remove every series of the pool (another replica leads it now) and what was shown of it."""
        self.metrics.forget_pool(pool)
        self.rows.pop(pool, None)
        self.children.pop(pool, None)

    def _write(self, p: str, n: str, old: NodeRow | None, new: NodeRow) -> None:
        m = self.metrics
        if old is None or old.state != new.state:
            for st in STATES:
                m.node_state.labels(p, n, st).set(1 if new.state == st else 0)
        if old is None or old.base_weight != new.base_weight:
            m.node_base_weight.labels(p, n).set(new.base_weight)
        if old is None or old.info != new.info:
            if old is not None:  # one info series a node: the old series key's goes
                m.node_info.remove(p, n, *old.info)
            m.node_info.labels(p, n, *new.info).set(1)
        for i, signal in enumerate(FACTOR_SIGNALS):
            if old is None or old.factors[i] != new.factors[i]:
                m.node_factor.labels(p, n, signal).set(new.factors[i])
        if new.weight is not None and (old is None or old.weight != new.weight):
            m.node_weight.labels(p, n).set(new.weight)
        was = (None, None, None) if old is None else (old.score, old.ema, old.peer_median)
        children = self.children.setdefault(p, {})
        for k, (gauge, value, before) in enumerate(zip((m.node_score, m.node_latency_ema, m.node_peer_median),
                                                       (new.score, new.ema, new.peer_median), was, strict=True)):
            if old is not None and value == before:  # (None == None: removed already)
                continue
            if value is None:  # absent is not zero
                children.pop((n, k), None)
                with contextlib.suppress(KeyError):
                    gauge.remove(p, n)
            else:
                child = children.get((n, k))
                if child is None:
                    child = children[(n, k)] = gauge.labels(p, n)
                child.set(value)
        if old is None or old.reason != new.reason:  # one reason series a node: drop the previous one
            if old is not None:
                m.node_reason.remove(p, n, *old.reason)
            m.node_reason.labels(p, n, *new.reason).set(1)
        if (old.shadow if old is not None else ()) != new.shadow:
            write_shadow(m, p, n, old.shadow if old is not None else (), new.shadow)
