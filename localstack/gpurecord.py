"""Record a real GPU's NVML answers and the exporter's page on it, as test fixtures.

Run on a machine with an NVIDIA GPU (the project's tests run without one: NVML is the one part they mock):

    python -m grayguard.localstack.gpurecord --out DIR [--load-seconds 40]

It runs the exporter's own NVML collector (exporters/nvml.py) on the real `pynvml`, through a recorder that keeps
every NVML call the collector makes (function, arguments with device handles written as their index, the answer or
the NVML error raised), and scrapes it in three phases: idle, under a matrix-multiplication load (PyTorch, bf16, on
every GPU; skipped without torch), and after. It writes:

- nvml_calls.json: the calls in order, each with its phase; constants the collector read; the driver and
  nvidia-ml-py versions. tests/exporters/test_nvml_recorded.py replays it (`replay_module`) through the same
  collector and checks that the pages come out as recorded, and what a real GPU says idle and busy.
- page_idle.prom, page_load.prom, page_after.prom: the exporter's GPU families, the last scrape of each phase.
- nvidia_smi_q.txt: `nvidia-smi -q` under load, for reference.

The card's settings are read, never changed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

log = logging.getLogger("gpurecord")

# The load: a bf16 matrix product on each GPU, repeated for `seconds` (a second process: NVML is read beside it).
LOAD = """
import sys, time, torch
seconds = float(sys.argv[1])
xs = []
for d in range(torch.cuda.device_count()):
    a = torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16)
    xs.append((a, torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16)))
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    for a, b in xs:
        a @ b
    n += 1
    if n % 50 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print(f"load: {n} rounds of {len(xs)} products in {seconds:.0f} s", flush=True)
