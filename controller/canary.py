"""Canaries: which peers get a reference canary and the node's latency estimate (pure), and the request itself.

A 1-token request measures time to first token, not latency per token; so each canary goes to the drained
node and to up to two in-rotation peers of its peer group at the same moment, and the node's estimate is
the peers' median EMA scaled by node TTFT / median peer TTFT. The live loop (controller/loop.py through
controller/decide.py) and the benchmark (bench/policies.py) both call the functions below. `make_canary` is
the I/O side: the exporter's micro-probe, sent by the controller straight to a drained node.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Iterable, Mapping, Sequence

from controller.policy import NodeState, canary_due
from grayguard.config import RecoveryConfig
from grayguard.vocab import IN_ROTATION

log = logging.getLogger("grayguard.canary")

PEERS = 2  # reference canaries per drained node


def canary_peers(node: str, candidates: Iterable[str], prev: Mapping[str, NodeState],
                 groups: Mapping[str, str | None], limit: int = PEERS) -> list[str]:
    """Up to `limit` reference peers: in rotation with an EMA, same peer group, lowest (score, name) first."""
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
    """median(peer EMA) * node TTFT / median(answered peer TTFT); a failed canary is +inf; no reference: None."""
    if node_ttft is None:
        return math.inf
    ref = [t for t in peer_ttfts if t is not None and t > 0]
    if not ref:
        return None
    return statistics.median(peer_emas) * node_ttft / statistics.median(ref)


def make_canary(r: RecoveryConfig):
    """A canary function: base URL -> time to first token (s) of an ok/slow answer, or None on any failure.

    It reuses exporters.prober (random prefix against the prefix cache, max_tokens 1, temperature 0,
    streaming, closed after the first chunk), with no cold-start grace: a node the controller drained
    has answered before, so silence is a failure.
    """
    from exporters.probe import ANSWERED
    from exporters.prober import ProbeConfig, Prober

    cfg = ProbeConfig(deadline=r.canary_timeout_s, slow_threshold=r.canary_timeout_s, model=r.canary_model,
                      api_key_env=r.canary_api_key_env, startup_grace=0.0)
    probers: dict[str, Prober] = {}  # one per URL: the discovered model is reused
    lock = threading.Lock()

    def canary(base_url: str) -> float | None:
        with lock:
            p = probers.get(base_url) or probers.setdefault(base_url, Prober(base_url, cfg))
        result = p.run_once()
        if result not in ANSWERED:
            log.info("canary %s: %s", base_url, result)
            return None
        return p.state.last_ttft

    return canary
