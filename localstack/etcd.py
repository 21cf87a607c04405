"""Run a local single-member etcd (tests, demo): 127.0.0.1 only, free ports, a data dir in workdir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.error
import urllib.request
from pathlib import Path

from localstack.procs import ManagedProcess, find_binary, free_port, start_process


def etcd_healthy(url: str, timeout_s: float = 1.0) -> bool:
    """True when etcd at url says {"health": "true"} (it has a leader and answers)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return json.loads(resp.read()).get("health") == "true"
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return False


class EtcdProc:
    """etcd (Debian's etcd-server) with its data in workdir/data; start, stop, kill, restart on the same ports.

    Supervised by localstack.procs: output in workdir/etcd.log, stopped at interpreter exit too.
    `restart()` keeps the data dir (leases and keys survive); `restart(wipe=True)` starts empty.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, name: str = "grayguard", client_port: int = 0,
                 peer_port: int = 0):
        self.binary = find_binary("etcd")  # BinaryMissing (a FileNotFoundError) with the apt-get hint
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "data"
        self.log = self.dir / "etcd.log"
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """The client URL (the v3 JSON gateway is under it: /v3/...)."""
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]

    def start(self, timeout_s: float = 30.0) -> EtcdProc:
        """Start etcd and wait until /health says true."""
        # etcd reads ETCD_* variables as flags, and refuses to start when one repeats a flag given here
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.proc = start_process(self.argv(), self.log, env=env)
        self.proc.wait_for(lambda: etcd_healthy(self.url), timeout_s, f"etcd at {self.url}", interval_s=0.05)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def stop(self) -> None:
        """SIGTERM (then SIGKILL after 5 s); idempotent."""
        if self.proc is not None:
            self.proc.stop()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no clean shutdown (what a crash or an OOM kill does)."""
        if self.proc is not None and self.proc.running():
            self.proc.proc.send_signal(signal.SIGKILL)
            self.proc.proc.wait(10)
        self.stop()

    def wipe(self) -> None:
        """Remove the data dir (stopped first): the next start is a new, empty etcd."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self, *, wipe: bool = False, timeout_s: float = 30.0) -> EtcdProc:
        """Stop and start again on the same ports, with the same data dir unless wipe."""
        self.stop()
        if wipe:
            self.wipe()
        return self.start(timeout_s)

    def __enter__(self) -> EtcdProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
