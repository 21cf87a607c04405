"""HAProxy's own reflexes, one definition: the shipped gateway config, the local stack and the benchmark model.

A 5 s controller tick cannot save the requests that reach a node answering HTTP 500 in between; the gateway
must react itself (retry elsewhere, take a failing server out within a few requests) and the controller
must work with it (see docs/architecture.md). These are the settings; `haproxy/haproxy.example.cfg`, the
local stack's generated config and the benchmark's HAProxy model are all derived from them, and a test
checks that the example config says the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reflexes:
    """The request-path reflexes of a grayguard-driven HAProxy backend."""

    # retry a request that failed before anything reached the client: on another server (redispatch)
    retries: int = 2
    retry_on: tuple[str, ...] = ("conn-failure", "empty-response", "500", "502", "503", "504")
    redispatch: bool = True
    # the retry budget: L7 retries stop while the backend's failed responses exceed this share of its
    # requests (over budget_window_s), so a pool-wide failure never multiplies the load
    retry_budget: float = 0.10
    budget_window_s: int = 10
    # passive health: error_limit consecutive errors (observe layer7) mark the server down
    error_limit: int = 5
    on_error: str = "mark-down"
    # active health check: what may bring a marked-down server back (the controller keeps it drained)
    check_inter_s: float = 2.0
    check_fall: int = 3
    check_rise: int = 2
    # request buffering: a request body up to this size is kept and can be retried; a larger one is not
    bufsize: int = 65536
    # timeouts: connect fails fast; server is the longest silence allowed mid-stream (not the length of a
    # whole generation), so a hung stream ends without cutting a long healthy one
    timeout_connect_s: float = 2.0
    timeout_server_s: float = 300.0


DEFAULT = Reflexes()
