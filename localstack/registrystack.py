"""The local stack with a registry: etcd, exporters that register their nodes, a backend that starts empty and that
the controller (a `grayguard controller` process, leader election on) fills from the registry (`discovery:
registry`); nodes that join and crash mid-run, each its own process (NodeHost: a simulated vLLM node and its
exporter, like a machine), so a crash is a real SIGKILL.

`python -m grayguard.localstack.registrystack host ...` is NodeHost's child process. Used by `grayguard demo --scenario
membership` and its tests.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import ManagedProcess, free_port, http_ok, wait_until
from grayguard.localstack.stack import BACKEND, POOL, REPO, LocalStack, StackSpec, _child_env

log = logging.getLogger("grayguard.stack")


@dataclass(frozen=True)
class RegistryTiming:
    """Demo time for the registry: the exporters' heartbeat and lease TTL bounds, the controller's side."""

    heartbeat_s: float = 1.0  # --registry.heartbeat
    ttl_min_s: int = 3  # --registry.ttl-min: a crashed node's key is gone this long after its last heartbeat
    ttl_max_s: int = 10  # --registry.ttl-max: the TTL's upper bound (the first lease is first_ttl: 4 s here)
    leave_grace_s: float = 0.2  # --registry.leave-grace
    timeout_s: float = 1.0  # every etcd call, both sides
    lease_ttl_s: int = 5  # the controller replicas' leader lease (registry.lease_ttl_s)
    new_node_warmup_s: float = 10.0  # a joining node holds the warm-up weight this long, then slow-starts

    def exporter_flags(self, etcd_url: str, node: str, advertise: str) -> list[str]:
        """`grayguard exporter` flags that register node at advertise in etcd."""
        return ["--registry.url", etcd_url, "--registry.pool", POOL, "--registry.node", node,
                "--registry.advertise", advertise, "--registry.heartbeat", f"{self.heartbeat_s:g}s",
                "--registry.ttl-min", f"{self.ttl_min_s}s", "--registry.ttl-max", f"{self.ttl_max_s}s",
                "--registry.leave-grace", f"{self.leave_grace_s:g}s", "--registry.timeout", f"{self.timeout_s:g}s"]

    def overrides(self, etcd_url: str, snapshot: Path) -> dict:
        """The controller config's registry section, the pool following the registry, the warm-up."""
        return {"registry": {"url": etcd_url, "lease_ttl_s": self.lease_ttl_s, "timeout_s": self.timeout_s,
                             "snapshot_file": str(snapshot)},
                "pools": [{"name": POOL, "backend": BACKEND, "discovery": "registry"}],
                "thresholds": {"new_node_warmup_s": self.new_node_warmup_s}}


class NodeHost:
    """One node as a machine of its own: a simulated vLLM node and its registering exporter in one child process.

    stop() is SIGTERM (the exporter leaves the registry, then both stop); kill() is SIGKILL: both die at once,
    nothing is written, the node's key expires with its lease.
    """

    prober = None  # the probe state lives in the child

    def __init__(self, name: str, index: int, etcd_url: str, timing: RegistryTiming, log_path: Path, *,
                 seed: int = 1, probe_interval_s: float = 0.5):
        self.name, self.host = name, "127.0.0.1"
        self.port, exporter_port, self.agent_port = free_port(), free_port(), free_port()
        self.url = f"http://{self.host}:{exporter_port}"  # the exporter, as LocalStack's exporters have it
        argv = [sys.executable, "-m", "grayguard.localstack.registrystack", "host", "--name", name,
                "--port", str(self.port), "--seed", str(seed), "--gpu-index", str(index),
                "--vllm.url", f"http://{self.host}:{self.port}", "--web.listen-address", f"{self.host}:{exporter_port}",
                "--agent.listen-address", f"{self.host}:{self.agent_port}", "--probe.interval", f"{probe_interval_s:g}",
                "--probe.deadline", "2s", "--probe.api-key-env", "",
                *timing.exporter_flags(etcd_url, name, self.address)]
        self.proc = ManagedProcess(argv, log_path, env=_child_env(), cwd=REPO)

    @property
    def address(self) -> str:
        """The node's vLLM address (what it advertises, what HAProxy and Prometheus know it by)."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def info(self) -> Any:
        """The node as sim.fleet.NodeInfo, like the fleet's own."""
        from grayguard.sim.fleet import NodeInfo
        return NodeInfo(self.name, self.host, self.port, "h100")

    def wait_ready(self, timeout_s: float = 30.0) -> NodeHost:
        """Until the node answers /health and its exporter /metrics (registration follows on its own)."""
        self.proc.wait_for(lambda: http_ok(f"http://{self.address}/health") and http_ok(self.url + "/metrics"),
                           timeout_s, f"node host {self.name}")
        return self

    def kill(self) -> None:
        """SIGKILL: the node and its exporter die together, as a machine that loses power."""
        if self.proc.running():
            self.proc.proc.send_signal(signal.SIGKILL)
            self.proc.proc.wait(10)
        self.proc.stop()  # reaps, closes the log

    def stop(self) -> None:
        self.proc.stop()


