"""A local Prometheus, Alertmanager and webhook receiver in a temp dir (tests, demo): start, query, stop."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from grayguard.httpserve import Request, Response, serve
from grayguard.localstack.procs import ManagedProcess, find_binary, free_port, start_process, wait_until

HOST = "127.0.0.1"


class _Service:
    """A started binary with a base URL and a work dir that stop() removes (when it created it)."""

    def __init__(self, proc: ManagedProcess, url: str, workdir: Path, owns_workdir: bool):
        self.proc, self.url, self.workdir, self._owns = proc, url, workdir, owns_workdir

    def stop(self) -> None:
        """Stop the process and remove a temporary work dir."""
        self.proc.stop()
        if self._owns:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def get(self, path: str, **params: Any) -> Any:
        """GET url+path, raise on HTTP errors, return the JSON body's data (or the body)."""
        r = requests.get(self.url + path, params=params, timeout=5)
        r.raise_for_status()
        body = r.json()
        return body.get("data", body) if isinstance(body, dict) else body


class Prometheus(_Service):
    """A running Prometheus."""

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result list."""
        return self.get("/api/v1/query", query=expr)["result"]

    def alerts(self) -> list[dict]:
        """Active (pending and firing) alerts."""
        return self.get("/api/v1/alerts")["alerts"]

    def rule_names(self) -> list[str]:
        """Names of every loaded recording and alert rule."""
        return [r["name"] for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]

    def reload(self) -> None:
        """POST /-/reload (needs --web.enable-lifecycle, which start_prometheus sets)."""
        requests.post(self.url + "/-/reload", timeout=10).raise_for_status()

    def wait_for(self, expr: str, predicate: Callable[[list[dict]], Any] = bool, timeout_s: float = 20.0) -> Any:
        """Poll an instant query until predicate(result) is truthy; returns the result."""
        def poll():
            res = self.query(expr)
            return res if predicate(res) else None
        return wait_until(poll, timeout_s, 0.2, f"Prometheus query {expr!r}")


class Alertmanager(_Service):
    """A running Alertmanager."""

    def alerts(self, **filters: str) -> list[dict]:
        """Alerts as the v2 API lists them (status.state: active, suppressed; status.inhibitedBy)."""
        params = {"filter": [f'{k}="{v}"' for k, v in filters.items()]}
        r = requests.get(self.url + "/api/v2/alerts", params=params, timeout=5)
        r.raise_for_status()
        return r.json()


def _workdir(workdir: str | Path | None, prefix: str) -> tuple[Path, bool]:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return Path(workdir), False
    return Path(tempfile.mkdtemp(prefix=prefix)), True


def prometheus_config(scrape_configs: Sequence[dict] = (), *, interval: str = "1s",
                      alertmanager_urls: Iterable[str] = (), evaluation_interval: str | None = None) -> dict:
    """A Prometheus config: global scrape/evaluation interval (evaluation: the scrape's unless given), scrape
    configs, Alertmanager targets."""
    cfg: dict = {"global": {"scrape_interval": interval, "evaluation_interval": evaluation_interval or interval,
                            "scrape_timeout": interval},
                 "scrape_configs": list(scrape_configs)}
    ams = [u.split("://", 1)[-1].rstrip("/") for u in alertmanager_urls]
    if ams:
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": ams}]}]}
    return cfg


def static_job(job: str, targets: Iterable[str], labels: dict[str, str] | None = None,
               interval: str | None = None) -> dict:
    """One scrape config: job name, static targets and target labels (e.g. pool)."""
    sc: dict = {"job_name": job, "static_configs": [{"targets": list(targets), "labels": dict(labels or {})}]}
    if interval:
        sc["scrape_interval"] = sc["scrape_timeout"] = interval
    return sc


def start_prometheus(config: dict, rule_files: Iterable[str | Path] = (), *, workdir: str | Path | None = None,
                     port: int | None = None, timeout_s: float = 30.0,
                     extra_args: Sequence[str] = ()) -> Prometheus:
    """Start Prometheus on 127.0.0.1 with config (rule_files added) and wait until /-/ready."""
    binary = find_binary("prometheus")
    wd, owns = _workdir(workdir, "grayguard-prom-")
    cfg = dict(config)
    cfg["rule_files"] = [str(Path(f).resolve()) for f in rule_files] + list(cfg.get("rule_files", []))
    (wd / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [binary, f"--config.file={wd / 'prometheus.yml'}", f"--storage.tsdb.path={wd / 'data'}",
            f"--web.listen-address={HOST}:{port}", "--web.enable-lifecycle", *extra_args]
    proc = start_process(argv, wd / "prometheus.log", ready_url=url + "/-/ready", timeout_s=timeout_s)
    return Prometheus(proc, url, wd, owns)


def start_alertmanager(config: dict | str, *, workdir: str | Path | None = None, port: int | None = None,
                       timeout_s: float = 30.0) -> Alertmanager:
    """Start Alertmanager (clustering off) on 127.0.0.1 with config and wait until /-/ready."""
    binary = find_binary("alertmanager", "prometheus-alertmanager")
    wd, owns = _workdir(workdir, "grayguard-am-")
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    (wd / "alertmanager.yml").write_text(text)
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [binary, f"--config.file={wd / 'alertmanager.yml'}", f"--storage.path={wd / 'data'}",
            f"--web.listen-address={HOST}:{port}", "--cluster.listen-address="]
    proc = start_process(argv, wd / "alertmanager.log", ready_url=url + "/-/ready", timeout_s=timeout_s)
    return Alertmanager(proc, url, wd, owns)


@dataclass
class Notification:
    """One webhook POST from Alertmanager."""

    path: str
    payload: dict
    received_at: float = field(default_factory=time.time)

    @property
    def alerts(self) -> list[dict]:
        return self.payload.get("alerts", [])


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that records Alertmanager webhook notifications by path."""

    def __init__(self, port: int | None = None):
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        self._server = serve((HOST, port or 0), {"POST /*": self._record}, name="webhook")
        self.port = self._server.port

    def _record(self, req: Request) -> Response:
        try:
            payload = json.loads(req.body or b"{}")
        except ValueError:
            payload = {"raw": req.body.decode(errors="replace")}
        with self._lock:
            self.notifications.append(Notification(req.path, payload))
        return 200, "text/plain; charset=utf-8", b""

    def url(self, path: str = "/") -> str:
        """The URL Alertmanager should POST to for path."""
        return f"http://{HOST}:{self.port}{path}"

    def received(self, path: str | None = None) -> list[Notification]:
        """Notifications so far (for one path, or all)."""
        with self._lock:
            return [n for n in self.notifications if path is None or n.path == path]

    def alerts(self, path: str | None = None, status: str | None = "firing") -> list[dict]:
        """Every alert of every notification (for one path), filtered by status (None: all)."""
        return [a for n in self.received(path) for a in n.alerts if status is None or a.get("status") == status]

    def wait_for(self, predicate: Callable[[WebhookReceiver], Any], timeout_s: float = 20.0,
                 what: str = "a webhook notification") -> Any:
        """Poll predicate(self) until truthy; returns its value."""
        return wait_until(lambda: predicate(self), timeout_s, 0.1, what)

    def stop(self) -> None:
        """Shut the server down and release its port."""
        self._server.stop()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def retarget_alertmanager_config(config: dict, receiver_url: Callable[[str], str], **timers: str) -> dict:
    """A copy of an Alertmanager config whose receivers all become webhooks to receiver_url(name).

    timers (group_wait, group_interval, repeat_interval) replace those of the route and its sub-routes:
    tests and the demo want notifications within seconds. Routing and inhibition stay as they are.
    """
    cfg = json.loads(json.dumps(config))  # deep copy of plain YAML data
    cfg["receivers"] = [{"name": r["name"], "webhook_configs": [{"url": receiver_url(r["name"]),
                                                                  "send_resolved": True}]}
                        for r in cfg.get("receivers", [])]

    def retime(route: dict) -> None:
        for k, v in timers.items():
            if k in route or route is cfg["route"]:
                route[k] = v
        for sub in route.get("routes", []):
            retime(sub)

    retime(cfg["route"])
    return cfg
