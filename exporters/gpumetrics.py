"""Pure core of the GPU collector: NVML readings in, Prometheus metric families out (no I/O)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from grayguard.vocab import CLOCK_EVENT_REASONS, GPU_SLOWDOWN_REASONS

GPU_LABELS = ["gpu", "uuid"]


# Plain per-GPU gauges: reading key -> (metric name, help). Keys are what nvml.py fills in.
GAUGES = {
    "sm_clock": ("grayguard_gpu_sm_clock_hertz", "Current SM clock (Hz)"),
    "sm_clock_max": ("grayguard_gpu_sm_clock_max_hertz", "Maximum SM clock (Hz)"),
    "mem_clock": ("grayguard_gpu_memory_clock_hertz", "Current memory clock (Hz)"),
    "mem_clock_max": ("grayguard_gpu_memory_clock_max_hertz", "Maximum memory clock (Hz)"),
    "temperature": ("grayguard_gpu_temperature_celsius", "GPU core temperature (Celsius)"),
    "memory_temperature": ("grayguard_gpu_memory_temperature_celsius", "GPU memory (HBM) temperature (Celsius)"),
    "power": ("grayguard_gpu_power_watts", "Current power draw (W)"),
    "power_limit": ("grayguard_gpu_power_limit_watts", "Enforced power limit (W)"),
    "pcie_gen": ("grayguard_gpu_pcie_link_generation", "Current PCIe link generation"),
    "pcie_gen_max": ("grayguard_gpu_pcie_link_max_generation", "Maximum PCIe link generation of GPU and system"),
    "pcie_width": ("grayguard_gpu_pcie_link_width", "Current PCIe link width (lanes)"),
    "pcie_width_max": ("grayguard_gpu_pcie_link_max_width", "Maximum PCIe link width (lanes)"),
    "remap_pending": ("grayguard_gpu_row_remap_pending", "1 when a row remap waits for a GPU reset"),
    "remap_failure": ("grayguard_gpu_row_remap_failure", "1 when a row remap failed (the GPU needs service)"),
    "utilization": ("grayguard_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (0-1)"),
    "memory_used": ("grayguard_gpu_memory_used_bytes", "Device memory in use (bytes)"),
    "memory_total": ("grayguard_gpu_memory_total_bytes", "Total device memory (bytes)"),
}
# Per-GPU counters: reading key -> (metric name without _total, help).
COUNTERS = {
    "energy": ("grayguard_gpu_energy_joules", "Energy consumed since the driver loaded (J)"),
    "pcie_replay": ("grayguard_gpu_pcie_replay", "PCIe replays (link-level retransmissions)"),
}
# The slowdowns that make a GPU slower than its peers, and the load from which they matter: an idle GPU's clocks drop
# and its link trains down to save power, which is no fault.
SLOWDOWN_BITS = sum(bit for reason, bit in CLOCK_EVENT_REASONS if reason in GPU_SLOWDOWN_REASONS)
UNDER_LOAD = 0.5  # utilization from which a GPU counts as under load
ECC_KINDS = tuple((t, c) for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate"))
NVML_ERROR_KINDS = ("timeout", "error")


@dataclass(frozen=True)
class GpuReading:
    """Everything read from one GPU in one pass; a missing key means the field is not exported."""

    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    lost: bool = False
    values: Mapping[str, float] = field(default_factory=dict)
    clock_event_reasons: int | None = None
    ecc: Mapping[tuple[str, str], int] = field(default_factory=dict)
    remapped_rows: tuple[int, int] | None = None  # correctable, uncorrectable


@dataclass(frozen=True)
class NvmlSnapshot:
    """One read of the whole node: NVML state, GPUs, XID counts and the collector's error counts."""

    up: bool
    driver_version: str = ""
    gpus: tuple[GpuReading, ...] = ()
    xid_counts: Mapping[tuple[int, str, int], int] = field(default_factory=dict)  # (gpu, uuid, xid) -> n
    errors: Mapping[str, int] = field(default_factory=dict)  # collector error kind -> n


