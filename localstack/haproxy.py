"""Run a local haproxy (demo, benchmarks, tests): generated config, runtime socket in a directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = "haproxy is not installed: run `make deps` or `sudo apt-get install haproxy`"


def haproxy_config(sock: Path, backends: dict[str, list[tuple[str, str, int]]], balance: str = "leastconn",
                   frontend_port: int | None = None, default_backend: str | None = None) -> str:
    """A minimal config: admin socket, one backend per entry [(server, "host:port", weight)], no checks."""
    lines = ["global", f"  stats socket {sock} level admin", "  maxconn 4096", "defaults", "  mode http",
             "  timeout connect 2s", "  timeout client 120s", "  timeout server 120s", "  option http-keep-alive"]
    if frontend_port is not None:
        lines += ["frontend gateway", f"  bind 127.0.0.1:{frontend_port}",
                  f"  default_backend {default_backend or next(iter(backends))}"]
    for be, servers in backends.items():
        lines += [f"backend {be}", f"  balance {balance}",
                  "  http-response set-header X-Served-By %s"]
        lines += [f"  server {s} {addr} weight {w}" for s, addr, w in servers]
    return "\n".join(lines) + "\n"


class HaproxyProc:
    """haproxy in the foreground (-db) with a config file; start, stop, restart."""

    def __init__(self, workdir: Path, config_text: str | None = None):
        if not shutil.which("haproxy"):
            raise FileNotFoundError(INSTALL_HINT)
        self.dir = Path(workdir)
        self.sock = self.dir / "admin.sock"
        self.cfg = self.dir / "haproxy.cfg"
        if config_text is not None:
            self.cfg.write_text(config_text)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"unix:{self.sock}"

    def start(self, timeout_s: float = 10.0) -> None:
        self.sock.unlink(missing_ok=True)
        check = subprocess.run(["haproxy", "-c", "-q", "-f", str(self.cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected {self.cfg}: {check.stdout}{check.stderr}")
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.cfg)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.sock))
                    s.sendall(b"show info\n")
                    if s.recv(16):
                        return
            except OSError:
                time.sleep(0.02)  # readiness poll, bounded by the deadline
        self.stop()
        raise RuntimeError(f"haproxy did not open its runtime socket within {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
