"""NGINX's upstream file, pure: what grayguard writes into it, how it reads it back, what one change may do to it.

Each line keeps grayguard's own weight and drain flag in a comment, so that reading the file back gives what was
written; NGINX's `weight=` must be >= 1, so a drained server, or one at weight 0, is `down` (controller/nginx.py
runs NGINX on it; docs/gateways.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from grayguard.config import PoolConfig
from grayguard.controller.gateway import GatewayError
from grayguard.controller.haproxy import Command

FULL_WEIGHT = 100  # a server's full weight when pools[].servers.<name>.weight is unset (HAProxy's configs use 100)
OP_RUNNING = 2  # srv_op_state "running": NGINX OSS shows no server state, so every server reads as up
HEADER = "# grayguard upstream servers (controller/nginx.py writes this file; edits are overwritten)"
_LINE_RE = re.compile(r"server (?P<addr>\S+) (?:weight=\d+|down); +# grayguard node=(?P<node>\S+) "
                      r"weight=(?P<weight>\d+)(?P<drain> drain)?")


class NginxError(GatewayError):
    """An NGINX gateway failure: a file it cannot read or write, a config `nginx -t` rejects, a failed reload."""


@dataclass(frozen=True)
class Server:
    """One server line of an upstream file, in grayguard's terms."""

    node: str
    address: str
    weight: int  # grayguard's weight, 0..256
    drain: bool

    def render(self) -> str:
        """Its `server` line: NGINX's weight is >= 1, so a drained server or one at weight 0 is `down`."""
        nginx = "down" if self.drain or self.weight == 0 else f"weight={self.weight}"
        return f"server {self.address} {nginx};  # grayguard node={self.node} weight={self.weight}" + (
            " drain" if self.drain else "")


def render_file(pool: str, backend: str, servers: Iterable[Server]) -> str:
    """The upstream file's text: a header, then one line per server, sorted by node (one text per state)."""
    lines = [HEADER, f"# pool {pool}, upstream {backend}"]
    lines += [s.render() for s in sorted(servers, key=lambda s: s.node)]
    return "\n".join(lines) + "\n"


def parse_file(text: str, path: str) -> dict[str, Server]:
    """node -> Server of an upstream file; NginxError (bad_file) on a line render_file would not write."""
    out = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE_RE.fullmatch(line)
        s = m and Server(m["node"], m["addr"], int(m["weight"]), bool(m["drain"]))
        if not s or s.render() != line or s.weight > 256 or s.node in out:
            raise NginxError("bad_file", f"{path}:{i}: not a line grayguard writes (hand-edited?): {line[:120]!r}")
        out[s.node] = s
    return out


def configured(pool: PoolConfig) -> dict[str, Server]:
    """The pool's servers as the config names them, each at its full weight, in rotation."""
    return {n: Server(n, sc.address or "", full_weight(pool, n), False) for n, sc in sorted(pool.servers.items())}


def full_weight(pool: PoolConfig, node: str) -> int:
    sc = pool.servers.get(node)
    return sc.weight if sc is not None and sc.weight is not None else FULL_WEIGHT


def only_adds(before: dict[str, Server], after: dict[str, Server]) -> bool:
    """Whether after gives no server less traffic than before (no new drain, no weight lower), one at least more."""
    def share(s: Server | None) -> int:
        return 0 if s is None or s.drain else s.weight
    nodes = set(before) | set(after)
    return (all(share(after.get(n)) >= share(before.get(n)) for n in nodes)
            and any(share(after.get(n)) > share(before.get(n)) for n in nodes))


def refusal(c: Command, servers: dict[str, Server]) -> tuple[str, str] | None:
    """(error kind, reply) when NGINX's file cannot take c; None when it can."""
    if c.server not in servers:
        return "no_such_server", f"no server {c.server!r} in pool's servers (pools[].servers)"
    if c.kind == "weight" and (not isinstance(c.value, int) or isinstance(c.value, bool) or not 0 <= c.value <= 256):
        return "bad_value", f"weight must be an int in 0..256, got {c.value!r}"
    if c.kind == "state" and c.value not in ("ready", "drain"):
        return "unsupported", f"NGINX has no state {c.value!r} (ready and drain only)"
    if c.kind not in ("weight", "state"):
        return "unsupported", f"NGINX has no {c.kind} command (no agent checks)"
    return None
