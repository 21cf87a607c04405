"""A fake `pynvml` module for tests and the simulator, driven by mutable FakeGpu dataclasses."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

GIB = 1024**3


class NVMLError(Exception):
    """Base of every fake NVML error; `value` is the NVML return code, as in pynvml."""

    value = 999

    def __str__(self) -> str:
        return f"{type(self).__name__} (NVML return code {self.value})"


def _error(name: str, code: int) -> type[NVMLError]:
    return type(f"NVMLError_{name}", (NVMLError,), {"value": code})


NVMLError_Uninitialized = _error("Uninitialized", 1)
NVMLError_NotSupported = _error("NotSupported", 3)
NVMLError_NoPermission = _error("NoPermission", 4)
NVMLError_DriverNotLoaded = _error("DriverNotLoaded", 9)
NVMLError_Timeout = _error("Timeout", 10)
NVMLError_LibraryNotFound = _error("LibraryNotFound", 12)
NVMLError_FunctionNotFound = _error("FunctionNotFound", 13)
NVMLError_GpuIsLost = _error("GpuIsLost", 15)
NVMLError_ResetRequired = _error("ResetRequired", 16)
NVMLError_Unknown = _error("Unknown", 999)

ERRORS = (NVMLError, NVMLError_Uninitialized, NVMLError_NotSupported, NVMLError_NoPermission,
          NVMLError_DriverNotLoaded, NVMLError_Timeout, NVMLError_LibraryNotFound,
          NVMLError_FunctionNotFound, NVMLError_GpuIsLost, NVMLError_ResetRequired, NVMLError_Unknown)

# Constants with pynvml's values (nvidia-ml-py 13.x).
CONSTANTS = dict(
    NVML_SUCCESS=0, NVML_ERROR_NOT_SUPPORTED=3, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
    NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
    NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1, NVML_FI_DEV_MEMORY_TEMP=82, NVML_VALUE_TYPE_UNSIGNED_INT=1,
    nvmlEventTypeXidCriticalError=0x8,
    nvmlClocksEventReasonGpuIdle=0x1, nvmlClocksEventReasonApplicationsClocksSetting=0x2,
    nvmlClocksEventReasonSwPowerCap=0x4, nvmlClocksEventReasonHwSlowdown=0x8,
    nvmlClocksEventReasonSyncBoost=0x10, nvmlClocksEventReasonSwThermalSlowdown=0x20,
    nvmlClocksEventReasonHwThermalSlowdown=0x40, nvmlClocksEventReasonHwPowerBrakeSlowdown=0x80,
    nvmlClocksEventReasonDisplayClockSetting=0x100,
)
_ECC_TYPE = {0: "corrected", 1: "uncorrected"}
_ECC_COUNTER = {0: "volatile", 1: "aggregate"}
# Bus ids of the eight GPUs of an HGX H100 board, for realistic-looking fixtures.
_HGX_BUS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


@dataclass
class FakeGpu:
    """One fake GPU; change any field at run time (the next NVML call sees it)."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:18:00.0"
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    mem_clock_mhz: int = 2619
    mem_clock_max_mhz: int = 2619
    clock_event_reasons: int = 0
    temperature_c: int = 46
    memory_temperature_c: int = 55
    power_mw: int = 512_000
    power_limit_mw: int = 700_000
    energy_mj: int = 123_456_789_000
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    pcie_replay: int = 0
    ecc: dict = field(default_factory=lambda: {(t, c): 0 for t in ("corrected", "uncorrected")
                                               for c in ("volatile", "aggregate")})
    remapped_rows: tuple = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    utilization_pct: int = 87
    memory_used_bytes: int = 74 * GIB
    memory_total_bytes: int = 85_520_809_984
    lost: bool = False
    reset_required: bool = False
    unsupported: set = field(default_factory=set)  # field names whose call raises NotSupported
    no_permission: set = field(default_factory=set)  # field names whose call raises NoPermission
    _event_sets: list = field(default_factory=list, repr=False, compare=False)

    def push_xid(self, xid: int) -> None:
        """Deliver an XID critical-error event to every event set registered for this GPU."""
        for es, handle in list(self._event_sets):
            es.put(SimpleNamespace(device=handle, eventType=0x8, eventData=int(xid),
                                   gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))


def healthy_h100(index: int = 0, **overrides) -> FakeGpu:
    """A busy, healthy H100 SXM (Gen5 x16, full clocks); deterministic uuid and bus id per index."""
    bus = _HGX_BUS[index] if index < len(_HGX_BUS) else f"{0xE0 + index:02X}"
    gpu = FakeGpu(uuid=f"GPU-{index:08x}-1111-2222-3333-{index:012x}", pci_bus_id=f"00000000:{bus}:00.0")
    for key, value in overrides.items():
        setattr(gpu, key, value)
    return gpu


@dataclass(eq=False)
class _Handle:
    index: int


class _EventSet(queue.Queue):
    pass


