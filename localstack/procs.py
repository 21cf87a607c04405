"""Run local helper binaries (prometheus, alertmanager, haproxy, promtool): start, wait until ready, always stop.

Used by the tests, the demo and `grayguard rules check`; nothing here knows about grayguard's rules.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from grayguard.binaries import DEBIAN_PACKAGES, BinaryMissing, find_binary, install_hint  # noqa: F401  (re-exported)

T = TypeVar("T")


class WaitAborted(Exception):
    """Raised by a wait_until predicate to stop waiting at once (the thing waited for cannot happen)."""


class ProcessExited(WaitAborted, RuntimeError):
    """The process died before it became ready."""


LISTEN_PORTS_FROM = 20000  # free_port picks below the kernel's ephemeral range, from here up


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (and to bind port 0); Linux's default when unreadable."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free a moment ago, for a server started soon after.

    Picked at random below the ephemeral range: a port the kernel chose (bind to port 0) comes from the same range
    as every outgoing connection's local port, and on a busy machine one of those took it before the server bound
    it (seen in CI: etcd's "bind: address already in use"). Falls back to the kernel's pick when that range is
    too small or nothing in it is free.

    A port is free only until its server binds it, which can be a minute later (the local stack's controller binds
    after the fleet is up): so a process never hands out one port twice, and each pytest-xdist worker picks from its
    own share of the range (seen in CI: the controller's port, picked at the stack's start, was taken by the time it
    bound it, "Address already in use").
    """
    lo = ephemeral_range()[0]
    first, last = _share(LISTEN_PORTS_FROM, lo)
    for _ in range(64 if lo - LISTEN_PORTS_FROM >= 1000 else 0):
        port = random.randrange(first, last)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.add(port)
    return port


_HANDED_OUT: set[int] = set()  # the ports free_port gave this process: never twice


def _share(first: int, end: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [first, end) (PYTEST_XDIST_WORKER gwK of PYTEST_XDIST_WORKER_COUNT): two
    workers of one run never pick the same port. Outside xdist, or a share under 500 ports: the whole range."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return first, end
    k, n = int(worker[2:]) % int(count), int(count)
    size = (end - first) // n
    return (first + k * size, first + (k + 1) * size) if size >= 500 else (first, end)


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.1,
               what: str = "condition") -> T:
    """Poll predicate until it returns a truthy value (returned); TimeoutError after timeout_s.

    A predicate that raises counts as "not yet", except WaitAborted, which ends the wait at once.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except WaitAborted:
            raise
        except Exception as e:  # a poll that raises counts as "not yet"; the last error is reported
            last_exc = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
        time.sleep(interval_s)


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when GET url answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False


_RUNNING: set[ManagedProcess] = set()


class ManagedProcess:
    """A child process with its output in a log file; stop() is idempotent and runs at exit too."""

    def __init__(self, argv: Sequence[str], log_path: str | os.PathLike[str], *,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None):
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # Own session: a Ctrl-C to the parent does not race our orderly stop.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        _RUNNING.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, url: str, timeout_s: float = 30.0) -> None:
        """Block until GET url answers 2xx; stop the process and raise if it exits or times out."""
        self.wait_for(lambda: http_ok(url), timeout_s, f"{Path(self.argv[0]).name} at {url}")

    def wait_for(self, ready: Callable[[], object], timeout_s: float = 30.0, what: str = "readiness",
                 interval_s: float = 0.05) -> None:
        """Block until ready() is truthy; stop the process and raise ProcessExited or TimeoutError if it
        exits first or never gets ready."""
        def poll() -> object:
            if not self.running():
                raise ProcessExited(f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            return ready()
        try:
            wait_until(poll, timeout_s, interval_s, what)
        except ProcessExited:
            self.stop()
            raise
        except TimeoutError as e:
            self.stop()
            raise TimeoutError(f"{e}\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        _RUNNING.discard(self)
        return self.proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_process(argv: Sequence[str], log_path: str | os.PathLike[str], *, ready_url: str | None = None,
                  timeout_s: float = 30.0, env: dict[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None) -> ManagedProcess:
    """Start argv (argv[0] looked up on PATH) and, with ready_url, wait until it answers 2xx."""
    argv = [find_binary(argv[0]), *argv[1:]]
    p = ManagedProcess(argv, log_path, env=env, cwd=cwd)
    if ready_url:
        p.wait_ready(ready_url, timeout_s)
    return p


@atexit.register
def _stop_all() -> None:
    for p in list(_RUNNING):
        p.stop(timeout_s=2.0)
