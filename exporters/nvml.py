"""NVML collector: reads every GPU through an injected pynvml-like module, bounded in time per scrape."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
from prometheus_client.core import Metric

from grayguard.exporters.gpumetrics import GpuReading, NvmlSnapshot, build_families, describe_families
from grayguard.exporters.nvmlfields import Unsupported, readers, text
from grayguard.exporters.xid import XidWatcher

log = logging.getLogger(__name__)


class NvmlCollector:
    """Custom collector for every GPU: `registry.register(NvmlCollector(nvml=pynvml))`.

    A scrape waits at most read_timeout for NVML; a read still running then is not restarted and the
    scrape exports no GPU series (stale data would hide a hung driver) and counts a timeout.
    """

    def __init__(self, nvml: Any = pynvml, *, read_timeout: float = 1.0, xid_events: bool = True,
                 init_retry_s: float = 30.0, clock: Callable[[], float] = time.monotonic, ecc_aggregate: bool = False):
        self._nvml = nvml
        self._readers = readers(ecc_aggregate)  # the lifetime ECC counts only when asked for
        self._read_timeout = read_timeout
        self._xid_events = xid_events
        self._init_retry_s = init_retry_s  # a driver that loads late is picked up without a restart
        self._clock = clock
        self._lock = threading.Lock()  # guards the dicts below; never held across an NVML call
        self._init_lock = threading.Lock()
        self._initialized = False
        self._stopped = False
        self._last_init_try: float | None = None
        self._driver = ""
        self._ident: dict[int, tuple[str, str, str]] = {}  # index -> (uuid, name, bus id)
        self._seen: dict[str, int] = {}  # uuid -> last index, to report a GPU that vanished as lost
        self._errors = {"timeout": 0, "error": 0}
        self._xids: dict[tuple[int, str, int], int] = {}
        self._logged: set[tuple] = set()
        self._job: _Job | None = None
        self.xid_watcher: XidWatcher | None = None

    # --- prometheus_client collector protocol ----------------------------------------------
    def describe(self) -> list[Metric]:
        """Every family this collector may export (no NVML call)."""
        return describe_families()

    def collect(self) -> Iterator[Metric]:
        """Read NVML (bounded by read_timeout) and yield the families."""
        yield from build_families(self.snapshot())

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> bool:
        """Initialize NVML and start the XID thread; False (and NVML up = 0) when NVML is absent."""
        return self._ensure_init(force=True)

    def stop(self) -> None:
        """Stop the XID thread and shut NVML down (later scrapes export NVML up = 0)."""
        self._stopped = True
        if self.xid_watcher is not None:
            self.xid_watcher.stop()
        with self._init_lock:
            if self._initialized:
                self._initialized = False
                try:
                    self._nvml.nvmlShutdown()
                except Exception as e:  # shutting down: nothing left to do about it
                    log.debug("nvmlShutdown: %s", e)

    def record_xid(self, index: int, xid: int) -> None:
        """Count one XID event for GPU index (called from the XID thread)."""
        with self._lock:
            uuid = self._ident.get(index, ("",))[0]
            key = (index, uuid, xid)
            self._xids[key] = self._xids.get(key, 0) + 1

    # --- reading -----------------------------------------------------------------------------
    def snapshot(self) -> NvmlSnapshot:
        """The current snapshot, waiting at most read_timeout for NVML."""
        with self._lock:
            job = self._job
            if job is None or job.done.is_set():
                job = self._job = _Job()
                threading.Thread(target=self._run_job, args=(job,), name="nvml-read", daemon=True).start()
        finished = job.done.wait(self._read_timeout)
        with self._lock:
            if finished:
                snap = job.result
                self._logged.discard(("timeout",))  # warn again if the driver hangs again
            else:
                self._errors["timeout"] += 1
                self._log_once(("timeout",), logging.WARNING, "NVML read still running after %.1f s: "
                               "GPU series left out until it answers", self._read_timeout)
                snap = NvmlSnapshot(up=self._initialized, driver_version=self._driver)
            return dataclasses.replace(snap, xid_counts=dict(self._xids), errors=dict(self._errors))

    def _run_job(self, job: _Job) -> None:
        try:
            job.result = self.read()
        except Exception as e:  # never let a surprise kill the scrape: count it and export NVML down
            with self._lock:
                self._errors["error"] += 1
            job.result = NvmlSnapshot(up=False, driver_version=self._driver)
            self._log_once(("read", type(e).__name__), logging.ERROR, "NVML read failed: %r", e)
        job.done.set()

    def read(self) -> NvmlSnapshot:
        """Read every GPU now (unbounded: the scrape path goes through snapshot())."""
        n = self._nvml
        if not self._ensure_init():
            return NvmlSnapshot(up=False)
        try:
            count = n.nvmlDeviceGetCount()
            self._driver = text(n.nvmlSystemGetDriverVersion())
        except n.NVMLError as e:  # the driver went away under us: report down, re-init later
            self._log_once(("count", type(e).__name__), logging.WARNING, "NVML stopped answering: %s", e)
            self._initialized = False
            return NvmlSnapshot(up=False)
        gpus = [self._read_gpu(i) for i in range(count)]
        present = {g.uuid for g in gpus}
        for uuid, index in sorted(self._seen.items(), key=lambda kv: kv[1]):
            if uuid not in present:  # fell off the bus: NVML no longer lists it
                _, name, bus = self._ident.get(index, (uuid, "", ""))
                gpus.append(GpuReading(index=index, uuid=uuid, name=name, pci_bus_id=bus, lost=True))
        return NvmlSnapshot(up=True, driver_version=self._driver, gpus=tuple(gpus))

    def _read_gpu(self, index: int) -> GpuReading:
        n = self._nvml
        lost = (getattr(n, "NVMLError_GpuIsLost", Unsupported), getattr(n, "NVMLError_ResetRequired", Unsupported))
        absent = (Unsupported, n.NVMLError_NotSupported, n.NVMLError_NoPermission)
        acc: dict[str, Any] = {"values": {}, "ecc": {}, "reasons": None, "remapped": None, "remap_state": None}
        try:
            h = n.nvmlDeviceGetHandleByIndex(index)
            ident = (text(n.nvmlDeviceGetUUID(h)), text(n.nvmlDeviceGetName(h)),
                     text(n.nvmlDeviceGetPciInfo(h).busId))
            with self._lock:
                self._ident[index] = ident
                self._seen[ident[0]] = index
            for field, reader in self._readers:
                try:
                    reader(n, h, acc)
                except lost:
                    raise
                except absent as e:  # absent, not zero: the series is simply not exported
                    self._log_once((index, field), logging.INFO, "GPU %d: %s not exported: %s", index, field, e)
                except Exception as e:
                    with self._lock:
                        self._errors["error"] += 1
                    self._log_once((index, field, type(e).__name__), logging.WARNING,
                                   "GPU %d: reading %s failed: %r", index, field, e)
        except lost as e:
            uuid, name, bus = self._ident.get(index, ("", "", ""))
            self._log_once((index, "lost"), logging.ERROR, "GPU %d (%s) is lost: %s", index, uuid, e)
            return GpuReading(index=index, uuid=uuid, name=name, pci_bus_id=bus, lost=True)
        self._logged.discard((index, "lost"))  # log again if it is lost again later
        return GpuReading(index=index, uuid=ident[0], name=ident[1], pci_bus_id=ident[2],
                          values=acc["values"], clock_event_reasons=acc["reasons"], ecc=acc["ecc"],
                          remapped_rows=acc["remapped"], remap_state=acc["remap_state"])

    def _ensure_init(self, force: bool = False) -> bool:
        # Its own lock, never self._lock: a hanging nvmlInit must not block a scrape.
        with self._init_lock:
            if self._initialized:
                return True
            if self._stopped:
                return False
            now = self._clock()
            if not force and self._last_init_try is not None and now - self._last_init_try < self._init_retry_s:
                return False
            self._last_init_try = now
            try:
                self._nvml.nvmlInit()
            except Exception as e:  # LibraryNotFound (no driver), DriverNotLoaded...: export NVML up = 0
                self._log_once(("init", type(e).__name__), logging.WARNING,
                               "NVML unavailable (%s): GPU series disabled, probes keep running", e)
                return False
            self._initialized = True
            log.info("NVML initialized")
            if self._xid_events and self.xid_watcher is None:
                self.xid_watcher = XidWatcher(self._nvml, self.record_xid)
                self.xid_watcher.start()
            return True

    def _log_once(self, key: tuple, level: int, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)


class _Job:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result = NvmlSnapshot(up=False)
