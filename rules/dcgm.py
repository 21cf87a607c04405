"""dcgm-exporter's series as grayguard's GPU evidence (rules.gpu_source: dcgm; docs/dcgm.md): the field table the
dcgm recording group is rendered from (rules/templates/dcgm.rules.yml.j2). Pure data and PromQL text.

Names are dcgm-exporter's own: a series is named after the DCGM field its counters CSV lists, so a field that DCGM
renamed is read under every name it has had (newest first), e.g. DCGM_FI_DEV_CLOCK_THROTTLE_REASONS (DCGM < 3.3)
and DCGM_FI_DEV_CLOCKS_EVENT_REASONS, DCGM_FI_DEV_XID_ERRORS and DCGM_FI_DEV_XID_ERROR (DCGM 4.6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grayguard.vocab import CLOCK_EVENT_REASONS, GPU_FLAG_BITS, GPU_SLOWDOWN_REASONS

GROUP = "grayguard-gpu-dcgm"
# the per-GPU join: one series a GPU of a grayguard node, labelled with the node's labels, gpu, uuid, UUID, the pod
POD_MAP = "gpu:dcgm_gpu_pod:info"
# the XIDs new within rules.human_window, per GPU; the value is the XID's code (dcgm-exporter's field is a gauge of
# the last XID, not a counter: config.DCGM_SIGNALS reads it)
XID_NEW = "grayguard_gpu_xid_recent"
# the series that names a GPU's pod (in dcgm-exporter's default counters) and the sidecar's series that names its own
JOIN_FIELD = "DCGM_FI_DEV_GPU_UTIL"
POD_INFO = "grayguard_node_pod_info"

THROTTLE = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
XID = ("DCGM_FI_DEV_XID_ERROR", "DCGM_FI_DEV_XID_ERRORS")
# the fields grayguard_gpu_flags is recorded from (with THROTTLE and JOIN_FIELD); DCGM has no "GPU is lost" field, so
# the lost bit is never set in dcgm mode
FLAGS = "grayguard_gpu_flags"
FLAG_FIELDS = {"row_remap_pending": "DCGM_FI_DEV_ROW_REMAP_PENDING",
               "row_remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
               "pcie_generation": "DCGM_FI_DEV_PCIE_LINK_GEN", "pcie_max_generation": "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
               "pcie_width": "DCGM_FI_DEV_PCIE_LINK_WIDTH", "pcie_max_width": "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"}


@dataclass(frozen=True)
class Field:
    """One grayguard_gpu_* series recorded from a dcgm-exporter field: its names, a unit scale, fixed labels."""

    record: str
    names: tuple[str, ...]
    scale: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)


FIELDS = (
    Field("grayguard_gpu_utilization_ratio", (JOIN_FIELD,), 0.01),  # percent
    Field("grayguard_gpu_pcie_link_generation", ("DCGM_FI_DEV_PCIE_LINK_GEN",)),
    Field("grayguard_gpu_pcie_link_width", ("DCGM_FI_DEV_PCIE_LINK_WIDTH",)),
    # DBE (double-bit) is NVML's uncorrected, SBE its corrected; VOL since the driver loaded, AGG the GPU's lifetime
    Field("grayguard_gpu_ecc_errors", ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",),
          labels={"error_type": "uncorrected", "counter_type": "volatile"}),
    Field("grayguard_gpu_ecc_errors", ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",),
          labels={"error_type": "corrected", "counter_type": "volatile"}),
    Field("grayguard_gpu_ecc_errors", ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",),
          labels={"error_type": "uncorrected", "counter_type": "aggregate"}),
    Field("grayguard_gpu_ecc_errors", ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",),
          labels={"error_type": "corrected", "counter_type": "aggregate"}),
    Field("grayguard_gpu_remapped_rows", ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",), labels={"cause": "correctable"}),
    Field("grayguard_gpu_remapped_rows", ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",),
          labels={"cause": "uncorrectable"}),
    # NVML's clock-event reasons bitmask, as the exporter serves it (DCGM passes NVML's bits through)
    Field("grayguard_gpu_clock_event_reasons", THROTTLE),
    # for the GPU dashboard: DCGM 4.6 renamed the temperature and power fields
    Field("grayguard_gpu_temperature_celsius", ("DCGM_FI_DEV_GPU_TEMP_CELSIUS", "DCGM_FI_DEV_GPU_TEMP")),
    Field("grayguard_gpu_memory_temperature_celsius", ("DCGM_FI_DEV_MEMORY_TEMP",)),
    Field("grayguard_gpu_power_watts", ("DCGM_FI_DEV_BOARD_POWER_WATTS", "DCGM_FI_DEV_POWER_USAGE")),
    Field("grayguard_gpu_power_limit_watts", ("DCGM_FI_DEV_POWER_MGMT_LIMIT",)),
    Field("grayguard_gpu_sm_clock_hertz", ("DCGM_FI_DEV_SM_CLOCK",), 1e6),  # MHz
    Field("grayguard_gpu_memory_clock_hertz", ("DCGM_FI_DEV_MEM_CLOCK",), 1e6),
    Field("grayguard_gpu_memory_used_bytes", ("DCGM_FI_DEV_FB_USED",), 1048576.0),  # MiB
    Field("grayguard_gpu_energy_joules_total", ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",), 0.001),  # mJ
    Field("grayguard_gpu_pcie_replay_total", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",)),
)


def selector(names: tuple[str, ...], matchers: str = "") -> str:
    """A selector for a field under any of its names, e.g. {__name__=~"A|B", exported_pod=""}."""
    if len(names) == 1:
        return f"{names[0]}{{{matchers}}}" if matchers else names[0]
    return f'{{__name__=~"{"|".join(names)}"{", " + matchers if matchers else ""}}}'


def field_names() -> set[str]:
    """Every dcgm-exporter series name the dcgm rules read."""
    return {n for f in FIELDS for n in f.names} | set(THROTTLE) | set(XID) | {JOIN_FIELD} | set(FLAG_FIELDS.values())


def slowdown_bits() -> tuple[tuple[str, int], ...]:
    """(reason, bit) of the slowdown reasons (grayguard/vocab.py), the bits that set grayguard_gpu_flags'
    slowed_under_load."""
    return tuple((reason, bit) for reason, bit in CLOCK_EVENT_REASONS if reason in GPU_SLOWDOWN_REASONS)


def context() -> dict:
    """What the dcgm template needs beyond rules/render.py's context."""
    return {"dcgm_fields": FIELDS, "dcgm_sel": selector, "throttle": THROTTLE,
            "xid": XID, "join_field": JOIN_FIELD, "pod_map": POD_MAP, "xid_new": XID_NEW, "pod_info": POD_INFO,
            "dcgm_group": GROUP, "flags": FLAGS, "flag_fields": FLAG_FIELDS, "flag_bits": GPU_FLAG_BITS}
