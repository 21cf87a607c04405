"""Canary requests: the exporter's 1-token micro-probe, sent by the controller straight to a drained node."""

from __future__ import annotations

import logging
import threading

from grayguard.config import RecoveryConfig

log = logging.getLogger("grayguard.canary")


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
