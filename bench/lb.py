"""Models of HAProxy's dynamic balancing algorithms, weighted (`leastconn`, `roundrobin`), and its reflexes.

Pure and clock-free. A server with weight 0 or in drain gets no new requests (as in HAProxy; stick-table
persistence is modelled by the engine's pinned requests, which bypass the balancer). `pick()` returns
the chosen index, or None when no server is eligible (HAProxy answers 503). Each balancer also keeps what
HAProxy's `show stat` shows per server: `active` (scur) and `stot` (requests sent, failed attempts included).
`make_balancer` also builds the peers' balancers (bench.peers), which read the engine's feedback hooks (_Stat);
HAProxy's ignore them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class _Stat:
    """HAProxy's per-server session counters (`show stat` scur and stot), and the engine's feedback hooks.

    HAProxy's balancers read none of the feedback: `first_byte` and `refresh` do nothing here, `refresh_s` is None
    (the engine schedules no refresh). The peers' balancers (bench.peers) use them.
    """

    refresh_s: float | None = None  # how often the engine calls refresh() with the nodes' gauges; None: never

    def __init__(self, n: int) -> None:
        self.active = [0] * n  # scur: requests on the server now
        self.stot = [0] * n  # stot: requests sent to the server so far

    def failed_at_once(self, i: int, t: float = 0.0, why: str = "") -> None:
        """An attempt on server i failed at t before it was served (why: '500', 'conn-failure'): stot counts it,
        scur does not."""
        self.stot[i] += 1

    def first_byte(self, i: int, t: float, rtt: float) -> None:
        """A request on server i got its first body bytes (its first token) at t, rtt seconds after it was sent;
        also called when one ends without any (timeout, error), with the time it waited."""

    def refresh(self, t: float, gauges: Sequence[tuple[int, int, float] | None]) -> None:
        """Every refresh_s: each node's vLLM gauges (running, waiting, KV usage) at t; None where it refuses."""


class LeastConn(_Stat):
    """HAProxy `balance leastconn`: the eligible server with the lowest (active + 1) / weight.

    HAProxy keeps servers in a tree keyed by (served + 1) * SRV_EWGHT_MAX / weight; among equal keys the
    one that reached its key first is picked (later insertions go after). We model that tie-break with the
    virtual time at which a server's active count last changed (then its position), so the choice does not
    depend on the order in which the engine happened to process simultaneous completions.
    """

    name = "leastconn"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self._seq: list[tuple[float, int]] = [(-1.0, i) for i in range(n)]  # initial order: by position

    def _touch(self, i: int, t: float) -> None:
        self._seq[i] = (t, i)

    def pick(self, weights: Sequence[int], drained: Sequence[bool], t: float = 0.0) -> int | None:
        """The next server, or None when none is eligible."""
        best = None
        best_key: tuple[float, tuple[float, int]] = (0.0, (0.0, 0))
        active, seq = self.active, self._seq
        for i, w in enumerate(weights):
            if w <= 0 or drained[i]:
                continue
            key = ((active[i] + 1) / w, seq[i])
            if best is None or key < best_key:
                best, best_key = i, key
        return best

    def started(self, i: int, t: float = 0.0) -> None:
        """A request was sent to server i at time t."""
        self.active[i] += 1
        self.stot[i] += 1
        self._touch(i, t)

    def ended(self, i: int, t: float = 0.0) -> None:
        """A request on server i ended at time t (answered, failed, or the client gave up)."""
        self.active[i] -= 1
        self._touch(i, t)


