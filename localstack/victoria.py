"""VictoriaMetrics in place of Prometheus (tests): victoria-metrics, vmagent, vmalert and vmauth on 127.0.0.1.

The Debian package `victoria-metrics` ships all four. VictoriaStack is LocalStack on them: vmagent scrapes
what Prometheus would (the same scrape config), vmalert evaluates the same rendered rules and notifies the
same Alertmanager, and the controller queries VictoriaMetrics through vmauth with a bearer token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import requests
import yaml

from grayguard.localstack.procs import ManagedProcess, find_binary, free_port, start_process
from grayguard.localstack.services import HOST, Prometheus, _Service
from grayguard.localstack.stack import LocalStack, StackSpec

log = logging.getLogger("grayguard.stack")
BINARIES = ("victoria-metrics", "vmagent", "vmalert", "vmauth")


def check_victoria_binaries() -> None:
    """Fail early, with the install command, when a VictoriaMetrics binary is missing."""
    for b in BINARIES:
        find_binary(b)


class VictoriaMetrics(Prometheus):
    """A single-node VictoriaMetrics: Prometheus' query API (query, wait_for); alerts() and rule_names() work
    when it proxies them to vmalert (-vmalert.proxyURL, as VictoriaStack starts it)."""


class VmAgent(_Service):
    """A running vmagent (scrapes, remote-writes to VictoriaMetrics)."""

    def targets_up(self) -> int:
        """How many scrape targets answered their last scrape."""
        r = requests.get(self.url + "/api/v1/targets", timeout=5)
        r.raise_for_status()
        return sum(t.get("health") == "up" for t in r.json()["data"]["activeTargets"])


class VmAlert(_Service):
    """A running vmalert; its alerts and rules API answers as Prometheus' does."""

    def _data(self, path: str) -> Any:
        r = requests.get(self.url + path, timeout=5)
        r.raise_for_status()
        return r.json()["data"]

    def alerts(self) -> list[dict]:
        """Active (pending and firing) alerts."""
        return self._data("/api/v1/alerts")["alerts"]

    def rule_names(self) -> list[str]:
        """Names of every loaded recording and alert rule."""
        return [r["name"] for g in self._data("/api/v1/rules")["groups"] for r in g["rules"]]

    def rule_errors(self) -> dict[str, str]:
        """Rule name -> the error of its last evaluation, for every rule that failed (MetricsQL rejects it)."""
        return {r["name"]: r["lastError"] for g in self._data("/api/v1/rules")["groups"] for r in g["rules"]
                if r.get("lastError")}


class VmAuth(_Service):
    """A running vmauth: requests with a known bearer token go to its user's url_prefix, others are refused."""


def _workdir(workdir: str | Path | None, name: str) -> tuple[Path, bool]:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return Path(workdir), False
    return Path(tempfile.mkdtemp(prefix=f"grayguard-{name}-")), True


def _start(name: str, args: Sequence[str], wd: Path, port: int | None, timeout_s: float) -> tuple[ManagedProcess, str]:
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    # Every VictoriaMetrics binary answers GET /health with 200 once it serves.
    proc = start_process([name, f"-httpListenAddr={HOST}:{port}", *args], wd / f"{name}.log",
                         ready_url=url + "/health", timeout_s=timeout_s)
    return proc, url


def start_victoria_metrics(*, workdir: str | Path | None = None, port: int | None = None,
                           timeout_s: float = 30.0, extra_args: Sequence[str] = ()) -> VictoriaMetrics:
    """Start single-node VictoriaMetrics on 127.0.0.1.

    A new sample of a known series is queryable within about a second; a series VictoriaMetrics has never
    seen becomes searchable only up to ~10 s after its first sample (its index is refreshed every 10 s).
    """
    wd, owns = _workdir(workdir, "vm")
    args = [f"-storageDataPath={wd / 'data'}", "-retentionPeriod=1d",
            # Queries near now see only samples older than this (default 30 s: they may still be arriving);
            # the controller and vmalert need second-old data, as on Prometheus. 1 s is 1.79's minimum.
            "-search.latencyOffset=1s",
            # The response cache is for dashboards; tests want every query to read the raw data.
            "-search.disableCache", *extra_args]
    proc, url = _start("victoria-metrics", args, wd, port, timeout_s)
    return VictoriaMetrics(proc, url, wd, owns)


