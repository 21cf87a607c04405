"""grayguard's shared words: node states, probe results, drain causes. Every package imports them from here.

They are `StrEnum`s: each member *is* its string (`State.HEALTHY == "healthy"`), so state files,
metric labels, CSV traces and YAML stay plain text, and a typo in code is an AttributeError rather
than a silently unmatched string.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """Where the controller holds a node (docs/architecture.md, "States")."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    QUARANTINED = "quarantined"
    CANARY = "canary"
    SLOW_START = "slow_start"


#: every state, in the order the metrics, dashboards and docs list them
STATES: tuple[State, ...] = tuple(State)
#: drained: out of rotation, probed with canaries
EJECTED = frozenset({State.QUARANTINED, State.CANARY})
#: in rotation: HAProxy sends it traffic (possibly at a reduced weight)
IN_ROTATION = frozenset({State.HEALTHY, State.DEGRADED, State.SLOW_START})


class ProbeResult(StrEnum):
    """The class of one micro-probe (or canary): exactly one per request."""

    OK = "ok"
    SLOW = "slow"
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"
    HTTP_ERROR = "http_error"
    CUDA_ERROR = "cuda_error"
    BAD_RESPONSE = "bad_response"
    STARTING = "starting"


PROBE_RESULTS: tuple[ProbeResult, ...] = tuple(ProbeResult)

# NVML clock-event reasons that make a busy GPU slower than its peers: not idling, not an application's clock setting,
# not sw_power_cap (a GPU at full load often sits at its power cap, and that is normal). The exporter's slowed flag,
# the throttling alert and the GPU dashboard read this one list.
# the target label that names a series' pool (README: Prometheus requirements): the controller matches series to pools
# by it, Prometheus shards pools by it (rules/shards.py)
POOL_LABEL = "pool"

#: NVML's clock-event reasons and their bits in its mask (nvmlClocksEventReason*, the same bits as the old throttle
#: reasons; DCGM passes the mask through): the exporter serves the mask as read, one series a GPU
#: (grayguard_gpu_clock_event_reasons); the rules, the dcgm rules, the dashboards and docs/metrics.md decode it
CLOCK_EVENT_REASONS = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
#: The exporter's judgements of a GPU, one bit each in one series a GPU (grayguard_gpu_flags): a bit is set while
#: its condition holds and clear when it does not or when NVML cannot tell (an unsupported field, an unknown
#: utilization). The alerts, the controller's GPU-evidence queries, the dcgm rules, the dashboards and
#: docs/metrics.md decode it as floor(x / bit) % 2. Replaces the 0/1 series grayguard_gpu_lost,
#: grayguard_gpu_row_remap_pending, grayguard_gpu_row_remap_failure, grayguard_gpu_slowed_under_load and
#: grayguard_gpu_pcie_degraded_under_load of earlier versions (CHANGELOG.md).
GPU_FLAGS = (
    ("lost", 0x1),  # NVML says GpuIsLost or ResetRequired, or a GPU seen earlier is no longer listed
    ("row_remap_pending", 0x2),  # a row remap waits for a GPU reset
    ("row_remap_failure", 0x4),  # a row remap failed: the GPU needs service
    ("slowed_under_load", 0x8),  # a slowdown reason (GPU_SLOWDOWN_REASONS) holds the clocks, utilization > 0.5
    ("pcie_below_max", 0x10),  # the link runs below its maximum generation or width, at any load
    ("pcie_degraded_under_load", 0x20),  # pcie_below_max while utilization > 0.5 (an idle link may train down)
)
#: flag name -> its bit
GPU_FLAG_BITS = dict(GPU_FLAGS)


def bit_of_mask(series: str, bit: int) -> str:
    """PromQL for one bit of a mask series (grayguard_gpu_flags, grayguard_gpu_clock_event_reasons): 1 while set."""
    return f"floor({series} / {bit}) % 2"


