"""A real haproxy process for tests: generated config, runtime socket in a temp dir."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def haproxy_config(sock: Path, backends: dict[str, list[tuple[str, str, int]]], balance: str = "leastconn") -> str:
    """backends: name -> [(server, "host:port", weight)]. No health checks: servers are UP."""
    lines = ["global", f"  stats socket {sock} level admin", "defaults", "  mode http",
             "  timeout connect 1s", "  timeout client 5s", "  timeout server 5s"]
    for be, servers in backends.items():
        lines += [f"backend {be}", f"  balance {balance}"]
        lines += [f"  server {s} {addr} weight {w}" for s, addr, w in servers]
    return "\n".join(lines) + "\n"


class HaproxyProc:
    """Start, stop and restart haproxy in the foreground (-db) with a config."""

    def __init__(self, workdir: Path, config_text: str):
        if not shutil.which("haproxy"):
            pytest.fail("haproxy is not installed: run `make deps` (apt-get install haproxy)")
        self.dir = workdir
        self.sock = workdir / "admin.sock"
        self.cfg = workdir / "haproxy.cfg"
        self.cfg.write_text(config_text)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"unix:{self.sock}"

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.cfg)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.proc.stdout.read().decode()}")  # type: ignore[union-attr]
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.sock))
                    s.sendall(b"show info\n")
                    if s.recv(16):
                        return
            except OSError:
                time.sleep(0.02)  # polling for readiness, bounded by the deadline
        raise RuntimeError("haproxy did not open its runtime socket within 10 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
