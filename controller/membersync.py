"""The membership step of a tick, for pools with `discovery: registry`: the Discovery's view and HAProxy's servers in,
membership's plan (controller/membership.py, pure) applied through the runtime API before the weight plan.

It returns the HAProxy view the rest of the tick decides on: read again when it wrote, and without the servers
being removed (gone for the policy: no weight or drain of theirs is written) or joining (added, not yet UP: a new
server's agent starts DOWN until its first answer, which the policy would take for an agent mark-down).

The expiry removals begun within the last minute (the cap's and the floor's window) are kept in etcd as well,
one key each under `<prefix>/membership/<pool>/expiries/` on a lease of two windows, written before the removal
is (write-ahead: a removal whose record failed is not begun): a restarted controller, or the replica a pool is
handed over to, counts them too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from grayguard.config import Config, PoolConfig
from grayguard.controller import membership as mb
from grayguard.controller.discovery import Discovery
from grayguard.controller.haproxy import HaproxyError, RuntimeClient, ServerState, check_name, parse_stat_columns
from grayguard.controller.policy import NodeState, Policy
from grayguard.registry import Registry, RegistryError

log = logging.getLogger("grayguard.membership")

Hap = dict[str, dict[str, dict[str, ServerState]]]  # endpoint -> backend -> server -> state
# replies of the runtime API that mean success (`set server`, `enable health` and `enable agent` answer nothing)
# what a topic says when all is well: not logged at start
_QUIET: dict[str, Any] = {"held": (), "frozen": False, "unroutable": (), "kept": (), "untrusted": False}
OK_REPLIES = ("New server registered", "Server deleted", "IP changed", "no need to change", "port changed")


def reply_ok(reply: str) -> bool:
    text = reply.strip()
    return not text or text.startswith(OK_REPLIES)


class MembershipMetrics:
    """The membership step's series, in the controller's registry."""

    def __init__(self, r: CollectorRegistry):
        self.changes = Counter("grayguard_membership_changes", "Membership writes by action (add, drain, delete, "
                               "ready, addr)", ["pool", "action"], registry=r)
        self.errors = Counter("grayguard_membership_write_errors", "Membership runtime-API lines HAProxy refused or "
                              "could not take, by kind", ["pool", "kind"], registry=r)
        self.held = Gauge("grayguard_membership_expiries_held", "Expired registrations HAProxy has DOWN that are not "
                          "removed: beyond registry.expiry_cap_per_minute or the pool's floor, or the view not trusted "
                          "(a mass expiry: the registry or the network, not the nodes)", ["pool"], registry=r)
        self.cap = Gauge("grayguard_membership_expiry_cap", "Servers expiries may remove per minute", ["pool"],
                         registry=r)
        self.removing = Gauge("grayguard_membership_removing", "Servers out of rotation, deleted once their "
                              "connections are gone", ["pool"], registry=r)
        self.joining = Gauge("grayguard_membership_joining", "Servers added and not yet UP in HAProxy", ["pool"],
                             registry=r)
        self.unroutable = Gauge("grayguard_membership_unroutable", "Registrations whose endpoint HAProxy cannot take "
                                "(not an IP address)", ["pool"], registry=r)
        self.kept = Gauge("grayguard_membership_expired_kept", "1 for a node whose registration expired while "
                          "HAProxy's checks and agent still have it UP: kept in rotation (expiry is evidence only "
                          "with the gateway's agreement)", ["pool", "node"], registry=r)
        self.untrusted = Gauge("grayguard_membership_view_untrusted", "1 while the pool's registry view is not "
                               "trusted to remove anything: it lost more registrations at once than the expiry cap, "
                               "or every one (an etcd freeze past the TTL, a re-list gap)", ["pool"], registry=r)


class MembershipSync:
    """Plans and applies the membership of every registry pool, one tick at a time; its memory is in-process."""

    def __init__(self, cfg: Config, discovery: Discovery, policies: Mapping[str, Policy],
                 metrics: CollectorRegistry | None = None, store: Registry | None = None):
        """store: where the window of expiry removals is kept (default: a client of registry.url of its own)."""
        self.cfg = cfg
        self.store = store if store is not None or cfg.registry.url is None else Registry(
            cfg.registry.url, timeout=cfg.registry.timeout_s)
        self.pools = [p for p in cfg.pools if p.discovery == "registry"]
        self.discovery = discovery
        self.policies = policies
        self.share = cfg.registry.expiry_share(cfg.thresholds.max_ejected_fraction)
        self.metrics = MembershipMetrics(metrics or CollectorRegistry())
        self.memory: dict[str, mb.PoolMemory] = {}
        self._said: dict[tuple[str, str], Any] = {}  # what was last logged per (pool, topic): said once
        self._refused: set[tuple[str, str, str]] = set()  # (endpoint, line, reply) already logged
        self._kept: dict[str, set[str]] = {}  # pool -> nodes whose expired_kept series is set

    def step(self, haproxies: Sequence[RuntimeClient], hap: Hap, now: float, result: Any,
             leads: Callable[[str], bool], may_write: Callable[[PoolConfig], bool], dry_run: bool,
             reread: Callable[[], Hap], states: Mapping[str, Mapping[str, NodeState]] | None = None) -> Hap:
        """Plan (and unless dry_run, apply) every led registry pool; the HAProxy view for the rest of the tick.

        states: the policy's node states by pool (a node it holds out of rotation is re-added drained)."""
        wrote = False
        for pool in self.pools:
            if leads(pool.name):
                wrote |= self._pool(pool, haproxies, hap, now, result, may_write, dry_run,
                                    (states or {}).get(pool.name, {}))
            else:  # the leader's flags are the truth: a standby's would page for nodes it does not decide on
                self._flag_kept(pool, ())
        if wrote:
            hap = reread() or hap
        return self.hide(hap)

    def hide(self, hap: Hap) -> Hap:
        """hap without the servers membership keeps from the policy (removing, joining)."""
        out: Hap = {}
        hidden = {p.backend: mb.hidden(self.memory.get(p.name, mb.PoolMemory())) for p in self.pools}
        for ep, backends in hap.items():
            out[ep] = {b: ({n: s for n, s in srv.items() if n not in hidden[b]} if hidden.get(b) else srv)
                       for b, srv in backends.items()}
            for b in hidden:  # a registry pool's backend is there even while it has no server
                out[ep].setdefault(b, {})
        return out

    def _pool(self, pool: PoolConfig, haproxies: Sequence[RuntimeClient], hap: Hap, now: float, result: Any,
              may_write: Callable[[PoolConfig], bool], dry_run: bool, states: Mapping[str, NodeState]) -> bool:
        view = self.discovery.view(pool.name)
        if view is None:
            self._say(pool, "view", "missing", logging.WARNING, "pool=%s: no registry view yet (etcd unreachable "
                      "and no snapshot): membership unchanged", pool.name)
            return False
        # `show servers state` lists no backend without servers: an endpoint that answered has it empty (a missing
        # backend makes `add server` fail, and that is logged)
        views = {hc.endpoint: hap[hc.endpoint].get(pool.backend, {}) for hc in haproxies if hc.endpoint in hap}
        present = {n for v in views.values() for n in v}
        up = {n for v in views.values() for n, s in v.items() if not s.down and not s.maint}
        mem = mb.joined(self.memory.get(pool.name, mb.PoolMemory()), list(views.values()), now)
        fraction = self.policies[pool.name].thresholds.max_ejected_fraction
        if mb.may_expire(view, mem, present, up):  # a removal could begin: count the window's removals of etcd too
            stored = self._stored_expiries(pool, now)
            d = mb.decide(view, mb.remembered(mem, stored or ()), present, now, self.share, up=up, fraction=fraction)
            if stored is None:  # the window is unknown: no expiry removal begins on a guess
                d = mb.withhold(d, d.started)
            elif not dry_run:
                d = self._record_expiries(pool, d, result)
        else:
            d = mb.decide(view, mem, present, now, self.share, up=up, fraction=fraction)
        self._report(pool, d, view)
        joining = dict(d.memory.joining)
        wrote = False
        unroutable: dict[str, str] = {}
        for hc in haproxies:
            servers = views.get(hc.endpoint)
            if servers is None:
                continue
            changes, bad = self._plan(hc, pool, d, servers, now, states)
            unroutable.update(bad)
            for c in changes:
                result.changes.append((hc.endpoint, c))
                log.info("%s%s %s", "[dry-run] " if dry_run else "", hc.endpoint, c.describe())
            if dry_run or not changes or not may_write(pool):
                continue
            wrote = True
            for n in self._apply(hc, pool, changes, result):
                joining.setdefault(n, now)
        self.memory[pool.name] = replace(d.memory, joining=joining)
        self._unroutable(pool, unroutable)
        m, p = self.metrics, pool.name
        m.joining.labels(p).set(len(joining))
        if len(views) == len(haproxies):  # every HAProxy answered: a departure none of them has is done with
            for n in set(view.departed) - present - set(d.removing):
                self.discovery.forget(p, n)
        return wrote

    def _plan(self, hc: RuntimeClient, pool: PoolConfig, d: mb.Decision, servers: Mapping[str, ServerState],
              now: float, states: Mapping[str, NodeState]) -> tuple[list[mb.MemberChange], dict[str, str]]:
        """One endpoint's writes; reads its sessions only when a removal waits on them, its agent ports only when
        a server is to be added."""
        try:
            conns = self._conns(hc, pool.backend) if any(n in servers for n in d.removing) else {}
            ports = self._agent_ports(hc, pool.backend) if any(n not in servers for n in d.wanted) else {}
        except HaproxyError as e:
            log.warning("pool=%s HAProxy %s: membership not planned this tick: %s", pool.name, hc.endpoint, e)
            return [], {}
        add = mb.add_settings(servers, ports, self.policies[pool.name], now)
        return mb.plan_endpoint(pool.name, pool.backend, d, servers, conns, add, states)

    def _apply(self, hc: RuntimeClient, pool: PoolConfig, changes: list[mb.MemberChange], result: Any) -> list[str]:
        """Send one endpoint's membership lines in one batch; the nodes whose `add server` HAProxy took."""
        m, p = self.metrics, pool.name
        try:
            replies = hc.execute([c.command.render() for c in changes])
        except (HaproxyError, ValueError) as e:
            kind = getattr(e, "kind", "unsafe")
            m.errors.labels(p, kind).inc()
            result.errors.append(f"pool={p}: membership not applied on {hc.endpoint}: {e}")
            log.error("pool=%s HAProxy %s: membership batch not applied: %s", p, hc.endpoint, e)
            return []
        added = []
        for c, reply in zip(changes, replies, strict=True):
            if reply_ok(reply):
                if c.action:
                    m.changes.labels(p, c.action).inc()
                if c.action == "add":
                    added.append(c.node)
                continue
            text = reply.strip()
            if c.command.kind == "del" and "connections" in text:  # a connection came back: the next tick retries
                log.info("pool=%s HAProxy %s: %s not deleted yet: %s", p, hc.endpoint, c.node, text)
                continue
            m.errors.labels(p, c.command.kind).inc()
            result.errors.append(f"{c.command.render()}: {text}")
            said = (hc.endpoint, c.command.render(), text)
            log.log(logging.DEBUG if said in self._refused else logging.ERROR, "HAProxy %s refused %r: %s (retried "
                    "every tick; said once)", hc.endpoint, c.command.render(), text)
            self._refused.add(said)
        return added

    @staticmethod
    def _conns(hc: RuntimeClient, backend: str) -> dict[str, int]:
        """server -> current sessions + queued requests (`show stat`); a server with no number is left out."""
        rows = parse_stat_columns(hc.execute([f"show stat {check_name(backend)} 4 -1"])[0], "scur", "qcur")
        out = {}
        for (b, srv), row in rows.items():
            scur, qcur = row.get("scur", ""), row.get("qcur", "") or "0"
            if b == backend and scur.isdigit() and qcur.isdigit():
                out[srv] = int(scur) + int(qcur)
        return out

    @staticmethod
    def _agent_ports(hc: RuntimeClient, backend: str) -> dict[str, int]:
        """server -> its agent check's port (`show servers state` srv_agent_port; 0 or absent: none)."""
        text = hc.execute([f"show servers state {check_name(backend)}"])[0]
        header: list[str] = []
        out = {}
        for ln in text.splitlines():
            if ln.startswith("#"):
                header = ln.lstrip("# ").split()
                continue
            f = dict(zip(header, ln.split(), strict=False))
            port = f.get("srv_agent_port", "")
            if f.get("be_name") == backend and port.isdigit() and int(port) > 0:
                out[f["srv_name"]] = int(port)
        return out

    # ---- the window of expiry removals, in etcd ------------------------------------------------------------
    def _expiries_prefix(self, pool: str) -> str:
        return f"{self.cfg.registry.prefix}/membership/{pool}/expiries/"

    def _stored_expiries(self, pool: PoolConfig, now: float) -> list[tuple[float, str]] | None:
        """The expiry removals of the pool begun within the window, as etcd has them; None when etcd did not
        answer ([] without a store: the window is this process's alone)."""
        if self.store is None:
            return []
        try:
            entries, _ = self.store.get_prefix(self._expiries_prefix(pool.name))
        except RegistryError as e:
            self.metrics.errors.labels(pool.name, "window").inc()
            self._say(pool, "window", e.kind, logging.WARNING, "pool=%s: the window of expiry removals could not "
                      "be read from etcd (%s): no expiry removal begins until it can", pool.name, e)
            return None
        self._say(pool, "window", None, logging.INFO, "pool=%s: the window of expiry removals read again", pool.name)
        out = []
        for e in entries.values():
            try:
                doc = json.loads(e.value)
                at, node = float(doc["at"]), str(doc["node"])
            except (ValueError, TypeError, KeyError):
                continue  # not ours to trust; it ends with its lease
            if now - at < mb.EXPIRY_WINDOW_S:
                out.append((at, node))
        return out

    def _record_expiries(self, pool: PoolConfig, d: mb.Decision, result: Any) -> mb.Decision:
        """Write-ahead: the expiry removals d begins are in etcd before HAProxy hears of them; those whose record
        failed are withheld (held this tick, tried again the next)."""
        begun = [n for n in d.started if d.removing[n].cause == mb.EXPIRED]
        if not begun or self.store is None:
            return d
        try:
            lease = self.store.grant(int(2 * mb.EXPIRY_WINDOW_S))
            for n in begun:
                at = d.removing[n].since
                self.store.put(f"{self._expiries_prefix(pool.name)}{n}@{at:.3f}",
                               json.dumps({"node": n, "at": at}, sort_keys=True), lease=lease)
        except RegistryError as e:
            self.metrics.errors.labels(pool.name, "window").inc()
            result.errors.append(f"pool={pool.name}: expiry removals not recorded in etcd: {e}")
            log.warning("pool=%s: expiry removal(s) of %s not begun: their record in etcd failed (%s); tried again "
                        "next tick", pool.name, ", ".join(begun), e)
            return mb.withhold(d, begun)
        return d

    # ---- reporting --------------------------------------------------------------------------------------------
    def _report(self, pool: PoolConfig, d: mb.Decision, view: mb.PoolView) -> None:
        m, p = self.metrics, pool.name
        m.held.labels(p).set(len(d.held))
        m.cap.labels(p).set(d.cap)
        m.removing.labels(p).set(len(d.removing))
        for n in d.started:
            rm = d.removing[n]
            log.warning("pool=%s node=%s %s: out of rotation, deleted once its connections are gone", p, n,
                        "registration expired (lease ended)" if rm.cause == mb.EXPIRED else "left the registry")
        for n in d.cancelled:
            log.info("pool=%s node=%s registered again: its removal is cancelled", p, n)
        m.untrusted.labels(p).set(1 if d.untrusted else 0)
        self._flag_kept(pool, d.kept)
        if d.kept:
            self._say(pool, "kept", d.kept, logging.ERROR, "pool=%s: registration(s) expired while HAProxy's checks "
                      "and agent still have them UP: kept in rotation, the registry's word alone removes nothing (an "
                      "exporter down or cut off from etcd?); removed once HAProxy has them DOWN: %s", p,
                      ", ".join(d.kept))
        else:
            self._say(pool, "kept", (), logging.INFO, "pool=%s: no expired registration is kept any more", p)
        if d.untrusted:
            self._say(pool, "untrusted", True, logging.ERROR, "pool=%s: the registry view lost more registrations "
                      "at once than the expiry cap (%d), or every one: not trusted to remove anything for a minute "
                      "or until they register again (an etcd freeze or a re-list gap, not that many deaths)", p, d.cap)
        else:
            self._say(pool, "untrusted", False, logging.INFO, "pool=%s: the registry view is trusted again", p)
        if d.held:
            why = ("the registry view is not trusted (a mass loss)" if d.untrusted else
                   f"more than registry.expiry_cap_per_minute allows ({d.cap}/min) or below the pool's floor "
                   f"({d.floor} nodes: 1 - thresholds.max_ejected_fraction)")
            self._say(pool, "held", d.held, logging.ERROR, "pool=%s: %d expired registration(s) HAProxy has DOWN "
                      "not removed: %s; a registry or network problem, not the nodes: %s", p, len(d.held), why,
                      ", ".join(d.held))
        else:
            self._say(pool, "held", (), logging.INFO, "pool=%s: no expired registration is held any more", p)
        if view.fresh:
            self._say(pool, "frozen", False, logging.INFO, "pool=%s: registry view current again", p)
        else:
            self._say(pool, "frozen", True, logging.WARNING, "pool=%s: registry unreachable: membership frozen on "
                      "the last snapshot (nothing is removed)", p)

    def _flag_kept(self, pool: PoolConfig, kept: Sequence[str]) -> None:
        """One expired_kept series per kept node; a node no longer kept loses its series (absent, not 0)."""
        was = self._kept.setdefault(pool.name, set())
        for n in was - set(kept):
            self.metrics.kept.remove(pool.name, n)
        for n in kept:
            self.metrics.kept.labels(pool.name, n).set(1)
        self._kept[pool.name] = set(kept)

    def _unroutable(self, pool: PoolConfig, bad: dict[str, str]) -> None:
        self.metrics.unroutable.labels(pool.name).set(len(bad))
        if bad:
            self._say(pool, "unroutable", tuple(sorted(bad.items())), logging.WARNING, "pool=%s: registrations "
                      "HAProxy cannot take, not added: %s", pool.name,
                      "; ".join(f"{n}: {w}" for n, w in sorted(bad.items())))
        else:
            self._say(pool, "unroutable", (), logging.DEBUG, "pool=%s: every registration is routable", pool.name)

    def _say(self, pool: PoolConfig, topic: str, value: Any, level: int, msg: str, *args: Any) -> None:
        """Log msg when the value of (pool, topic) changes (once per situation, not every tick)."""
        key = (pool.name, topic)
        if self._said.setdefault(key, _QUIET.get(topic)) != value:
            self._said[key] = value
            log.log(level, msg, *args)
