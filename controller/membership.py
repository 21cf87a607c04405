"""Membership of a registry pool, pure: from the registry's view, what was seen before and HAProxy's servers to
the runtime-API writes that add, drain and delete servers. No I/O, no clock: `now` is a parameter.

A serving registration is a server: `add server` at the pool's base weight with the shipped health and agent
checks (HAProxy 2.6 takes a subset of a server line's keywords and nothing from `default-server`), then its
checks enabled, the warm-up weight (the policy's new-node warm-up) and `ready`; the policy slow-starts it once
HAProxy has it UP. A node the policy holds out of rotation (quarantined, canary) comes back drained at weight 0
instead: a re-add (after an HAProxy restart) never puts it back in rotation. A key deleted while its last value
said "leaving" (a graceful leave), or a record that says "leaving", takes the server out at once. A key deleted
while it said "serving" is an expiry (a lease that ended: a crash, or a partition), evidence only with the
gateway's agreement: a server HAProxy still has UP (checks and agent) is kept in rotation and flagged; one it has
DOWN is removed, at most `expiry_cap` per minute (registry.expiry_cap_per_minute, default the pool's ejection cap
share) and never below the pool's floor (the nodes max_ejected leaves: 1 - thresholds.max_ejected_fraction of
it), the others held (they page). A registry view that lost more than the cap at once, or every registration,
is not trusted for a minute (an etcd freeze past the TTL ends every lease; the exporters re-register within a
heartbeat): no expiry removal begins. A removed server is drained, and deleted (`set server ... state maint` then
`del server`, as 2.6 requires) once it has no connections.
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from grayguard.controller.haproxy import CHK_ST_CONFIGURED, Command, ServerState, check_name, host_port
from grayguard.controller.policy import IN_ROTATION, SLOW_START, NodeState, Policy, max_ejected, target_weight
from grayguard.reflexes import DEFAULT, Reflexes, duration

EXPIRY_WINDOW_S = 60.0  # the expiry cap counts removals begun in this sliding window; a mass loss is doubted this long
JOIN_TIMEOUT_S = 60.0  # a new server HAProxy has not had UP after this long is shown to the policy anyway
DEFAULT_WEIGHT = 100  # base weight of a registered node when the backend has no server to copy it from
SERVING, LEAVING = "serving", "leaving"
EXPIRED, LEFT = "expired", "left"  # removal causes


class Registration(Protocol):
    """What membership reads of a registry record (grayguard.registry.NodeRecord)."""

    endpoint: str
    exporter: str
    state: str


@dataclass(frozen=True)
class PoolView:
    """One pool as the registry shows it (controller/discovery.py)."""

    nodes: Mapping[str, Registration]  # node -> its current record
    departed: Mapping[str, Registration] = field(default_factory=dict)  # keys deleted: node -> the last value seen
    fresh: bool = True  # etcd answers; False: frozen on the last snapshot, so no removal begins


@dataclass(frozen=True)
class Removal:
    cause: str  # EXPIRED or LEFT
    since: float


@dataclass(frozen=True)
class PoolMemory:
    """What membership remembers of a pool between ticks (in-process; the expiries also in etcd, membersync)."""

    removing: Mapping[str, Removal] = field(default_factory=dict)  # out of rotation, deleted once idle
    joining: Mapping[str, float] = field(default_factory=dict)  # added at (hidden from the policy until UP)
    expiries: tuple[tuple[float, str], ...] = ()  # (when, node) of each expiry removal begun within EXPIRY_WINDOW_S
    registered: frozenset[str] | None = None  # the nodes the last fresh view had a record of (None: none seen yet)
    untrusted_since: float | None = None  # when the view last lost more than the cap at once (or every record)


@dataclass(frozen=True)
class Decision:
    """What the pool's membership should be now."""

    wanted: dict[str, Registration]  # serving registrations: in HAProxy, in rotation
    removing: dict[str, Removal]  # drained, deleted once their connections are gone
    held: tuple[str, ...]  # expired, DOWN in HAProxy, not removed: beyond the cap or the floor, or the view doubted
    cap: int  # expiry removals allowed per EXPIRY_WINDOW_S
    started: tuple[str, ...]  # removals begun this tick
    cancelled: tuple[str, ...]  # removals stopped: registered (serving) again
    memory: PoolMemory
    kept: tuple[str, ...] = ()  # expired while HAProxy has them UP: kept in rotation (the registry's word alone)
    floor: int = 0  # the pool's nodes expiries may not go below (those max_ejected leaves)
    untrusted: bool = False  # the view lost more than the cap at once, or every record: no expiry removal