"""


def plain(value: Any) -> Any:
    """An NVML answer as JSON: ctypes structures and unions as dicts of their fields, bytes as text."""
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return {"__struct__": {name: plain(getattr(value, name)) for name, *_ in value._fields_}}
    if isinstance(value, SimpleNamespace):  # the test fake's structures
        return {"__struct__": {name: plain(v) for name, v in vars(value).items()}}
    if isinstance(value, ctypes.Array):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def unplain(value: Any) -> Any:
    """The inverse for replay: structures as attribute namespaces, lists as they were (tuples where unpacked)."""
    if isinstance(value, dict) and "__struct__" in value:
        return SimpleNamespace(**{k: unplain(v) for k, v in value["__struct__"].items()})
    if isinstance(value, list):
        return tuple(unplain(v) for v in value)
    return value


class Recorder:
    """A pynvml stand-in that forwards to the real module and keeps each call: the collector sees the real GPU."""

    def __init__(self, real: Any):
        self._real = real
        self._lock = threading.Lock()
        self._handles: dict[int, int] = {}  # id of a handle's pointer value -> device index
        self.calls: list[dict] = []
        self.constants: dict[str, Any] = {}
        self.phase = "start"

    def _arg(self, a: Any) -> Any:
        key = _handle_key(a)
        if key is not None and key in self._handles:
            return {"handle": self._handles[key]}
        if key is not None:
            return {"opaque": type(a).__name__}  # an event set: one per process
        return plain(a)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if isinstance(attr, type):  # the NVMLError classes: the collector catches them by class
            return attr
        if not callable(attr):
            with self._lock:
                self.constants[name] = plain(attr)
            return attr
        if not name.startswith("nvml"):
            return attr

        def call(*args: Any) -> Any:
            rec = {"fn": name, "args": [self._arg(a) for a in args], "phase": self.phase}
            try:
                out = attr(*args)
            except self._real.NVMLError as e:
                rec["error"] = type(e).__name__
                rec["code"] = getattr(e, "value", None)
                with self._lock:
                    self.calls.append(rec)
                raise
            if name == "nvmlDeviceGetHandleByIndex":
                with self._lock:
                    self._handles[_handle_key(out)] = int(args[0])
                rec["result"] = {"handle": int(args[0])}
            elif name == "nvmlEventSetCreate":
                rec["result"] = {"opaque": "event_set"}
            else:
                rec["result"] = plain(out)
            with self._lock:
                self.calls.append(rec)
            return out
        return call


def _handle_key(a: Any) -> int | None:
    """A device handle's or event set's identity (a ctypes pointer's address; any other object that is no plain
    value, as the test fake's handles), None for a plain argument."""
    if isinstance(a, (ctypes._Pointer, ctypes.c_void_p)):
        return ctypes.cast(a, ctypes.c_void_p).value
    if isinstance(a, (int, float, str, bytes, bool, list, tuple, dict)) or a is None:
        return None
    return id(a)


def replay_module(recording: dict, phase: str | None = None) -> SimpleNamespace:
    """A pynvml-like module answering from a recording: each (function, arguments) gives its recorded answers in
    order (the last one repeats), from `phase` on when given. The NVML error classes are the test fake's, matched by
    name, so the collector's except clauses see what the real one raised."""
    from grayguard.exporters import fakenvml

    queues: dict[str, list] = {}
    started = phase is None
    for rec in recording["calls"]:
        started = started or rec["phase"] == phase
        if started or rec["fn"] in ("nvmlInit", "nvmlInit_v2"):
            queues.setdefault(_key(rec["fn"], rec["args"]), []).append(rec)
    errors = {c.__name__: c for c in fakenvml.ERRORS}
    mod = SimpleNamespace(**recording["constants"], **errors)

    def make(fn: str):
        def call(*args: Any) -> Any:
            q = queues.get(_key(fn, [a if isinstance(a, dict) else plain(a) for a in args]))
            if not q:
                raise errors["NVMLError_FunctionNotFound"](f"{fn} was not recorded")
            rec = q.pop(0) if len(q) > 1 else q[0]
            if "error" in rec:
                raise errors.get(rec["error"], errors["NVMLError_Unknown"])()
            res = rec["result"]
            return res if isinstance(res, dict) and ("handle" in res or "opaque" in res) else unplain(res)
        return call

    for fn in {rec["fn"] for rec in recording["calls"]}:
        setattr(mod, fn, make(fn))
    return mod


def _key(fn: str, args: list) -> str:
    return json.dumps([fn, args], sort_keys=True)


def page(collector: Any) -> str:
    """The exporter's GPU families as one scrape shows them."""
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(collector)
    return generate_latest(reg).decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.localstack.gpurecord", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the fixtures (created)")
    ap.add_argument("--load-seconds", type=float, default=40.0, help="how long the matrix-product load runs")
    ap.add_argument("--scrape-interval", type=float, default=2.0, help="seconds between scrapes in each phase")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import pynvml

    from grayguard.exporters.nvml import NvmlCollector

    a.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(pynvml)
    col = NvmlCollector(nvml=rec, read_timeout=5.0, xid_events=True)
    if not col.start():
        log.error("NVML did not initialize: no GPU here")
        return 1
    pages: dict[str, str] = {}

    def scrape(phase: str, n: int) -> None:
        rec.phase = phase
        for _ in range(n):
            pages[phase] = page(col)
            time.sleep(a.scrape_interval)
        log.info("%s: %d scrapes", phase, n)

    scrape("idle", 3)
    load = None
    if _has_torch():
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(a.load_seconds)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        time.sleep(min(15.0, a.load_seconds / 2))  # clocks and power settle before the phase is recorded
        rec.phase = "load"
        deadline = time.monotonic() + a.load_seconds / 2 - 5
        n = 0
        while time.monotonic() < deadline:
            pages["load"] = page(col)
            n += 1
            time.sleep(a.scrape_interval)
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=60)
            (a.out / "nvidia_smi_q.txt").write_text(q.stdout + q.stderr)
        log.info("load: %d scrapes; %s", n, load.communicate(timeout=a.load_seconds + 120)[0].strip())
    else:
        log.warning("no torch: no load phase")
    time.sleep(5)
    scrape("after", 3)
    col.stop()
    for phase, text in pages.items():
        (a.out / f"page_{phase}.prom").write_text(text)
    meta = {"nvidia_ml_py": _version("nvidia-ml-py"), "recorded": time.strftime("%Y-%m-%d"),
            "note": os.environ.get("GPURECORD_NOTE", "")}
    (a.out / "nvml_calls.json").write_text(json.dumps({"meta": meta, "constants": rec.constants,
                                                      "calls": rec.calls}, indent=None, sort_keys=True))
    log.info("wrote %d calls, pages %s to %s", len(rec.calls), sorted(pages), a.out)
    return 0


def _has_torch() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
