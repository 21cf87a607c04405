"""Fleet membership in etcd: the shared contract of the exporter (which registers its node) and the
controller (which discovers the nodes and elects one active replica).

Keys (prefix default `/grayguard/v1`): `<prefix>/nodes/<pool>/<node>` holds one node's NodeRecord as JSON,
attached to the node's own lease. The exporter keeps the lease alive every heartbeat with an adaptive TTL
(adaptive_ttl; until two intervals are measured, first_ttl of the configured heartbeat). A graceful leave
rewrites the value with state "leaving" on the same lease, waits a short moment, then revokes the lease (the
key goes at once); a crash just lets the lease expire (the key is deleted): the controller tells the two
apart by the last value it saw. Pool and node names are HAProxy
names (grayguard.config.HAPROXY_NAME_RE). Unknown fields of a record are ignored (newer writers).

Client: `Registry` (grayguard/etcdgw.py, re-exported here) speaks etcd's v3 JSON gateway through the
maintained etcd3gw library; every failure is one RegistryError with a kind (ERROR_KINDS). `Snapshot` keeps
the last records in a file (atomic writes) for a controller that starts while etcd is down.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from grayguard.atomicfile import write_atomic
from grayguard.config import HAPROXY_NAME_RE
from grayguard.etcdgw import ERROR_KINDS, Entry, Registry, RegistryError, WatchEvent

__all__ = ["DEFAULT_PREFIX", "ERROR_KINDS", "FIRST_TTL_ROUNDS", "STATES", "TTL_WINDOW", "Entry", "GpuInfo",
           "NodeRecord", "RecordError", "Registry", "RegistryError", "Snapshot", "SnapshotError", "WatchEvent",
           "adaptive_ttl", "first_ttl", "node_key", "node_records", "nodes_prefix", "parse_node_key"]

DEFAULT_PREFIX = "/grayguard/v1"
STATES = ("serving", "leaving")
TTL_WINDOW = 5  # adaptive_ttl looks at the last 5 heartbeat intervals
FIRST_TTL_ROUNDS = 3  # the first lease outlasts this many heartbeat rounds (two lost keep-alives), plus one call
_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")  # host:port, [v6]:port
_PREFIX_RE = re.compile(r"^(/[A-Za-z0-9_.:-]+)+$")
_TEXT_MAX = 256


def first_ttl(heartbeat: float, timeout: float, lo: float = 5.0, hi: float = 60.0) -> float:
    """The lease TTL before two heartbeat intervals are measured: FIRST_TTL_ROUNDS x max(heartbeat, timeout) +
    timeout, in [lo, hi].

    No spread is known yet, so the configured cadence stands in for the measured one. A heartbeat round lasts
    the heartbeat, or a keep-alive's whole timeout when etcd does not answer; three rounds plus the timeout of
    the keep-alive that renews the lease let two keep-alives in a row fail before the third renews it (the
    steady TTL, mean + 2 stddev of a steady cadence clamped to lo, is usually shorter). It is no wider: a node
    that crashes right after joining is gone within it (8 s with a 2 s heartbeat and timeout), not after hi
    (60 s) of HAProxy sending to a dead server. ValueError on a heartbeat that is not positive and finite, a
    negative or non-finite timeout, or bad bounds.
    """
    _check_bounds(lo, hi)
    if not (math.isfinite(heartbeat) and heartbeat > 0 and math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"need a positive finite heartbeat and a finite timeout >= 0; got heartbeat={heartbeat}, "
                         f"timeout={timeout}")
    return min(hi, max(lo, FIRST_TTL_ROUNDS * max(heartbeat, timeout) + timeout))


def adaptive_ttl(intervals: Sequence[float], lo: float = 5.0, hi: float = 60.0, *,
                 first: float | None = None) -> float:
    """Lease TTL from the last TTL_WINDOW heartbeat intervals (seconds): mean x (1 + 2 x stddev/mean), in [lo, hi].

    That is mean + 2 stddev: a heartbeat later than that is a ~2.5 % event on a normal spread (the seed
    article's formula). Fewer than 2 intervals give no spread: the TTL is `first` (first_ttl of the configured
    heartbeat, which the exporter passes), clamped to [lo, hi]; without one, hi. The stddev is the population
    one over the window. Zero, negative or non-finite intervals, or lo > hi, raise ValueError.
    """
    _check_bounds(lo, hi)
    window = [float(x) for x in intervals][-TTL_WINDOW:]
    for x in window:
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"a heartbeat interval must be a positive finite number of seconds, got {x}")
    if len(window) < 2:
        if first is None:
            return hi
        if not math.isfinite(first):
            raise ValueError(f"the first TTL must be finite, got {first}")
        return min(hi, max(lo, first))
    mean = statistics.fmean(window)
    ttl = mean * (1 + 2 * statistics.pstdev(window) / mean)
    return min(hi, max(lo, ttl))


def _check_bounds(lo: float, hi: float) -> None:
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise ValueError(f"need 0 < lo <= hi, finite; got lo={lo}, hi={hi}")


# --- keys -------------------------------------------------------------------------------------
def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"registry prefix must look like /grayguard/v1 (no trailing '/'), got {prefix!r}")
    return prefix


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not HAPROXY_NAME_RE.match(name):
        raise ValueError(f"{what} name must be 1-64 letters, digits, '-', '_', '.', ':' (HAProxy-safe), "
                         f"got {name!r:.80}")
    return name


def nodes_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    """`<prefix>/nodes/`: every node key starts with it (get_prefix and watch_prefix take it)."""
    return f"{_check_prefix(prefix)}/nodes/"


def node_key(prefix: str, pool: str, node: str) -> str:
    """`<prefix>/nodes/<pool>/<node>`; ValueError on a bad prefix or a name HAProxy would not take."""
    return f"{nodes_prefix(prefix)}{_check_name('pool', pool)}/{_check_name('node', node)}"


def parse_node_key(prefix: str, key: str) -> tuple[str, str]:
    """(pool, node) of a node key; ValueError when key is not `<prefix>/nodes/<pool>/<node>` with valid names."""
    head = nodes_prefix(prefix)
    if not key.startswith(head) or key[len(head):].count("/") != 1:
        raise ValueError(f"not a node key under {head}: {key!r:.120}")
    pool, node = key[len(head):].split("/")
    return _check_name("pool", pool), _check_name("node", node)


# --- records ----------------------------------------------------------------------------------
class RecordError(ValueError):
    """A node record is not valid; the message names the field."""


@dataclass(frozen=True)
class GpuInfo:
    """The node's GPUs as NVML names them: model name, count, PCI bus ids (index order), NUMA nodes (sorted)."""

    name: str = ""
    count: int = 0
    pci_bus_ids: tuple[str, ...] = ()
    numa_nodes: tuple[int, ...] = ()  # empty when the system does not say


