"""`grayguard actuator`: the sidecar beside each HAProxy of a gateway tier (`haproxy.writer: actuators`).

Every --interval it reads the leader's desired state of every pool from the registry (<prefix>/desired/, one range
read; controller/desired.py), reads its own HAProxy (`show servers state`, on the pod-local admin socket), plans
with the controller's own `plan_backend` and writes the differences in one batch. Level-triggered: a restarted
HAProxy, a lost write or an actuator that was down converges at its next round; a converged HAProxy gets no write.
It never decides anything: what it applies is what a leader put in etcd under its leader key. With
--view.listen-address it also serves the controller the read-only view of this HAProxy (controller/runtime_view.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from grayguard import etcdconn, terminate
from grayguard.config import ConfigError
from grayguard.controller import desired as desired_doc
from grayguard.controller.haproxy import HaproxyError, RuntimeClient, ServerState
from grayguard.controller.plan import Change, plan_backend
from grayguard.controller.runtime_view import RuntimeView, request_counter
from grayguard.exporters.cli import parse_duration, parse_listen_address
from grayguard.registry import DEFAULT_PREFIX, Registry, RegistryError, nodes_prefix

HELP = "apply the leader's desired HAProxy weights to this HAProxy (a sidecar of each gateway replica)"
DESCRIPTION = """\
Beside each HAProxy of a gateway tier driven with `haproxy.writer: actuators` (Kubernetes: the runtime API
never leaves the HAProxy pod). Every --interval: read the desired state the leading controller published
(<prefix>/desired/<pool> in etcd), read this HAProxy's `show servers state` on its admin socket, and write
only the differences (drains, then weights, then returns to ready, then agent checks), in one batch.
With --view.listen-address it serves the controller a read-only view of this HAProxy: `show servers
state` and `show stat` only; every other command is refused.

examples:
  grayguard actuator --registry.url http://etcd:2379 --haproxy.socket unix:/run/haproxy/admin.sock \\
      --view.listen-address :9999
  grayguard actuator --registry.url http://etcd:2379 --once --dry-run   # print this HAProxy's plan, write nothing
  grayguard actuator --registry.url https://etcd-0:2379 --registry.url https://etcd-1:2379 \\
      --registry.ca-file ca.pem --registry.cert-file client.pem --registry.key-file client.key \\
      --registry.user grayguard --registry.password-file /run/secrets/etcd-password   # TLS and an etcd user
"""
log = logging.getLogger("grayguard.actuator")


class ActuatorMetrics:
    """The actuator's own series, on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rounds = Counter("grayguard_actuator_rounds", "Actuator rounds by result (ok; registry or haproxy: "
                              "that read failed and nothing was written)", ["result"], registry=r)
        self.writes = Counter("grayguard_actuator_writes", "Runtime-API writes applied, by kind (weight, state, "
                              "agent)", ["kind"], registry=r)
        self.write_errors = Counter("grayguard_actuator_write_errors", "Writes HAProxy refused or a batch that "
                                    "failed, by kind", ["kind"], registry=r)
        self.invalid = Counter("grayguard_actuator_invalid_documents", "Desired-state documents that could not be "
                               "applied (left as they were), by reason: version (another major version: a newer "
                               "leader's; upgrade the actuators) or invalid", ["reason"], registry=r)
        for reason in ("version", "invalid"):  # both shown from the start: 0, not absent
            self.invalid.labels(reason)
        self.pools = Gauge("grayguard_actuator_pools", "Pools whose desired state this HAProxy applies", registry=r)
        self.view_requests = request_counter(r)
        self.last_success = Gauge("grayguard_actuator_last_success_timestamp_seconds", "Unix time of the last round "
                                  "that read both the registry and HAProxy and applied every change", registry=r)


@dataclass
class RoundResult:
    """What one round saw and did."""

    changes: list[Change] = field(default_factory=list)
    failed: list[tuple[Change, str]] = field(default_factory=list)  # (change, HAProxy's reply)
    error: str | None = None  # a read or the batch failed
    pools: tuple[str, ...] = ()  # the pools applied to this HAProxy


