"""NGINX as the gateway: one rendered upstream file per pool, checked by `nginx -t`, then a graceful reload.

NGINX OSS has no runtime API. Each pool's servers live in <upstream_dir>/<backend>.conf, which the NGINX config
includes inside `upstream <backend> { ... }` (docs/gateways.md). The file is the gateway's state as far as the
controller can know it: each tick reads it back (weights, which servers are down) and the loop plans against it as
against HAProxy's `show servers state`; apply renders the whole file from what it read plus the changes (the
desired state, not deltas). An unchanged file is not written and NGINX not reloaded. A new file is put in place
atomically, checked with `nginx -t`, then NGINX reloads (`nginx -s reload`: its master starts new workers on the new
config and the old ones finish their requests); a rejected check or a failed reload puts the old file back and
raises a classified GatewayError. A batch that only adds traffic (a slow-start ramp's next step) waits until
gateway.nginx.min_reload_interval_s after the pool's last reload, answered "deferred"; cuts and drains never wait.

Weights: grayguard's weight (0..256, a server's full weight from pools[].servers.<name>.weight, default 100) is
NGINX's `weight=`, which must be >= 1: a drained server, or one at weight 0, is `down`. Each line keeps grayguard's
own weight and drain flag in a comment, so that reading the file back gives what was written. NGINX OSS has no slow
start: the controller's slow-start weights ramp a returning node. It has no per-server state to read either: every
server reads as up (op_state 2), with no check status, error-limit counter or agent (docs/gateways.md). The file's
format and what one change may do to it are pure, in controller/nginxfile.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from grayguard.config import NginxConfig, PoolConfig
from grayguard.controller.haproxy import ADMF_FDRAIN, Command, CommandResult, ServerState
from grayguard.controller.nginxfile import (
    OP_RUNNING,
    NginxError,
    Server,
    configured,
    full_weight,
    only_adds,
    parse_file,
    refusal,
    render_file,
)


class NginxGateway:
    """The pools' upstream files and the NGINX that includes them; the loop's gateway seam (controller/gateway.py).

    run: the subprocess runner (a seam: tests of the file logic pass a fake NGINX); clock: monotonic seconds."""

    def __init__(self, cfg: NginxConfig, pools: Sequence[PoolConfig], run=subprocess.run, clock=time.monotonic):
        self.cfg = cfg
        self.pools = {p.backend: p for p in pools}
        self.endpoint = f"nginx:{cfg.conf}"
        self.run = run
        self.clock = clock
        self.reloads = 0  # reloads that succeeded (tests, /status of a later version)
        self._reloaded_at: dict[str, float] = {}  # backend -> when its file last went in with a reload

    def path(self, backend: str) -> Path:
        return Path(self.cfg.upstream_dir) / f"{backend}.conf"

    # ---- read ------------------------------------------------------------------------------------
    def read(self, backend: str) -> dict[str, Server]:
        """The backend's upstream file as written; NginxError when it is missing, unreadable or not grayguard's."""
        p = self.path(backend)
        try:
            text = p.read_text()
        except FileNotFoundError as e:
            raise NginxError("no_file", f"{p} is missing (written at start-up; deleted since?)") from e
        except (OSError, UnicodeDecodeError) as e:
            raise NginxError("io", f"cannot read {p}: {e}") from e
        return parse_file(text, str(p))

    def show_servers_state(self, backend: str | None = None) -> list[ServerState]:
        """The configured servers of one backend (or every pool's) as the upstream files have them."""
        if backend is not None and backend not in self.pools:
            raise NginxError("no_such_backend", f"no pool has backend {backend!r} (pools[].backend)")
        return self.show_backends_state([backend] if backend is not None else list(self.pools))

    def show_backends_state(self, backends: Sequence[str]) -> list[ServerState]:
        """The configured servers of these backends. A configured server the file does not have (or has at another
        address) gets no traffic through NGINX: it reads as drained at weight 0, and comes in through canaries."""
        out = []
        for b in backends:
            pool = self.pools.get(b)
            if pool is None:
                continue
            out += [ServerState(backend=b, name=n, address=s.address, weight=s.weight,
                                initial_weight=full_weight(pool, n), admin_state=ADMF_FDRAIN if s.drain else 0,
                                op_state=OP_RUNNING) for n, s in self.current(pool).items()]
        return out

    def current(self, pool: PoolConfig) -> dict[str, Server]:
        """The pool's configured servers as its file has them; one the file lacks, or has at another address, at
        weight 0, drained (it gets no traffic through NGINX). A server the file has and the config not is left out."""
        written = self.read(pool.backend)
        out = {}
        for n, want in configured(pool).items():
            got = written.get(n)
            out[n] = got if got is not None and got.address == want.address else replace(want, weight=0, drain=True)
        return out

    # ---- write -----------------------------------------------------------------------------------
    def apply(self, commands: list[Command]) -> list[CommandResult]:
        """Apply the changes backend by backend onto what each file has: one write and one reload per backend
        whose file changes, none when the changes leave it as it is."""
        results: dict[int, CommandResult] = {}
        for backend in dict.fromkeys(c.backend for c in commands):
            mine = [(i, c) for i, c in enumerate(commands) if c.backend == backend]
            results.update(self._apply_backend(backend, mine))
        return [results[i] for i in range(len(commands))]

    def _apply_backend(self, backend: str, commands: list[tuple[int, Command]]) -> dict[int, CommandResult]:
        pool = self.pools.get(backend)
        if pool is None:
            return {i: CommandResult(c, False, f"no pool has backend {backend!r}", "no_such_server")
                    for i, c in commands}
        servers = self.current(pool)  # a server no longer configured leaves the file at this write
        before = dict(servers)
        out = {}
        for i, c in commands:
            why = refusal(c, servers)
            if why:
                out[i] = CommandResult(c, False, why[1], why[0])
                continue
            s = servers[c.server]
            if c.kind == "weight":
                servers[c.server] = replace(s, weight=c.value)
            else:
                servers[c.server] = replace(s, drain=c.value == "drain")
            out[i] = CommandResult(c, True, "")
        wait = self._reloaded_at.get(backend, -math.inf) + self.cfg.min_reload_interval_s - self.clock()
        if wait > 0 and only_adds(before, servers):  # a ramp's next step: at the next tick past the interval
            return {i: r if not r.ok else CommandResult(r.command, False, f"deferred {wait:.1f}s (gateway.nginx."
                                                        "min_reload_interval_s)", "deferred") for i, r in out.items()}
        if self.write(pool, servers.values()):
            self._reloaded_at[backend] = self.clock()
        return out

    def write(self, pool: PoolConfig, servers: Iterable[Server]) -> bool:
        """Put the pool's file in place, check it, reload NGINX; False when the file already says so (nothing done).
        NginxError (the old file back in place) when NGINX rejects it or does not reload."""
        path = self.path(pool.backend)
        text = render_file(pool.name, pool.backend, servers)
        try:
            old = path.read_text()
        except FileNotFoundError:
            old = None
        except (OSError, UnicodeDecodeError) as e:
            raise NginxError("io", f"cannot read {path}: {e}") from e
        if old == text:
            return False
        _replace(path, text)
        try:
            self._nginx("check_failed", "-t", "-q")
            self._nginx("reload_failed", "-s", "reload")
        except NginxError:
            if old is None:
                path.unlink(missing_ok=True)
            else:
                _replace(path, old)
            raise
        self.reloads += 1
        return True

    def prepare(self) -> list[str]:
        """Write the file of every pool that has none (each server at its full weight), without a reload: NGINX cannot
        start without the files it includes. The paths written."""
        written = []
        for pool in self.pools.values():
            path = self.path(pool.backend)
            if not path.exists():
                _replace(path, render_file(pool.name, pool.backend, configured(pool).values()))
                written.append(str(path))
        return written

    def check(self) -> list[str]:
        """Problems worth saying at start-up: `nginx -t` fails, or the config does not include a pool's file."""
        try:
            dump = self._nginx("check_failed", "-T", "-q")
        except NginxError as e:
            return [str(e)]
        return [f"{self.cfg.conf} does not include {self.path(p.backend)} (inside `upstream {p.backend} {{ ... }}`): "
                f"pool {p.name}'s weights would change nothing" for p in self.pools.values()
                if f"# configuration file {self.path(p.backend)}:" not in dump]

    def _nginx(self, kind: str, *args: str) -> str:
        """Run the NGINX binary on the configured config (its error log to stderr); its output, or NginxError."""
        argv = [self.cfg.binary, "-e", "stderr", "-c", self.cfg.conf]
        argv += ["-p", self.cfg.prefix] if self.cfg.prefix else []
        try:
            done = self.run([*argv, *args], capture_output=True, text=True, timeout=self.cfg.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise NginxError("timeout", f"`nginx {' '.join(args)}` did not finish within "
                             f"{self.cfg.timeout_s:g}s") from e
        except OSError as e:
            raise NginxError("io", f"cannot run {self.cfg.binary}: {e}") from e
        if done.returncode != 0:
            said = (done.stderr or done.stdout or "").strip()
            raise NginxError(kind, f"`nginx {' '.join(args)}` failed ({done.returncode}): {said[-300:]}")
        return done.stdout or ""


def _replace(path: Path, text: str) -> None:
    """Write text to path atomically: a temp file in the same folder, flushed, then renamed over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise NginxError("io", f"cannot write {path}: {e}") from e
