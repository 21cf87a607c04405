"""What to read from one GPU through NVML: one reader per field, with fallbacks for older drivers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MHZ = 1_000_000
_VALUE_ATTR = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class Unsupported(Exception):
    """Neither the current NVML call nor its older fallback exists, or the field reports NotSupported."""


def text(value: Any) -> str:
    """NVML strings: str from nvidia-ml-py, bytes from older versions and raw structs."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _call(n: Any, names: tuple[str, ...], *args: Any) -> Any:
    """Call the first of names the library has; FunctionNotFound (an older driver) moves to the next."""
    for name in names:
        fn = getattr(n, name, None)
        if fn is None:
            continue
        try:
            return fn(*args)
        except n.NVMLError_FunctionNotFound:
            continue
    raise Unsupported(f"none of {', '.join(names)}")


def _memory_temperature(n: Any, h: Any) -> float:
    # No temperature sensor enum for HBM: NVML exposes it as a field value (as dcgm-exporter reads it).
    (fv,) = n.nvmlDeviceGetFieldValues(h, [getattr(n, "NVML_FI_DEV_MEMORY_TEMP", 82)])
    if fv.nvmlReturn in (15, 16):  # GPU_IS_LOST, RESET_REQUIRED
        raise n.NVMLError_GpuIsLost()
    if fv.nvmlReturn != 0:
        raise Unsupported(f"field value returned {fv.nvmlReturn}")
    return float(getattr(fv.value, _VALUE_ATTR.get(fv.valueType, "uiVal")))


def _values(**readers: Callable[[Any, Any], float]) -> list[tuple[str, Callable]]:
    def make(key, fn):
        def read(n, h, acc):
            acc["values"][key] = float(fn(n, h))
        return read
    return [(key, make(key, fn)) for key, fn in readers.items()]


def _reasons(n, h, acc):
    names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    acc["reasons"] = int(_call(n, names, h))


def _memory(n, h, acc):
    mem = n.nvmlDeviceGetMemoryInfo(h)
    acc["values"].update(memory_used=float(mem.used), memory_total=float(mem.total))


def _remapped(n, h, acc):
    corr, unc, pending, failure = n.nvmlDeviceGetRemappedRows(h)
    acc["remapped"] = (int(corr), int(unc))
    acc["remap_state"] = (bool(pending), bool(failure))


def _ecc(etype: str, ctype: str):
    def read(n, h, acc):
        et = n.NVML_MEMORY_ERROR_TYPE_CORRECTED if etype == "corrected" else n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        ct = n.NVML_VOLATILE_ECC if ctype == "volatile" else n.NVML_AGGREGATE_ECC
        acc["ecc"][(etype, ctype)] = int(n.nvmlDeviceGetTotalEccErrors(h, et, ct))
    return (f"ecc_{etype}_{ctype}", read)


# (field name for logs, reader(nvml, handle, accumulator)), in exposition order: every field there is; readers()
# picks those a collector reads.
READERS: list[tuple[str, Callable]] = [
    *_values(
        sm_clock=lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM) * MHZ,
        sm_clock_max=lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM) * MHZ,
        mem_clock=lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM) * MHZ,
        mem_clock_max=lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM) * MHZ,
        temperature=lambda n, h: _call(n, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                                       h, n.NVML_TEMPERATURE_GPU),
        memory_temperature=_memory_temperature,
        power=lambda n, h: n.nvmlDeviceGetPowerUsage(h) / 1000,
        power_limit=lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
        energy=lambda n, h: n.nvmlDeviceGetTotalEnergyConsumption(h) / 1000,
        pcie_gen=lambda n, h: n.nvmlDeviceGetCurrPcieLinkGeneration(h),
        pcie_gen_max=lambda n, h: n.nvmlDeviceGetMaxPcieLinkGeneration(h),
        pcie_width=lambda n, h: n.nvmlDeviceGetCurrPcieLinkWidth(h),
        pcie_width_max=lambda n, h: n.nvmlDeviceGetMaxPcieLinkWidth(h),
        pcie_replay=lambda n, h: n.nvmlDeviceGetPcieReplayCounter(h),
        utilization=lambda n, h: n.nvmlDeviceGetUtilizationRates(h).gpu / 100,
    ),
    ("memory", _memory),
    ("clock_event_reasons", _reasons),
    *[_ecc(t, c) for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate")],
    ("remapped_rows", _remapped),
]
AGGREGATE_ECC = frozenset(f"ecc_{t}_aggregate" for t in ("corrected", "uncorrected"))


def readers(ecc_aggregate: bool = False) -> list[tuple[str, Callable]]:
    """The fields to read: every one, less the lifetime (aggregate) ECC counts unless asked for
    (--collector.ecc-aggregate: remapped rows are the memory's health record on Ampere and later)."""
    return [(name, read) for name, read in READERS if ecc_aggregate or name not in AGGREGATE_ECC]