class Actuator:
    """Applies the desired state of every published pool (or of `pools`) to one HAProxy; every seam injected."""

    def __init__(self, registry: Registry, haproxy: RuntimeClient, prefix: str = DEFAULT_PREFIX, *,
                 pools: frozenset[str] = frozenset(), metrics: ActuatorMetrics | None = None, dry_run: bool = False,
                 clock: Callable[[], float] = time.time):
        self.registry, self.haproxy, self.prefix, self.only = registry, haproxy, prefix, pools
        self.metrics, self.dry_run, self.clock = metrics or ActuatorMetrics(), dry_run, clock
        self._said: set[str] = set()  # problems already logged (once each, until they clear)

    def read_desired(self) -> dict[str, desired_doc.Desired]:
        """pool -> its desired state, each valid document under <prefix>/desired/; RegistryError when etcd fails."""
        entries, _ = self.registry.get_prefix(desired_doc.desired_prefix(self.prefix))
        out = {}
        for key, e in sorted(entries.items()):
            try:
                d = desired_doc.load(e.value)
                if key != desired_doc.desired_key(self.prefix, d.pool):
                    raise desired_doc.DesiredError(f"pool {d.pool!r} under another pool's key")
            except desired_doc.DesiredError as err:
                self.metrics.invalid.labels("version" if isinstance(err, desired_doc.DesiredVersionError)
                                            else "invalid").inc()
                self._once(f"invalid:{key}:{e.mod_revision}",
                           f"{key} (revision {e.mod_revision}) left as it was: {err}")
                continue
            if not self.only or d.pool in self.only:
                out[d.pool] = d
        return out

    def round(self) -> RoundResult:
        """Read, plan, write once; never raises for I/O trouble (it is counted and the next round tries again)."""
        res = RoundResult()
        try:
            docs = self.read_desired()
            servers = self.haproxy.show_servers_state()
        except RegistryError as e:
            return self._failed(res, "registry", f"registry {self.registry.url}: {e}")
        except HaproxyError as e:
            return self._failed(res, "haproxy", f"HAProxy {self.haproxy.endpoint}: {e}")
        by_backend: dict[str, dict[str, ServerState]] = {}
        for s in servers:
            by_backend.setdefault(s.backend, {})[s.name] = s
        for pool, d in sorted(docs.items()):
            actual = by_backend.get(d.backend)
            if actual is None:
                self._once(f"backend:{d.backend}", f"pool={pool}: this HAProxy has no backend {d.backend!r}: skipped")
                continue
            res.pools += (pool,)
            res.changes += plan_backend(pool, d.backend, d.decisions(), actual, d.agent_off)
        self.metrics.pools.set(len(res.pools))
        for c in res.changes:
            log.info("%s%s %s", "[dry-run] " if self.dry_run else "", self.haproxy.endpoint, c.describe())
        if res.changes and not self.dry_run:
            try:
                replies = self.haproxy.apply([c.command for c in res.changes])
            except HaproxyError as e:
                self.metrics.write_errors.labels(e.kind).inc()
                return self._failed(res, "haproxy", f"HAProxy {self.haproxy.endpoint}: batch not applied: {e}")
            for c, r in zip(res.changes, replies, strict=True):
                if r.ok:
                    self.metrics.writes.labels(c.command.kind).inc()
                else:
                    self.metrics.write_errors.labels(r.kind).inc()
                    res.failed.append((c, r.reply))
                    log.error("HAProxy %s refused %r: %s", self.haproxy.endpoint, c.command.render(), r.reply)
        self.metrics.rounds.labels("ok").inc()
        if not res.failed:
            self.metrics.last_success.set(self.clock())
            self._said = {k for k in self._said if k.startswith(("invalid:", "backend:"))}  # read errors cleared
        return res

    def _failed(self, res: RoundResult, source: str, why: str) -> RoundResult:
        res.error = why
        self.metrics.rounds.labels(source).inc()
        self._once(f"error:{source}:{why}", f"{why}: nothing written this round")
        return res

    def _once(self, key: str, msg: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", msg)


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    etcdconn.add_flags(p, required=True, url_help="etcd's v3 HTTP gateway, as the controller's registry.url or "
                       "endpoints (e.g. https://etcd-0:2379)")  # TLS files and the etcd user: as the exporter's
    a("--registry.prefix", dest="registry_prefix", default=DEFAULT_PREFIX, metavar="PREFIX",
      help=f"the controller's registry.prefix (default {DEFAULT_PREFIX})")
    a("--registry.timeout", dest="registry_timeout", type=parse_duration, default="2s", metavar="DURATION",
      help="deadline of one registry call (default 2s)")
    a("--haproxy.socket", dest="haproxy_socket", default="unix:/run/haproxy/admin.sock", metavar="ENDPOINT",
      help="this HAProxy's admin runtime API, pod-local (default unix:/run/haproxy/admin.sock)")
    a("--haproxy.timeout", dest="haproxy_timeout", type=parse_duration, default="2s", metavar="DURATION",
      help="deadline of one runtime-API batch (default 2s)")
    a("--interval", type=parse_duration, default="500ms", metavar="DURATION",
      help="time between rounds (default 500ms: within one controller tick of a change)")
    a("--pool", dest="pools", action="append", default=[], metavar="NAME",
      help="apply only this pool (repeat for several; default: every pool the leader publishes)")
    a("--web.listen-address", dest="listen", type=parse_listen_address, default="127.0.0.1:9310", metavar="HOST:PORT",
      help="where to serve /metrics, /healthz and /readyz (default 127.0.0.1:9310; ':9310' = all interfaces)")
    a("--view.listen-address", dest="view", type=parse_listen_address, default=None, metavar="HOST:PORT",
      help="serve the controller a read-only view of this HAProxy here (show servers state, show stat; "
           "everything else refused); default: off")
    a("--once", action="store_true", help="run one round, print its plan and exit (1 if it failed)")
    a("--dry-run", action="store_true", help="plan, log, write nothing")


def config_error(args: argparse.Namespace) -> str | None:
    """The first invalid flag, named, or None."""
    try:
        etcdconn.settings_from_flags(args)  # the URLs, TLS files and password, loaded once
    except ConfigError as e:
        return str(e)
    try:
        nodes_prefix(args.registry_prefix)
    except ValueError as e:
        return f"--registry.prefix: {e}"
    if args.interval <= 0 or args.registry_timeout <= 0 or args.haproxy_timeout <= 0:
        return "--interval, --registry.timeout and --haproxy.timeout must be positive"
    if args.view is not None and args.view[1] == args.listen[1] != 0:
        return "--view.listen-address must differ from --web.listen-address"
    return None


def run(args: argparse.Namespace) -> int:
    """Round every --interval until SIGTERM/SIGINT; 2 on a bad flag, 1 when an address cannot be bound."""
    error = config_error(args)
    if error:
        print(f"grayguard: actuator: {error}", file=sys.stderr)
        return 2
    metrics = ActuatorMetrics()
    hap = RuntimeClient(args.haproxy_socket, args.haproxy_timeout)
    act = Actuator(Registry(etcdconn.settings_from_flags(args)), hap, args.registry_prefix,
                   pools=frozenset(args.pools), metrics=metrics, dry_run=args.dry_run)
    if args.once:
        res = act.round()
        for c in res.changes:
            print(f"plan: {hap.endpoint}: {c.command.render()}    # {c.reason}")
        print(res.error or f"pools: {', '.join(res.pools) or 'none'}; {len(res.changes)} change(s)")
        return 1 if res.error or res.failed else 0
    from grayguard.controller.ticker import Periodic
    from grayguard.health import Beat, probe, readiness, stall_limit_s
    from grayguard.httpserve import metrics_handler
    from grayguard.httpserve import serve as serve_routes

    beat = Beat()
    # a round waits on etcd, then on HAProxy: past twice that and 10 rounds (at least 10 s) the loop is stalled
    limit = stall_limit_s(args.interval, args.registry_timeout + args.haproxy_timeout)
    routes = {"GET /metrics": metrics_handler(metrics.registry),
              "GET /healthz": probe(lambda: beat.health(limit, "round")),
              "GET /readyz": probe(lambda: readiness(beat.completed, what="round"))}
    try:
        view = RuntimeView(args.view, hap, metrics.view_requests).start() if args.view else None
        srv = serve_routes(f"{args.listen[0]}:{args.listen[1]}", routes, name="actuator-http", logger=log)
    except OSError as e:
        print(f"grayguard: actuator: cannot listen: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    def round_() -> None:
        try:
            act.round()
        finally:
            beat.done()

    job = Periodic("actuator", round_, args.interval, stop).start()
    log.info("actuator: %s -> %s every %gs%s%s", ", ".join(args.registry_url), hap.endpoint, args.interval,
             f"; read-only view on {args.view[0]}:{args.view[1]}" if view else "", " (dry run)" if args.dry_run else "")
    terminate.wait(stop)  # timed: a SIGTERM delivered to a worker thread is still seen (grayguard/terminate.py)
    job.join()
    if view is not None:
        view.stop()
    srv.shutdown()
    return 0
