"""The control tick: observe every pool (HAProxy, Prometheus, canaries) -> decide (pure, controller/decide.py)
-> plan and act (HAProxy writes, metrics, state file).

"HAProxy" here is the gateway seam (controller/gateway.py): HAProxy's runtime API, or NGINX's rendered upstream
files (controller/nginx.py). Fencing, registry membership and actuators are HAProxy's alone (the config refuses them
with NGINX); reading the servers and applying each pool's planned batch are every gateway's.

Level-triggered: every tick re-reads HAProxy and Prometheus and writes only differences, so a
restarted HAProxy or a lost write is repaired on the next tick. When the data cannot be trusted
(Prometheus down, answers garbage, or too old) the tick holds: no decision, no write.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grayguard.config import HARDWARE_SIGNALS, Config, PoolConfig
from grayguard.controller import canary, canary_rounds, decide, readscope
from grayguard.controller.clock import SteadyClock
from grayguard.controller.desired import dump as dump_desired
from grayguard.controller.desired import from_decision
from grayguard.controller.export import NodeSeries, node_row
from grayguard.controller.gateway import Gateway, GatewayError
from grayguard.controller.haproxy import Fence, ServerState, epoch_var, write_backend
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.plan import Change, plan_backend, tier_view
from grayguard.controller.policy import NodeState, PoolDecision, config_policy, on_this_clock, pool_policies
from grayguard.controller.statefile import StateFile
from grayguard.controller.ticker import next_read
from grayguard.promclient import PromError, PrometheusClient, Sample
from grayguard.redact import redact_url
from grayguard.vocab import EJECTED

if TYPE_CHECKING:  # imported by the command only with registry.url set (it pulls in the etcd client)
    from grayguard.controller.leader import Leadership
    from grayguard.controller.membersync import MembershipSync
    from grayguard.controller.recorder import Recorder

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
    standby: str | None = None  # with a registry: why this replica leads no pool this tick (it wrote nothing)


class Controller:
    """Owns the node states and runs ticks; every I/O seam is injected."""

    # pools with `discovery: registry`: servers added, drained and deleted as the registry says, before the weight
    # plan (controller/membersync.py); set by the command when registry.url is; None: every pool is static
    membership: MembershipSync | None = None

    def __init__(self, cfg: Config, prom: PrometheusClient, haproxies: list[Gateway],
                 canary: CanaryFn | None = None, metrics: ControllerMetrics | None = None,
                 state_file: StateFile | None = None, clock: Callable[[], float] | None = None,
                 dry_run: bool = False, leadership: Leadership | None = None,
                 canary_workers: int = canary_rounds.WORKERS, recorder: Recorder | None = None):
        self.cfg = cfg
        self.recorder = recorder  # controller/recorder.py: every tick's Observation (grayguard controller --record)
        self.policy = config_policy(cfg)
        self.policies = pool_policies(cfg)  # the same builder as replay
        self.prom = prom
        self.haproxies = haproxies  # the gateways (controller/gateway.py): HAProxy endpoints, or one NGINX
        self.canary = canary
        self.metrics = metrics or ControllerMetrics.create()
        self.state_file = state_file
        self.clock = clock or SteadyClock()  # durations follow the monotonic clock, not wall-clock steps
        # canary rounds run off the tick on a bounded pool of daemon threads; a later tick takes them back
        self.workers = canary_rounds.Workers(canary, self.clock, canary_workers) if canary else None
        self.rounds = canary_rounds.Rounds()
        self.dry_run = dry_run
        # a time in the stored states after this clock's now (a run before the wall clock was stepped back) is now
        now, t = self.clock(), self.policy.thresholds
        self.states: dict[str, dict[str, NodeState]] = {
            p: on_this_clock(s, now, t) for p, s in (state_file.load() if state_file else {}).items()}
        self.last_decisions: dict[str, PoolDecision] = {}
        self.last_tick: float | None = None
        self.warned: set[str] = set()
        self.node_series = NodeSeries(self.metrics)  # each node's series as last shown: writes only changes
        self._no_data: dict[tuple[str, str], tuple[str, ...]] = {}  # (pool, reason) -> nodes last reported
        # the hardware signals' last answers: name -> (its query as sent, the answer, when the next read is due)
        self._hardware: dict[str, tuple[str, list[Sample], float]] = {}
        # with a registry (controller/leader.py): only the pools this replica leads are observed, decided and
        # written; None: it runs alone and leads every pool
        self.leadership = leadership
        self._led: frozenset[str] | None = None
        # whether the last turn knew if this replica leads (it leads a pool, or reached the registry and every scope
        # has a leader): /readyz waits for it (grayguard/health.py); alone, it always knows
        self.knows_leadership = leadership is None
        self._restoring: set[tuple[str, str]] = set()  # (endpoint, backend): a registry pool's servers all gone
        self._reseed: set[str] = set()  # pools just taken over: drains HAProxy has and their states do not, kept
        self._said_unpublished: set[str] = set()
        self._said_lost: set[str] = set()  # the backends a standby last said HAProxy lost every server of
        # every HAProxy batch is fenced by the scope's epoch in HAProxy (leader.py); a leadership seam without
        # fencing (bench/ticklocal.py's, which leads for good) writes unfenced
        self._fencing = leadership is not None and hasattr(leadership, "fence")
        if self._fencing:
            for hc in haproxies:
                hc.fence_for = self._fence_for

    # ---- observe -------------------------------------------------------------------------------
    def read_haproxy(self, result: TickResult) -> dict[str, dict[str, dict[str, ServerState]]]:
        """endpoint -> backend -> server -> state, for every endpoint that answered."""
        out = {}
        scope = self._read_scope()
        wanted = {p.backend for p in self.cfg.pools if scope is None or p.name in scope}
        for hc in self.haproxies:
            try:  # a replica leading part of the pools reads their backends only (controller/readscope.py)
                servers = hc.show_servers_state() if scope is None else hc.show_backends_state(sorted(wanted))
            except GatewayError as e:
                self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()
                result.errors.append(str(e))
                log.warning("gateway %s: %s", hc.endpoint, e)
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
        """Latency and request-rate samples and the time of their data, or the reason to hold.

        An instant query stamps every sample with its evaluation time, so the age of the data comes from
        `timestamp()` of the same query (a recorded series: the time of its last evaluation): Prometheus'
        evaluation time minus that, both on Prometheus' clock, so the controller's clock does not matter.
        decide.pool_data drops each node's series older than stale_after_s.
        """
        sig, scope = self.cfg.signals, self._read_scope()
        got = self._query_all({k: readscope.scoped(q, scope) for k, q in (
            ("latency", sig.latency_query), ("rate", sig.request_rate_query),
            ("latency_timestamp", f"timestamp({sig.latency_query})"),
            ("rate_timestamp", f"timestamp({sig.request_rate_query})"))})
        for res in got.values():
            if isinstance(res, PromError):
                self.metrics.prometheus_errors.labels(res.kind).inc()
                return {}, f"Prometheus {res.kind}: {res}"
        return got, None  # type: ignore[return-value]

    def check_pool_data(self, pool: PoolConfig, servers: dict[str, ServerState],
                        samples: dict[str, list[Sample]]) -> tuple[str | None, decide.PoolData]:
        """Export how many of the pool's nodes have usable data, say why the others have none; the reason the
        pool holds (not one node has fresh data: no canary, no decision, no write, the tick is no success), and
        the data (decide_tick takes it as it is: the same samples and max age)."""
        data = decide.pool_data(pool, servers, samples, self.cfg.stale_after_s)
        m, p = self.metrics, pool.name
        m.pool_nodes_with_data.labels(p).set(len(data.with_data))
        for reason in decide.NO_DATA_REASONS:
            m.pool_nodes_without_data.labels(p, reason).set(sum(1 for r in data.without.values() if r == reason))

        def nodes(reason: str, keys: bool = False) -> tuple[str, ...]:
            return tuple(f"{n} ({', '.join(decide.series_keys(pool, servers[n]))})" if keys else n
                         for n, r in data.without.items() if r == reason)
        lbl, q = pool.series_label, f"{self.cfg.signals.latency_query} / {self.cfg.signals.request_rate_query}"
        self._report_nodes(p, "unmatched", nodes("unmatched", keys=True),
                           f"no series of the pool (label {decide.POOL_LABEL}={p!r} or none) in {q} has a {lbl} "
                           "label naming these servers (the values looked for in brackets); they have no data "
                           "and are not protected: check that Prometheus scrapes them and how it labels them, "
                           "pools[].series_label and pools[].servers.<name>.series")
        self._report_nodes(p, "conflict", nodes("conflict"), f"two or more series of the pool name each of these "
                           f"nodes in {q}; which one is the node's own is a guess, so they have no data: check the "
                           f"{lbl} and {decide.POOL_LABEL} labels (a global view merging two Prometheus?)")
        self._report_nodes(p, "stale", nodes("stale"), f"the data of these nodes is older than stale_after_s="
                           f"{self.cfg.stale_after_s:g}s (a lagging rule group or remote-write backlog?); they "
                           "have no data")
        if data.held:
            if "stale" in data.without.values():
                m.prometheus_errors.labels("stale").inc()
            why = f"pool={p}: {data.held}: holding every weight of the pool"
            log.warning(why)
            return why, data
        return None, data

    def _report_nodes(self, pool: str, reason: str, nodes: tuple[str, ...], msg: str) -> None:
        """Warn when the set of a pool's nodes without data for reason changes (once per set, not every tick)."""
        if self._no_data.get((pool, reason), ()) == nodes:
            return
        self._no_data[(pool, reason)] = nodes
        if nodes:
            log.warning("pool=%s: %s: %s", pool, msg, ", ".join(nodes))
        else:
            log.info("pool=%s: no node is %s any more", pool, reason)

    def read_optional(self, now: float | None = None) -> dict[str, list[Sample]]:
        """The optional signals; a failing query is counted, logged once, and treated as absent.

        The hardware signals (HARDWARE_SIGNALS) are read once in signals.hardware_every_s: their source, the
        exporter's full page, changes every scrape (5 s) at most, so reading them every second read the same answer
        five times. Each is due on its own schedule, spread evenly over the interval after the first tick, so no tick
        sends them all; between reads its last answer stands. A failed read is absent and due again the next tick; a
        query that changes (the pools this replica leads) is due at once."""
        now = self.clock() if now is None else now
        every = self.cfg.signals.hardware_every_s
        wanted = {name: getattr(self.cfg.signals, f"{name}_query") for name in decide.OPTIONAL}
        if not any(p.peer_group_label for p in self.cfg.pools):
            wanted.pop("peer_group")
        scope = self._read_scope()
        queries = {k: readscope.scoped(q, scope) for k, q in wanted.items() if q}
        got = {}
        for name in HARDWARE_SIGNALS:
            last = self._hardware.get(name)
            if name in queries and every > 0 and last is not None and last[0] == queries[name] and now < last[2]:
                del queries[name]  # not due: its last answer stands
                got[name] = last[1]
        slots = [n for n in HARDWARE_SIGNALS if n in wanted and wanted[n]]
        for name, res in self._query_all(queries).items():
            if isinstance(res, PromError):
                self.metrics.prometheus_errors.labels(res.kind).inc()
                self._warn_once(f"signal:{name}:{res.kind}", f"signal {name} unavailable ({res.kind}): {res}; "
                                f"treated as absent (signals.{name}_query)")
                self._hardware.pop(name, None)
            else:
                got[name] = res
                if name in HARDWARE_SIGNALS and every > 0:
                    last = self._hardware.get(name)
                    due = next_read(last[2] if last is not None and last[0] == queries[name] else None, now, every,
                                    slots.index(name), len(slots))
                    self._hardware[name] = (queries[name], res, due)
        return got

    def canary_url(self, pool: PoolConfig, server: ServerState) -> str:
        """The configured canary_url, else http://<server address> (an IPv6 address bracketed)."""
        o = pool.servers.get(server.name)
        return o.canary_url if o and o.canary_url else canary.node_url(server.address)

    def send_canaries(self, pools: dict[str, decide.PoolObservation],
                      now: float) -> dict[str, decide.PoolObservation]:
        """Take every pool's canary rounds that completed since the last tick and start the rounds due now; the
        observations with the rounds taken.

        Never waits on a canary (controller/canary_rounds.py): the requests run on the canary workers, and a round
        is decided on the first tick that finds each target answered, failed, or running canary_timeout_s since it
        was sent, if its node is still in the canary stage it was sent in. A node whose round is in flight is sent
        no other and is decided as if no canary were due (it stays drained). Which peers, and what the answers
        mean, is controller/canary.py's (shared with the benchmark); a peer of two rounds started together gets one
        request.
        """
        if self.canary is None or self.workers is None:
            return pools
        for name in self.rounds.pools():
            if not self._leads(name):  # not this replica's to decide any more
                self.rounds.discard(name)
        by_name, timeout = {p.name: p for p in self.cfg.pools}, self.policy.recovery.canary_timeout_s
        out = dict(pools)
        due: list[tuple[str, str, list[str]]] = []  # (pool, node, [node, *peers])
        for name, o in pools.items():
            busy = self.rounds.nodes(name)  # in flight, or taken now: the next round starts on a later tick
            got = [r for r in (self._taken(name, p, o, now, timeout) for p in self.rounds.take(name, now, timeout))
                   if r is not None]
            if got:
                out[name] = dataclasses.replace(o, canaries=tuple(got))
            if not self.workers.closed:
                due += [(name, n, targets) for n, targets in canary.canary_rounds(
                    sorted(o.servers), o.prev, decide.canary_groups(by_name[name], o.servers), now,
                    self.policy.recovery) if n not in busy]
        urls = {(name, m): self.canary_url(by_name[name], pools[name].servers[m]) for name, _, ts in due for m in ts}
        probes = {u: self.workers.submit(u) for u in sorted(set(urls.values()))}
        for name, m in urls:  # one request a target: the rules take it out of the node's request rate
            self.metrics.canary_sent(name, m, decide.series_keys(by_name[name], pools[name].servers[m]))
        for name, n, targets in due:
            prev = pools[name].prev
            self.rounds.add(canary_rounds.Pending(name, n, prev[n].since, now, tuple(targets[1:]),
                                                  {m: prev[m].ema for m in targets[1:]},  # type: ignore[misc]
                                                  {m: probes[urls[name, m]] for m in targets}))
        self.metrics.canaries_in_flight.set(self.workers.in_flight())
        return out

    def _taken(self, pool: str, r: canary_rounds.Pending, o: decide.PoolObservation, now: float,
               timeout: float) -> decide.CanaryRound | None:
        """A completed round as the decision takes it (each target's TTFT, None: failed), or None to discard it."""
        why = canary_rounds.discard_reason(r, o.prev, o.servers, now, self.cfg.stale_after_s)
        if why:
            log.info("pool=%s node=%s: canary round discarded: %s", pool, r.node, why)
            return None
        ttft: dict[str, float | None] = {}
        for m, p in r.probes.items():
            failed = p.outcome(now, timeout)[1]
            ttft[m] = p.value(failed)
            if failed == "timeout":
                log.warning("canary %s: no answer within %gs of being sent (recovery.canary_timeout_s): failed",
                            redact_url(p.url), timeout)
            elif failed == "raised":
                e = p.error
                self._warn_once(f"canary-error:{p.url}:{type(e).__name__}", f"canary {redact_url(p.url)} raised "
                                f"{type(e).__name__}: {e}; counted as a failed canary")
        return decide.CanaryRound(r.node, r.peers, ttft, r.at, r.emas)

    def close(self, timeout_s: float = canary_rounds.CLOSE_WAIT_S) -> None:
        """Start no more canaries and let the workers go, waiting for them at most timeout_s (they are daemons)."""
        if self.workers is not None:
            self.workers.close(timeout_s)

    # ---- tick ----------------------------------------------------------------------------------
    def tick(self) -> TickResult:
        """One observe-decide-act cycle; never raises for I/O trouble."""
        started = time.perf_counter()
        result = TickResult()
        try:
            self._tick(result)
        finally:
            self.metrics.tick_duration.observe(time.perf_counter() - started)
            self.metrics.ticks.labels("standby" if result.standby else "held" if result.held else "ok").inc()
            self.metrics.data_stale.set(1 if result.held and not result.standby else 0)
        return result

    def _tick(self, result: TickResult) -> None:
        if not self._take_turn(result):
            return
        seen = self.observe(result)
        if seen is None:
            log.warning("holding every weight: %s", result.held)
            return
        obs, hap = seen
        if self.recorder is not None:
            self.recorder.write(obs)
        self.act(obs, decide.decide_tick(obs, self.cfg.pools, self.policies), hap, result)

    def observe(self, result: TickResult) -> tuple[decide.Observation, dict] | None:
        """Read HAProxy, Prometheus, then take and start every pool's canary rounds; None (result.held set) to hold."""
        hap = self.read_haproxy(result)
        if not hap:
            result.held = ("no HAProxy endpoint answered" if self.cfg.gateway.kind == "haproxy"
                           else f"the {self.cfg.gateway.kind} gateway did not answer")
            return None
        hap = self.sync_membership(hap, result)  # first: a restore into a restarted HAProxy goes in before a claim
        if self._fencing and self._led:
            self._hold_epochs(self._led)
        samples, why = self.read_prometheus()
        if why:
            result.held = why
            return None
        now = self.clock()
        optional = self.read_optional(now)
        views = list(hap.values())  # first endpoint first
        pools = {}
        held: list[str] = []  # pools without fresh data
        grouped = decide.by_pool(samples)  # once: each pool then matches its own series, not the fleet's
        for pool in self.cfg.pools:
            if not self._leads(pool.name):
                continue
            # one view across the tier: MAINT or DOWN on one HAProxy holds (or counts) the node only there
            servers = tier_view([v.get(pool.backend) for v in views])
            if servers is None:
                self._warn_once(f"backend:{pool.backend}", f"pool={pool.name}: HAProxy has no backend "
                                f"{pool.backend!r} (pools[].backend)")
                result.errors.append(f"no backend {pool.backend}")
                continue
            for name in pool.servers:
                if name not in servers:
                    self._warn_once(f"server:{pool.name}:{name}", f"pool={pool.name}: configured server "
                                    f"{name!r} is not in HAProxy backend {pool.backend!r}")
            why, data = self.check_pool_data(pool, servers, decide.pool_samples(grouped, pool.name))
            if why:  # the pool holds: not observed, so not decided, and the tick is no success
                result.errors.append(why)
                held.append(why)
                continue
            prev = self._reseeded(pool, servers)
            pools[pool.name] = decide.PoolObservation(servers, prev, data=data)
        if held and not pools:
            result.held = "; ".join(held)
            return None
        pools = self.send_canaries(pools, now)  # the rounds completed since the last tick; new ones start, unwaited
        return decide.Observation(now, samples, optional, pools, self.cfg.stale_after_s), hap

    def act(self, obs: decide.Observation, outcomes: dict[str, decide.PoolOutcome], hap: dict,
            result: TickResult) -> None:
        """Record the decisions, write HAProxy, export metrics, save the states."""
        for pool in self.cfg.pools:
            o = outcomes.get(pool.name)
            if o is None:
                continue
            for n, res in o.canaries:
                self.metrics.canaries.labels(pool.name, n, res).inc()
                if res == "no_reference":
                    log.warning("pool=%s node=%s canary: no peer answered a reference canary", pool.name, n)
            decision = o.decision
            result.decisions[pool.name] = decision
            self.states[pool.name] = o.states
            before = self.last_decisions.get(pool.name)
            for n, d in decision.nodes.items():
                if d.changed:
                    self.metrics.transitions.labels(pool.name, n, d.previous, d.state.state).inc()
                    log.info("pool=%s node=%s %s -> %s: %s", pool.name, n, d.previous, d.state.state,
                             d.state.reason)
                was = before.nodes.get(n) if before is not None else None
                if d.shadow or (was is not None and was.shadow):
                    self._shadow_changes(pool.name, n, was.shadow if was is not None else (), d.shadow)
            if self._handed_over(pool, o.states, result, decision):
                self._write(pool, decision, hap, result)
            self._export(pool, decision, obs.pools[pool.name].servers)
        self.last_decisions = result.decisions
        if self.state_file and not self.dry_run:
            self.state_file.save(self.states)
        if not result.errors:
            self.metrics.last_success.set(obs.now)
        self.last_tick = obs.now

    def _shadow_changes(self, pool: str, n: str, old: tuple, new: tuple) -> None:
        """Log and count what a shadowed detector begins or stops asking for (a cut, a quarantine): each finding
        once, when it begins, as the state changes are, not every tick it lasts."""
        def asks(fs: tuple) -> dict[tuple[str, str], str]:
            return {(f.detector, a): (f"would cut its weight x{f.factor:.2g}: {f.reason}" if a == "cut"
                                      else f"would quarantine it: {f.quarantine}") for f in fs for a in f.asks()}
        a, b = asks(old), asks(new)
        for key in sorted(set(b) - set(a)):
            self.metrics.shadow_findings.labels(pool, key[0], key[1]).inc()
            log.info("pool=%s node=%s shadow: detector %s %s", pool, n, key[0], b[key])
        for key in sorted(set(a) - set(b)):
            log.info("pool=%s node=%s shadow: detector %s no longer asks for a %s", pool, n, key[0], key[1])

    def _write(self, pool: PoolConfig, decision: PoolDecision, hap: dict, result: TickResult) -> None:
        """Plan and apply one pool's writes on every HAProxy endpoint that answered this tick."""
        actuated = self.cfg.haproxy.writer == "actuators"
        for hc in self.haproxies:
            actual = hap.get(hc.endpoint, {}).get(pool.backend)
            if actual is None:
                continue
            changes = plan_backend(pool.name, pool.backend, decision.nodes, actual, decision.agent_off)
            for c in changes:
                result.changes.append((hc.endpoint, c))
                log.info("%s%s %s", "[dry-run] " if self.dry_run else "[actuators] " if actuated else "",
                         hc.endpoint, c.describe())
            if self.dry_run or actuated or not changes:  # actuators: published with the states, applied there
                continue
            if not self._may_write(pool, result):
                break
            try:
                replies = hc.apply([c.command for c in changes])
            except GatewayError as e:
                self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()
                result.errors.append(str(e))
                log.error("gateway %s: batch not applied: %s", hc.endpoint, e)
                continue
            for c, r in zip(changes, replies, strict=True):
                if r.kind == "deferred":  # a gateway holding back a raise (NGINX between reloads): planned next tick
                    continue
                self.metrics.haproxy_writes.labels(hc.endpoint, c.command.kind).inc()
                if not r.ok:
                    self.metrics.haproxy_errors.labels(hc.endpoint, r.kind).inc()
                    result.failed.append((hc.endpoint, c, r.reply))
                    result.errors.append(f"{c.command.render()}: {r.reply}")
                    log.error("gateway %s refused %r: %s", hc.endpoint, c.command.render(), r.reply)

    # ---- membership (pools with discovery: registry; controller/membersync.py) --------------------
    def sync_membership(self, hap: dict, result: TickResult) -> dict:
        """Add, drain and delete the registry pools' servers (even when Prometheus is down: membership needs none
        of its data); the HAProxy view the tick goes on with, without the servers leaving or not yet UP."""
        if self.membership is None:
            return hap
        self._restoring = self._lost_members(hap)  # membership batches only: weights never pass without an epoch
        try:
            return self.membership.step(self.haproxies, hap, self.clock(), result, self._leads,
                                        lambda pool: self._may_write(pool, result), self.dry_run,
                                        lambda: self.read_haproxy(result), states=self.states)
        finally:
            self._restoring = set()

    def _lost_members(self, hap: dict, pools: list[PoolConfig] | None = None) -> set[tuple[str, str]]:
        """(endpoint, backend) of the registry pools whose HAProxy has none of the registry's (or the snapshot's)
        servers: a restarted HAProxy, which lost its dynamic servers."""
        out = set()
        for pool in self.membership.pools if pools is None else pools:  # type: ignore[union-attr]
            view = self.membership.discovery.view(pool.name)  # type: ignore[union-attr]
            if view is None or not view.nodes:
                continue
            for ep, backends in hap.items():
                if not set(view.nodes) & set(backends.get(pool.backend, {})):
                    out.add((ep, pool.backend))
        return out

    def _restore_membership(self, result: TickResult) -> None:
        """A replica leading nothing (a standby, or one that cannot reach etcd) puts the membership back into a
        HAProxy that lost every server of a registry pool, from the registry or the snapshot; each batch goes only
        where HAProxy has no fencing epoch (nobody steers it since it started: Fence.restore)."""
        pools = [p for p in self.membership.pools if not self._leads(p.name)]  # type: ignore[union-attr]
        if not pools:
            return
        hap: dict = {}
        for hc in self.haproxies:
            try:
                servers = hc.show_backends_state(sorted({p.backend for p in pools}))
            except GatewayError as e:
                self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()
                continue
            by_backend: dict[str, dict[str, ServerState]] = {p.backend: {} for p in pools}
            for srv in servers:
                by_backend.setdefault(srv.backend, {})[srv.name] = srv
            hap[hc.endpoint] = by_backend
        restoring = self._lost_members(hap, pools)
        lost = {b for _, b in restoring}
        if lost != self._said_lost:  # said once per set of backends
            self._said_lost = lost
            if lost:
                log.warning("HAProxy lost every server of %s: the membership goes back from the %s (where HAProxy has "
                            "no fencing epoch)", ", ".join(sorted(lost)), "registry" if all(
                                self.membership.discovery.view(p.name).fresh  # type: ignore[union-attr]
                                for p in pools if p.backend in lost) else "snapshot")
        if not lost:
            return
        self._restoring = restoring
        try:
            self.membership.step(self.haproxies, hap, self.clock(), result,  # type: ignore[union-attr]
                                 lambda name: any(p.name == name and p.backend in lost for p in pools),
                                 lambda pool: True, self.dry_run, lambda: {}, states=self.states)
        finally:
            self._restoring = set()

    def _fence_for(self, endpoint: str, lines: list[str]) -> Fence | None:
        """The fence of a batch (RuntimeClient.fence_for): its backend's pool's epoch (controller/leader.py);
        None for reads. A backend of no pool gets a fence nothing passes."""
        backend = write_backend(lines)
        if backend is None or self.leadership is None:
            return None
        pool = next((p for p in self.cfg.pools if p.backend == backend), None)
        if pool is None:
            return Fence(epoch_var(self.cfg.registry.prefix, f"backend:{backend}"), None)
        return self.leadership.fence(pool.name, restore=(endpoint, backend) in self._restoring)

    # ---- leadership (registry.url set; controller/leader.py) ------------------------------------
    def _take_turn(self, result: TickResult) -> bool:
        """Renew or campaign; take the states handed over for pools just taken; False when it leads no pool."""
        if self.leadership is None:
            return True
        turn = self.leadership.begin_tick()
        self.knows_leadership = bool(turn.led) or turn.ready
        for pool, states in turn.handover.items():
            self._reseed.add(pool)
            if states is not None:  # None: nothing was ever published, keep what this replica has (its state file)
                # the last leader's times are its clock's: one ahead of this replica's would freeze their timers
                self.states[pool] = on_this_clock(states, self.clock(), self.policy.thresholds)
        for pool in sorted((self._led or frozenset()) - turn.led):  # the new leader's series are the truth
            self.node_series.forget_pool(pool)
            self.rounds.discard(pool)  # and its canaries are the new leader's to send and decide
        self._led = turn.led
        if not turn.led:
            result.standby = result.held = turn.why
            if turn.ready:  # a standby's liveness: it reaches the registry and could lead at once
                self.metrics.last_success.set(self.clock())
            if self.membership is not None and self._fencing:  # with etcd or without: a restarted HAProxy gets
                # its members back (only where HAProxy has no epoch: without fencing a standby writes nothing)
                self._restore_membership(result)
            return False
        return True

    def _reseeded(self, pool: PoolConfig, servers: dict[str, ServerState]) -> dict[str, NodeState]:
        """The pool's states; at the first tick after a takeover without the states of the nodes HAProxy has drained
        while they say in rotation (a predecessor that steered without etcd drained them after its last put): those
        are seeded from HAProxy, so a drain is never undone by states older than it."""
        prev = self.states.get(pool.name, {})
        if pool.name not in self._reseed:
            return prev
        self._reseed.discard(pool.name)
        stale = sorted(n for n, st in prev.items() if n in servers and servers[n].drain and st.state not in EJECTED)
        if stale:
            log.warning("pool=%s: %s drained in HAProxy but in rotation in the states taken over: seeded from HAProxy "
                        "(kept drained)", pool.name, ", ".join(stale))
            prev = {n: st for n, st in prev.items() if n not in stale}
        return prev

    def _hold_epochs(self, led: frozenset[str]) -> None:
        """Claim this replica's epoch in every HAProxy (once per term; leader.py), even with nothing to write: it
        steers on it alone through an etcd outage."""
        if self.dry_run or self.cfg.haproxy.writer == "actuators":  # the actuators write HAProxy, from etcd
            return
        scopes = {self.leadership.scope_of(p): p for p in sorted(led)}  # type: ignore[union-attr]
        for pool in scopes.values():
            fence = self.leadership.fence(pool)  # type: ignore[union-attr]
            for hc in self.haproxies:
                hold = getattr(hc, "hold", None)  # a fake seam without fencing has none
                try:
                    if hold is not None:
                        hold(fence)
                except GatewayError as e:
                    self.metrics.haproxy_errors.labels(hc.endpoint, e.kind).inc()

    def _leads(self, pool: str) -> bool:
        return self._led is None or pool in self._led

    def _read_scope(self) -> list[str] | None:
        """The pools whose series this tick reads (controller/readscope.py); None: every series (no registry, or this
        replica leads every pool)."""
        if self._led is None or self._led >= {p.name for p in self.cfg.pools}:
            return None
        return sorted(self._led)

    def _handed_over(self, pool: PoolConfig, states: dict[str, NodeState], result: TickResult,
                     decision: PoolDecision) -> bool:
        """Write-ahead: with a registry the pool's states are in etcd before HAProxy hears of them, so a new leader
        never starts from states older than what HAProxy was told. False: do not write the pool this tick. With
        haproxy.writer: actuators the pool's desired HAProxy state goes with them: that is the write."""
        if self.leadership is None or self.dry_run:
            return True
        desired = None
        if self.cfg.haproxy.writer == "actuators":
            desired = dump_desired(from_decision(pool.name, pool.backend, decision))
        why = self.leadership.publish(pool.name, states, desired)
        if why and desired is None and self.leadership.steering_unpublished(pool.name):
            if pool.name not in self._said_unpublished:  # fenced in HAProxy all the same; etcd gets them once back
                self._said_unpublished.add(pool.name)
                log.warning("pool=%s: %s; steering on without (the HAProxy fencing epoch guards each write)",
                            pool.name, why)
            return True
        self._said_unpublished.discard(pool.name)
        if why:
            result.errors.append(f"pool={pool.name}: {why}")
            log.warning("pool=%s: HAProxy not written this tick: %s", pool.name, why)
        return why is None

    def _may_write(self, pool: PoolConfig, result: TickResult) -> bool:
        """Before every HAProxy batch: only the pool's leader sends it (HAProxy's epoch fences it, leader.py), and not
        while its claim of the epoch is still waited on (quietly: that is every takeover's first CLAIM_WAIT_S)."""
        if self.leadership is None:
            return True
        why = self.leadership.may_write(pool.name, self.cfg.haproxy.timeout_s)
        if why is None and self._fencing:
            var = self.leadership.fence(pool.name).var
            if any(getattr(hc, "claim_pending", lambda _: 0.0)(var) > 0 for hc in self.haproxies):
                log.debug("pool=%s: HAProxy not written this tick: its fencing epoch was just claimed", pool.name)
                return False
        if why:
            result.errors.append(f"pool={pool.name}: {why}")
            log.warning("pool=%s: HAProxy not written: %s", pool.name, why)
        return why is None

    def _export(self, pool: PoolConfig, decision: PoolDecision, servers: dict[str, ServerState]) -> None:
        m, p = self.metrics, pool.name
        m.pool_nodes.labels(p).set(len(servers))
        m.pool_ejected.labels(p).set(decision.ejected)
        m.pool_max_ejected.labels(p).set(decision.max_ejected)
        m.pool_safeguard.labels(p).set(1 if decision.safeguard else 0)
        m.pool_nodes_uncompared.labels(p).set(len(decision.uncompared))
        self._report_nodes(p, "uncompared", tuple(sorted(decision.uncompared)),
                           "these nodes have latency data but no peers to compare it with: their peer group has fewer "
                           "than 3 nodes with data and pools[].group_speed gives it no speed, so a slow one is not "
                           "detected by latency (set group_speed for the group, or check pools[].peer_group_label "
                           "and pools[].servers.<name>.peer_group)")
        rows = {n: node_row(d, servers[n].initial_weight, pool.backend, decide.series_key(pool, servers[n]))
                for n, d in decision.nodes.items()}
        # retained: gone from HAProxy < forget_after_s; the others' states were dropped: their series go
        self.node_series.export(p, rows, set(decision.nodes) | set(decision.retained))

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
                              "gone_since": s.gone_since, "unreachable": s.unreachable,
                              "shadow": [{"detector": f.detector, "factor": f.factor, "quarantine": f.quarantine,
                                          "reason": f.reason} for f in (nd.shadow if nd else ())]})
            pools.append({"pool": pool.name, "backend": pool.backend,
                          "ejected": d.ejected if d else None, "max_ejected": d.max_ejected if d else None,
                          "safeguard_engaged": d.safeguard if d else None, "nodes": nodes})
        doc = {"last_tick": self.last_tick, "dry_run": self.dry_run, "pools": pools}
        if self.leadership is not None:
            doc["leadership"] = self.leadership.status()
        return doc