class RoundRobin(_Stat):
    """HAProxy `balance roundrobin` (dynamic weights), modelled as smooth weighted round robin.

    Each pick adds every eligible server's weight to its credit and takes the server with the most credit,
    which then pays the total: servers are interleaved in proportion to their weights, as HAProxy's fwrr
    does. A weight change takes effect on the next pick.
    """

    name = "roundrobin"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self._credit = [0] * n

    def pick(self, weights: Sequence[int], drained: Sequence[bool], t: float = 0.0) -> int | None:
        """The next server, or None when none is eligible."""
        best = None
        total = 0
        credit = self._credit
        for i, w in enumerate(weights):
            if w <= 0 or drained[i]:
                continue
            credit[i] += w
            total += w
            if best is None or credit[i] > credit[best]:
                best = i
        if best is not None:
            credit[best] -= total
        return best

    def started(self, i: int, t: float = 0.0) -> None:
        self.active[i] += 1
        self.stot[i] += 1

    def ended(self, i: int, t: float = 0.0) -> None:
        self.active[i] -= 1


class Gateway:
    """HAProxy's request-path reflexes on one backend, as configured by grayguard.reflexes.Reflexes.

    - passive health (`observe layer7`, `error-limit`, `on-error mark-down`): `error_limit` consecutive
      failed answers (5xx, connection failures) mark a server down; an answer with another status resets
      the count. A 200 whose text is garbage, or an error event after the first token, is a success here:
      HAProxy only sees the status line.
    - active health checks: `check_fall` failed checks mark an up server down, `check_rise` good ones bring
      a down server back (whatever marked it down). The check is GET /health: a node that answers 500 to
      requests while /health is 200 comes back and fails again. The next check follows HAProxy's
      srv_getinter(): `check_downinter_s` while the server is down with no good check yet, otherwise
      `check_inter_s` (no fastinter is configured). A mark-down by error-limit does not reschedule the check
      already planned (HAProxy requeues it only when fastinter is set), so a server marked down for errors
      whose /health answers 200 is back after at most about check_inter_s * check_rise.
    - the agent check (`agent-check agent-port ... agent-inter ...`): every `agent_inter_s` HAProxy reads one
      line from the node's exporter; "down" marks the server DOWN (agent) at once (no fall count), "up" lifts
      that at once (the health check's own verdict still applies). While the agent check is disabled
      (runtime API `disable agent`, what the controller does past its cap) its answers are ignored and the
      server follows its health check alone.
    - what the controller can read (`show servers state`): the server is DOWN, and whether the last verdict
      was the error-limit one (check_status HANA) -- until the next health check overwrites it; DOWN (agent),
      and whether its agent check is disabled.
    - the retry budget: the backend's failed responses (what its clients got: a 5xx after the retries, or
      its own 503; a retried-then-served request is no failure, as the stick table's http_fail_rate counts
      them) over its requests in the last `budget_window_s`; while that exceeds `retry_budget`, L7 retries
      (5xx, empty response) are disabled (`http-request disable-l7-retry`). Connection failures are still
      retried: HAProxy's rule spares them, and a refused connection costs the server nothing.
    - streaming (`option http-no-delay`, `no_delay`): each chunk of a stream passes as it comes, so the gateway
      adds no time to a first token and none is modelled. Without it HAProxy held every streamed chunk up to
      200 ms (tests/localstack/test_stream_latency.py); `no_delay=False` is not modelled.
    Pure and clock-free: the engine passes the time.
    """

    def __init__(self, rx, n: int) -> None:
        self.rx = rx  # grayguard.reflexes.Reflexes
        self.down = [False] * n
        self.errors = [0] * n  # consecutive failed answers (observe layer7)
        self.checks = [0] * n  # consecutive check results against the current state (toward rise or fall)
        self.hana = [False] * n  # down by error-limit, and no health check has run since (check_status HANA)
        self.agent_down = [False] * n  # the agent's last answer was "down" (only while the agent is enabled)
        self.agent_on = [True] * n  # the agent check is enabled (runtime API `enable agent` / `disable agent`)
        self.out = [False] * n  # out of rotation: DOWN by its health check or error-limit, or DOWN (agent)
        self.requests: deque[float] = deque()
        self.failures: deque[float] = deque()
        self.events: list[tuple[float, int, bool, str]] = []  # (time, server, down, why)

    def _set(self, k: int, down: bool, t: float, why: str) -> None:
        self.down[k] = down
        self.checks[k] = 0
        self.errors[k] = 0
        self.hana[k] = why == "error-limit"
        self.out[k] = down or self.agent_down[k]
        self.events.append((t, k, down, why))

    def agent(self, k: int, t: float, down: bool) -> None:
        """An agent check of server k at t: the exporter answered "down" (down=True) or "up"."""
        if not self.agent_on[k] or down == self.agent_down[k]:
            return
        self.agent_down[k] = down
        self.out[k] = down or self.down[k]
        self.events.append((t, k, down, "agent" if down else "agent up"))

    def set_agent(self, k: int, on: bool, t: float) -> None:
        """Enable or disable server k's agent check; disabled, its last "down" no longer holds the server."""
        if on == self.agent_on[k]:
            return
        self.agent_on[k] = on
        if not on and self.agent_down[k]:
            self.agent_down[k] = False
            self.out[k] = self.down[k]
            self.events.append((t, k, False, "agent disabled"))

    def request(self, t: float) -> None:
        """A client request entered the backend."""
        self.requests.append(t)

    def response_failed(self, t: float) -> None:
        """A client got a failed response at t (a 5xx after the retries, or HAProxy's own 503)."""
        self.failures.append(t)

    def failed(self, k: int, t: float) -> None:
        """An attempt on server k failed (it answered 5xx or refused the connection)."""
        self.errors[k] += 1
        if self.errors[k] >= self.rx.error_limit and not self.down[k]:
            self._set(k, True, t, "error-limit")

    def answered(self, k: int) -> None:
        """Server k answered with a non-error status."""
        self.errors[k] = 0

    def budget_ok(self, t: float) -> bool:
        """May an L7 retry be attempted at t (failed answers within retry_budget of the requests)?"""
        lo = t - self.rx.budget_window_s
        for q in (self.requests, self.failures):
            while q and q[0] <= lo:
                q.popleft()
        return len(self.failures) <= self.rx.retry_budget * max(1, len(self.requests))

    def next_check_in(self, k: int) -> float:
        """Seconds to server k's next check after one just ran (HAProxy's srv_getinter, no fastinter)."""
        if self.down[k] and self.checks[k] == 0:
            return self.rx.check_downinter_s
        return self.rx.check_inter_s

    def rejoin(self, k: int) -> None:
        """Server k was added to the backend again: UP, no counts, its agent check enabled."""
        self.down[k] = self.hana[k] = self.agent_down[k] = self.out[k] = False
        self.errors[k] = self.checks[k] = 0
        self.agent_on[k] = True

    def check(self, k: int, t: float, healthy: bool) -> None:
        """An active health check of server k at t: GET /health answered 200 (healthy) or not."""
        self.hana[k] = False  # the check's own verdict replaces the error-limit one
        if healthy == (not self.down[k]):
            self.checks[k] = 0
            return
        self.checks[k] += 1
        if self.down[k] and self.checks[k] >= self.rx.check_rise:
            self._set(k, False, t, "check rise")
        elif not self.down[k] and self.checks[k] >= self.rx.check_fall:
            self._set(k, True, t, "check fall")


BALANCERS = {"leastconn": LeastConn, "roundrobin": RoundRobin}


def make_balancer(name: str, n: int, seed: int = 0) -> _Stat:
    """A balancer for n servers: HAProxy's by name, or a peer's (bench.peers, seeded with the scenario's seed)."""
    from grayguard.bench.peers import PEER_BALANCERS  # bench.peers builds on _Stat

    if name in PEER_BALANCERS:
        return PEER_BALANCERS[name](n, seed)
    try:
        return BALANCERS[name](n)
    except KeyError:
        raise ValueError(f"unknown balancer {name!r}; known: {', '.join([*BALANCERS, *PEER_BALANCERS])}") from None
