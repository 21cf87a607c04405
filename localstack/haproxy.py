"""Run a local haproxy (demo, benchmarks, tests): generated config, runtime socket in a directory."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from grayguard.localstack.procs import ManagedProcess, find_binary, start_process
from grayguard.reflexes import Reflexes, backend_lines, global_lines, stream_lines

UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, its last one the terminating NUL


def haproxy_config(sock: Path, backends: dict[str, list[tuple]], balance: str = "leastconn",
                   frontend_port: int | None = None, default_backend: str | None = None,
                   reflexes: Reflexes | None = None) -> str:
    """A minimal config: admin socket, one backend per entry [(server, "host:port", weight[, agent port])].

    Without reflexes: no checks, no retries, but streams still go through unheld (stream_lines). With them
    (grayguard/reflexes.py, as haproxy/haproxy.example.cfg): retries with redispatch and a retry budget, observe
    layer7 error-limit, health checks, request buffering.
    """
    lines = ["global", f"  stats socket {sock} level admin", "  maxconn 4096"]
    if reflexes is not None:
        lines += [f"  {ln}" for ln in global_lines(reflexes)]
    lines += ["defaults", "  mode http", "  timeout connect 2s", "  timeout client 120s", "  timeout server 120s",
              "  option http-keep-alive"]
    if frontend_port is not None:
        lines += ["frontend gateway", f"  bind 127.0.0.1:{frontend_port}",
                  f"  default_backend {default_backend or next(iter(backends))}"]
    for be, servers in backends.items():
        lines += [f"backend {be}", f"  balance {balance}",
                  "  http-response set-header X-Served-By %s"]
        lines += [f"  {ln}" for ln in (backend_lines(reflexes) if reflexes is not None else stream_lines())]
        lines += [f"  server {srv[0]} {srv[1]} weight {srv[2]}" + (f" agent-port {srv[3]}" if len(srv) > 3 else "")
                  for srv in servers]
    return "\n".join(lines) + "\n"


class HaproxyProc:
    """haproxy in the foreground (-db) with a config file in workdir; start, stop, restart.

    Supervised by localstack.procs: output in workdir/haproxy.log, stopped at interpreter exit too.
    """

    def __init__(self, workdir: Path, config_text: str | None = None):
        self.binary = find_binary("haproxy")  # BinaryMissing (a FileNotFoundError) with the apt-get hint
        self.dir = Path(workdir)
        self.sock = self.dir / "admin.sock"
        self.cfg = self.dir / "haproxy.cfg"
        self.log = self.dir / "haproxy.log"
        if config_text is not None:
            self.cfg.write_text(config_text)
        self.proc: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        """The runtime API address, as controller.haproxy.RuntimeClient takes it."""
        return f"unix:{self.sock}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Check the config, start haproxy and wait until its runtime socket answers."""
        self.sock.unlink(missing_ok=True)
        if len(os.fsencode(self.sock)) > UNIX_PATH_MAX:  # haproxy -c says nothing useful about it
            raise RuntimeError(f"the runtime socket path {self.sock} is {len(os.fsencode(self.sock))} bytes, beyond "
                               f"the {UNIX_PATH_MAX} a unix socket takes: use a shorter working directory (TMPDIR)")
        check = subprocess.run([self.binary, "-c", "-f", str(self.cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected {self.cfg}: {(check.stdout + check.stderr).strip()}")
        self.proc = start_process([self.binary, "-db", "-f", str(self.cfg)], self.log)
        self.proc.wait_for(self._answers, timeout_s, f"haproxy's runtime socket {self.sock}", interval_s=0.02)

    def _answers(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1.0)
            s.connect(str(self.sock))
            s.sendall(b"show info\n")
            return bool(s.recv(16))

    def stop(self) -> None:
        """Stop haproxy (SIGTERM, then SIGKILL); idempotent."""
        if self.proc is not None:
            self.proc.stop()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again: the runtime state (weights, drains) is lost, as in production."""
        self.stop()
        self.start()
