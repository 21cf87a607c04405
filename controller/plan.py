"""Plan: the runtime-API writes that take HAProxy from what it has to what the policy wants. Pure."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from grayguard.controller.haproxy import CHK_ST_CONFIGURED, Command, ServerState
from grayguard.controller.policy import NodeDecision


@dataclass(frozen=True)
class Change:
    """One planned write and why."""

    pool: str
    node: str
    command: Command
    reason: str
    before: int | str

    def describe(self) -> str:
        c = self.command
        return (f"pool={self.pool} backend={c.backend} node={self.node} {c.kind} {self.before} -> {c.value}"
                f" ({self.reason})")


def tier_view(views: Sequence[Mapping[str, ServerState] | None]) -> dict[str, ServerState] | None:
    """One backend as the decision sees it across every HAProxy endpoint that answered (first endpoint first).

    The servers are the first endpoint's (None: it has no such backend). Each server is decided once, on
    the endpoint where it is most in rotation: one in MAINT (or DOWN) on one HAProxy of a tier still takes
    traffic through the others, so it is held (or counted out of rotation) only when it is so everywhere;
    writes to the endpoints where it is in MAINT are skipped there alone (plan_backend). Among equals, a
    drained or lower-weight view stands for it, so a node the controller does not know is seeded cautiously.
    """
    if not views or views[0] is None:
        return None
    out = {}
    for name in views[0]:
        seen = [v[name] for v in views if v is not None and name in v]
        out[name] = min(seen, key=lambda s: (s.maint, s.down, not s.drain, s.weight))  # min keeps the first of equals
    return out


def plan_backend(pool: str, backend: str, decisions: Mapping[str, NodeDecision],
                 actual: Mapping[str, ServerState], agent_off: Collection[str] = frozenset()) -> list[Change]:
    """Writes for one backend of one HAProxy. Converged input gives an empty list.

    Order matters for traffic: drains go first, then weights, then returns to ready, so a node is
    never sent traffic at a weight meant for its drained state. Agent checks go last: disabled for the nodes
    in agent_off (released past the safeguard cap), enabled again for every other node whose agent is off.
    """
    drains, weights, readies, agents = [], [], [], []
    for node in sorted(decisions):
        d = decisions[node]
        a = actual.get(node)
        if a is None or d.weight is None or a.maint:
            continue  # unknown server (reported by the caller), held by policy, or in operator MAINT on this endpoint
        configured = a.agent_state is not None and bool(a.agent_state & CHK_ST_CONFIGURED)
        agent = configured and (node in agent_off) != a.agent_off
        if d.drain == a.drain and a.weight == d.weight and not agent:
            continue  # converged: most nodes, most ticks
        reason = f"{d.state.state}: {d.state.reason}" if d.state.reason else str(d.state.state)
        if d.drain and not a.drain:
            drains.append(Change(pool, node, Command(backend, node, "state", "drain"), reason, "ready"))
        if a.weight != d.weight:
            weights.append(Change(pool, node, Command(backend, node, "weight", d.weight), reason, a.weight))
        if not d.drain and a.drain:
            readies.append(Change(pool, node, Command(backend, node, "state", "ready"), reason, "drain"))
        if agent:
            action = "disable" if node in agent_off else "enable"
            why = (f"its agent marked it DOWN past the safeguard cap; {reason}" if action == "disable"
                   else "agent check re-armed: probe healthy, drained by the controller, or room in the pool")
            agents.append(Change(pool, node, Command(backend, node, "agent", action), why,
                                 "disabled" if a.agent_off else "enabled"))
    return drains + weights + readies + agents