def expiry_cap(share: float, nodes: int) -> int:
    """Expiry removals allowed per minute in a pool of `nodes` registered nodes: share of it, at least one
    (a lone crash is removed), none at share 0."""
    if share <= 0 or nodes <= 0:
        return 0
    return max(1, math.floor(share * nodes + 1e-9))


def decide(view: PoolView, memory: PoolMemory, present: Collection[str], now: float, share: float, *,
           up: Collection[str], fraction: float) -> Decision:
    """Which registered nodes should serve, which leave (and which expiries are kept, or held).

    present: the servers some HAProxy of the tier has; up: those some HAProxy has UP (checks and agent; not in
    MAINT). fraction: the pool's thresholds.max_ejected_fraction (its floor). Only nodes the registry named are
    ever removed: a server it never knew (a static one, or one seen by no snapshot) is left alone.
    """
    wanted = {n: r for n, r in view.nodes.items() if r.state == SERVING}
    leaving = {n for n, r in view.nodes.items() if r.state == LEAVING}
    leaving |= {n for n, r in view.departed.items() if r.state == LEAVING and n not in view.nodes}
    expired = {n for n, r in view.departed.items() if r.state == SERVING and n not in view.nodes}
    cancelled = tuple(sorted(n for n in memory.removing if n in wanted))
    # a removal ends when no HAProxy has the server any more (deleted), or when the node serves again
    removing = {n: rm for n, rm in memory.removing.items() if n in present and n not in wanted}
    started: list[str] = []
    recent = tuple(sorted(e for e in memory.expiries if now - e[0] < EXPIRY_WINDOW_S))
    known = set(view.nodes) | (set(view.departed) & set(present)) | set(removing)
    cap = expiry_cap(share, len(known))
    lapsed = expired & set(present)  # expired, still in HAProxy
    untrusted_since, registered = _trust(view, memory, expired, lapsed, cap, now)
    untrusted = untrusted_since is not None
    if view.fresh:  # a frozen view begins nothing: what it shows may be hours old
        for n in sorted(leaving & set(present) - set(removing)):
            removing[n] = Removal(LEFT, now)
            started.append(n)
    candidates = sorted(lapsed - set(removing))
    kept = tuple(n for n in candidates if n in up)  # the gateway disagrees: it serves, whatever the registry says
    down = [n for n in candidates if n not in up]
    # the floor: the pool (its members and those expiries removed within the window) keeps what max_ejected leaves
    out = {n for n, rm in removing.items() if rm.cause == EXPIRED} | {n for _, n in recent}
    members = known - leaving - {n for n, rm in removing.items() if rm.cause == LEFT}
    pool = len(members | out)
    ejectable = max_ejected(pool, fraction)
    room = max(0, min(cap - len(recent), ejectable - len(out)))
    begin = down[:room] if view.fresh and not untrusted else []  # frozen: they wait for a fresh view
    for n in begin:
        removing[n] = Removal(EXPIRED, now)
        started.append(n)
        recent += ((now, n),)
    held = tuple(down[len(begin):] if untrusted else down[room:])
    joining = {n: t for n, t in memory.joining.items() if n in wanted and n in present}
    return Decision(wanted, removing, held, cap, tuple(started), cancelled,
                    PoolMemory(removing=removing, joining=joining, expiries=recent, registered=registered,
                               untrusted_since=untrusted_since),
                    kept=kept, floor=pool - ejectable, untrusted=untrusted)


def _trust(view: PoolView, memory: PoolMemory, expired: set[str], lapsed: set[str], cap: int,
           now: float) -> tuple[float | None, frozenset[str] | None]:
    """(since when the view is doubted, None: trusted; the records it had). A view that lost more than the cap at
    once, or every record of a pool that had members, is doubted for EXPIRY_WINDOW_S, or until the nodes register
    again (what is left lapsed is within the cap)."""
    since, registered = memory.untrusted_since, memory.registered
    if view.fresh:
        lost = ((memory.registered or frozenset()) - set(view.nodes)) & expired
        # the pool had members: the last view had records, or (the first view since a start) HAProxy has them
        had = bool(memory.registered) or (memory.registered is None and bool(lapsed))
        if len(lost) > cap or (not view.nodes and had):  # a freeze past the TTL, a re-list gap: not that many deaths
            since = now
        elif since is not None and view.nodes and len(lapsed) <= cap:
            since = None  # registered again: the view holds together
        registered = frozenset(view.nodes)
    if since is not None and now - since >= EXPIRY_WINDOW_S:
        since = None  # a minute later the losses stand: the gateway, cap and floor rules decide
    return since, registered


