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
    # a server DOWN that fails its checks is checked this often (HAProxy's srv_getinter: only at health 0). It
    # does not prolong an error-limit mark-down: that server passes /health and is back after about
    # check_inter_s * check_rise, its HANA status gone at the next check; the controller reads `hanafail`
    check_downinter_s: float = 10.0
    health_path: str = "/health"
    # agent check: HAProxy asks the node's exporter (exporters/agent.py) every agent_inter_s; it answers "down" when
    # its 1 s probe saw garbage text, a CUDA error or a hang (one strike: none of them is load), "up" otherwise, so a
    # node answering 200 with broken text is out of rotation about a second later, before any controller tick. Cost:
    # one TCP connect and one short line per server every agent_inter_s per HAProxy (1,000 servers: 2,000/s); 0.5 s
    # rather than 1 s takes a quarter second off the time to DOWN (docs/benchmarks.md)
    agent_port: int = 9401
    agent_inter_s: float = 0.5
    # request buffering: a request body up to this size is kept and can be retried; a larger one is not
    bufsize: int = 65536
    # timeouts: connect fails fast; server is the longest silence allowed mid-stream (not the length of a
    # whole generation), so a hung stream ends without cutting a long healthy one
    timeout_connect_s: float = 2.0
    timeout_server_s: float = 300.0
    # `option http-no-delay`: send each chunk of a streamed response as it arrives. Off, HAProxy sends an unfinished
    # response with MSG_MORE and Linux holds a small chunk up to 200 ms waiting for more: every streamed first token
    # came ~200 ms late and a stream in bursts (measured with vLLM and the simulated fleet; off only to show that)
    no_delay: bool = True


DEFAULT = Reflexes()


# `show servers state` srv_check_status of a server HAProxy marked down for errors (HCHK_STATUS_HANA,
# shown as check_status "HANA" by `show stat`); a health check's own verdict overwrites it.
CHECK_STATUS_HANA = 4


def duration(seconds: float) -> str:
    """HAProxy's time format: whole seconds as "2s", anything finer in milliseconds."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def global_lines(r: Reflexes = DEFAULT) -> list[str]:
    """The `global` section's reflex lines (unindented)."""
    return ["# request buffer: a request (headers + body) that fits is kept and can be retried",
            f"tune.bufsize {r.bufsize}"]


def stream_lines(r: Reflexes = DEFAULT) -> list[str]:
    """The lines that let a streamed completion through as it comes: every backend that serves one needs them."""
    if not r.no_delay:
        return []
    return ["# an SSE stream of small chunks must not wait for more data: without this HAProxy sends an unfinished",
            "# response with MSG_MORE and the kernel holds each chunk up to 200 ms (every first token 200 ms late)",
            "option http-no-delay"]


def backend_lines(r: Reflexes = DEFAULT) -> list[str]:
    """The reflex lines of a grayguard-driven backend (unindented); servers take them from default-server."""
    share = round(r.retry_budget * 1000)  # failed/requests > share/1000 <=> fail*1000 - req*share > 0
    window = duration(r.budget_window_s)
    check = (f"check inter {duration(r.check_inter_s)} downinter {duration(r.check_downinter_s)} "
             f"fall {r.check_fall} rise {r.check_rise}")
    agent = f"agent-check agent-port {r.agent_port} agent-inter {duration(r.agent_inter_s)}"
    return [
        *stream_lines(r),
        "# retry what failed before anything reached the client, on another server (redispatch every retry);",
        "# a retry needs the whole request in the buffer (tune.bufsize): a larger prompt is not retried",
        "option http-buffer-request",
        f"retry-on {' '.join(r.retry_on)}",
        f"retries {r.retries}",
        *(["option redispatch 1"] if r.redispatch else []),
        f"# retry budget: L7 retries stop while failed responses exceed {r.retry_budget:.0%} of the requests of the",
        f"# last {window} (a retried-then-served request is no failure), so a pool-wide failure is not multiplied",
        f"stick-table type integer size 1 expire {window} store http_req_rate({window}),http_fail_rate({window})",
        "http-request track-sc0 int(0)",
        f"http-request set-var(txn.gg_budget) sc_http_req_rate(0),mul({share})",
        "http-request disable-l7-retry if { sc_http_fail_rate(0),mul(1000),sub(txn.gg_budget) gt 0 }",
        "# connect fails fast; `timeout server` is the longest silence mid-stream, not a generation's length",
        f"timeout connect {duration(r.timeout_connect_s)}",
        f"timeout server {duration(r.timeout_server_s)}",
        f"option httpchk GET {r.health_path}",
        "http-check expect status 200",
        f"# {r.error_limit} consecutive errors delivered to clients mark a server DOWN (check_status HANA); its",
        "# health check brings it back, grayguard keeps it drained until canaries pass",
        "# the node's exporter answers the agent check (exporters/agent.py): \"down\" when its probe saw garbage text,",
        "# a CUDA error or a hang, so such a node leaves rotation about a second later (a server line may set its",
        "# own agent-port); grayguard quarantines it, and disables agents that would take out more than the cap",
        f"default-server {check} observe layer7 error-limit {r.error_limit} on-error {r.on_error} {agent}",
    ]
