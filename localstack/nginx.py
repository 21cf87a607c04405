"""Run a local nginx as the gateway (tests, the demo): a generated config in a temp dir, no root.

NginxProc runs nginx in the foreground (`daemon off`, its master and one worker) with `-p <dir>`: the pid file, the
logs and every temp path are inside the dir. Each pool's servers come from the upstream file grayguard writes
(controller/nginx.py), included inside the pool's `upstream` block. The access log says which server took each
request ($upstream_addr), so a test can count the traffic each node gets through nginx.

NginxStack is the local stack (localstack/stack.py) with nginx as the controller's gateway: the load goes through
nginx and the controller writes its upstream file. The base stack's HAProxy still runs, idle: nothing is sent
through it and the controller does not steer it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from grayguard.localstack.procs import ManagedProcess, find_binary, free_port, http_ok
from grayguard.localstack.stack import BACKEND, POOL, LocalStack

READY_PATH = "/nginx-ready"  # answered by nginx itself: it is up and serving
# one line per request: when it ended, how long it took, the server(s) that took it, the status
ACCESS_FORMAT = "$msec $request_time $upstream_addr $status"


def nginx_config(workdir: Path, port: int, upstreams: dict[str, Path], balance: str = "",
                 client_keepalive: bool = False) -> str:
    """The main config: the pid file, logs and temp paths in workdir; one upstream per entry including its
    file; a frontend on 127.0.0.1:port proxying to the first upstream. balance: "" (round robin) or "least_conn".

    Without client_keepalive nginx closes each client connection after its response: at a reload the old workers
    close their idle keep-alive connections, and a client that sent a request on one that moment loses it (measured
    in docs/gateways.md). Prompts up to 128 KB stay in memory (larger ones go to the temp folder)."""
    d = workdir
    temp = "".join(f"  {k}_temp_path {d / 'temp' / k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    ups = "".join(f"  upstream {name} {{\n" + (f"    {balance};\n" if balance else "")
                  + f"    include {path};\n  }}\n" for name, path in upstreams.items())
    first = next(iter(upstreams))
    return (f"daemon off;\nmaster_process on;\nworker_processes 1;\npid {d / 'nginx.pid'};\n"
            f"error_log {d / 'error.log'} notice;\nevents {{\n  worker_connections 1024;\n}}\n"
            f"http {{\n  log_format grayguard '{ACCESS_FORMAT}';\n  access_log {d / 'access.log'} grayguard;\n"
            f"{temp}  client_body_buffer_size 128k;\n"
            + ("" if client_keepalive else "  keepalive_timeout 0;\n")
            + f"{ups}"
            f"  server {{\n    listen 127.0.0.1:{port};\n"
            f"    location = {READY_PATH} {{\n      return 200 \"ok\\n\";\n    }}\n"
            f"    location / {{\n      proxy_pass http://{first};\n      proxy_http_version 1.1;\n"
            "      proxy_set_header Connection \"\";\n      proxy_buffering off;\n      proxy_read_timeout 120s;\n"
            "      add_header X-Served-By $upstream_addr;\n    }\n  }\n}\n")


class NginxProc:
    """nginx in the foreground with its config in workdir; start, reload, stop. Output in workdir/nginx.out."""

    def __init__(self, workdir: Path, port: int | None = None, backends: tuple[str, ...] = (BACKEND,),
                 balance: str = "", client_keepalive: bool = False):
        self.binary = find_binary("nginx")  # BinaryMissing (a FileNotFoundError) with the apt-get hint
        self.dir = Path(workdir)
        self.port = port or free_port()
        self.conf = self.dir / "nginx.conf"
        self.upstream_dir = self.dir / "upstreams"
        self.access_log = self.dir / "access.log"
        self.upstreams = {b: self.upstream_dir / f"{b}.conf" for b in backends}
        self.balance = balance
        self.client_keepalive = client_keepalive
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gateway_doc(self) -> dict:
        """The controller config's `gateway` section for this nginx."""
        return {"kind": "nginx", "nginx": {"upstream_dir": str(self.upstream_dir), "conf": str(self.conf),
                                           "binary": self.binary, "prefix": str(self.dir)}}

    def start(self, timeout_s: float = 10.0) -> None:
        """Write the main config, start nginx and wait until it answers. The upstream files must exist
        (NginxGateway.prepare writes them)."""
        for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.dir / "temp" / k).mkdir(parents=True, exist_ok=True)
            (self.dir / "temp" / k).chmod(0o777)  # run as root, nginx's workers are nobody: they write here
        self.conf.write_text(nginx_config(self.dir, self.port, self.upstreams, self.balance, self.client_keepalive))
        self.proc = ManagedProcess([self.binary, "-e", "stderr", "-p", str(self.dir), "-c", str(self.conf)],
                                   self.dir / "nginx.out")
        self.proc.wait_for(lambda: http_ok(self.url + READY_PATH), timeout_s, f"nginx at {self.url}")

    def master_pid(self) -> int | None:
        """The master's pid from its pid file (None before it wrote one)."""
        try:
            return int((self.dir / "nginx.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def served(self) -> list[tuple[float, str]]:
        """(when it started, upstream address) of every request nginx proxied and finished so far, from its access
        log (wall-clock time, as nginx stamps it)."""
        out = []
        try:
            lines = self.access_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        for ln in lines:
            parts = ln.split(" ", 2)
            if len(parts) == 3 and not parts[2].startswith("-"):
                addr = parts[2].rsplit(" ", 1)[0].split(",")[-1].strip()  # a retried request: the last server
                out.append((float(parts[0]) - float(parts[1]), addr))
        return out

    def stop(self) -> None:
        """Stop nginx (SIGTERM: a fast shutdown, then SIGKILL); idempotent."""
        if self.proc is not None:
            self.proc.stop()
        self.proc = None


class NginxStack(LocalStack):
    """The local stack with nginx as the controller's gateway (its `gateway.kind: nginx`), the load through it."""

    def __init__(self, spec=None, progress=lambda msg: None, balance: str = "", client_keepalive: bool = False):
        super().__init__(spec, progress)
        self.nginx = NginxProc(self.dir / "nginx", balance=balance, client_keepalive=client_keepalive)
        self._start_controller_after = self.spec.controller

    def _start(self) -> None:
        from grayguard.controller.nginx import NginxGateway

        self.spec = dataclasses.replace(self.spec, controller=False)  # started below, once nginx runs
        super()._start()
        assert self.cfg is not None
        self.progress("starting nginx (the controller's gateway; the load goes through it)")
        NginxGateway(self.cfg.gateway.nginx, self.cfg.pools).prepare()
        self.nginx.start()
        self.gateway_url = self.nginx.url
        self.gateway_urls = [self.nginx.url]
        self.spec = dataclasses.replace(self.spec, controller=self._start_controller_after)
        if self._start_controller_after:
            self.start_controller()

    def _config(self, prom_url: str, listen: str):
        from grayguard.config import parse_config

        super()._config(prom_url, listen)
        doc = self._cfg_doc
        doc["gateway"] = self.nginx.gateway_doc()
        doc["pools"] = [{**p, "servers": {n.name: {"address": n.address} for n in self.nodes}}
                        if p["name"] == POOL else p for p in doc["pools"]]
        return parse_config(doc)

    def start_controller(self) -> None:
        """The controller with gateway nginx: in this process, or the `grayguard controller` child process."""
        if self.spec.controller_process:
            super().start_controller()
            return
        import threading

        from grayguard.controller.canary import make_canary
        from grayguard.controller.cmd_controller import make_rerender, run_loop, startup_checks
        from grayguard.controller.gateway import build_gateways
        from grayguard.controller.httpserver import serve
        from grayguard.controller.loop import Controller
        from grayguard.controller.metrics import ControllerMetrics
        from grayguard.promclient import PrometheusClient

        assert self.cfg is not None
        self.progress("starting the controller (gateway nginx)")
        cfg = self.cfg
        self.controller = Controller(cfg, PrometheusClient(cfg.prometheus), build_gateways(cfg),
                                     canary=make_canary(cfg.recovery), metrics=ControllerMetrics.create(),
                                     recorder=self._recorder())
        for problem in startup_checks(self.controller):
            self.progress(f"controller start-up check: {problem}")
        self._http = serve(cfg.listen_address, self.controller.metrics.registry, self.controller.status)
        self._ctl_thread = threading.Thread(
            target=run_loop, args=(self.controller, cfg.tick_interval_s, self._ctl_stop),
            kwargs={"rerender": make_rerender(cfg)}, name="controller", daemon=True)
        self._ctl_thread.start()

    def nginx_weights(self) -> dict[str, tuple[int, bool]]:
        """node -> (grayguard weight, drained) as the pool's upstream file has them."""
        from grayguard.controller.nginxfile import parse_file
        path = self.nginx.upstreams[BACKEND]
        return {n: (s.weight, s.drain) for n, s in parse_file(path.read_text(), str(path)).items()}

    def haproxy_weights(self, i: int = 0) -> dict[str, tuple[int, bool]]:
        """The weights of the gateway the controller steers (nginx's file), where the demo's sampler and watcher
        read the base stack's HAProxy."""
        return self.nginx_weights()

    def stop(self, keep_workdir: bool = False) -> None:
        """The controller first (it would reload a stopped nginx), then nginx, then the rest; never raises."""
        try:
            self._stop_controller()
            self.nginx.stop()
        except Exception as e:  # keep tearing down the rest
            self.progress(f"stopping the controller and nginx: {e}")
        super().stop(keep_workdir)
