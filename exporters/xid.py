"""XID critical-error events: one thread waits on an NVML event set and reports each XID."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _same_handle(a: Any, b: Any) -> bool:
    if a is b or a == b:
        return True
    try:  # pynvml handles are ctypes pointers: equal when they point at the same device struct
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return False


class XidWatcher:
    """Registers every GPU for XID events and calls on_xid(gpu_index, xid) from its own thread."""

    def __init__(self, nvml: Any, on_xid: Callable[[int, int], None], poll_ms: int = 200):
        self._nvml = nvml
        self._on_xid = on_xid
        self._poll_ms = poll_ms  # how often the thread looks at the stop flag
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once registration is done (or has failed)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the event thread (a daemon: a wedged driver call cannot hold the process)."""
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to stop and wait for it (at most timeout seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _register(self) -> tuple[Any, list[tuple[int, Any]]]:
        n = self._nvml
        event_set = n.nvmlEventSetCreate()
        handles = []
        for index in range(n.nvmlDeviceGetCount()):
            try:
                handle = n.nvmlDeviceGetHandleByIndex(index)
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, event_set)
                handles.append((index, handle))
            except n.NVMLError as e:  # NotSupported on some boards, GpuIsLost: that GPU has no XIDs
                log.warning("GPU %d: XID events unavailable: %s", index, e)
        return event_set, handles

    def _index_of(self, device: Any, handles: list[tuple[int, Any]]) -> int:
        for index, handle in handles:
            if _same_handle(device, handle):
                return index
        try:
            return int(self._nvml.nvmlDeviceGetIndex(device))
        except Exception:  # an XID we cannot place is still an XID (reported as gpu "-1")
            return -1

    def _run(self) -> None:
        n = self._nvml
        try:
            event_set, handles = self._register()
        except n.NVMLError as e:
            log.warning("XID events unavailable: %s", e)
            self.ready.set()
            return
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    data = n.nvmlEventSetWait(event_set, self._poll_ms)
                except n.NVMLError_Timeout:
                    continue  # no event in this window
                except n.NVMLError as e:
                    log.warning("waiting for XID events failed: %s", e)
                    if self._stop.wait(self._poll_ms / 1000):
                        break
                    continue
                if data.eventType & n.nvmlEventTypeXidCriticalError:
                    xid = int(data.eventData)
                    index = self._index_of(data.device, handles)
                    log.warning("GPU %d: XID %d", index, xid)
                    self._on_xid(index, xid)
        finally:
            with contextlib.suppress(n.NVMLError):
                n.nvmlEventSetFree(event_set)