class FakeNvml:
    """Module-like stand-in for pynvml: `NvmlCollector(nvml=FakeNvml([healthy_h100()]))`.

    available=False: nvmlInit raises LibraryNotFound (a machine without a driver).
    old_driver=True: the newer calls (clock event reasons, TemperatureV) raise FunctionNotFound.
    hang: set it to a threading.Event and every device call blocks until that event is set
    (a hung driver; bounded at 30 s so a forgotten event cannot wedge a test run).
    """

    def __init__(self, gpus: list[FakeGpu] | None = None, available: bool = True,
                 driver_version: str = "550.54.15", old_driver: bool = False):
        for err in ERRORS:
            setattr(self, err.__name__, err)
        for name, value in CONSTANTS.items():
            setattr(self, name, value)
        self.gpus = list(gpus if gpus is not None else [healthy_h100()])
        self.available = available
        self.driver_version = driver_version
        self.old_driver = old_driver
        self.hang: threading.Event | None = None
        self.initialized = False
        self.calls = 0  # device calls made, for tests that check nothing is called
        self._handles: dict[int, _Handle] = {}

    # --- library -----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.available:
            raise NVMLError_LibraryNotFound()
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)
        return self._handles.setdefault(index, _Handle(index))

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        return handle.index

    # --- device queries ----------------------------------------------------------------------
    def nvmlDeviceGetName(self, h):
        return self._gpu(h, "name").name

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h, "uuid").uuid

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._gpu(h, "pci_bus_id").pci_bus_id)

    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._gpu(h, "sm_clock_mhz").sm_clock_mhz if clock == 1 else self._gpu(h, "mem_clock_mhz").mem_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        if clock == 1:
            return self._gpu(h, "sm_clock_max_mhz").sm_clock_max_mhz
        return self._gpu(h, "mem_clock_max_mhz").mem_clock_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if self.old_driver:
            raise NVMLError_FunctionNotFound()
        return self._gpu(h, "clock_event_reasons").clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._gpu(h, "clock_event_reasons").clock_event_reasons

    def nvmlDeviceGetTemperatureV(self, h, sensor, version=None):
        if self.old_driver:
            raise NVMLError_FunctionNotFound()
        return self._gpu(h, "temperature_c").temperature_c

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._gpu(h, "temperature_c").temperature_c

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        gpu = self._gpu(h, None)
        out = []
        for fid in field_ids:
            ok = fid == 82 and "memory_temperature_c" not in gpu.unsupported | gpu.no_permission
            out.append(SimpleNamespace(fieldId=fid, scopeId=0, timestamp=0, latencyUsec=0, valueType=1,
                                       nvmlReturn=0 if ok else 3,
                                       value=SimpleNamespace(uiVal=gpu.memory_temperature_c if ok else 0)))
        return out

    def nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h, "power_mw").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h, "power_limit_mw").power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._gpu(h, "energy_mj").energy_mj

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._gpu(h, "pcie_gen").pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._gpu(h, "pcie_gen_max").pcie_gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._gpu(h, "pcie_width").pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._gpu(h, "pcie_width_max").pcie_width_max

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._gpu(h, "pcie_replay").pcie_replay

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        return self._gpu(h, "ecc").ecc[(_ECC_TYPE[error_type], _ECC_COUNTER[counter_type])]

    def nvmlDeviceGetRemappedRows(self, h):
        return tuple(self._gpu(h, "remapped_rows").remapped_rows)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._gpu(h, "utilization_pct").utilization_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        gpu = self._gpu(h, "memory_used_bytes")
        return SimpleNamespace(total=gpu.memory_total_bytes, used=gpu.memory_used_bytes,
                               free=gpu.memory_total_bytes - gpu.memory_used_bytes)

    # --- events ------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        self._check_init()
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set) -> None:
        gpu = self._gpu(h, "xid")
        if event_types & 0x8:
            gpu._event_sets.append((event_set, h))

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int):
        try:
            return event_set.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError_Timeout() from None

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        for gpu in self.gpus:
            gpu._event_sets[:] = [(es, h) for es, h in gpu._event_sets if es is not event_set]

    def push_xid(self, index: int, xid: int) -> None:
        """Deliver an XID event for GPU `index` (same as `gpus[index].push_xid(xid)`)."""
        self.gpus[index].push_xid(xid)

    # --- internals ---------------------------------------------------------------------------
    def _check_init(self) -> None:
        if not self.initialized:
            raise NVMLError_Uninitialized()

    def _gpu(self, handle: _Handle, field_name: str | None) -> FakeGpu:
        self._check_init()
        self.calls += 1
        hang = self.hang
        if hang is not None:
            hang.wait(30)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        if gpu.reset_required:
            raise NVMLError_ResetRequired()
        if field_name in gpu.unsupported:
            raise NVMLError_NotSupported()
        if field_name in gpu.no_permission:
            raise NVMLError_NoPermission()
        return gpu