def _families() -> dict[str, Metric]:
    g = GaugeMetricFamily
    fams: dict[str, Metric] = {
        "up": g("grayguard_exporter_nvml_up", "1 when NVML is initialized, 0 when it is absent or failed"),
        "nvml_errors": CounterMetricFamily("grayguard_exporter_nvml_errors",
                                           "NVML reads that timed out or failed unexpectedly", labels=["kind"]),
        "info": g("grayguard_gpu_info", "GPU identity (value 1)",
                  labels=GPU_LABELS + ["name", "pci_bus_id", "driver_version"]),
        "lost": g("grayguard_gpu_lost", "1 when NVML reports the GPU lost or needing a reset", labels=GPU_LABELS),
    }
    for key, (name, doc) in GAUGES.items():
        fams[key] = g(name, doc, labels=GPU_LABELS)
    fams["reasons"] = g("grayguard_gpu_clock_event_reasons",
                        "NVML's clock event reasons bitmask (nvmlDeviceGetCurrentClocksEventReasons): a set bit is a "
                        "reason holding the clocks down, e.g. 0x8 hw_slowdown, 0x40 hw_thermal_slowdown "
                        "(docs/metrics.md has every bit)", labels=GPU_LABELS)
    fams["ecc"] = g("grayguard_gpu_ecc_errors", "ECC errors (volatile: since boot, aggregate: lifetime)",
                    labels=GPU_LABELS + ["error_type", "counter_type"])
    fams["remapped"] = g("grayguard_gpu_remapped_rows", "Memory rows remapped, by cause",
                         labels=GPU_LABELS + ["cause"])
    # derived beside the node, for the controller's hot path: one series a GPU to read instead of a join in Prometheus
    fams["slowed"] = g("grayguard_gpu_slowed_under_load", "1 while a slowdown reason (hardware, thermal, power brake) "
                       f"holds the clocks down and the GPU is busy (utilization > {UNDER_LOAD}), else 0",
                       labels=GPU_LABELS)
    fams["pcie_degraded"] = g("grayguard_gpu_pcie_degraded_under_load", "1 while the PCIe link runs below its maximum "
                              f"generation or width and the GPU is busy (utilization > {UNDER_LOAD}), else 0",
                              labels=GPU_LABELS)
    for key, (name, doc) in COUNTERS.items():
        fams[key] = CounterMetricFamily(name, doc, labels=GPU_LABELS)
    fams["xid"] = CounterMetricFamily("grayguard_gpu_xid_errors", "XID critical-error events seen by the exporter",
                                      labels=GPU_LABELS + ["xid"])
    return fams


def under_load(gpu: GpuReading) -> dict[str, int]:
    """The derived flags of one GPU whose inputs were read: slowed (a slowdown reason under load) and pcie_degraded
    (a link below its maximum under load); a flag whose inputs are missing is absent (absent is not zero)."""
    v = gpu.values
    if "utilization" not in v:
        return {}
    busy = v["utilization"] > UNDER_LOAD
    out = {}
    if gpu.clock_event_reasons is not None:
        out["slowed"] = int(busy and bool(gpu.clock_event_reasons & SLOWDOWN_BITS))
    if all(k in v for k in ("pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max")):
        below = v["pcie_gen"] < v["pcie_gen_max"] or v["pcie_width"] < v["pcie_width_max"]
        out["pcie_degraded"] = int(busy and below)
    return out


def describe_families() -> list[Metric]:
    """Every family the collector may export, without samples (for `describe()`)."""
    return list(_families().values())


def build_families(snap: NvmlSnapshot) -> Iterator[Metric]:
    """Turn a snapshot into metric families; families without samples are left out."""
    fams = _families()
    fams["up"].add_metric([], 1 if snap.up else 0)
    for kind in NVML_ERROR_KINDS:
        fams["nvml_errors"].add_metric([kind], snap.errors.get(kind, 0))
    for gpu in snap.gpus:
        ids = [str(gpu.index), gpu.uuid]
        fams["info"].add_metric(ids + [gpu.name, gpu.pci_bus_id, snap.driver_version], 1)
        fams["lost"].add_metric(ids, 1 if gpu.lost else 0)
        for key, value in gpu.values.items():
            fams[key].add_metric(ids, value)
        if gpu.clock_event_reasons is not None:
            fams["reasons"].add_metric(ids, gpu.clock_event_reasons)
        for (etype, ctype), n in gpu.ecc.items():
            fams["ecc"].add_metric(ids + [etype, ctype], n)
        for key, flag in under_load(gpu).items():
            fams[key].add_metric(ids, flag)
        if gpu.remapped_rows is not None:
            fams["remapped"].add_metric(ids + ["correctable"], gpu.remapped_rows[0])
            fams["remapped"].add_metric(ids + ["uncorrectable"], gpu.remapped_rows[1])
    for (index, uuid, xid), n in sorted(snap.xid_counts.items()):
        fams["xid"].add_metric([str(index), uuid, str(xid)], n)
    for fam in fams.values():
        if fam.samples:
            yield fam
