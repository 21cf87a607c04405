"""The node's membership in etcd: pre-checks (asked as the node's engine answers: RegistrationConfig.engine, the
exporter's --engine), then a key on its own lease, kept alive every heartbeat with an
adaptive TTL (the first lease: a few configured heartbeats); "leaving" then a revoke on a graceful stop;
registered again after a lost lease or an etcd restart (docs/exporters.md, "Registry"; the contract is
grayguard/registry.py)."""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import requests
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from grayguard.engines import DEFAULT_ENGINE
from grayguard.etcdconn import EtcdSettings
from grayguard.exporters.gpumetrics import NvmlSnapshot
from grayguard.exporters.precheck import CHECKS, Prechecks, numa_node_of, run_prechecks
from grayguard.health import Beat
from grayguard.registry import (
    DEFAULT_PREFIX,
    ERROR_KINDS,
    TTL_WINDOW,
    NodeRecord,
    Registry,
    RegistryError,
    adaptive_ttl,
    first_ttl,
    node_key,
)

log = logging.getLogger(__name__)
RESULTS = ("ok", "lost", "error")  # heartbeat results: kept alive; etcd no longer knows the lease; no answer
VERIFY_EVERY = 15  # heartbeats between two reads of the node's own key (someone may have deleted it)


@dataclass(frozen=True)
class RegistrationConfig:
    """What --registry.* says (exporters/cli.py maps the flags one to one)."""

    url: str  # etcd client URL (the first endpoint, for the logs)
    pool: str
    node: str
    advertise: str  # host:port of vLLM for HAProxy
    exporter: str | None = None  # host:port of this exporter; None: the advertised host, the bound /metrics port
    prefix: str = DEFAULT_PREFIX
    heartbeat: float = 2.0  # seconds between keep-alives (and between pre-check retries)
    ttl_min: float = 5.0  # adaptive TTL clamp (s)
    ttl_max: float = 60.0
    leave_grace: float = 1.0  # "leaving" is visible this long before the lease is revoked
    timeout: float = 2.0  # longest wait for one etcd or vLLM call
    max_concurrency: int | None = None  # vLLM --max-num-seqs, for the record; None: unknown
    model: str | None = None  # the model that must be loaded (--probe.model); None: the first listed
    api_key_file: str | None = None  # the probe's API key (--probe.api-key-file, re-read at every try)...
    api_key_env: str | None = "VLLM_API_KEY"  # ...or its environment variable (--probe.api-key-env)
    # how to reach etcd (every --registry.url, TLS files, the etcd user; grayguard/etcdconn.py); None: url alone
    etcd: EtcdSettings | None = None
    # the node's engine (grayguard/engines.py): how the pre-checks ask for the model and the version (the Exporter
    # sets the one it probes with, --engine)
    engine: str = DEFAULT_ENGINE


def api_key_reader(key_file: str | None, key_env: str | None,
                   env: Mapping[str, str] = os.environ) -> Callable[[], str | None]:
    """The probe's API key, read when called: the file (wins) or the environment variable."""
    said: list[str] = []  # the last read error, logged once

    def read() -> str | None:
        if key_file:
            try:
                with open(key_file, encoding="utf-8") as f:
                    key = f.read().strip() or None
                said.clear()
                return key
            except OSError as e:
                if said != [str(e)]:
                    log.warning("registry pre-check: cannot read API key file %s: %s", key_file, e)
                    said[:] = [str(e)]
                return None
        return env.get(key_env) if key_env else None
    return read


def material_change(current: int, new: int) -> bool:
    """True when a new TTL differs enough from the lease's to re-grant: by 25 % and at least 1 s."""
    return abs(new - current) >= max(1.0, 0.25 * current)


