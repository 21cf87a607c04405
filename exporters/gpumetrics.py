"""Pure core of the GPU collector: NVML readings in, Prometheus metric families out (no I/O)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from grayguard.vocab import CLOCK_EVENT_REASONS, GPU_FLAG_BITS, GPU_FLAGS, GPU_SLOWDOWN_REASONS

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
    "pcie_width": ("grayguard_gpu_pcie_link_width", "Current PCIe link width (lanes)"),
    "utilization": ("grayguard_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (0-1)"),
    "memory_used": ("grayguard_gpu_memory_used_bytes", "Device memory in use (bytes)"),
    "memory_total": ("grayguard_gpu_memory_total_bytes", "Total device memory (bytes)"),
}
# Readings served as labels of grayguard_gpu_info, not as series of their own: reading key -> label name. A label is
# absent when NVML cannot tell.
INFO_LABELS = {"pcie_gen_max": "pcie_max_generation", "pcie_width_max": "pcie_max_width"}
# Per-GPU counters: reading key -> (metric name without _total, help).
COUNTERS = {
    "energy": ("grayguard_gpu_energy_joules", "Energy consumed since the driver loaded (J)"),
    "pcie_replay": ("grayguard_gpu_pcie_replay", "PCIe replays (link-level retransmissions)"),
}
# The slowdowns that make a GPU slower than its peers, and the load from which they matter: an idle GPU's clocks drop
# and its link trains down to save power, which is no fault.
SLOWDOWN_BITS = sum(bit for reason, bit in CLOCK_EVENT_REASONS if reason in GPU_SLOWDOWN_REASONS)
UNDER_LOAD = 0.5  # utilization from which a GPU counts as under load
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
    remap_state: tuple[bool, bool] | None = None  # a row remap pending, a row remap failed


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
        # its labels differ by GPU (a PCIe maximum NVML cannot tell is left out): samples added with add_sample
        "info": g("grayguard_gpu_info", "GPU identity (value 1); pcie_max_generation and pcie_max_width are the "
                  "link's maxima of GPU and system, absent when NVML cannot tell"),
        "flags": g("grayguard_gpu_flags", "The exporter's judgements of the GPU as a bitmask: "
                   + ", ".join(f"{bit:#x} {name}" for name, bit in GPU_FLAGS)
                   + f" (under load: utilization > {UNDER_LOAD}; docs/metrics.md)", labels=GPU_LABELS),
    }
    for key, (name, doc) in GAUGES.items():
        fams[key] = g(name, doc, labels=GPU_LABELS)
    fams["reasons"] = g("grayguard_gpu_clock_event_reasons",
                        "NVML's clock event reasons bitmask (nvmlDeviceGetCurrentClocksEventReasons): a set bit is a "
                        "reason holding the clocks down, e.g. 0x8 hw_slowdown, 0x40 hw_thermal_slowdown "
                        "(docs/metrics.md has every bit)", labels=GPU_LABELS)
    fams["ecc"] = g("grayguard_gpu_ecc_errors", "ECC errors (volatile: since boot; aggregate: "
                    "lifetime, only with --collector.ecc-aggregate)",
                    labels=GPU_LABELS + ["error_type", "counter_type"])
    fams["remapped"] = g("grayguard_gpu_remapped_rows", "Memory rows remapped, by cause",
                         labels=GPU_LABELS + ["cause"])
    for key, (name, doc) in COUNTERS.items():
        fams[key] = CounterMetricFamily(name, doc, labels=GPU_LABELS)
    fams["xid"] = CounterMetricFamily("grayguard_gpu_xid_errors", "XID critical-error events seen by the exporter",
                                      labels=GPU_LABELS + ["xid"])
    return fams


def flags(gpu: GpuReading) -> set[str]:
    """The GPU_FLAGS names that hold for one GPU. A flag whose inputs NVML could not tell (an unsupported field, an
    unknown utilization) is not set: the mask says what is known to hold."""
    if gpu.lost:
        return {"lost"}  # nothing else was read
    v, out = gpu.values, set()
    if gpu.remap_state is not None:
        out |= {name for name, held in zip(("row_remap_pending", "row_remap_failure"), gpu.remap_state, strict=True)
                if held}
    busy = v.get("utilization", 0.0) > UNDER_LOAD  # unknown utilization: not known to be under load
    if busy and gpu.clock_event_reasons is not None and gpu.clock_event_reasons & SLOWDOWN_BITS:
        out.add("slowed_under_load")
    if all(k in v for k in ("pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max")) and (
            v["pcie_gen"] < v["pcie_gen_max"] or v["pcie_width"] < v["pcie_width_max"]):
        out.add("pcie_below_max")
        if busy:
            out.add("pcie_degraded_under_load")
    return out


def flags_mask(gpu: GpuReading) -> int:
    """grayguard_gpu_flags of one GPU: the bits of its flags (grayguard.vocab.GPU_FLAGS)."""
    return sum(GPU_FLAG_BITS[name] for name in flags(gpu))


def info_labels(gpu: GpuReading, driver_version: str) -> dict[str, str]:
    """grayguard_gpu_info's labels of one GPU: its identity, and the PCIe maxima NVML could tell."""
    labels = {"gpu": str(gpu.index), "uuid": gpu.uuid, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id,
              "driver_version": driver_version}
    labels.update({label: str(int(gpu.values[key])) for key, label in INFO_LABELS.items() if key in gpu.values})
    return labels


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
        fams["info"].add_sample("grayguard_gpu_info", info_labels(gpu, snap.driver_version), 1)
        fams["flags"].add_metric(ids, flags_mask(gpu))
        for key, value in gpu.values.items():
            if key not in INFO_LABELS:
                fams[key].add_metric(ids, value)
        if gpu.clock_event_reasons is not None:
            fams["reasons"].add_metric(ids, gpu.clock_event_reasons)
        for (etype, ctype), n in gpu.ecc.items():
            fams["ecc"].add_metric(ids + [etype, ctype], n)
        if gpu.remapped_rows is not None:
            fams["remapped"].add_metric(ids + ["correctable"], gpu.remapped_rows[0])
            fams["remapped"].add_metric(ids + ["uncorrectable"], gpu.remapped_rows[1])
    for (index, uuid, xid), n in sorted(snap.xid_counts.items()):
        fams["xid"].add_metric([str(index), uuid, str(xid)], n)
    for fam in fams.values():
        if fam.samples:
            yield fam
