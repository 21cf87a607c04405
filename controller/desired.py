"""The desired HAProxy state of one pool, as the leader publishes it for the actuators (`haproxy.writer: actuators`).

The leader puts it to <prefix>/desired/<pool> in the same guarded transaction as the pool's node states
(controller/leader.py, `publish`), before it would have written HAProxy: a deposed leader's late put fails in etcd,
and what an actuator applies is always a leader's decision. Each actuator turns it back into the decisions
`plan_backend` takes, so a tier driven by actuators gets exactly the writes the leader would have sent. Pure.

A stable, versioned format (grayguard/verdict.py, grayguard/schemas/desired.v1.json, docs/api.md): load() reads
version 1 (a document without `version` too), ignores fields it does not know, and refuses another major version
with DesiredVersionError, so the actuator leaves its HAProxy as it is and counts it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from grayguard.config import HAPROXY_NAME_RE
from grayguard.controller.policy import NodeDecision, NodeState, PoolDecision
from grayguard.verdict import VERSION, VersionError, document_version
from grayguard.vocab import STATES

MAX_WEIGHT = 256  # HAProxy's largest weight


class DesiredError(ValueError):
    """A desired-state document that cannot be applied; the message names the field."""


class DesiredVersionError(DesiredError):
    """A document of another major version (a newer leader's): applied by nobody here until the actuator is upgraded."""


def desired_prefix(prefix: str) -> str:
    return f"{prefix}/desired/"


def desired_key(prefix: str, pool: str) -> str:
    return f"{prefix}/desired/{pool}"


@dataclass(frozen=True)
class DesiredServer:
    """One server as the leader wants it: its weight, drained or not, and the state behind it (for logs)."""

    weight: int
    drain: bool
    state: str


@dataclass(frozen=True)
class Desired:
    """One pool's HAProxy backend as the leader wants it."""

    pool: str
    backend: str
    servers: Mapping[str, DesiredServer] = field(default_factory=dict)
    agent_off: frozenset[str] = frozenset()  # agent checks to disable (released past the safeguard cap)

    def decisions(self) -> dict[str, NodeDecision]:
        """The decisions plan_backend takes: the leader's weight and drain for every server it decided."""
        return {n: NodeDecision(NodeState(state=s.state, weight=s.weight), s.state, s.weight, s.drain)
                for n, s in self.servers.items()}


def from_decision(pool: str, backend: str, decision: PoolDecision) -> Desired:
    """What a tick decided for pool; nodes held as they are (weight None: MAINT everywhere) are left out."""
    servers = {n: DesiredServer(d.weight, d.drain, str(d.state.state))
               for n, d in decision.nodes.items() if d.weight is not None}
    return Desired(pool, backend, servers, frozenset(decision.agent_off))


def dump(d: Desired) -> str:
    """Compact JSON, keys sorted: equal decisions give equal text (an unchanged pool is not put again)."""
    doc = {"version": VERSION, "pool": d.pool, "backend": d.backend, "agent_off": sorted(d.agent_off),
           "servers": {n: {"weight": s.weight, "drain": s.drain, "state": s.state}
                       for n, s in sorted(d.servers.items())}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def load(text: str | bytes) -> Desired:
    """Parse and check dump() output; DesiredError names the first bad field. Names must be HAProxy-safe."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DesiredError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise DesiredError("expected an object")
    try:
        document_version(doc, "desired-state document")
    except VersionError as e:
        raise DesiredVersionError(str(e)) from None
    pool, backend = _name(doc.get("pool"), "pool"), _name(doc.get("backend"), "backend")
    servers, agents = doc.get("servers"), doc.get("agent_off", [])
    if not isinstance(servers, dict):
        raise DesiredError("servers: expected an object")
    if not isinstance(agents, list):
        raise DesiredError("agent_off: expected a list")
    out = {}
    for n, s in servers.items():
        where = f"servers.{_name(n, 'servers')}"
        if not isinstance(s, dict):
            raise DesiredError(f"{where}: expected an object")
        w, drain, state = s.get("weight"), s.get("drain"), s.get("state")
        if type(w) is not int or not 0 <= w <= MAX_WEIGHT:
            raise DesiredError(f"{where}.weight: expected an int in 0..{MAX_WEIGHT}, got {w!r}")
        if type(drain) is not bool:
            raise DesiredError(f"{where}.drain: expected true or false, got {drain!r}")
        if state not in STATES:
            raise DesiredError(f"{where}.state: unknown state {state!r}")
        out[n] = DesiredServer(w, drain, state)
    return Desired(pool, backend, out, frozenset(_name(a, "agent_off") for a in agents))


def _name(v: object, where: str) -> str:
    if not isinstance(v, str) or not HAPROXY_NAME_RE.fullmatch(v):  # fullmatch: `$` takes a "\n"
        raise DesiredError(f"{where}: not a HAProxy name: {v!r}")
    return v