class Registrar:
    """Registers one node and keeps it registered, in a daemon thread: `start()`, then `stop(leave=True)`.

    Pre-checks gate registration only: a registered node that turns sick stays registered, so the
    controller keeps seeing it and drains it through HAProxy (leaving would hide it). stop(leave=False)
    stops heartbeating without leaving, as a crash would (the key expires with the lease).
    """

    def __init__(self, config: RegistrationConfig, *, vllm_url: str, registry: CollectorRegistry | None = None,
                 nvml_snapshot: Callable[[], NvmlSnapshot] | None = None,
                 api_key: Callable[[], str | None] = lambda: None, client: Registry | None = None,
                 session: requests.Session | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, numa_of: Callable[[str], int | None] = numa_node_of):
        self.config = config
        self.key = node_key(config.prefix, config.pool, config.node)
        self.exporter = config.exporter
        self.agent = ""  # the agent check's host:port for the record (start)
        self._vllm_url, self._nvml_snapshot, self._api_key = vllm_url, nvml_snapshot, api_key
        self._client = client or Registry(config.etcd or config.url, timeout=config.timeout)
        self._session = session or requests.Session()
        self._session.trust_env = False  # the local vLLM, never through a proxy
        self._clock, self._wall, self._numa_of = clock, wall, numa_of
        self._lock = threading.Lock()  # guards what the collector reads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease: int | None = None
        self.record: NodeRecord | None = None
        self.prechecks = Prechecks()
        self._claimed = False  # registered, as far as this process can tell
        self._last_ok: float | None = None  # clock() of the last successful keep-alive (or the grant)
        self._granted: int | None = None  # the TTL etcd says the lease has (it may raise a short one to its minimum)
        self._intervals: collections.deque[float] = collections.deque(maxlen=TTL_WINDOW)
        self._beats = dict.fromkeys(RESULTS, 0)
        self._errors = dict.fromkeys(ERROR_KINDS, 0)
        self._verify_in = VERIFY_EVERY
        self._said = ""  # the last problem logged, so a repeated one is not logged every heartbeat
        self.rounds = Beat(clock)  # every completed round, failed ones too: /healthz watches it (exporters/liveness.py)
        if registry is not None:
            registry.register(_Collector(self))

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, exporter: str | None = None, agent: str = "") -> Registrar:
        """Begin registering (pre-checks first) in the background; exporter: this exporter's host:port; agent: its
        HAProxy agent check's host:port ("" without one), so a server added from the registry gets its agent."""
        if exporter is not None:
            self.exporter = exporter
        self.agent = agent
        if self.exporter is None:
            raise ValueError("the exporter's host:port is needed for the record")
        self.rounds = Beat(self._clock)  # the loop starts now
        self._thread = threading.Thread(target=self._run, name="registry", daemon=True)
        self._thread.start()
        return self

    def stop(self, leave: bool = True) -> None:
        """Stop heartbeating; with leave, write "leaving", wait leave_grace, revoke the lease (the key goes)."""
        self._stop.set()
        if self._thread is not None:  # every call of a round is bounded: a round ends within a few timeouts
            self._thread.join(8 * self.config.timeout + self.config.heartbeat)
        lease, record = self.lease, self.record
        if leave and lease is not None and record is not None:
            self._leave(lease, record)
        with self._lock:
            self._claimed, self.lease = False, None

    def _leave(self, lease: int, record: NodeRecord) -> None:
        try:
            self._client.put(self.key, record.leaving().to_json(), lease=lease)
            log.info("registry: %s leaving (deregistering in %gs)", self.key, self.config.leave_grace)
            time.sleep(self.config.leave_grace)  # watchers see "leaving" before the key goes
            self._client.revoke(lease)
            log.info("registry: %s deregistered (lease revoked)", self.key)
        except RegistryError as e:
            if e.kind != "lease_gone":
                log.warning("registry: could not deregister %s (%s): it expires with its lease within %ss",
                            self.key, e, record.ttl_s)

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            try:
                delay = self.step()
            except Exception:  # never let a surprise end registration: log it and retry at the next heartbeat
                log.exception("registry: unexpected error")
                delay = self.config.heartbeat
            self.rounds.done()

    def step(self) -> float:
        """One round: register (pre-checks first) when not registered, else one heartbeat; seconds to wait."""
        started = self._clock()
        if self.lease is None:
            self._register()
        elif not self._heartbeat():
            return 0.0  # the lease is gone: register again at once
        return max(0.0, self.config.heartbeat - (self._clock() - started))

    # --- registering -------------------------------------------------------------------------
    def _register(self) -> None:
        cfg = self.config
        checks = run_prechecks(nvml_snapshot=self._nvml_snapshot, advertise=cfg.advertise, vllm_url=self._vllm_url,
                               api_key=self._api_key(), model=cfg.model, session=self._session,
                               timeout=cfg.timeout, numa_of=self._numa_of, engine=cfg.engine)
        with self._lock:
            self.prechecks = checks
        if not checks.ok:
            self._say(logging.WARNING, f"not registering {self.key}: pre-check failed: {checks.failures()} "
                                       f"(retrying every {cfg.heartbeat:g}s)")
            return
        ttl = self._ttl()
        assert self.exporter is not None
        record = NodeRecord(pool=cfg.pool, node=cfg.node, endpoint=cfg.advertise, exporter=self.exporter,
                            model=checks.model or "", version=checks.version, gpu=checks.gpu,
                            max_concurrency=cfg.max_concurrency, registered_at=round(self._wall(), 3), ttl_s=ttl,
                            agent=self.agent)
        lease = self._write(record)
        if lease is None:
            return
        with self._lock:
            self.lease, self.record, self._claimed, self._granted = lease, record, True, None
            self._last_ok = self._clock()
        self._verify_in = VERIFY_EVERY
        self._say(logging.INFO, f"registered {self.key}: {record.endpoint} serving {record.model} "
                                f"(lease {lease:x}, TTL {ttl}s)")

    def _write(self, record: NodeRecord) -> int | None:
        """Grant a lease of record.ttl_s and put record on it; the lease, or None (logged, counted)."""
        lease = None
        try:
            lease = self._client.grant(record.ttl_s)
            self._client.put(self.key, record.to_json(), lease=lease)
            return lease
        except RegistryError as e:
            self._count_error(e)
            self._say(logging.WARNING, f"cannot register {self.key} at {self.config.url}: {e}")
            if lease is not None:
                self._revoke_quietly(lease)
            return None

    def _ttl(self) -> int:
        """The TTL to ask for: adaptive to the measured intervals; before two are, first_ttl of the configured
        heartbeat and timeout (8 s by default), not ttl_max: a node that dies right after joining goes soon."""
        cfg = self.config
        first = first_ttl(cfg.heartbeat, cfg.timeout, cfg.ttl_min, cfg.ttl_max)
        return math.ceil(adaptive_ttl(list(self._intervals), cfg.ttl_min, cfg.ttl_max, first=first))

    # --- heartbeats --------------------------------------------------------------------------
    def _heartbeat(self) -> bool:
        """Keep the lease alive; False when it is gone (registration starts over)."""
        assert self.lease is not None and self.record is not None
        try:
            left = self._client.keep_alive(self.lease)
        except RegistryError as e:
            self._count_error(e)
            with self._lock:
                self._beats["error"] += 1
                ttl = self._granted or self.record.ttl_s
                if self._last_ok is not None and self._clock() - self._last_ok > ttl:
                    self._claimed = False  # the lease has run out unless etcd stopped its clock: check on return
            self._verify_in = 0
            self._say(logging.WARNING, f"heartbeat of {self.key} failed: {e} (retrying every "
                                       f"{self.config.heartbeat:g}s)")
            return True
        if left <= 0:
            with self._lock:
                self._beats["lost"] += 1
                self.lease, self._claimed = None, False
            self._say(logging.WARNING, f"lease of {self.key} is gone (expired, or etcd lost its data): "
                                       "registering again")
            return False
        now = self._clock()
        with self._lock:
            self._beats["ok"] += 1
            self._granted = left
            if self._last_ok is not None:
                self._intervals.append(max(1e-3, now - self._last_ok))
            self._last_ok = now
        self._verify_in -= 1
        if self._verify_in <= 0 and not self._verify():
            return True
        with self._lock:
            self._claimed = True
        if self._said:
            self._say(logging.INFO, f"heartbeats of {self.key} succeed again")
        new = self._ttl()
        if material_change(self.record.ttl_s, new):
            self._regrant(new)
        return True

    def _verify(self) -> bool:
        """Read the node's own key; write it again when missing or changed. False when etcd did not answer."""
        assert self.lease is not None and self.record is not None
        try:
            entry = self._client.get(self.key)
            if entry is None or entry.lease != self.lease or entry.value != self.record.to_json():
                self._client.put(self.key, self.record.to_json(), lease=self.lease)
                log.warning("registry: %s was %s: written again", self.key, "missing" if entry is None else "changed")
        except RegistryError as e:
            self._count_error(e)
            return False
        self._verify_in = VERIFY_EVERY
        return True

    def _regrant(self, ttl: int) -> None:
        """Move the key to a new lease of ttl (the adaptive TTL moved), then revoke the old lease."""
        assert self.lease is not None and self.record is not None
        old, old_ttl, record = self.lease, self.record.ttl_s, replace(self.record, ttl_s=ttl)
        lease = self._write(record)
        if lease is None:
            return  # the old lease still holds the key; tried again at the next heartbeat
        with self._lock:
            self.lease, self.record, self._granted = lease, record, None
        self._revoke_quietly(old)
        log.info("registry: %s lease TTL %ds -> %ds (heartbeat intervals %s s)", self.key, old_ttl, ttl,
                 ", ".join(f"{x:.2f}" for x in self._intervals))

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self._client.revoke(lease)
        except RegistryError as e:
            log.debug("registry: revoking lease %x: %s (it expires by itself)", lease, e)

    def _count_error(self, e: RegistryError) -> None:
        with self._lock:
            self._errors[e.kind] = self._errors.get(e.kind, 0) + 1

    def _say(self, level: int, message: str) -> None:
        """Log message, unless it repeats the last problem; INFO messages clear the memory."""
        if level >= logging.WARNING and message == self._said:
            return
        self._said = message if level >= logging.WARNING else ""
        log.log(level, "registry: %s", message)

    # --- read by the collector and the tests -------------------------------------------------
    @property
    def registered(self) -> bool:
        """True while this process believes its key is in etcd."""
        return self._claimed

    def sample(self) -> dict[str, object]:
        """A consistent copy of what /metrics shows."""
        with self._lock:
            age = None if self._last_ok is None or self.lease is None else self._clock() - self._last_ok
            ttl = (self._granted or self.record.ttl_s) if self.lease and self.record else None
            return {"registered": self._claimed, "ttl": ttl,
                    "age": age, "beats": dict(self._beats), "errors": dict(self._errors),
                    "checks": {c.name: c.ok for c in self.prechecks.checks}}


