"""The gateway seam: what the control loop reads from a gateway and writes to it, whichever gateway it is.

The loop (controller/loop.py) sees a gateway as the servers of each backend (address, weight, drained or not,
up or down as far as the gateway knows) and a batch of planned changes for one backend (controller/plan.py). It
plans against what it read, so a batch takes the gateway to the desired state whatever it had: a lost write or a
restarted gateway is repaired on the next tick. Two implementations: HAProxy's runtime API
(controller/haproxy.py, RuntimeClient) and NGINX through a rendered upstream file and a graceful reload
(controller/nginx.py, NginxGateway). docs/gateways.md says what each can and cannot do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # haproxy.py imports GatewayError from here
    from grayguard.config import Config
    from grayguard.controller.haproxy import Command, CommandResult, ServerState


class GatewayError(Exception):
    """A gateway failure (unreachable, timed out, refused a batch, answered garbage); kind is a short metric label."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@runtime_checkable
class Gateway(Protocol):
    """What the loop needs of a gateway. The method names are HAProxy's, whose client came first."""

    endpoint: str  # the gateway's name in logs and in the controller's metric labels

    def show_servers_state(self, backend: str | None = None) -> list[ServerState]:
        """Every server of one backend, or of all the backends the gateway has; GatewayError when it cannot say."""
        ...

    def show_backends_state(self, backends: Sequence[str]) -> list[ServerState]:
        """The servers of these backends (one the gateway does not have is left out)."""
        ...

    def apply(self, commands: list[Command]) -> list[CommandResult]:
        """Apply one backend's planned changes; one result per command (a refused one: ok False, its kind).
        GatewayError when the batch as a whole did not apply (nothing of it, or, for HAProxy, unknown)."""
        ...


def build_gateways(cfg: Config) -> list[Gateway]:
    """The gateways of cfg.gateway.kind: one RuntimeClient per HAProxy endpoint, or the one NGINX."""
    if cfg.gateway.kind == "nginx":
        from grayguard.controller.nginx import NginxGateway
        return [NginxGateway(cfg.gateway.nginx, cfg.pools)]
    from grayguard.controller.haproxy import RuntimeClient
    return [RuntimeClient(ep, cfg.haproxy.timeout_s) for ep in cfg.haproxy.endpoints]
