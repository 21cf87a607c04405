"""The whole system on one machine: simulated fleet, exporters, HAProxy, Prometheus, Alertmanager, pager, controller.

Used by `grayguard demo` and the end-to-end tests. Everything binds 127.0.0.1 on free ports, lives in
one temp dir, and stop() tears it all down (also after a failed start).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.haproxy import RuntimeClient
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from grayguard.config import Config, parse_config
from grayguard.promclient import PrometheusClient
from localstack.haproxy import HaproxyProc, haproxy_config
from localstack.procs import find_binary, free_port

log = logging.getLogger("grayguard.stack")
POOL, BACKEND = "chat", "vllm_chat"

# The demo compresses time: production `for:` durations (minutes) would outlast a 150 s run.
DEMO_ALERT_FOR = {
    "GrayguardNodeDegraded": "5s", "GrayguardNodeQuarantined": "3s", "GrayguardSafeguardEngaged": "5s",
    "GrayguardProbeFailing": "5s", "GrayguardProbeCudaError": "3s", "GrayguardGpuThrottled": "10s",
    "GrayguardGpuPcieLinkDegraded": "10s", "GrayguardGpuXidError": "0s", "GrayguardKvCacheSaturated": "30s",
}


@dataclass
class StackSpec:
    """What to bring up."""

    nodes: int = 8
    seed: int = 1
    controller: bool = True
    tick_s: float = 1.0
    control_window: str = "10s"
    probe_interval_s: float = 0.5  # demo time: a sick node is seen within a second or two
    speed_classes: Any = None
    balance: str = "roundrobin"  # HAProxy's default algorithm; leastconn already shies away from slow nodes
    overrides: dict = field(default_factory=dict)  # merged into the controller config document


def check_binaries() -> None:
    """Fail early, with the install command, when a binary the stack needs is missing."""
    for names in (("haproxy",), ("prometheus",), ("alertmanager", "prometheus-alertmanager")):
        find_binary(*names)


def alertmanager_config(webhook_url_page: str, webhook_url_ticket: str) -> dict:
    """Pages and tickets to two webhook paths; a pool's safeguard page inhibits its per-node quarantine pages."""
    return {
        "route": {"receiver": "ticket", "group_by": ["pool", "alertname"], "group_wait": "1s",
                  "group_interval": "2s", "repeat_interval": "1h",
                  "routes": [{"receiver": "page", "matchers": ['severity="page"']}]},
        "receivers": [{"name": "page", "webhook_configs": [{"url": webhook_url_page, "send_resolved": True}]},
                      {"name": "ticket", "webhook_configs": [{"url": webhook_url_ticket, "send_resolved": True}]}],
        "inhibit_rules": [{"source_matchers": ['alertname="GrayguardSafeguardEngaged"'],
                           "target_matchers": ['alertname="GrayguardNodeQuarantined"'], "equal": ["pool"]}],
    }