def scrape_only(prometheus_config: dict) -> dict:
    """The parts of a Prometheus config vmagent reads (scrape settings and jobs; no rules, no alerting)."""
    glob = {k: v for k, v in prometheus_config.get("global", {}).items()
            if k in ("scrape_interval", "scrape_timeout", "external_labels")}
    return {"global": glob, "scrape_configs": list(prometheus_config.get("scrape_configs", []))}


def start_vmagent(prometheus_config: dict, remote_write_url: str, *, workdir: str | Path | None = None,
                  port: int | None = None, timeout_s: float = 30.0, extra_args: Sequence[str] = ()) -> VmAgent:
    """Start vmagent scraping prometheus_config's jobs and remote-writing to remote_write_url (a VM base URL)."""
    wd, owns = _workdir(workdir, "vmagent")
    (wd / "scrape.yml").write_text(yaml.safe_dump(scrape_only(prometheus_config), sort_keys=False))
    args = [f"-promscrape.config={wd / 'scrape.yml'}", f"-remoteWrite.url={remote_write_url.rstrip('/')}/api/v1/write",
            f"-remoteWrite.tmpDataPath={wd / 'remotewrite'}", "-remoteWrite.flushInterval=500ms", *extra_args]
    proc, url = _start("vmagent", args, wd, port, timeout_s)
    return VmAgent(proc, url, wd, owns)


def start_vmalert(rule_files: Iterable[str | Path], datasource_url: str, notifier_urls: Iterable[str], *,
                  evaluation_interval: str = "1s", workdir: str | Path | None = None, port: int | None = None,
                  timeout_s: float = 30.0, extra_args: Sequence[str] = ()) -> VmAlert:
    """Start vmalert on rule_files: queries and writes recording rules to datasource_url (VictoriaMetrics),
    restores alert state from it, and sends alerts to the Alertmanagers at notifier_urls."""
    wd, owns = _workdir(workdir, "vmalert")
    ds = datasource_url.rstrip("/")
    args = [*(f"-rule={Path(f).resolve()}" for f in rule_files),
            f"-datasource.url={ds}", f"-remoteWrite.url={ds}", f"-remoteRead.url={ds}",
            *(f"-notifier.url={u.rstrip('/')}" for u in notifier_urls),
            # Groups without their own interval (Prometheus' global evaluation_interval).
            f"-evaluationInterval={evaluation_interval}",
            # Recording-rule results reach VictoriaMetrics within a second (the default flush is 5 s).
            "-remoteWrite.flushInterval=500ms", *extra_args]
    port = port or free_port()
    # Alerts link back to vmalert (generatorURL), as Prometheus' link back to Prometheus.
    args.append(f"-external.url=http://{HOST}:{port}")
    proc, url = _start("vmalert", args, wd, port, timeout_s)
    return VmAlert(proc, url, wd, owns)


def start_vmauth(users: Sequence[dict], *, workdir: str | Path | None = None, port: int | None = None,
                 timeout_s: float = 30.0) -> VmAuth:
    """Start vmauth with users (e.g. [{"bearer_token": t, "url_prefix": vm.url}])."""
    wd, owns = _workdir(workdir, "vmauth")
    path = wd / "auth.yml"
    path.write_text(yaml.safe_dump({"users": list(users)}, sort_keys=False))
    path.chmod(0o600)  # it holds the tokens
    proc, url = _start("vmauth", [f"-auth.config={path}"], wd, port, timeout_s)
    return VmAuth(proc, url, wd, owns)