#: Series grayguard once exported or recorded and no longer does by default (CHANGELOG.md), each with what reads in
#: its place: a signal query naming one is refused by the config check (it would be absent, every weight held or no
#: GPU evidence), and tests/rules/test_removed_series.py keeps every shipped rule, dashboard and runbook off them.
REMOVED_SERIES = {
    **{f"grayguard_gpu_{name}": bit_of_mask("grayguard_gpu_flags", bit) for name, bit in GPU_FLAGS
       if name != "pcie_below_max"},  # the five 0/1 series the mask replaced (pcie_below_max was never one)
    "grayguard_gpu_pcie_link_max_generation": "the pcie_max_generation label of grayguard_gpu_info",
    "grayguard_gpu_pcie_link_max_width": "the pcie_max_width label of grayguard_gpu_info",
    "grayguard_gpu_clock_event_reason_active": "floor(grayguard_gpu_clock_event_reasons / BIT) % 2",
    "instance:vllm_num_requests_running:sum": "sum by (pool, instance) (vllm:num_requests_running)",
    # on the exporter's full page only, which the example scrape config does not store
    "grayguard_live_generation_tokens_per_second": "rate(vllm:generation_tokens_total[1m])",
    "grayguard_live_requests_running": "vllm:num_requests_running",
    "grayguard_live_requests_waiting": "vllm:num_requests_waiting",
    "grayguard_live_window_seconds": "nothing (a detail of the live window)",
    "grayguard_agent_down": "nothing (HAProxy's agent check asks the exporter itself)",
}
#: the reasons that make a GPU slower than its peers (sw_power_cap is a GPU at full load, no fault)
GPU_SLOWDOWN_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
#: the engine answered (a time to first token was measured)
PROBE_ANSWERED = frozenset({ProbeResult.OK, ProbeResult.SLOW})
#: failures that count towards quarantine (a CUDA error quarantines at once; `starting` is no fault)
PROBE_FAILURES = frozenset({ProbeResult.TIMEOUT, ProbeResult.CONNECT_ERROR, ProbeResult.HTTP_ERROR,
                            ProbeResult.BAD_RESPONSE})
#: a probe that waited: slow, or timed out (a queue, or a slow node: the slow-probe run's share of peers)
PROBE_WAITED = frozenset({ProbeResult.SLOW, ProbeResult.TIMEOUT})
#: every failed probe: the failures plus a CUDA error (the exporter's failure streak, a failed canary)
PROBE_FAULTS = PROBE_FAILURES | {ProbeResult.CUDA_ERROR}
#: one strike for the agent check (exporters/agent.py, and the benchmark's model of it): neither is load
PROBE_AGENT_DOWN = frozenset({ProbeResult.BAD_RESPONSE, ProbeResult.CUDA_ERROR})


class Signal(StrEnum):
    """A signal that yields a weight factor (`grayguard_node_weight_factor{signal}`)."""

    LATENCY = "latency"
    PROBE = "probe"
    ERRORS = "errors"
    KV_CACHE = "kv_cache"
    LIVE = "live"  # the live ITL or probe TTFT median against the peers' (controller/live.py)


class Detector(StrEnum):
    """A detector of the decision, by its name in the config's `detectors` section (shadow mode) and in
    `grayguard_node_shadow_*{detector}`."""

    LATENCY = "latency"  # the 30 s window's outlier
    LIVE = "live"  # the live ITL against its peers' (controller/live.py)
    PROBE = "probe"  # slow and failed probes
    ERRORS = "errors"  # the error share and the error circuit
    KV_OUTLIER = "kv_outlier"  # a KV cache far fuller than its peers'


class DrainCause(StrEnum):
    """Why a node was drained (the `drain_cause` of /status, the reason code of quarantined nodes)."""

    LATENCY = "latency"
    PROBE = "probe"
    ERRORS = "errors"
    GATEWAY = "gateway"  # HAProxy marked it DOWN for errors (observe layer7 error-limit): its own circuit breaker
    SEEDED = "seeded"  # found drained in HAProxy by a controller with no state for the node
    KV_CACHE = "kv_cache"  # its KV cache far fuller than its peers' (a KV budget that shrank)