class LocalStack:
    """Start with start(); stop() always cleans up. Attributes are set as each part comes up."""

    def __init__(self, spec: StackSpec | None = None, progress=lambda msg: None):
        self.spec = spec or StackSpec()
        self.progress = progress
        self.dir = Path(tempfile.mkdtemp(prefix="grayguard-stack-"))
        self.fleet = None
        self.nodes: list = []
        self.gpus: dict[str, Any] = {}
        self._gpu_base: dict[str, dict] = {}
        self.exporters: dict[str, Any] = {}
        self.haproxy: HaproxyProc | None = None
        self.gateway_url = ""
        self.webhook = None
        self.alertmanager = None
        self.prometheus = None
        self.cfg: Config | None = None
        self.controller: Controller | None = None
        self.controller_url = ""
        self._ctl_stop = threading.Event()
        self._ctl_thread: threading.Thread | None = None
        self._http = None

    # ---- bring-up ------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from exporters.fakenvml import FakeNvml, healthy_h100
        from exporters.prober import ProbeConfig
        from exporters.server import Exporter
        from localstack.services import (
            WebhookReceiver,
            prometheus_config,
            start_alertmanager,
            start_prometheus,
            static_job,
        )
        from rules.render import render_all
        from sim.fleet import FleetThread

        check_binaries()
        s = self.spec
        self.progress(f"starting {s.nodes} simulated vLLM nodes")
        self.fleet = FleetThread(n=s.nodes, seed=s.seed, speed_classes=s.speed_classes,
                                 on_fault_change=self._on_fault)
        self.nodes = self.fleet.start()
        self.progress("starting one exporter per node (fake NVML, 1-token probes)")
        for i, n in enumerate(self.nodes):
            gpu = healthy_h100(i)
            self.gpus[n.name] = gpu
            self._gpu_base[n.name] = dict(vars(gpu))
            ex = Exporter(n.url, port=0, nvml=FakeNvml([gpu]),
                          probe=ProbeConfig(interval=s.probe_interval_s, deadline=2.0, api_key_env=None))
            self.exporters[n.name] = ex.start()
        self.progress("starting HAProxy")
        gw_port = free_port()
        hdir = self.dir / "haproxy"
        hdir.mkdir()
        servers = [(n.name, n.address, 100) for n in self.nodes]
        self.haproxy = HaproxyProc(hdir, haproxy_config(hdir / "admin.sock", {BACKEND: servers},
                                                        balance=s.balance, frontend_port=gw_port))
        self.haproxy.start()
        self.gateway_url = f"http://127.0.0.1:{gw_port}"
        self.progress("starting Alertmanager and the webhook pager")
        self.webhook = WebhookReceiver()
        self.alertmanager = start_alertmanager(
            alertmanager_config(self.webhook.url("/page"), self.webhook.url("/ticket")), workdir=self.dir / "am")
        ctl_port = free_port()
        self.controller_url = f"http://127.0.0.1:{ctl_port}"
        prom_port = free_port()
        self.cfg = self._config(f"http://127.0.0.1:{prom_port}", f"127.0.0.1:{ctl_port}")
        rules_dir = Path(self.cfg.rules.output_dir)
        rules_dir.mkdir(parents=True)
        for name, text in render_all(self.cfg, {}).items():
            (rules_dir / name).write_text(text)
        jobs = [
            {"job_name": "vllm", "static_configs": [
                {"targets": [n.address], "labels": {"pool": POOL, "node": n.name}} for n in self.nodes]},
            {"job_name": self.cfg.rules.exporter_job, "static_configs": [
                {"targets": [ex.url.split("://")[1]], "labels": {"pool": POOL, "instance": n.address, "node": n.name}}
                for n, ex in zip(self.nodes, self.exporters.values(), strict=True)]},
            static_job(self.cfg.rules.controller_job, [f"127.0.0.1:{ctl_port}"]),
        ]
        self.progress("starting Prometheus (1 s scrape, grayguard rules)")
        self.prometheus = start_prometheus(
            prometheus_config(jobs, interval="1s", alertmanager_urls=[self.alertmanager.url]),
            sorted(rules_dir.glob("*.yml")), workdir=self.dir / "prometheus", port=prom_port)
        if s.controller:
            self.start_controller()

    def _config(self, prom_url: str, listen: str) -> Config:
        w = self.spec.control_window
        doc = {
            "prometheus": {"url": prom_url, "timeout_s": 2},
            "haproxy": {"endpoints": [self.haproxy.endpoint]},  # type: ignore[union-attr]
            "signals": {"latency_query": f"instance:vllm_normalized_latency_seconds_per_token:rate{w}",
                        "request_rate_query": f"instance:vllm_request_rate:rate{w}"},
            "pools": [{"name": POOL, "backend": BACKEND}],
            # 1 s ticks: a faster EMA than the 5 s default keeps the same reaction time.
            # min_request_rate 0.5: at least ~5 finished requests in the window before a node is scored.
            # sustain_ticks 6: consecutive 1 s ticks over a 10 s window see mostly the same requests, so a
            # latency outlier must hold for about half a window, as 3 ticks x 5 s do over production's 30 s.
            "thresholds": {"ema_alpha": 0.3, "sustain_ticks": 6, "min_request_rate": 0.5},
            # compressed recovery so a 150 s demo shows the whole cycle
            "recovery": {"min_quarantine_s": 10, "canary_interval_s": 5, "canary_successes": 3,
                         "canary_timeout_s": 3, "slow_start_initial": 0.1, "slow_start_step_per_min": 3.0},
            "rules": {"control_window": w, "control_interval": "1s", "human_window": "1m",
                      "output_dir": str(self.dir / "rules"), "rerender_interval_s": 30,
                      "alert_for": dict(DEMO_ALERT_FOR)},
            "tick_interval_s": self.spec.tick_s,
            "stale_after_s": 15,
            "state_file": None,
            "listen_address": listen,
        }
        for k, v in self.spec.overrides.items():
            doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
        return parse_config(doc)

    def start_controller(self) -> None:
        from controller.canary import make_canary
        from controller.cmd_controller import make_rerender, run_loop, startup_checks
        from controller.httpserver import serve

        assert self.cfg is not None
        self.progress("starting the controller")
        cfg = self.cfg
        self.controller = Controller(cfg, PrometheusClient(cfg.prometheus),
                                     [RuntimeClient(e, cfg.haproxy.timeout_s) for e in cfg.haproxy.endpoints],
                                     canary=make_canary(cfg.recovery), metrics=ControllerMetrics.create())
        for problem in startup_checks(self.controller):
            log.warning("%s", problem)
        self._http = serve(cfg.listen_address, self.controller.metrics.registry, self.controller.status)
        self._ctl_thread = threading.Thread(
            target=run_loop, args=(self.controller, cfg.tick_interval_s, self._ctl_stop),
            kwargs={"rerender": make_rerender(cfg)}, name="controller", daemon=True)
        self._ctl_thread.start()

    # ---- faults --------------------------------------------------------------------------------
    def _on_fault(self, node: str, fault: Any) -> None:
        """Keep the fake GPU telling the same story as the fault (called from the fleet's loop)."""
        from sim.faults import gpu_effects
        gpu = self.gpus.get(node)
        if gpu is None:
            return
        for k, v in self._gpu_base[node].items():
            if not k.startswith("_"):
                setattr(gpu, k, v)
        if fault is not None:
            effects = gpu_effects(fault.name, fault.params, self._gpu_base[node])
            xid = effects.pop("xid", None)
            for k, v in effects.items():
                setattr(gpu, k, v)
            if xid is not None:
                gpu.push_xid(int(xid))

    def set_fault(self, node: str, fault: str, **params: Any) -> None:
        self.fleet.set_fault(node, fault, **params)  # type: ignore[union-attr]

    def clear_fault(self, node: str) -> None:
        self.fleet.clear_fault(node)  # type: ignore[union-attr]

    def haproxy_weights(self) -> dict[str, tuple[int, bool]]:
        """node -> (weight, drained) as HAProxy has them now."""
        c = RuntimeClient(self.haproxy.endpoint)  # type: ignore[union-attr]
        return {s.name: (s.weight, s.drain) for s in c.show_servers_state(BACKEND)}

    # ---- teardown ------------------------------------------------------------------------------
    def stop(self, keep_workdir: bool = False) -> None:
        """Stop everything that was started, in reverse order; never raises. keep_workdir keeps the logs."""
        steps = [
            ("controller", self._stop_controller),
            ("prometheus", lambda: self.prometheus and self.prometheus.stop()),
            ("alertmanager", lambda: self.alertmanager and self.alertmanager.stop()),
            ("webhook", lambda: self.webhook and self.webhook.stop()),
            ("haproxy", lambda: self.haproxy and self.haproxy.stop()),
            ("exporters", lambda: [e.stop() for e in self.exporters.values()]),
            ("fleet", lambda: self.fleet and self.fleet.stop()),
        ]
        for name, fn in steps:
            try:
                fn()
            except Exception as e:  # keep tearing down the rest
                log.warning("stopping %s: %s", name, e)
        if not keep_workdir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_controller(self) -> None:
        self._ctl_stop.set()
        if self._ctl_thread:
            self._ctl_thread.join(10)
        if self._http:
            self._http.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