def may_expire(view: PoolView, memory: PoolMemory, present: Collection[str], up: Collection[str]) -> bool:
    """Whether decide could begin an expiry removal: a lapsed registration whose server no HAProxy has UP."""
    return view.fresh and any(r.state == SERVING and n not in view.nodes and n in present and n not in up
                              and n not in memory.removing for n, r in view.departed.items())


def remembered(memory: PoolMemory, stored: Collection[tuple[float, str]]) -> PoolMemory:
    """memory with the expiry removals another process (or this one before a restart) recorded in the window."""
    merged = tuple(sorted(set(memory.expiries) | set(stored)))
    return memory if merged == memory.expiries else replace(memory, expiries=merged)


def withhold(d: Decision, nodes: Collection[str]) -> Decision:
    """d without the expiry removals it began for nodes (their record in etcd failed: they are held instead)."""
    back = {n for n in nodes if n in d.started and d.removing[n].cause == EXPIRED}
    if not back:
        return d
    removing = {n: rm for n, rm in d.removing.items() if n not in back}
    expiries = tuple(e for e in d.memory.expiries if not (e[1] in back and e[0] == d.removing[e[1]].since))
    return replace(d, removing=removing, started=tuple(n for n in d.started if n not in back),
                   held=tuple(sorted((*d.held, *back))),
                   memory=replace(d.memory, removing=removing, expiries=expiries))


def joined(memory: PoolMemory, views: Collection[Mapping[str, ServerState]], now: float) -> PoolMemory:
    """The memory without the joining nodes that every HAProxy having them shows UP (or that waited too long)."""
    def up(n: str) -> bool:
        seen = [v[n] for v in views if n in v]
        return bool(seen) and not any(s.down or s.maint for s in seen)
    keep = {n: t for n, t in memory.joining.items() if not up(n) and now - t < JOIN_TIMEOUT_S}
    return memory if len(keep) == len(memory.joining) else replace(memory, joining=keep)


def hidden(memory: PoolMemory) -> frozenset[str]:
    """Servers the policy must not see this tick: leaving ones (gone for it), and new ones not yet UP."""
    return frozenset(memory.removing) | frozenset(memory.joining)


# --- planning the writes of one HAProxy endpoint ----------------------------------------------------------------
@dataclass(frozen=True)
class MemberCommand:
    """A runtime-API line Command does not cover: add (value: the server's arguments), del, health, addr."""

    backend: str
    server: str
    kind: str  # "add", "del", "health" (value "enable"), "addr" (value "<ip> port <port>")
    value: str = ""

    def render(self) -> str:
        b, s = check_name(self.backend), check_name(self.server)
        if any(c in self.value for c in ";\r\n"):
            raise ValueError(f"refusing a separator in {self.value!r}")
        if self.kind == "add":
            return f"add server {b}/{s} {self.value}"
        if self.kind == "del":
            return f"del server {b}/{s}"
        if self.kind == "health":
            return f"{self.value} health {b}/{s}"
        if self.kind == "addr":
            return f"set server {b}/{s} addr {self.value}"
        raise ValueError(f"unknown membership command {self.kind!r}")


@dataclass(frozen=True)
class MemberChange:
    """One planned membership write and why (shaped like plan.Change: print_plan and the logs take both)."""

    pool: str
    node: str
    command: Command | MemberCommand
    reason: str
    before: int | str = "-"
    action: str = ""  # add, drain, delete, ready, addr (a metric label); "" for the lines that follow an action

    def describe(self) -> str:
        c = self.command
        return f"pool={self.pool} backend={c.backend} node={self.node} {c.render()} ({self.reason})"


class BadEndpoint(ValueError):
    """A registered endpoint HAProxy cannot take as a dynamic server's address."""


def server_address(endpoint: str) -> tuple[str, int]:
    """(ip, port) of a registered `host:port` / `[v6]:port`; BadEndpoint unless host is an IP literal (a
    dynamic server is never resolved: HAProxy 2.6 creates it with `init-addr none`)."""
    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise BadEndpoint(f"{endpoint!r}: not an IP address (HAProxy never resolves a dynamic server's "
                          "name)") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadEndpoint(f"{endpoint!r}: bad port")
    return ip.compressed, int(port)


