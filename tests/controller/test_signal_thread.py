"""SIGTERM stops the controller whichever of its threads the kernel delivers it to.

A process-directed signal goes to any thread that does not block it. Python runs the handler (stop.set()) in the
main thread only; a main thread blocked in Event.wait() with no timeout is not woken by a signal that hit a worker
thread, so the controller kept ticking, and leading, until a second signal (a fresh-clone CI run caught it: a
standby took 20 s to resign after SIGTERM). grayguard/terminate.py's wait() polls."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def tgkill(pid: int, tid: int, sig: int) -> None:
    """Send sig to one thread of another process (no Python wrapper for tgkill(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL[platform.machine()], pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def config(tmp_path: Path) -> Path:
    f = tmp_path / "grayguard.yaml"
    f.write_text(yaml.safe_dump({
        "prometheus": {"url": "http://127.0.0.1:9", "timeout_s": 0.5},
        "haproxy": {"endpoints": [f"unix:{tmp_path}/no-haproxy.sock"], "timeout_s": 0.5},
        "pools": [{"name": "chat", "backend": "vllm_chat"}], "tick_interval_s": 0.5,
        "rules": {"rerender_interval_s": 0}, "state_file": str(tmp_path / "state.json")}))
    return f


@pytest.mark.skipif(platform.machine() not in SYS_TGKILL or not Path("/proc/self/task").is_dir(),
                    reason="tgkill(2) and /proc are Linux's")
def test_sigterm_delivered_to_a_worker_thread_stops_the_controller(tmp_path):
    log = tmp_path / "controller.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "grayguard.cli", "controller", "--config.file",
                                 str(config(tmp_path)), "--no-http"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "controller running" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        workers = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert workers, "the controller runs its ticks on a thread of their own"
        tgkill(proc.pid, workers[0], signal.SIGTERM)
        try:
            rc = proc.wait(20)  # a stop asked for is seen within half a second; a tick in flight finishes first
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM delivered to a worker thread did not stop the controller within 20 s:\n"
                        + log.read_text()[-2000:])
        assert rc == 0 and "controller stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
