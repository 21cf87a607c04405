"""Registration pre-checks: is this node fit to join its pool (GPU, serving port, model, API key), and the
facts its NodeRecord carries (model, vLLM version, GPUs). The GPU verdict is pure; the rest asks vLLM,
each call bounded by a timeout, and never raises for what vLLM does."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from grayguard.engines import DEFAULT_ENGINE, profile
from grayguard.exporters.gpumetrics import NvmlSnapshot
from grayguard.registry import GpuInfo

CHECKS = ("gpu", "port", "model", "api_key")
SYSFS_PCI = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class Check:
    """One pre-check's verdict; reason says why it failed."""

    name: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Prechecks:
    """Every verdict that could be judged (a check that could not, e.g. the key when vLLM is down, is absent),
    and what was learnt on the way."""

    checks: tuple[Check, ...] = ()
    model: str | None = None
    version: str = ""
    gpu: GpuInfo = field(default_factory=GpuInfo)

    @property
    def ok(self) -> bool:
        """True when every check that ran passed and the model is known (registering is allowed)."""
        return self.model is not None and all(c.ok for c in self.checks)

    def failures(self) -> str:
        """`check: reason; ...` of the failed checks ("" when none)."""
        return "; ".join(f"{c.name}: {c.reason}" for c in self.checks if not c.ok)


def gpu_verdict(snap: NvmlSnapshot) -> Check:
    """NVML readable, every GPU present, no uncorrectable ECC error since boot, no XID since the exporter started."""
    if not snap.up:
        return Check("gpu", False, "NVML not readable (no driver, or it stopped answering)")
    if not snap.gpus:
        return Check("gpu", False, "NVML lists no GPU")
    for g in snap.gpus:
        if g.lost:
            return Check("gpu", False, f"GPU {g.index} ({g.uuid}) is lost or needs a reset")
        dbe = g.ecc.get(("uncorrected", "volatile"), 0)
        if dbe > 0:
            return Check("gpu", False, f"GPU {g.index} ({g.uuid}) has {dbe} uncorrectable ECC errors since boot")
    for (index, uuid, xid), n in sorted(snap.xid_counts.items()):
        if n > 0:
            return Check("gpu", False, f"GPU {index} ({uuid}) reported XID {xid} ({n}x) since the exporter started")
    return Check("gpu", True)


def numa_node_of(pci_bus_id: str, sysfs: Path = SYSFS_PCI) -> int | None:
    """The NUMA node of a PCI device from sysfs (NVML's 8-digit domain shortened), None when unknown."""
    domain, _, rest = pci_bus_id.lower().partition(":")
    try:
        text = (sysfs / f"{domain[-4:]}:{rest}" / "numa_node").read_text().strip()
        node = int(text)
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform does not say


def gpu_info(snap: NvmlSnapshot, numa_of: Callable[[str], int | None] = numa_node_of) -> GpuInfo:
    """The GPUs for the record: first GPU's name, count, bus ids in index order, NUMA nodes sorted."""
    gpus = sorted((g for g in snap.gpus if not g.lost), key=lambda g: g.index)
    numa = {n for g in gpus if (n := numa_of(g.pci_bus_id)) is not None}
    return GpuInfo(name=gpus[0].name if gpus else "", count=len(gpus), pci_bus_ids=tuple(g.pci_bus_id for g in gpus),
                   numa_nodes=tuple(sorted(numa)))