def _same_address(s: ServerState, ip: str, port: int) -> bool:
    host, _, p = s.address.rpartition(":")
    host = host[1:-1] if host.startswith("[") else host
    try:
        return ipaddress.ip_address(host).compressed == ip and p == str(port)
    except ValueError:
        return False


@dataclass(frozen=True)
class AddSettings:
    """How a registered node enters a backend."""

    base_weight: int
    warm_weight: int
    agent_port: int | None  # the agent port the backend's servers use (at the exporter's host); None: no agent
    reflexes: Reflexes = DEFAULT

    def agent(self, rec: Registration) -> tuple[str, int] | None:
        """Where the node's agent check answers: the record's `agent` (host:port) when it names one, else the
        exporter's host at the backend's agent port; None: no agent check (see add_settings). The host is an IP
        address (HAProxy would resolve a name when it parses the line): a name, or a wildcard, is the node's own."""
        own = getattr(rec, "agent", "") or ""
        if own:
            host, _, port = own.rpartition(":")
            if not (port.isdigit() and 1 <= int(port) <= 65535):
                return None
            return _agent_host(host, rec), int(port)
        if self.agent_port is None:
            return None
        return _agent_host(rec.exporter.rpartition(":")[0], rec), self.agent_port

    def arguments(self, ip: str, port: int, rec: Registration) -> str:
        """`add server` arguments: address, weight, the reflexes' health check and observe, the agent check."""
        r = self.reflexes
        args = [host_port(ip, str(port)), "weight", str(self.base_weight),
                "check", "inter", duration(r.check_inter_s), "downinter", duration(r.check_downinter_s),
                "fall", str(r.check_fall), "rise", str(r.check_rise),
                "observe", "layer7", "error-limit", str(r.error_limit), "on-error", r.on_error]
        agent = self.agent(rec)
        if agent is not None:
            args += ["agent-check", "agent-addr", agent[0], "agent-port", str(agent[1]),
                     "agent-inter", duration(r.agent_inter_s)]
        return " ".join(args)


def _agent_host(host: str, rec: Registration) -> str:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return server_address(rec.endpoint)[0]
    return server_address(rec.endpoint)[0] if ip.is_unspecified else ip.compressed


def add_settings(servers: Mapping[str, ServerState], agent_ports: Mapping[str, int], policy: Policy, now: float,
                 reflexes: Reflexes = DEFAULT) -> AddSettings:
    """The pool's base weight (its servers' most common initial weight, else DEFAULT_WEIGHT), the warm-up weight a
    new node holds (policy.warm_up's share of it), and the agent port its servers' agent checks use.

    A dynamic server's agent starts DOWN and only an answer brings it UP (HAProxy 2.6): an agent nobody answers
    keeps the server out for ever. So a new node gets an agent check only where one is known to answer: the port
    the backend's own servers use (agent_ports: `show servers state` srv_agent_port), or its record's `agent`.
    """
    weights = Counter(s.initial_weight for s in servers.values() if s.initial_weight > 0)
    base = min(256, max(weights.items(), key=lambda kv: (kv[1], kv[0]))[0]) if weights else DEFAULT_WEIGHT
    warm = NodeState(state=SLOW_START, since=now, ramp_start=now + policy.thresholds.new_node_warmup_s)
    ports = Counter(agent_ports[n] for n, s in servers.items()
                    if s.agent_state is not None and s.agent_state & CHK_ST_CONFIGURED and agent_ports.get(n))
    agent_port = max(ports.items(), key=lambda kv: (kv[1], -kv[0]))[0] if ports else None
    return AddSettings(base, target_weight(warm, base, now, policy), agent_port, reflexes)


