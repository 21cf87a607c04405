"""Models of HAProxy's dynamic balancing algorithms, weighted: `leastconn` and `roundrobin`.

Pure and clock-free. A server with weight 0 or in drain gets no new requests (as in HAProxy; stick-table
persistence is modelled by the engine's pinned requests, which bypass the balancer). `pick()` returns
the chosen index, or None when no server is eligible (HAProxy answers 503).
"""

from __future__ import annotations

from collections.abc import Sequence


class LeastConn:
    """HAProxy `balance leastconn`: the eligible server with the lowest (active + 1) / weight.

    HAProxy keeps servers in a tree keyed by (served + 1) * SRV_EWGHT_MAX / weight; among equal keys the
    one that reached its key first is picked (later insertions go after). We model that tie-break with the
    virtual time at which a server's active count last changed (then its position), so the choice does not
    depend on the order in which the engine happened to process simultaneous completions.
    """

    name = "leastconn"

    def __init__(self, n: int) -> None:
        self.active = [0] * n
        self._seq: list[tuple[float, int]] = [(-1.0, i) for i in range(n)]  # initial order: by position

    def _touch(self, i: int, t: float) -> None:
        self._seq[i] = (t, i)

    def pick(self, weights: Sequence[int], drained: Sequence[bool]) -> int | None:
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
        self._touch(i, t)

    def ended(self, i: int, t: float = 0.0) -> None:
        """A request on server i ended at time t (answered, failed, or the client gave up)."""
        self.active[i] -= 1
        self._touch(i, t)


class RoundRobin:
    """HAProxy `balance roundrobin` (dynamic weights), modelled as smooth weighted round robin.

    Each pick adds every eligible server's weight to its credit and takes the server with the most credit,
    which then pays the total: servers are interleaved in proportion to their weights, as HAProxy's fwrr
    does. A weight change takes effect on the next pick.
    """

    name = "roundrobin"

    def __init__(self, n: int) -> None:
        self.active = [0] * n
        self._credit = [0] * n

    def pick(self, weights: Sequence[int], drained: Sequence[bool]) -> int | None:
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

    def ended(self, i: int, t: float = 0.0) -> None:
        self.active[i] -= 1


BALANCERS = {"leastconn": LeastConn, "roundrobin": RoundRobin}


def make_balancer(name: str, n: int) -> LeastConn | RoundRobin:
    """A balancer by HAProxy name for n servers."""
    try:
        return BALANCERS[name](n)
    except KeyError:
        raise ValueError(f"unknown balancer {name!r}; known: {', '.join(BALANCERS)}") from None
