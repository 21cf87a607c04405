"""Canaries: which peers get a reference canary and the node's latency estimate (pure), and the request itself.

A 1-token request measures time to first token, not latency per token; so each canary goes to the drained
node and to up to two in-rotation peers of its peer group at the same moment, and the node's estimate is
the peers' median window latency (their last sample, NodeState.ema) scaled by node TTFT / median peer TTFT.
The live loop (controller/loop.py through controller/decide.py) and the benchmark (bench/policies.py) both call the
functions below. `make_canary` is the I/O side: the exporter's micro-probe, sent by the controller straight to a
drained node.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Iterable, Mapping, Sequence

from grayguard.config import RecoveryConfig
from grayguard.controller.policy import NodeState, canary_due
from grayguard.redact import redact_url
from grayguard.vocab import IN_ROTATION

log = logging.getLogger("grayguard.canary")

PEERS = 2  # reference canaries per drained node


def canary_peers(node: str, candidates: Iterable[str], prev: Mapping[str, NodeState],
                 groups: Mapping[str, str | None], limit: int = PEERS) -> list[str]:
    """Up to `limit` reference peers: in rotation with a window latency, same peer group, lowest (score, name) first."""
    g = groups.get(node)
    return sorted((m for m in candidates if m != node and m in prev and prev[m].state in IN_ROTATION
                   and prev[m].ema is not None and groups.get(m) == g),
                  key=lambda m: (prev[m].score or 0.0, m))[:limit]


def canary_rounds(candidates: Sequence[str], prev: Mapping[str, NodeState], groups: Mapping[str, str | None],
                  now: float, recovery: RecoveryConfig, limit: int = PEERS) -> list[tuple[str, list[str]]]:
    """(node, [node, *peers]) for every candidate due a canary now, in the candidates' order."""
    return [(n, [n, *canary_peers(n, candidates, prev, groups, limit)]) for n in candidates
            if n in prev and canary_due(prev[n], now, recovery)]


def canary_estimate(node_ttft: float | None, peer_ttfts: Sequence[float | None],
                    peer_emas: Sequence[float]) -> float | None:
    """median(peer window latency) * node TTFT / median(answered peer TTFT); a failed canary is +inf; no reference:
    None."""
    if node_ttft is None:
        return math.inf
    ref = [t for t in peer_ttfts if t is not None and t > 0]
    if not ref:
        return None
    return statistics.median(peer_emas) * node_ttft / statistics.median(ref)


def node_url(address: str) -> str:
    """The base URL of a server address "host:port": an IPv6 host is bracketed, with or without brackets given.

    "10.0.0.1:8000" -> http://10.0.0.1:8000; "::1:8000" and "[::1]:8000" -> http://[::1]:8000;
    "fe80::1%eth0:8000" -> http://[fe80::1%25eth0]:8000 (RFC 6874 zone); "node1:8000" -> http://node1:8000.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():  # no port at all: the address is the host
        host, port = address, ""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:  # IPv6: the last colon separates the port, the others belong to the address
        host = "[" + host.replace("%25", "%").replace("%", "%25") + "]"
    return f"http://{host}:{port}" if port else f"http://{host}"


def make_canary(r: RecoveryConfig):
    """A canary function: base URL -> time to first token (s) of an ok/slow answer, or None on any failure.

    It reuses exporters.prober (random prefix against the prefix cache, max_tokens 1, temperature 0,
    streaming, closed after the first chunk), with no cold-start grace: a node the controller drained
    has answered before, so silence is a failure.
    """
    from grayguard.exporters.probe import ANSWERED
    from grayguard.exporters.prober import ProbeConfig, Prober

    cfg = ProbeConfig(deadline=r.canary_timeout_s, slow_threshold=r.canary_timeout_s, model=r.canary_model,
                      api_key_env=r.canary_api_key_env, startup_grace=0.0)
    probers: dict[str, tuple[Prober, threading.Lock]] = {}  # one per URL: the discovered model is reused
    lock = threading.Lock()

    def canary(base_url: str) -> float | None:
        with lock:
            p, busy = probers.get(base_url) or probers.setdefault(base_url, (Prober(base_url, cfg), threading.Lock()))
        if not busy.acquire(blocking=False):
            # an earlier canary to this URL still runs (the tick stopped waiting for it): a prober of its own,
            # so that neither reads the other's TTFT, and this one is not queued behind a hung request
            p, busy = Prober(base_url, cfg), threading.Lock()
            busy.acquire()
        try:
            result = p.run_once()  # bounded: the prober's deadline is canary_timeout_s
            ttft = p.state.last_ttft
        finally:
            busy.release()
        if result not in ANSWERED:
            log.info("canary %s: %s", redact_url(base_url), result)
            return None
        return ttft

    return canary