def plan_endpoint(pool: str, backend: str, d: Decision, servers: Mapping[str, ServerState],
                  conns: Mapping[str, int], add: AddSettings, states: Mapping[str, NodeState] | None = None,
                  ) -> tuple[list[MemberChange], dict[str, str]]:
    """The membership writes for one HAProxy endpoint, and {node: why} for registrations it cannot add.

    conns: current sessions + queued requests per server (`show stat` scur + qcur); a server missing from it
    is not deleted this tick. states: the policy's node states (retained ones too): a node it holds out of
    rotation is added drained at weight 0, and a cancelled removal of one is not made ready. Removals come first
    (a leaving node stops taking traffic before anything else), then additions, then address changes and
    returns from a cancelled removal.
    """
    states = states or {}

    def ejected(n: str) -> NodeState | None:
        st = states.get(n)
        return st if st is not None and st.state not in IN_ROTATION else None

    removals: list[MemberChange] = []
    adds: list[MemberChange] = []
    fixes: list[MemberChange] = []
    bad: dict[str, str] = {}
    for n in sorted(d.removing):
        s = servers.get(n)
        if s is None:
            continue
        rm = d.removing[n]
        why = ("its registration expired (lease ended)" if rm.cause == EXPIRED
               else "it left the registry (graceful leave)")
        idle = conns.get(n) == 0
        if not s.maint and not s.drain and not idle:
            removals.append(MemberChange(pool, n, Command(backend, n, "state", "drain"), f"{why}: drained until its "
                                         "connections are gone", "ready", "drain"))
        if idle:
            if s.agent_state is not None and s.agent_state & CHK_ST_CONFIGURED and not s.agent_off:
                removals.append(MemberChange(pool, n, Command(backend, n, "agent", "disable"),
                                             f"{why}: its agent may not bring it back", "enabled"))
            if not s.maint:
                removals.append(MemberChange(pool, n, Command(backend, n, "state", "maint"),
                                             f"{why}: no connections left, into maintenance to delete it",
                                             "drain" if s.drain else "ready"))
            removals.append(MemberChange(pool, n, MemberCommand(backend, n, "del"), f"{why}: no connections left",
                                         "maint", "delete"))
    for n in sorted(d.wanted):
        rec = d.wanted[n]
        try:
            ip, port = server_address(rec.endpoint)
        except BadEndpoint as e:
            bad[n] = str(e)
            continue
        s = servers.get(n)
        out = ejected(n)
        if s is None and out is not None:
            why = (f"registered at {rec.endpoint}, {out.state} by the policy ({out.reason or 'no reason kept'}): "
                   "enters drained at weight 0 until the policy releases it")
            adds.append(MemberChange(pool, n, MemberCommand(backend, n, "add", add.arguments(ip, port, rec)),
                                     why, "-", "add"))
            adds.append(MemberChange(pool, n, Command(backend, n, "weight", 0), why, add.base_weight))
            adds.append(MemberChange(pool, n, MemberCommand(backend, n, "health", "enable"), why, "disabled"))
            if add.agent(rec) is not None:
                adds.append(MemberChange(pool, n, Command(backend, n, "agent", "enable"), why, "disabled"))
            adds.append(MemberChange(pool, n, Command(backend, n, "state", "drain"), why, "maint"))
            continue
        if s is None:
            why = f"registered at {rec.endpoint}: enters at the warm-up weight {add.warm_weight}, then slow start"
            adds.append(MemberChange(pool, n, MemberCommand(backend, n, "add", add.arguments(ip, port, rec)),
                                     why, "-", "add"))
            adds.append(MemberChange(pool, n, Command(backend, n, "weight", add.warm_weight), why, add.base_weight))
            adds.append(MemberChange(pool, n, MemberCommand(backend, n, "health", "enable"), why, "disabled"))
            if add.agent(rec) is not None:
                adds.append(MemberChange(pool, n, Command(backend, n, "agent", "enable"), why, "disabled"))
            adds.append(MemberChange(pool, n, Command(backend, n, "state", "ready"), why, "maint"))
            continue
        if not _same_address(s, ip, port):
            fixes.append(MemberChange(pool, n, MemberCommand(backend, n, "addr", f"{ip} port {port}"),
                                      f"registered at {rec.endpoint}", s.address, "addr"))
        if n in d.cancelled and out is not None and s.maint:  # out of MAINT (its checks run), not into rotation
            why = f"registered again while it was being removed, {out.state} by the policy: drained"
            fixes.append(MemberChange(pool, n, Command(backend, n, "state", "drain"), why, "maint", "drain"))
        elif n in d.cancelled and out is None and (s.maint or s.drain):
            why = "registered again while it was being removed"
            fixes.append(MemberChange(pool, n, Command(backend, n, "state", "ready"), why,
                                      "maint" if s.maint else "drain", "ready"))
            if s.agent_off:
                fixes.append(MemberChange(pool, n, Command(backend, n, "agent", "enable"), why, "disabled"))
    return removals + adds + fixes, bad
