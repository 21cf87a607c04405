"""The control tick: observe (HAProxy, Prometheus, canaries) -> decide (pure) -> plan -> act.

Level-triggered: every tick re-reads HAProxy and Prometheus and writes only differences, so a
restarted HAProxy or a lost write is repaired on the next tick. When the data cannot be trusted
(Prometheus down, answers garbage, or too old) the tick holds: no decision, no write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from controller.haproxy import HaproxyError, RuntimeClient, ServerState
from controller.metrics import STATES, ControllerMetrics
from controller.plan import Change, plan_backend
from controller.policy import (
    IN_ROTATION,
    NodeInput,
    NodeState,
    Policy,
    PoolDecision,
    canary_due,
    decide_pool,
)
from controller.statefile import StateFile
from grayguard.config import Config, PoolConfig
from grayguard.promclient import PromError, PrometheusClient, Sample, finite

log = logging.getLogger("grayguard.controller")

# canary(base_url) -> time to first token in seconds, or None when the request failed.
CanaryFn = Callable[[str], "float | None"]


@dataclass
class TickResult:
    """What one tick saw and did."""

    held: str | None = None  # why the tick held every weight, if it did
    changes: list[tuple[str, Change]] = field(default_factory=list)  # (endpoint, change)
    failed: list[tuple[str, Change, str]] = field(default_factory=list)  # (endpoint, change, reply)
    decisions: dict[str, PoolDecision] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Controller:
    """Owns the node states and runs ticks; every I/O seam is injected."""

    def __init__(self, cfg: Config, prom: PrometheusClient, haproxies: list[RuntimeClient],
                 canary: CanaryFn | None = None, metrics: ControllerMetrics | None = None,
                 state_file: StateFile | None = None, clock: Callable[[], float] = time.time,
                 dry_run: bool = False):
        self.cfg = cfg
        self.policy = Policy(cfg.thresholds, cfg.recovery)
        self.policies = {p.name: Policy(cfg.thresholds, cfg.recovery, dict(p.group_speed)) for p in cfg.pools}
        self.prom = prom
        self.haproxies = haproxies
        self.canary = canary
        self.metrics = metrics or ControllerMetrics.create()
        self.state_file = state_file
        self.clock = clock
        self.dry_run = dry_run
        self.states: dict[str, dict[str, NodeState]] = state_file.load() if state_file else {}
        self.last_decisions: dict[str, PoolDecision] = {}
        self.last_tick: float | None = None
        self.warned: set[str] = set()
        self._reason_series: dict[tuple[str, str], tuple[str, str]] = {}

    # ---- observe -------------------------------------------------------------------------------
    def read_haproxy(self, result: TickResult) -> dict[str, dict[str, dict[str, ServerState]]]:
        """endpoint -> backend -> server -> state, for every endpoint that answered."""
        out = {}
        wanted = {p.backend for p in self.cfg.pools}
        for hc in self.haproxies:
            try:
                servers = hc.show_servers_state()
            except HaproxyError as e:
                self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()
                result.errors.append(str(e))
                log.warning("HAProxy %s: %s", hc.endpoint, e)
                continue
            by_backend: dict[str, dict[str, ServerState]] = {}
            for s in servers:
                if s.backend in wanted:
                    by_backend.setdefault(s.backend, {})[s.name] = s
            out[hc.endpoint] = by_backend
        return out

    def _query_all(self, queries: dict[str, str]) -> dict[str, list[Sample] | PromError]:
        """Run instant queries concurrently (one round trip per tick, not one per signal)."""
        if not queries:
            return {}

        def one(q: str) -> list[Sample] | PromError:
            try:
                return self.prom.query(q)
            except PromError as e:
                return e
        with ThreadPoolExecutor(max_workers=len(queries)) as ex:
            return dict(zip(queries, ex.map(one, queries.values()), strict=True))

    def read_prometheus(self) -> tuple[dict[str, list[Sample]], str | None]:
        """Latency and request-rate samples, or the reason to hold."""
        got = self._query_all({"latency": self.cfg.signals.latency_query,
                               "rate": self.cfg.signals.request_rate_query})
        for res in got.values():
            if isinstance(res, PromError):
                self.metrics.prometheus_errors.labels(res.kind).inc()
                return {}, f"Prometheus {res.kind}: {res}"
        now = self.clock()
        for samples in got.values():
            for s in samples:  # type: ignore[union-attr]
                if abs(now - s.timestamp) > self.cfg.stale_after_s:
                    self.metrics.prometheus_errors.labels("stale").inc()
                    return {}, (f"Prometheus data is {now - s.timestamp:.0f}s old "
                                f"(stale_after_s={self.cfg.stale_after_s:g})")
        return got, None  # type: ignore[return-value]

    OPTIONAL = ("probe_result", "probe_ttft", "probe_failures", "error_ratio", "kv_cache", "gpu_throttled",
                "pcie_degraded", "gpu_ecc", "gpu_xid", "peer_group")

    def read_optional(self) -> dict[str, list[Sample]]:
        """The optional signals; a failing query is counted, logged once, and treated as absent."""
        wanted = {name: getattr(self.cfg.signals, f"{name}_query") for name in self.OPTIONAL}
        if not any(p.peer_group_label for p in self.cfg.pools):
            wanted.pop("peer_group")
        got = {}
        for name, res in self._query_all({k: q for k, q in wanted.items() if q}).items():
            if isinstance(res, PromError):
                self.metrics.prometheus_errors.labels(res.kind).inc()
                self._warn_once(f"signal:{name}:{res.kind}", f"signal {name} unavailable ({res.kind}): {res}; "
                                f"treated as absent (signals.{name}_query)")
            else:
                got[name] = res
        return got

    @staticmethod
    def series_key(pool: PoolConfig, server: ServerState) -> str:
        o = pool.servers.get(server.name)
        return o.series if o and o.series else server.address

    def canary_url(self, pool: PoolConfig, server: ServerState) -> str:
        o = pool.servers.get(server.name)
        return o.canary_url if o and o.canary_url else f"http://{server.address}"

    def run_canaries(self, pool: PoolConfig, servers: dict[str, ServerState], prev: dict[str, NodeState],
                     now: float) -> dict[str, float]:
        """Latency estimates for the nodes due a canary, in normalized-latency units.

        A 1-token request measures time to first token, not latency per token; so the same request
        also goes to up to two in-rotation peers, and the node's estimate is the peers' median EMA
        scaled by node TTFT / peer TTFT. A failed canary is +inf; no usable reference is no estimate.
        """
        due = [n for n in sorted(servers) if n in prev and canary_due(prev[n], now, self.policy.recovery)]
        if not due or self.canary is None:
            return {}
        group = {n: (pool.servers[n].peer_group if n in pool.servers else None) for n in servers}
        out = {}
        for n in due:
            peers = sorted((m for m in servers if m != n and m in prev and prev[m].state in IN_ROTATION
                            and prev[m].ema is not None and group.get(m) == group.get(n)),
                           key=lambda m: (prev[m].score or 0.0, m))[:2]
            targets = [n] + peers
            with ThreadPoolExecutor(max_workers=len(targets)) as ex:
                ttfts = dict(zip(targets, ex.map(lambda m: self.canary(self.canary_url(pool, servers[m])),
                                                 targets), strict=True))
            ref = [ttfts[m] for m in peers if ttfts[m] is not None and ttfts[m] > 0]
            node_ttft = ttfts[n]
            if node_ttft is None:
                out[n] = math.inf
                self.metrics.canaries.labels(pool.name, n, "failed").inc()
            elif ref:
                scale = statistics.median(prev[m].ema for m in peers)  # type: ignore[misc]
                out[n] = scale * node_ttft / statistics.median(ref)
                self.metrics.canaries.labels(pool.name, n, "measured").inc()
            else:
                self.metrics.canaries.labels(pool.name, n, "no_reference").inc()
                log.warning("pool=%s node=%s canary: no peer answered a reference canary", pool.name, n)
        return out

    # ---- tick ----------------------------------------------------------------------------------
    def tick(self) -> TickResult:
        """One observe-decide-act cycle; never raises for I/O trouble."""
        started = time.perf_counter()
        result = TickResult()
        try:
            self._tick(result)
        finally:
            self.metrics.tick_duration.observe(time.perf_counter() - started)
            self.metrics.ticks.labels("held" if result.held else "ok").inc()
            self.metrics.data_stale.set(1 if result.held else 0)
        return result

    def _tick(self, result: TickResult) -> None:
        hap = self.read_haproxy(result)
        if not hap:
            result.held = "no HAProxy endpoint answered"
            log.warning("holding every weight: %s", result.held)
            return
        samples, why = self.read_prometheus()
        if why:
            result.held = why
            log.warning("holding every weight: %s", why)
            return
        optional = self.read_optional()
        now = self.clock()
        primary = next(iter(hap.values()))
        lat = {}
        rate = {}
        for pool in self.cfg.pools:
            lat[pool.name] = {s.labels.get(pool.series_label): s.value for s in samples["latency"]}
            rate[pool.name] = {s.labels.get(pool.series_label): s.value for s in samples["rate"]}
        for pool in self.cfg.pools:
            servers = primary.get(pool.backend)
            if servers is None:
                self._warn_once(f"backend:{pool.backend}", f"pool={pool.name}: HAProxy has no backend "
                                f"{pool.backend!r} (pools[].backend)")
                result.errors.append(f"no backend {pool.backend}")
                continue
            for name in pool.servers:
                if name not in servers:
                    self._warn_once(f"server:{pool.name}:{name}", f"pool={pool.name}: configured server "
                                    f"{name!r} is not in HAProxy backend {pool.backend!r}")
            prev = self.states.get(pool.name, {})
            canaries = self.run_canaries(pool, servers, prev, now)
            sig = signal_maps(pool, optional)
            inputs = {}
            for n, s in servers.items():
                key = self.series_key(pool, s)
                o = pool.servers.get(n)
                inputs[n] = NodeInput(
                    base_weight=s.initial_weight, latency=lat[pool.name].get(key),
                    request_rate=rate[pool.name].get(key),
                    peer_group=(o.peer_group if o and o.peer_group else sig["peer_group"].get(key)),
                    canary=canaries.get(n), hold=s.maint,
                    probe_result=sig["probe_result"].get(key), probe_ttft=finite(sig["probe_ttft"].get(key)),
                    probe_failures=_int(sig["probe_failures"].get(key)),
                    error_ratio=finite(sig["error_ratio"].get(key)), kv_cache_usage=finite(sig["kv_cache"].get(key)),
                    gpu_throttled=_flag(sig["gpu_throttled"].get(key)),
                    pcie_degraded=_flag(sig["pcie_degraded"].get(key)),
                    gpu_ecc_uncorrectable=_flag(sig["gpu_ecc"].get(key)), gpu_xid=_flag(sig["gpu_xid"].get(key)))
            decision = decide_pool(prev, inputs, self.policies[pool.name], now)
            result.decisions[pool.name] = decision
            self.states[pool.name] = {**decision.retained, **{n: d.state for n, d in decision.nodes.items()}}
            for n, d in decision.nodes.items():
                if d.changed:
                    self.metrics.transitions.labels(pool.name, n, d.previous, d.state.state).inc()
                    log.info("pool=%s node=%s %s -> %s: %s", pool.name, n, d.previous, d.state.state,
                             d.state.reason)
            self._act(pool, decision, hap, result)
            self._export(pool, decision, servers)
        self.last_decisions = result.decisions
        if self.state_file and not self.dry_run:
            self.state_file.save(self.states)
        if not result.errors:
            self.metrics.last_success.set(now)
        self.last_tick = now

    def _act(self, pool: PoolConfig, decision: PoolDecision, hap: dict, result: TickResult) -> None:
        for hc in self.haproxies:
            actual = hap.get(hc.endpoint, {}).get(pool.backend)
            if actual is None:
                continue
            changes = plan_backend(pool.name, pool.backend, decision.nodes, actual)
            for c in changes:
                result.changes.append((hc.endpoint, c))
                log.info("%s%s %s", "[dry-run] " if self.dry_run else "", hc.endpoint, c.describe())
            if self.dry_run or not changes:
                continue
            try:
                replies = hc.apply([c.command for c in changes])
            except HaproxyError as e:
                self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()
                result.errors.append(str(e))
                log.error("HAProxy %s: batch not applied: %s", hc.endpoint, e)
                continue
            for c, r in zip(changes, replies, strict=True):
                self.metrics.haproxy_writes.labels(hc.endpoint, c.command.kind).inc()
                if not r.ok:
                    self.metrics.haproxy_errors.labels(hc.endpoint, r.kind).inc()
                    result.failed.append((hc.endpoint, c, r.reply))
                    result.errors.append(f"{c.command.render()}: {r.reply}")
                    log.error("HAProxy %s refused %r: %s", hc.endpoint, c.command.render(), r.reply)

    def _export(self, pool: PoolConfig, decision: PoolDecision, servers: dict[str, ServerState]) -> None:
        m, p = self.metrics, pool.name
        m.pool_nodes.labels(p).set(len(servers))
        m.pool_ejected.labels(p).set(decision.ejected)
        m.pool_max_ejected.labels(p).set(decision.max_ejected)
        m.pool_safeguard.labels(p).set(1 if decision.safeguard else 0)
        for n, d in decision.nodes.items():
            s = d.state
            for st in STATES:
                m.node_state.labels(p, n, st).set(1 if s.state == st else 0)
            m.node_base_weight.labels(p, n).set(servers[n].initial_weight)
            m.node_info.labels(p, n, pool.backend, self.series_key(pool, servers[n])).set(1)
            active = {k: f for k, f, _ in s.factors}
            kv_zero = d.weight == 0 and not d.drain and servers[n].initial_weight > 0
            for signal in ("latency", "probe", "errors"):
                m.node_factor.labels(p, n, signal).set(active.get(signal, 1.0))
            m.node_factor.labels(p, n, "kv_cache").set(0.0 if kv_zero else 1.0)
            if d.weight is not None:
                m.node_weight.labels(p, n).set(d.weight)
            for gauge, value in ((m.node_score, s.score), (m.node_latency_ema, s.ema),
                                 (m.node_peer_median, d.peer_median)):
                if value is None:  # absent is not zero
                    with contextlib.suppress(KeyError):
                        gauge.remove(p, n)
                else:
                    gauge.labels(p, n).set(value)
            key = (s.state, reason_code(s, kv_zero))
            old = self._reason_series.get((p, n))
            if old != key:  # one reason series per node: drop the previous one
                if old is not None:
                    m.node_reason.remove(p, n, *old)
                m.node_reason.labels(p, n, *key).set(1)
                self._reason_series[(p, n)] = key

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(msg)

    def status(self) -> dict:
        """The JSON document served at /status."""
        pools = []
        for pool in self.cfg.pools:
            d = self.last_decisions.get(pool.name)
            nodes = []
            for n, s in sorted(self.states.get(pool.name, {}).items()):
                nd = d.nodes.get(n) if d else None
                nodes.append({"node": n, "state": s.state, "since": s.since, "weight": s.weight,
                              "score": s.score, "ratio_to_peers": s.ratio, "latency_ema": s.ema,
                              "peer_median": nd.peer_median if nd else None, "reason": s.reason,
                              "factors": {k: f for k, f, _ in s.factors}, "drain_cause": s.cause or None,
                              "gone_since": s.gone_since})
            pools.append({"pool": pool.name, "backend": pool.backend,
                          "ejected": d.ejected if d else None, "max_ejected": d.max_ejected if d else None,
                          "safeguard_engaged": d.safeguard if d else None, "nodes": nodes})
        return {"last_tick": self.last_tick, "dry_run": self.dry_run, "pools": pools}


def _flag(v: float | None) -> bool | None:
    return None if v is None or v != v else v > 0


def _int(v: float | None) -> int | None:
    return None if v is None or not math.isfinite(v) else int(v)


def signal_maps(pool: PoolConfig, optional: dict[str, list[Sample]]) -> dict[str, dict]:
    """Series key -> value for every optional signal (probe_result and peer_group map to label values)."""
    out: dict[str, dict] = {}
    for name in Controller.OPTIONAL:
        samples = optional.get(name, [])
        if name == "probe_result":
            out[name] = {s.labels.get(pool.series_label): s.labels.get("result") for s in samples if s.value == 1}
        elif name == "peer_group":
            lbl = pool.peer_group_label
            out[name] = {s.labels.get(pool.series_label): s.labels.get(lbl) for s in samples} if lbl else {}
        else:
            out[name] = {s.labels.get(pool.series_label): s.value for s in samples}
    return out


def reason_code(s: NodeState, kv_zero: bool) -> str:
    """A low-cardinality summary of why a node is where it is: the signals in force, or its stage."""
    if s.state in ("quarantined", "canary"):
        return s.cause or "latency"
    parts = [k for k, _, _ in s.factors]
    if kv_zero:
        parts.append("kv_cache")
    if s.state == "slow_start":
        parts.insert(0, "recovery")
    return ",".join(parts) or "none"
