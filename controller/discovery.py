"""Discovery: the registry's node records (`<prefix>/nodes/<pool>/<node>`, grayguard/registry.py), followed in a
background thread and kept as one membership snapshot the tick reads (controller/membersync.py).

One get_prefix, then a watch from the revision after it (no polling). A compacted history, a broken stream or a
failed heartbeat ends the watch: the thread lists again (with backoff while etcd is unreachable) and the new list
replaces the snapshot in one step, so a tick never sees half of it. While etcd is unreachable the snapshot is
frozen: nothing is removed from it, `fresh` is False (membership begins no removal), grayguard_registry_up is 0
and grayguard_registry_snapshot_age_seconds grows. The snapshot is written atomically to a file when it changes
(at most once per heartbeat) and loaded at start, so a controller that starts while etcd is down has the last
membership. A key deleted is kept as departed, with its last value, until membership has removed the server:
that last value tells an expiry ("serving") from a graceful leave ("leaving").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from grayguard.controller.membership import PoolView
from grayguard.registry import (
    NodeRecord,
    RecordError,
    Registry,
    RegistryError,
    Snapshot,
    SnapshotError,
    WatchEvent,
    node_key,
    nodes_prefix,
    parse_node_key,
)

log = logging.getLogger("grayguard.discovery")

Nodes = Mapping[str, Mapping[str, NodeRecord]]  # pool -> node -> record


@dataclass(frozen=True)
class Membership:
    """One consistent snapshot of the registry (replaced whole, never changed in place)."""

    nodes: Nodes = field(default_factory=dict)
    departed: Nodes = field(default_factory=dict)  # deleted keys: pool -> node -> the last value seen
    revision: int = 0  # the etcd revision it reflects


@dataclass
class DiscoveryMetrics:
    """The registry's series, in the controller's registry."""

    up: Gauge
    snapshot_age: Gauge
    nodes: Gauge
    errors: Counter
    relists: Counter
    invalid: Gauge
    snapshot_errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> DiscoveryMetrics:
        r = registry
        return cls(
            up=Gauge("grayguard_registry_up", "1 while the registry (etcd) answers and its watch runs; 0: membership "
                     "is frozen on the last snapshot", registry=r),
            snapshot_age=Gauge("grayguard_registry_snapshot_age_seconds", "Seconds since the membership snapshot was "
                               "last known current (about 0 while the registry answers)", registry=r),
            nodes=Gauge("grayguard_membership_nodes", "Serving registrations of a registry pool in the membership "
                        "snapshot", ["pool"], registry=r),
            errors=Counter("grayguard_discovery_errors", "Registry (etcd) calls of the discovery that failed, by kind",
                           ["kind"], registry=r),
            relists=Counter("grayguard_discovery_relists", "Full listings of the node keys, by why (start, compacted, "
                            "reconnect)", ["reason"], registry=r),
            invalid=Gauge("grayguard_discovery_invalid_records", "Node keys whose value is not a valid record "
                          "(ignored; the last valid value stands)", registry=r),
            snapshot_errors=Counter("grayguard_discovery_snapshot_errors", "Membership snapshot writes or loads that "
                                    "failed", registry=r),
        )


class Discovery:
    """Follows the registry's node keys for the given pools; `view(pool)` is what the tick plans from."""

    def __init__(self, registry: Registry, prefix: str, pools: Collection[str], snapshot_path: str | None = None,
                 metrics: CollectorRegistry | None = None, heartbeat_s: float = 1.0, retry_s: float = 1.0,
                 max_retry_s: float = 10.0, clock: Callable[[], float] = time.monotonic, readonly: bool = False):
        self.registry = registry
        self.prefix = prefix
        self.watched = nodes_prefix(prefix)
        self.pools = frozenset(pools)
        self.heartbeat_s, self.retry_s, self.max_retry_s = heartbeat_s, retry_s, max_retry_s
        self.clock = clock
        self.readonly = readonly  # a dry run reads the snapshot file and never writes it
        self.metrics = DiscoveryMetrics.create(metrics or CollectorRegistry())
        self.metrics.snapshot_age.set_function(self.snapshot_age)
        self.snapshot = Snapshot(snapshot_path) if snapshot_path else None
        self.departed_file = Snapshot(Path(snapshot_path).with_name(Path(snapshot_path).name + ".departed")) \
            if snapshot_path else None
        self.state: Membership | None = None  # None: no snapshot and never listed (membership does nothing)
        self.up = False
        self.last_ok: float | None = None  # when the snapshot was last known current (clock)
        self._lock = threading.Lock()  # one writer of `state`: the thread or forget()
        self._io = threading.Lock()  # the Registry serves one caller at a time (the watch has its own session)
        self._stop = threading.Event()
        self._watch_stop = threading.Event()
        self._synced = threading.Event()
        self._dirty = False
        self._invalid: dict[str, str] = {}
        self._threads: list[threading.Thread] = []

    # ---- the tick's side ------------------------------------------------------------------------
    def view(self, pool: str) -> PoolView | None:
        """The pool's registrations and departures; None before anything is known (no snapshot, never listed)."""
        st = self.state
        if st is None:
            return None
        return PoolView(nodes=dict(st.nodes.get(pool, {})), departed=dict(st.departed.get(pool, {})), fresh=self.up)

    def forget(self, pool: str, node: str) -> None:
        """Drop a departed node: membership has removed its server from every HAProxy."""
        with self._lock:
            st = self.state
            if st is None or node not in st.departed.get(pool, {}):
                return
            departed = {p: dict(ns) for p, ns in st.departed.items()}
            del departed[pool][node]
            self._swap(Membership(st.nodes, departed, st.revision))

    def snapshot_age(self) -> float:
        """Seconds since the snapshot was last known current; 0 before anything was ever listed and loaded."""
        return 0.0 if self.last_ok is None else max(0.0, self.clock() - self.last_ok)

    def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the first listing is in (True), or timeout_s (False: etcd unreachable, snapshot or nothing)."""
        return self._synced.wait(timeout_s)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Discovery:
        """Load the snapshot file, then follow the registry in a daemon thread (and heartbeat it in another)."""
        self._load()
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, name="discovery", daemon=True),
                         threading.Thread(target=self._heartbeat, name="discovery-heartbeat", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following; the snapshot is written if it changed."""
        self._stop.set()
        self._watch_stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._save()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        reason, delay = "start", self.retry_s
        while not self._stop.is_set():
            try:
                with self._io:
                    entries, revision = self.registry.get_prefix(self.watched)
            except RegistryError as e:
                self._down(e)
                self._stop.wait(delay)
                delay, reason = min(self.max_retry_s, delay * 2), "reconnect"
                continue
            self.metrics.relists.labels(reason).inc()
            self._apply_list({k: e.value for k, e in entries.items()}, revision)
            self._watch_stop = threading.Event()
            if self._stop.is_set():
                break
            self._set_up()
            self._synced.set()
            delay = self.retry_s
            try:
                for ev in self.registry.watch_prefix(self.watched, revision + 1, self._watch_stop,
                                                     idle_timeout=max(5.0, 5 * self.heartbeat_s)):
                    self._apply_event(ev)
                    self.last_ok = self.clock() if self.up else self.last_ok
                reason = "reconnect"  # stopped: by stop(), or by a failed heartbeat (which marked it down)
            except RegistryError as e:
                if e.kind == "compacted":
                    log.info("registry: %s; listing again", e)
                    reason = "compacted"
                    continue
                self._down(e)
                reason = "reconnect"
                self._stop.wait(delay)

    def _heartbeat(self) -> None:
        """Every heartbeat_s: confirm etcd answers while watching (a silent partition does not end a stream at once),
        and write the snapshot file if it changed."""
        while not self._stop.wait(self.heartbeat_s):
            self._save()
            if not self.up:
                continue
            try:
                with self._io:
                    self.registry.revision()
            except RegistryError as e:
                self._down(e)
                self._watch_stop.set()  # the watch ends; the thread lists again once etcd answers
                continue
            if self.up:
                self.last_ok = self.clock()

    def _set_up(self) -> None:
        was = self.up
        self.last_ok = self.clock()
        self.up = True
        self.metrics.up.set(1)
        if not was:
            st = self.state
            n = sum(len(ns) for ns in st.nodes.values()) if st else 0
            log.info("registry %s: following %s (%d registration(s), revision %d)", self.registry.url, self.watched,
                     n, st.revision if st else 0)

    def _down(self, e: RegistryError) -> None:
        self.metrics.errors.labels(e.kind).inc()
        if self.up or self.last_ok is None:
            age = self.snapshot_age()
            log.warning("registry unreachable (%s): membership frozen on the last snapshot (%s); nothing is removed "
                        "until it answers", e, "none" if self.state is None else f"{age:.0f}s old")
        self.up = False
        self.metrics.up.set(0)
        if self.last_ok is None:
            self.last_ok = self.clock()  # the age counts from the first failure when nothing was ever current

    # ---- applying what etcd says ---------------------------------------------------------------
    def _record(self, key: str, value: str) -> NodeRecord | None:
        """The record under key; None (logged once, counted) when the key or value is not one."""
        try:
            pool, node = parse_node_key(self.prefix, key)
            rec = NodeRecord.from_json(value)
            if (rec.pool, rec.node) != (pool, node):
                raise RecordError(f"names {rec.pool}/{rec.node}, its key {pool}/{node}")
        except ValueError as e:
            if self._invalid.get(key) != str(e):
                log.warning("registry: ignoring %s: %s (the last valid value, if any, stands)", key, e)
            self._invalid[key] = str(e)
            self.metrics.invalid.set(len(self._invalid))
            return None
        if self._invalid.pop(key, None) is not None:
            self.metrics.invalid.set(len(self._invalid))
        return rec

    def _apply_list(self, values: Mapping[str, str], revision: int) -> None:
        """Replace the snapshot with a full listing; keys gone since the last one are departures."""
        with self._lock:
            old = self.state or Membership()
            nodes: dict[str, dict[str, NodeRecord]] = {}
            for key, value in values.items():
                rec = self._record(key, value)
                if rec is None:  # an invalid value: its key is still there, the last valid record stands
                    try:
                        pool, node = parse_node_key(self.prefix, key)
                    except ValueError:
                        continue
                    rec = old.nodes.get(pool, {}).get(node)
                    if rec is None:
                        continue
                nodes.setdefault(rec.pool, {})[rec.node] = rec
            for gone in set(self._invalid) - set(values):
                self._invalid.pop(gone)
            self.metrics.invalid.set(len(self._invalid))
            departed = {p: dict(ns) for p, ns in old.departed.items()}
            for pool, ns in old.nodes.items():
                for node, rec in ns.items():
                    if node not in nodes.get(pool, {}):
                        departed.setdefault(pool, {})[node] = rec
            for pool, ns in nodes.items():
                for node in ns:
                    departed.get(pool, {}).pop(node, None)
            self._swap(Membership(nodes, self._registry_pools(departed), revision))

    def _apply_event(self, ev: WatchEvent) -> None:
        with self._lock:
            st = self.state or Membership()
            try:
                pool, node = parse_node_key(self.prefix, ev.key)
            except ValueError:
                self._record(ev.key, ev.value)  # logged once and counted
                return
            nodes = {p: dict(ns) for p, ns in st.nodes.items()}
            departed = {p: dict(ns) for p, ns in st.departed.items()}
            if ev.kind == "put":
                rec = self._record(ev.key, ev.value)
                if rec is None:
                    return
                nodes.setdefault(pool, {})[node] = rec
                departed.get(pool, {}).pop(node, None)
            else:
                self._invalid.pop(ev.key, None)
                last = nodes.get(pool, {}).pop(node, None)
                if last is None and ev.prev_value:  # never had a valid value of it: etcd's last one, if valid
                    last = self._record(ev.key, ev.prev_value)
                if last is not None:
                    departed.setdefault(pool, {})[node] = last
            self._swap(Membership(nodes, self._registry_pools(departed), ev.revision))

    def _registry_pools(self, departed: dict[str, dict[str, NodeRecord]]) -> dict[str, dict[str, NodeRecord]]:
        """Departures matter only for the pools membership manages: the others are not kept."""
        return {p: ns for p, ns in departed.items() if p in self.pools and ns}

    def _swap(self, st: Membership) -> None:
        """Publish a new snapshot (one reference assignment: a reader sees the old one or the new one)."""
        old = self.state
        self.state = st
        for pool in self.pools:
            self.metrics.nodes.labels(pool).set(sum(1 for r in st.nodes.get(pool, {}).values()
                                                    if r.state == "serving"))
        if old is None or old.nodes != st.nodes or old.departed != st.departed:
            self._dirty = True

    # ---- the snapshot file -----------------------------------------------------------------------
    def _load(self) -> None:
        if self.snapshot is None or self.state is not None:
            return
        try:
            got = self.snapshot.load()
            gone = self.departed_file.load() if self.departed_file else None
        except (SnapshotError, OSError) as e:
            self.metrics.snapshot_errors.inc()
            log.error("registry snapshot: %s; starting without one", e)
            return
        if got is None:
            return
        records, revision = got
        nodes: dict[str, dict[str, NodeRecord]] = {}
        for r in records.values():
            nodes.setdefault(r.pool, {})[r.node] = r
        departed: dict[str, dict[str, NodeRecord]] = {}
        for r in (gone[0] if gone else {}).values():
            if r.node not in nodes.get(r.pool, {}):
                departed.setdefault(r.pool, {})[r.node] = r
        with self._lock:
            self._swap(Membership(nodes, self._registry_pools(departed), revision))
            self._dirty = False
        log.info("registry snapshot %s loaded: %d registration(s) at revision %d (used until etcd answers)",
                 self.snapshot.path, sum(len(ns) for ns in nodes.values()), revision)

    def _save(self) -> None:
        """Write the snapshot (and its departures) if it changed; a failure is counted, logged, retried later."""
        st = self.state
        if not self._dirty or st is None or self.snapshot is None or self.readonly:
            return
        self._dirty = False
        try:
            self.snapshot.save({node_key(self.prefix, r.pool, r.node): r
                                for ns in st.nodes.values() for r in ns.values()}, st.revision)
            if self.departed_file is not None:
                self.departed_file.save({node_key(self.prefix, r.pool, r.node): r
                                         for ns in st.departed.values() for r in ns.values()}, st.revision)
        except OSError as e:
            self._dirty = True
            self.metrics.snapshot_errors.inc()
            log.error("registry snapshot %s: cannot write it: %s", self.snapshot.path, e.strerror or e)