class VictoriaStack(LocalStack):
    """LocalStack with VictoriaMetrics in place of Prometheus.

    vmagent scrapes the jobs LocalStack would give Prometheus, vmalert evaluates the same rendered rules
    and notifies the same Alertmanager, and the controller queries through vmauth with the bearer token
    held by the environment variable token_env (set it before start(); the controller reads it there).
    """

    def __init__(self, spec: StackSpec | None = None, progress=lambda msg: None,
                 token_env: str = "GRAYGUARD_VM_TOKEN"):
        spec = spec or StackSpec()
        prom = {**spec.overrides.get("prometheus", {}), "bearer_token_env": token_env}
        super().__init__(dataclasses.replace(spec, overrides={**spec.overrides, "prometheus": prom}), progress)
        self.token_env = token_env
        self.victoria: VictoriaMetrics | None = None
        self.vmagent: VmAgent | None = None
        self.vmalert: VmAlert | None = None
        self.vmauth: VmAuth | None = None
        self.query_url = ""  # vmauth: what the controller queries

    def _start(self) -> None:
        check_victoria_binaries()
        token = os.environ.get(self.token_env)
        if not token:
            raise RuntimeError(f"set {self.token_env} to the bearer token the controller sends to vmauth")
        want_controller = self.spec.controller
        self.spec = dataclasses.replace(self.spec, controller=False)
        try:
            super()._start()  # fleet, exporters, HAProxy, Alertmanager, pager, rules, Prometheus
        finally:
            self.spec = dataclasses.replace(self.spec, controller=want_controller)
        # LocalStack always starts a Prometheus; keep its scrape config and let VictoriaMetrics take over.
        assert self.prometheus is not None and self.cfg is not None
        prom_cfg = yaml.safe_load((self.prometheus.workdir / "prometheus.yml").read_text())
        self.prometheus.stop()
        self.prometheus = None
        self.progress("starting VictoriaMetrics, vmagent (1 s scrape), vmalert (grayguard rules) and vmauth")
        vmalert_port = free_port()
        self.victoria = start_victoria_metrics(workdir=self.dir / "victoria-metrics",
                                               extra_args=[f"-vmalert.proxyURL=http://{HOST}:{vmalert_port}"])
        self.prometheus = self.victoria  # what LocalStack's users query (alerts and rules too, from vmalert)
        self.vmagent = start_vmagent(prom_cfg, self.victoria.url, workdir=self.dir / "vmagent")
        rules_dir = Path(self.cfg.rules.output_dir)
        self.vmalert = start_vmalert(sorted(rules_dir.glob("*.yml")), self.victoria.url, [self.alertmanager.url],
                                     evaluation_interval=prom_cfg["global"]["evaluation_interval"],
                                     workdir=self.dir / "vmalert", port=vmalert_port)
        self.vmauth = start_vmauth([{"bearer_token": token, "url_prefix": self.victoria.url}],
                                   workdir=self.dir / "vmauth")
        self.query_url = self.vmauth.url
        # The controller queries through vmauth; re-rendered rules are reloaded by vmalert, not by the query URL.
        ov = self.spec.overrides
        self.spec = dataclasses.replace(self.spec, overrides={
            **ov, "rules": {**ov.get("rules", {}), "reload_url": f"{self.vmalert.url}/-/reload"}})
        self.cfg = self._config(self.vmauth.url, self.controller_url.split("://", 1)[1])
        if want_controller:
            self.start_controller()

    def stop(self, keep_workdir: bool = False) -> None:
        """Stop vmauth, vmalert and vmagent, then everything LocalStack started; never raises."""
        self._stop_controller()  # first: it queries through vmauth
        for part in (self.vmauth, self.vmalert, self.vmagent):
            try:
                if part is not None:
                    part.stop()
            except Exception as e:  # keep tearing down the rest
                log.warning("stopping %s: %s", type(part).__name__, e)
        super().stop(keep_workdir)
