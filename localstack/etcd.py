"""Run a local single-member etcd (tests, demo): 127.0.0.1 only, free ports, a data dir in workdir; optionally
over TLS with client certificates (EtcdTls.generate makes a CA and the certificates with the openssl binary)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grayguard.localstack.procs import ManagedProcess, find_binary, free_port, start_process


def etcd_healthy(url: str, timeout_s: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """True when etcd at url says {"health": "true"} (it has a leader and answers); context: TLS, for https."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s, context=context) as resp:
            return json.loads(resp.read()).get("health") == "true"
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return False


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([find_binary("openssl"), *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class EtcdTls:
    """PEM files for an etcd served over TLS: its CA, its server certificate (for IP 127.0.0.1) and a client
    certificate and key signed by the same CA; client_cert_auth: etcd refuses a client without one."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str
    client_key_file: str
    client_cert_auth: bool = True

    @classmethod
    def generate(cls, directory: str | os.PathLike[str], *, ca_name: str = "grayguard-test-ca",
                 client_cert_auth: bool = True) -> EtcdTls:
        """A new CA in directory and the certificates it signs (the client's has no Common Name: etcd's gateway
        refuses one that has, once auth is on). Call it twice, in two directories, for a CA etcd does not trust."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days",
                 "2", "-subj", f"/CN={ca_name}", cwd=d)
        for name, subject, ext in (
                ("server", "/CN=etcd-test", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
                ("client", "/O=grayguard", "extendedKeyUsage=clientAuth")):
            (d / f"{name}.ext").write_text(ext + "\n")
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                     "-subj", subject, cwd=d)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
        return cls(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"),
                   str(d / "client.key"), client_cert_auth)

    def client_context(self) -> ssl.SSLContext:
        """A client TLS context that trusts the CA and presents the client certificate."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.client_cert_file, self.client_key_file)
        return ctx

    def args(self) -> list[str]:
        """etcd's flags for its client URLs."""
        return ["--cert-file", self.cert_file, "--key-file", self.key_file, "--trusted-ca-file", self.ca_file,
                *(["--client-cert-auth"] if self.client_cert_auth else [])]


class EtcdProc:
    """etcd (Debian's etcd-server) with its data in workdir/data; start, stop, kill, restart on the same ports.

    Supervised by localstack.procs: output in workdir/etcd.log, stopped at interpreter exit too.
    `restart()` keeps the data dir (leases and keys survive); `restart(wipe=True)` starts empty.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, name: str = "grayguard", client_port: int = 0,
                 peer_port: int = 0, tls: EtcdTls | None = None, extra_args: Sequence[str] = ()):
        self.binary = find_binary("etcd")  # BinaryMissing (a FileNotFoundError) with the apt-get hint
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "data"
        self.log = self.dir / "etcd.log"
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.tls, self.extra_args = tls, list(extra_args)  # tls: clients over https; extra_args: more etcd flags
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """The client URL (the v3 JSON gateway is under it: /v3/...)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
                *(self.tls.args() if self.tls else []), *self.extra_args]

    def start(self, timeout_s: float = 30.0) -> EtcdProc:
        """Start etcd and wait until /health says true."""
        # etcd reads ETCD_* variables as flags, and refuses to start when one repeats a flag given here
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.proc = start_process(self.argv(), self.log, env=env)
        context = self.tls.client_context() if self.tls else None
        self.proc.wait_for(lambda: etcd_healthy(self.url, context=context), timeout_s, f"etcd at {self.url}",
                           interval_s=0.05)
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