class RegistryStack(LocalStack):
    """LocalStack with etcd: every node registers (the fleet's through in-process exporters, `hosts` as NodeHost
    processes), HAProxy's backend starts empty, and the controller process follows the registry with the election
    on. The spec's nodes are the fleet's; `hosts` names the nodes that run as processes from the start."""

    def __init__(self, spec: StackSpec, progress=lambda msg: None, *, hosts: tuple[str, ...] = (),
                 timing: RegistryTiming | None = None):
        spec.controller_process = True  # `grayguard controller`: the election and the discovery as shipped
        super().__init__(spec, progress)
        self.timing = timing or RegistryTiming()
        self.host_names = tuple(hosts)
        self.hosts: dict[str, NodeHost] = {}
        self.etcd: EtcdProc | None = None

    def _start(self) -> None:
        self.progress("starting etcd (the registry)")
        self.etcd = EtcdProc(self.dir / "etcd").start()
        self.spec.overrides = {**self.spec.overrides,
                               **self.timing.overrides(self.etcd.url, self.dir / "controller" / "members.json")}
        super()._start()

    def _backend_servers(self) -> list[tuple[str, str, int, int]]:
        return []  # the controller adds each node once it registers

    def _start_exporters(self) -> None:
        from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
        from grayguard.exporters.prober import ProbeConfig
        from grayguard.exporters.registration import RegistrationConfig
        from grayguard.exporters.server import Exporter

        assert self.etcd is not None
        t = self.timing
        self.progress("starting one exporter per node, each registering its node in etcd")
        for i, n in enumerate(self.nodes):
            gpu = healthy_h100(i)
            self.gpus[n.name] = gpu
            self._gpu_base[n.name] = dict(vars(gpu))
            self.agent_ports[n.name] = free_port()
            reg = RegistrationConfig(url=self.etcd.url, pool=POOL, node=n.name, advertise=n.address,
                                     heartbeat=t.heartbeat_s, ttl_min=t.ttl_min_s, ttl_max=t.ttl_max_s,
                                     leave_grace=t.leave_grace_s, timeout=t.timeout_s, api_key_env=None)
            ex = Exporter(n.url, port=0, nvml=FakeNvml([gpu]), agent=("127.0.0.1", self.agent_ports[n.name]),
                          probe=ProbeConfig(interval=self.spec.probe_interval_s, deadline=2.0, api_key_env=None),
                          registration=reg)
            self.exporters[n.name] = ex.start()
        for name in self.host_names:  # after the fleet's: LocalStack pairs nodes and exporters in order
            h = self._new_host(name)
            self.nodes.append(h.info())
            self.exporters[name] = h
            self.agent_ports[name] = h.agent_port

    def _new_host(self, name: str) -> NodeHost:
        assert self.etcd is not None
        self.progress(f"starting {name} as its own process (node and exporter)")
        index = len(self.nodes)  # its fake GPU's, and its latency jitter's seed: unlike every other node's
        h = NodeHost(name, index, self.etcd.url, self.timing, self.dir / "hosts" / f"{name}.log",
                     seed=self.spec.seed * 100 + index, probe_interval_s=self.spec.probe_interval_s)
        self.hosts[name] = h
        return h.wait_ready()

    # ---- mid-run ----------------------------------------------------------------------------------------------
    def start_host(self, name: str) -> NodeHost:
        """A node joins: its process starts, its exporter registers it, Prometheus scrapes it from now on."""
        h = self._new_host(name)
        self.nodes.append(h.info())
        self.exporters[name] = h
        self.agent_ports[name] = h.agent_port
        self._scrape(h)
        return h

    def kill_host(self, name: str) -> None:
        """SIGKILL the node's process (node and exporter): no leave, its key expires with its lease."""
        self.hosts[name].kill()

    def _scrape(self, h: NodeHost) -> None:
        """Add the node and its exporter to Prometheus' jobs (as service discovery would) and reload it."""
        assert self._prom_launch is not None and self.prometheus is not None and self.cfg is not None
        config, _ = self._prom_launch
        exporter = {"targets": [h.url.split("://")[1]], "labels": {"pool": POOL, "instance": h.address,
                                                                  "node": h.name}}
        seen: set[int] = set()  # a target list two jobs share (the exporter's full and fast pages) takes it once
        for job in config["scrape_configs"]:
            configs = job["static_configs"]
            if id(configs) in seen:
                continue
            if job["job_name"] == "vllm":
                configs.append({"targets": [h.address], "labels": {"pool": POOL, "node": h.name}})
            elif job["job_name"] == self.cfg.rules.exporter_job or job.get("metrics_path") == "/metrics/fast":
                configs.append(exporter)
            seen.add(id(configs))
        path = self.prometheus.workdir / "prometheus.yml"
        doc = yaml.safe_load(path.read_text())
        doc["scrape_configs"] = config["scrape_configs"]
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.prometheus.reload()

    # ---- what the registry says ----------------------------------------------------------------------------------
    def registry(self) -> Any:
        """A grayguard.registry.Registry client of this stack's etcd."""
        from grayguard.registry import Registry
        assert self.etcd is not None
        return Registry(self.etcd.url, timeout=self.timing.timeout_s)

    def records(self) -> dict[str, Any]:
        """node -> NodeRecord of the pool's registrations now."""
        from grayguard.registry import DEFAULT_PREFIX, node_records, nodes_prefix
        reg = self.registry()
        try:
            entries, _ = reg.get_prefix(nodes_prefix(DEFAULT_PREFIX))
        finally:
            reg.close()
        valid, _ = node_records(DEFAULT_PREFIX, entries)
        return {r.node: r for r in valid.values() if r.pool == POOL}

    def wait_registered(self, names, timeout_s: float = 30.0) -> None:
        """Until every node of names is registered."""
        wait_until(lambda: set(names) <= set(self.records()), timeout_s, 0.2, f"{', '.join(names)} registered")

    # ---- teardown ----------------------------------------------------------------------------------------------
    def stop(self, keep_workdir: bool = False) -> None:
        """Everything LocalStack stops, then the node processes and etcd; never raises."""
        super().stop(keep_workdir=True)
        for name, fn in [*((f"host {n}", h.stop) for n, h in self.hosts.items()),
                         ("etcd", lambda: self.etcd and self.etcd.stop())]:
            try:
                fn()
            except Exception as e:  # keep tearing down the rest
                log.warning("stopping %s: %s", name, e)
        if not keep_workdir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _host_main(argv: list[str]) -> int:
    """NodeHost's child: one simulated vLLM node and its exporter (`grayguard exporter` flags, a fake healthy H100,
    --registry.* registering the node) until SIGTERM."""
    import argparse

    from grayguard import logsetup
    from grayguard.exporters import cli
    from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
    from grayguard.sim.fleet import Fleet, FleetThread

    p = argparse.ArgumentParser(prog="python -m grayguard.localstack.registrystack host")
    p.add_argument("--name", required=True, help="the node's name (its HAProxy server name)")
    p.add_argument("--port", type=int, required=True, help="the simulated vLLM node's port")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gpu-index", type=int, default=0, help="index of the fake H100 (its uuid and serial)")
    cli.add_arguments(p)
    logsetup.add_flags(p)  # what `grayguard exporter` has from the dispatcher
    args = p.parse_args(argv)
    logsetup.setup_from_args(args, default_level="INFO")
    error = cli.config_error(args)
    if error:
        log.error("bad configuration: %s", error)
        return 2
    fleet = FleetThread(Fleet(1, seed=args.seed, base_port=args.port, names=[args.name]))
    fleet.start()
    exporter = cli.build_exporter(args, nvml=FakeNvml([healthy_h100(args.gpu_index)]))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exporter.start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        exporter.stop()  # leaves the registry first: HAProxy stops sending while the node still serves
        fleet.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["host"]:
        sys.exit("usage: python -m grayguard.localstack.registrystack host --name NODE --port PORT "
                 "[grayguard exporter flags]")
    sys.exit(_host_main(sys.argv[2:]))