@dataclass(frozen=True)
class NodeRecord:
    """The value of `<prefix>/nodes/<pool>/<node>`: where to send traffic and what serves there."""

    pool: str
    node: str
    endpoint: str  # host:port of vLLM, as HAProxy should send to it
    exporter: str  # host:port of the node's exporter (/metrics; its agent check listens beside it)
    model: str  # the model vLLM serves (/v1/models)
    version: str = ""  # vLLM's version (/version); "" when it did not say
    gpu: GpuInfo = field(default_factory=GpuInfo)
    max_concurrency: int | None = None  # requests the node runs at once (vLLM --max-num-seqs); None: unknown
    registered_at: float = 0.0  # Unix time of this registration (a re-grant for a new TTL keeps it)
    ttl_s: int = 0  # the lease's TTL (s)
    state: str = "serving"  # "serving", or "leaving" during a graceful leave
    agent: str = ""  # host:port of the exporter's HAProxy agent check; "" when it runs none

    def __post_init__(self) -> None:
        _validate(self)

    def to_json(self) -> str:
        """Compact JSON, keys sorted (equal records give equal text)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["gpu"].items()}
        return d

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        """Parse and check a record; RecordError names the first bad field."""
        try:
            doc = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise RecordError(f"not JSON: {e}") from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: object) -> NodeRecord:
        """A record from parsed JSON (unknown fields ignored); RecordError names the first bad field."""
        if not isinstance(doc, dict):
            raise RecordError(f"expected a JSON object, got {type(doc).__name__}")
        missing = [k for k in ("pool", "node", "endpoint", "exporter", "model") if k not in doc]
        if missing:
            raise RecordError(f"{missing[0]}: missing")
        gpu = doc.get("gpu", {})
        if not isinstance(gpu, dict):
            raise RecordError(f"gpu: expected an object, got {type(gpu).__name__}")
        for k in ("pci_bus_ids", "numa_nodes"):
            if not isinstance(gpu.get(k, []), list):
                raise RecordError(f"gpu.{k}: expected a list, got {type(gpu[k]).__name__}")
        info = GpuInfo(name=gpu.get("name", ""), count=gpu.get("count", 0),
                       pci_bus_ids=tuple(gpu.get("pci_bus_ids", [])), numa_nodes=tuple(gpu.get("numa_nodes", [])))
        known = {k: doc[k] for k in ("pool", "node", "endpoint", "exporter", "model", "version", "max_concurrency",
                                     "registered_at", "ttl_s", "state", "agent") if k in doc}
        return cls(gpu=info, **known)

    def leaving(self) -> NodeRecord:
        """The same record in state "leaving"."""
        return replace(self, state="leaving")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def _validate(r: NodeRecord) -> None:
    def bad(where: str, what: str, got: object) -> RecordError:
        return RecordError(f"{where}: expected {what}, got {got!r:.80}")

    for where in ("pool", "node"):
        try:
            _check_name(where, getattr(r, where))
        except ValueError as e:
            raise RecordError(f"{where}: {e}") from None
    for where in ("endpoint", "exporter", "agent"):
        v = getattr(r, where)
        if where == "agent" and v == "":
            continue
        m = _ADDRESS_RE.match(v) if isinstance(v, str) else None
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            raise bad(where, "host:port (or [v6]:port), port 1-65535", v)
    for where, v, empty in (("model", r.model, False), ("version", r.version, True), ("gpu.name", r.gpu.name, True)):
        if not isinstance(v, str) or (not v and not empty) or len(v) > _TEXT_MAX or not v.isprintable():
            raise bad(where, f"{'a' if empty else 'a non-empty'} printable string of at most {_TEXT_MAX} characters", v)
    if not _whole(r.gpu.count, 0):
        raise bad("gpu.count", "a whole number >= 0", r.gpu.count)
    for i, b in enumerate(r.gpu.pci_bus_ids):
        if not isinstance(b, str) or not b or len(b) > 64 or not b.isprintable():
            raise bad(f"gpu.pci_bus_ids[{i}]", "a PCI bus id string", b)
    for i, n in enumerate(r.gpu.numa_nodes):
        if not _whole(n, 0):
            raise bad(f"gpu.numa_nodes[{i}]", "a whole number >= 0", n)
    if r.max_concurrency is not None and not _whole(r.max_concurrency, 1):
        raise bad("max_concurrency", "a whole number >= 1 or null", r.max_concurrency)
    if isinstance(r.registered_at, bool) or not isinstance(r.registered_at, int | float) \
            or not math.isfinite(r.registered_at) or r.registered_at < 0:
        raise bad("registered_at", "Unix seconds >= 0", r.registered_at)
    if not _whole(r.ttl_s, 0):
        raise bad("ttl_s", "a whole number of seconds >= 0", r.ttl_s)
    if r.state not in STATES:
        raise bad("state", " or ".join(STATES), r.state)


def _whole(v: object, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def node_records(prefix: str, entries: Mapping[str, Entry]) -> tuple[dict[str, NodeRecord], dict[str, str]]:
    """The valid records of get_prefix(nodes_prefix(prefix)) by key, and {key: why} for the others.

    A record whose pool or node differs from its key's is invalid (the key is what etcd deletes).
    """
    good: dict[str, NodeRecord] = {}
    bad: dict[str, str] = {}
    for key, entry in entries.items():
        try:
            pool, node = parse_node_key(prefix, key)
            rec = NodeRecord.from_json(entry.value)
            if (rec.pool, rec.node) != (pool, node):
                raise RecordError(f"names {rec.pool}/{rec.node}, its key {pool}/{node}")
            good[key] = rec
        except ValueError as e:
            bad[key] = str(e)
    return good, bad


# --- snapshot ---------------------------------------------------------------------------------
class SnapshotError(ValueError):
    """The snapshot file is not a snapshot; it was set aside (`.corrupt`), the message says why and where."""


class Snapshot:
    """The last known records in one JSON file: save() writes atomically (temp file, fsync, os.replace)."""

    FORMAT = "grayguard-registry-snapshot/1"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def save(self, records: Mapping[str, NodeRecord], revision: int, *, now: float | None = None) -> None:
        """Write {key: record} read at etcd revision; OSError when it cannot (the old file is then intact)."""
        doc = {"format": self.FORMAT, "revision": int(revision), "saved_at": time.time() if now is None else now,
               "records": {k: r.to_dict() for k, r in sorted(records.items())}}
        text = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False)
        write_atomic(self.path, text, sync_dir=True)  # the rename itself survives a power cut once the dir is synced

    def load(self) -> tuple[dict[str, NodeRecord], int] | None:
        """({key: record}, revision), or None when there is no file; SnapshotError when it is corrupt
        (the bad file is moved to `<path>.corrupt`, so the next save starts clean)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(data.decode(), parse_constant=_no_constant)
            if not isinstance(doc, dict) or doc.get("format") != self.FORMAT:
                raise ValueError(f"not a {self.FORMAT} document")
            revision, raw = doc.get("revision"), doc.get("records")
            if not _whole(revision, 0) or not isinstance(raw, dict):
                raise ValueError("revision or records missing or of the wrong type")
            records = {}
            for key, value in raw.items():
                try:
                    records[key] = NodeRecord.from_dict(value)
                except RecordError as e:
                    raise ValueError(f"records[{key!r}]: {e}") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            bad = self.path.with_name(self.path.name + ".corrupt")
            try:
                os.replace(self.path, bad)
                kept = f"set aside as {bad}"
            except OSError as err:
                kept = f"could not be set aside ({err.strerror or err})"
            raise SnapshotError(f"registry snapshot {self.path} is corrupt ({e}); {kept}") from None
        return records, revision