class _Collector:
    """grayguard_registry_* from the Registrar's state at scrape time."""

    def __init__(self, registrar: Registrar):
        self._r = registrar

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        reg, ttl, age, checks, beats, errors = self._families()
        s = self._r.sample()
        reg.add_metric([], 1 if s["registered"] else 0)
        if s["ttl"] is not None:
            ttl.add_metric([], s["ttl"])
        if s["age"] is not None:
            age.add_metric([], s["age"])
        for name in CHECKS:  # a check that has not been judged is absent, not failed
            if name in s["checks"]:  # type: ignore[operator]
                checks.add_metric([name], 1 if s["checks"][name] else 0)  # type: ignore[index]
        for result, n in s["beats"].items():  # type: ignore[attr-defined]
            beats.add_metric([result], n)
        for kind, n in s["errors"].items():  # type: ignore[attr-defined]
            errors.add_metric([kind], n)
        yield from (reg, ttl, age, checks, beats, errors)

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        g = GaugeMetricFamily
        return (g("grayguard_registry_registered", "1 while the node's key is in etcd, as far as the exporter knows"),
                g("grayguard_registry_lease_ttl_seconds", "TTL of the node's lease (adaptive to its heartbeats), "
                  "as etcd granted it"),
                g("grayguard_registry_last_heartbeat_age_seconds", "Seconds since the last successful keep-alive"),
                g("grayguard_registry_precheck_ok", "1 when the registration pre-check passed at the last try",
                  labels=["check"]),
                CounterMetricFamily("grayguard_registry_heartbeats", "Lease keep-alives by result", labels=["result"]),
                CounterMetricFamily("grayguard_registry_errors", "Failed etcd calls by kind", labels=["kind"]))