def port_check(address: str, timeout: float) -> Check:
    """A TCP connection to the advertised host:port (what HAProxy will connect to) succeeds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return Check("port", True)
    except (OSError, ValueError) as e:
        return Check("port", False, f"cannot connect to {address}: {e.strerror if isinstance(e, OSError) else e}")


def vllm_checks(session: requests.Session, base_url: str, headers: dict[str, str], want: str | None,
                timeout: float) -> tuple[list[Check], str | None]:
    """([model, api_key] verdicts, the model) from GET /v1/models with the probe's key.

    The key fails on a 401 or 403 only; the model fails when the list lacks `want` (or, without it, is empty).
    """
    url = f"{base_url.rstrip('/')}/v1/models"
    resp, refused = _get(session, url, headers, timeout)
    if refused:
        return refused, None
    key = Check("api_key", True)
    if resp.status_code != 200:
        return [key, Check("model", False, f"GET {url} answered {resp.status_code}")], None
    try:
        data = resp.json().get("data")
        ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, AttributeError, TypeError):
        return [key, Check("model", False, f"GET {url}: not a model list")], None
    if want is not None and want not in ids:
        return [key, Check("model", False, f"{want!r} not loaded (loaded: {', '.join(ids) or 'none'})")], None
    if not ids:
        return [key, Check("model", False, "no model loaded (/v1/models lists none)")], None
    return [key, Check("model", True)], want or ids[0]


def triton_checks(session: requests.Session, base_url: str, headers: dict[str, str], want: str | None,
                  timeout: float) -> tuple[list[Check], str | None]:
    """([model, api_key] verdicts, the model) for Triton: GET /v2/models/<model>/ready (the profile's default model,
    `ensemble`, without `want`)."""
    model = want or profile("triton").default_model or "ensemble"
    url = f"{base_url.rstrip('/')}/v2/models/{model}/ready"
    resp, refused = _get(session, url, headers, timeout)
    if refused:
        return refused, None
    if resp.status_code != 200:
        return [Check("api_key", True), Check("model", False, f"{model!r} not ready: GET {url} answered "
                                                              f"{resp.status_code}")], None
    return [Check("api_key", True), Check("model", True)], model


def _get(session: requests.Session, url: str, headers: dict[str, str],
         timeout: float) -> tuple[requests.Response | None, list[Check]]:
    """(the answer, []) of GET url with the probe's key; (None, the failed check) when there is no answer (a failed
    model check) or the key is refused (401 or 403: a failed key check)."""
    try:
        resp = session.get(url, headers=headers, timeout=timeout)
    except requests.RequestException as e:
        return None, [Check("model", False, f"GET {url}: {type(e).__name__}")]
    if resp.status_code in (401, 403):
        return None, [Check("api_key", False, f"GET {url} answered {resp.status_code}: the probe's API key is missing "
                                              "or wrong (--probe.api-key-file, --probe.api-key-env)")]
    return resp, []


def vllm_version(session: requests.Session, base_url: str, headers: dict[str, str], timeout: float,
                 engine: str = DEFAULT_ENGINE) -> str:
    """The engine's version, "" when it does not say: vLLM's GET /version, SGLang's /get_server_info, TGI's /info,
    llama.cpp's /props (its build_info), Triton's /v2 (grayguard/engines.py)."""
    p = profile(engine)
    try:
        resp = session.get(f"{base_url.rstrip('/')}{p.version_path}", headers=headers, timeout=timeout)
        version = resp.json().get(p.version_key) if resp.status_code == 200 else None
    except (requests.RequestException, ValueError, AttributeError):
        return ""
    return version if isinstance(version, str) and version.isprintable() and len(version) <= 64 else ""


def run_prechecks(*, nvml_snapshot: Callable[[], NvmlSnapshot] | None, advertise: str, vllm_url: str,
                  api_key: str | None, model: str | None, session: requests.Session, timeout: float,
                  numa_of: Callable[[str], int | None] = numa_node_of, engine: str = DEFAULT_ENGINE) -> Prechecks:
    """Every pre-check, in order: gpu (skipped without NVML), port, model and api_key, then the version, each asked
    the way the engine answers (grayguard/engines.py)."""
    checks: list[Check] = []
    gpu = GpuInfo()
    if nvml_snapshot is not None:
        snap = nvml_snapshot()
        checks.append(gpu_verdict(snap))
        gpu = gpu_info(snap, numa_of)
    checks.append(port_check(advertise, timeout))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ask = triton_checks if profile(engine).dialect == "triton" else vllm_checks
    found, served = ask(session, vllm_url, headers, model, timeout)
    checks += found
    version = vllm_version(session, vllm_url, headers, timeout, engine) if served is not None else ""
    return Prechecks(checks=tuple(checks), model=served, version=version, gpu=gpu)
