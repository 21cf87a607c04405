"""The exporter's /healthz and /readyz: which of its loops they watch, each loop's stall limit, one verdict.

Pure: the loops' Beats (grayguard/health.py) are read at the probe's time. Watched, each with its own limit:

- the probe round (exporters/prober.py): every --probe.interval, a readiness check and a probe (each within
  --probe.deadline), then at most two reads of vLLM's /metrics (each within ProbeConfig.metrics_timeout);
- the live fast path's reads of vLLM's /metrics: they ride the probe round (at its start, again when it times out), so
  the longest healthy gap between two is a round and its wait, the same limit; a round whose read raised still
  completes, so the fast path can stall alone;
- the registry round (exporters/registration.py, with --registry.url): pre-checks or a heartbeat every
  --registry.heartbeat, bounded by --registry.timeout per call.

A failed round completes: a vLLM or etcd that does not answer is the round's finding, not the exporter's death. The
NVML collector has no loop of its own (it reads in the scrape, bounded by --collector.nvml.timeout, and counts a read
that hangs), and the XID thread waits inside the driver: a hung driver is the GPU's finding, which a restart of the
exporter would not cure, so neither is watched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.registration import RegistrationConfig
from grayguard.health import Beat, Verdict, combined, readiness, stall_limit_s

PROBE_ROUND = "probe round"
FAST_READ = "fast-path read"
REGISTRY_ROUND = "registry round"
METRICS_READS = 2  # vLLM /metrics reads a probe round may wait on in turn: at its start, again after a timeout
# --registry.timeout calls one registry round may wait on in turn (pre-checks, then a grant and a put): the bound
# Registrar.stop waits for the thread, less its heartbeat
REGISTRY_CALLS = 8


@dataclass(frozen=True)
class Loop:
    """One watched loop: its name in the reasons, its Beat, its stall limit (s), whether readiness waits for it."""

    what: str
    beat: Beat
    limit_s: float
    gates_readiness: bool = True


def probe_round_budget_s(cfg: ProbeConfig) -> float:
    """The longest a healthy probe round takes: readiness check and probe, then its /metrics reads, in turn."""
    return 2 * cfg.deadline + METRICS_READS * cfg.metrics_timeout


def probe_stall_limit_s(cfg: ProbeConfig) -> float:
    """max(10 s, 10 probe intervals at their longest jitter, 2 x a round's budget): the probe round's and the fast
    path's limit (12 s with the defaults: 1 s +- 20 %, 2 s deadline, 1 s reads)."""
    return stall_limit_s(cfg.interval * (1 + cfg.jitter), probe_round_budget_s(cfg))


def registry_stall_limit_s(cfg: RegistrationConfig) -> float:
    """max(10 s, 10 heartbeats, 2 x 8 x --registry.timeout) (32 s with the defaults: 2 s heartbeat, 2 s timeout)."""
    return stall_limit_s(cfg.heartbeat, REGISTRY_CALLS * cfg.timeout)


def health(loops: Sequence[Loop]) -> Verdict:
    """/healthz: 503 naming each loop whose last completed round is older than its limit; 200 otherwise."""
    return combined([lp.beat.health(lp.limit_s, lp.what) for lp in loops],
                    Verdict(True, "ok: no loop to watch (probing and registration are off)"))


def ready(loops: Sequence[Loop]) -> Verdict:
    """/readyz: 503 until each gating loop has completed a round (the exporter has looked at its vLLM); 200 after."""
    gating = [readiness(lp.beat.completed, what=lp.what) for lp in loops if lp.gates_readiness]
    return combined(gating, Verdict(True, "ready: probing is off, nothing to wait for"))
