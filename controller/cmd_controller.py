"""`grayguard controller`: run the control loop (or one tick) against Prometheus and HAProxy."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from grayguard import flags, terminate
from grayguard.config import Config, ConfigError, load_config
from grayguard.controller import gcpolicy
from grayguard.controller.gateway import GatewayError, build_gateways
from grayguard.controller.haproxy import STATIC_ALGOS, HaproxyError
from grayguard.controller.loop import Controller, TickResult
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.statefile import StateFile, StateLock, StateLockError
from grayguard.health import Beat, readiness, stall_limit_s
from grayguard.httpserve import parse_address
from grayguard.promclient import PromError, PrometheusClient, build_session_headers, tls_settings
from grayguard.redact import redact_url

if TYPE_CHECKING:
    from grayguard.controller.discovery import Discovery
    from grayguard.controller.leader import Leadership

HELP = "run the control loop: read Prometheus, score nodes, write HAProxy weights"
DESCRIPTION = """\
Every tick (tick_interval_s) the controller reads each HAProxy's `show servers state` and the
per-node normalized latency from Prometheus, scores each node against its peers, moves it through
healthy -> degraded -> quarantined -> canary -> slow_start -> healthy, and writes only the weight and
state differences to every configured HAProxy. When Prometheus is unreachable or its data is stale
it holds every weight. Serves /metrics and /status on listen_address, and the probes /healthz (503
when no tick has completed for max(10 s, 10 ticks, 2 x a tick's deadlines): the loop is stalled) and
/readyz (503 until the first tick, and with a registry until it knows whether it leads). Alert rules are re-rendered by
a job of their own, off the tick. One controller per state file: a second one exits 2 (state_file.lock).

examples:
  grayguard controller --config.file grayguard.yaml --check          # validate the config and exit
  grayguard controller --config.file grayguard.yaml --once --dry-run # print one tick's plan, write nothing
  grayguard controller --config.file grayguard.yaml                  # run
"""
log = logging.getLogger("grayguard.controller")
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")  # it is part of a registry key (sharded)


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.renamed(p, "--config.file", "--config", required=True, dest="config", metavar="FILE",
                  help="YAML config (see grayguard.example.yaml)")
    p.add_argument("--once", action="store_true", help="run one tick and exit (exit 1 if it held or failed)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; write nothing to HAProxy or the state file")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    flags.renamed(p, "--web.listen-address", "--listen-address", dest="listen_address", metavar="HOST:PORT",
                  help="override listen_address for /metrics, /status, /healthz and /readyz")
    p.add_argument("--no-http", action="store_true", help="do not serve /metrics, /status, /healthz and /readyz")
    p.add_argument("--id", metavar="ID", default=None,
                   help="this replica's name in the leader election (registry.url set); default hostname:pid")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="flight recorder: append every tick's observation (Prometheus samples, HAProxy servers, "
                   "states, canary rounds) to FILE as JSON lines (.gz: gzip), to decide the run again offline "
                   "with `grayguard replay --recording FILE --config.file ...` (same config: the same decisions; "
                   "another: what it would have done). About 2.5 KB per node per tick; gzipped (.gz) 0.2 KB")


def build_controller(cfg: Config, dry_run: bool = False, metrics: ControllerMetrics | None = None,
                     replica_id: str | None = None) -> Controller:
    """A Controller wired to the real Prometheus, HAProxy and canary adapters (and the registry when one is set)."""
    from grayguard.controller.canary import make_canary  # local: pulls in the exporter's probe code

    metrics = metrics or ControllerMetrics.create()
    return Controller(
        cfg,
        PrometheusClient(cfg.prometheus),
        build_gateways(cfg),  # HAProxy's endpoints, or NGINX (gateway.kind; controller/gateway.py)
        canary=make_canary(cfg.recovery),
        metrics=metrics,
        state_file=StateFile(cfg.state_file, save_errors=metrics.state_save_errors) if cfg.state_file else None,
        dry_run=dry_run,
        leadership=build_leadership(cfg, replica_id or default_id(), metrics) if not dry_run else None,
    )


def default_id() -> str:
    """hostname:pid: unique among the replicas of a fleet."""
    return f"{socket.gethostname()}:{os.getpid()}"


def build_leadership(cfg: Config, replica_id: str, metrics: ControllerMetrics) -> Leadership | None:
    """The election on cfg.registry (None without registry.url: the controller runs alone and leads every pool).
    A dry run never campaigns: it would hold the leader key while writing nothing."""
    if cfg.registry.url is None:
        return None
    from grayguard.controller.leader import Leadership
    from grayguard.controller.leader_store import ElectionStore

    if not REPLICA_ID_RE.match(replica_id):
        raise ConfigError("--id", f"{replica_id!r} may only hold letters, digits, '-', '_', '.' and ':' (1-128)")
    r = cfg.registry
    return Leadership(ElectionStore.from_config(r), replica_id, [p.name for p in cfg.pools],
                      r.lease_ttl_s, prefix=r.prefix, shard=r.shard_pools, metrics=metrics)


def preflight(cfg: Config, environ: Mapping[str, str] | None = None) -> None:
    """What the config file alone cannot show, checked by --check and at startup: the environment variables
    and files it names exist and load, and the state file's directory can exist. One ConfigError names every
    field with a problem (each check runs, as the file's own checks do)."""
    env = os.environ if environ is None else environ
    errors: list[tuple[str, str]] = []

    def check(fn, *args) -> None:
        try:
            fn(*args)
        except ConfigError as e:
            errors.extend(e.errors)

    check(build_session_headers, cfg.prometheus, env)  # headers_env, *_env, token
    check(tls_settings, cfg.prometheus)  # ca_file, cert_file, key_file
    if cfg.registry.url is not None:  # its TLS files and the etcd user's password
        from grayguard.etcdconn import settings as etcd_settings

        check(etcd_settings, cfg.registry, env)
    if cfg.gateway.kind == "nginx":
        errors += nginx_preflight(cfg)
    if cfg.state_file:
        path = Path(cfg.state_file)
        parent = next((a for a in path.parents if a.exists()), None)  # the first ancestor that exists
        if path.is_dir():
            errors.append(("state_file", f"{path} is a directory"))
        elif parent is not None and not parent.is_dir():
            errors.append(("state_file", f"{parent} is not a directory, so {path} cannot be written"))
    if errors:
        raise ConfigError(errors=errors)


def nginx_preflight(cfg: Config) -> list[tuple[str, str]]:
    """gateway.nginx's binary runs, its main config exists, its upstream folder can be written."""
    import shutil

    n, errors = cfg.gateway.nginx, []
    if shutil.which(n.binary) is None:
        errors.append(("gateway.nginx.binary", f"{n.binary!r} is not an executable on PATH"))
    if not Path(n.conf).is_file():
        errors.append(("gateway.nginx.conf", f"{n.conf} is not a file"))
    d = Path(n.upstream_dir)
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        errors.append(("gateway.nginx.upstream_dir", f"{d} is not a folder this user can write"))
    if n.prefix is not None and not Path(n.prefix).is_dir():
        errors.append(("gateway.nginx.prefix", f"{n.prefix} is not a folder"))
    return errors


def startup_checks(ctl: Controller) -> list[str]:
    """Problems worth saying before the first tick: missing backends, static balance algorithms; with NGINX, a
    config `nginx -t` rejects or that does not include a pool's upstream file."""
    from grayguard.controller.nginx import NginxGateway

    problems = []
    for hc in ctl.haproxies:
        if isinstance(hc, NginxGateway):
            problems += hc.check()
            continue
        try:
            algos = hc.backend_algorithms()
        except HaproxyError as e:
            problems.append(f"HAProxy {hc.endpoint}: {e}")
            continue
        for pool in ctl.cfg.pools:
            algo = algos.get(pool.backend)
            static = algo in STATIC_ALGOS
            ctl.metrics.static_backend.labels(pool.name, pool.backend).set(1 if static else 0)
            if algo is None:
                problems.append(f"HAProxy {hc.endpoint} has no backend {pool.backend!r} (pool {pool.name})")
            elif static:
                problems.append(f"HAProxy {hc.endpoint} backend {pool.backend!r} uses `balance {algo}`, which only "
                                "accepts weights 0% or 100%: degraded weights cannot apply; use roundrobin or "
                                "leastconn")
    problems += staleness_checks(ctl)
    problems += fencing_checks(ctl)
    return problems


def fencing_checks(ctl: Controller) -> list[str]:
    """With a registry every batch is fenced by an epoch kept in HAProxy (`get var`, `set var`: HAProxy 2.6+ on an
    admin-level socket): one that cannot keep it would refuse every write."""
    if ctl.leadership is None or ctl.dry_run or ctl.cfg.haproxy.writer == "actuators":
        return []
    from grayguard.controller.haproxy import epoch_var

    problems = []
    var = epoch_var(ctl.cfg.registry.prefix, "check")
    for hc in ctl.haproxies:
        try:
            got, level = hc.execute([f"get var {var}", "show cli level"])
        except HaproxyError as e:
            problems.append(f"HAProxy {hc.endpoint}: {e}")
            continue
        if ("not found" not in got.lower() and "value=" not in got) or "admin" not in level:
            problems.append(f"HAProxy {hc.endpoint} cannot keep the fencing epoch (`get var`: {got.strip()[:60]!r}, "
                            f"CLI level {level.strip()!r}): with registry.url every write is fenced by it, so this "
                            "replica will write nothing there; HAProxy 2.6+ and `stats socket ... level admin` needed")
    return problems


def staleness_checks(ctl: Controller) -> list[str]:
    """A latency or rate query whose data has no age: every node would count as stale and its pool hold.

    The age of a node's data is `timestamp(<query>)`. Of a recorded series that is its last evaluation, on
    any engine; of an expression, Prometheus answers the evaluation time (age 0: staleness not measured)
    and VictoriaMetrics answers nothing (every node stale, the pool holds for ever).
    """
    problems = []
    for field in ("latency_query", "request_rate_query"):
        q = getattr(ctl.cfg.signals, field)
        try:
            has_data, has_age = ctl.prom.query(q), ctl.prom.query(f"timestamp({q})")
        except PromError as e:  # the first tick says it again, classified and counted
            problems.append(f"signals.{field}: cannot query Prometheus yet ({e.kind})")
            continue
        if has_data and not has_age:
            problems.append(f"signals.{field}: {len(has_data)} series, but timestamp() of it returns none, so "
                            "the age of the data cannot be measured and every node would count as stale (its "
                            "pool holds). Use a recorded series (rules/), not an expression, on this engine")
    return problems


def print_plan(result: TickResult, out: TextIO | None = None) -> None:
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    if result.standby:
        print(f"STANDBY: {result.standby}", file=out)
    elif result.held:
        print(f"HOLD: {result.held}", file=out)
    for pool, d in sorted(result.decisions.items()):
        print(f"pool {pool}: {d.ejected}/{d.max_ejected} drained, safeguard "
              f"{'ENGAGED' if d.safeguard else 'off'}", file=out)
        for n, nd in sorted(d.nodes.items()):
            s = nd.state
            score = "-" if s.score is None else f"{s.score:.2f}"
            print(f"  {n:<20} {s.state:<11} weight={nd.weight!s:<4} score={score:<7} {s.reason}", file=out)
    if not result.changes:
        print("plan: no changes", file=out)
    for ep, c in result.changes:
        print(f"plan: {ep}: {c.command.render()}    # {c.reason}", file=out)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, promql=args.check)  # --check: the signals' PromQL too, by promtool
        if args.listen_address:
            try:
                parse_address(args.listen_address)
            except ValueError as e:
                raise ConfigError("--web.listen-address", str(e)) from None
        preflight(cfg)
        if args.check:
            gw = (f"NGINX {cfg.gateway.nginx.conf}" if cfg.gateway.kind == "nginx"
                  else f"{len(cfg.haproxy.endpoints)} HAProxy endpoint(s)")
            print(f"{args.config}: OK ({len(cfg.pools)} pool(s), {gw})")
            return 0
    except ConfigError as e:
        if e.source is None and not e.path.startswith("--"):  # the environment's problems (preflight) of this file
            e.source = args.config
        print(e.report(), file=sys.stderr)  # every problem, one a line, under the file's name
        return 2
    lock = None
    if cfg.state_file and not args.dry_run:  # a dry run writes nothing: it needs no lock
        try:
            lock = StateLock(cfg.state_file).acquire()
        except StateLockError as e:
            print(f"grayguard: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"grayguard: state_file: cannot lock {cfg.state_file}.lock: {e.strerror or e}", file=sys.stderr)
            return 2
    elif not cfg.state_file and not args.dry_run:
        log.warning("state_file is null: nothing stops a second controller on this host from driving the same "
                    "backends")
    try:
        return _run_locked(args, cfg)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(args: argparse.Namespace, cfg: Config) -> int:
    try:
        ctl = build_controller(cfg, dry_run=args.dry_run, replica_id=args.id)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    if getattr(args, "record", None):
        from grayguard.controller.recorder import Recorder
        try:
            ctl.recorder = Recorder(args.record)
        except OSError as e:
            print(f"grayguard: --record: cannot write {args.record}: {e.strerror or e}", file=sys.stderr)
            return 2
        log.info("recording every tick to %s", args.record)
    discovery = start_discovery(cfg, ctl)
    try:
        return _run_controller(args, cfg, ctl)
    finally:
        if ctl.recorder is not None:
            ctl.recorder.close()
        ctl.close()  # no canary starts any more; one in flight is not waited on past a second
        if discovery is not None:
            discovery.stop()
        if ctl.leadership is not None:
            ctl.leadership.close()  # resign: a standby leads at its next tick instead of after the lease


def start_discovery(cfg: Config, ctl: Controller) -> Discovery | None:
    """With registry.url and a pool with `discovery: registry`: follow the registry (controller/discovery.py) and
    give the controller its membership step; the Discovery to stop at exit, or None (nothing to follow)."""
    pools = [p.name for p in cfg.pools if p.discovery == "registry"]
    if cfg.registry.url is None or not pools:
        return None
    from grayguard.controller.discovery import Discovery
    from grayguard.controller.membersync import MembershipSync
    from grayguard.registry import Registry

    r = cfg.registry
    disc = Discovery(Registry.from_config(r), r.prefix, pools, r.snapshot_path(cfg.state_file),
                     ctl.metrics.registry, readonly=ctl.dry_run).start()
    ctl.membership = MembershipSync(cfg, disc, ctl.policies, ctl.metrics.registry)
    if not disc.wait_synced(r.timeout_s + 1.0):  # the first tick plans from etcd's listing, or from the snapshot
        log.warning("registry %s did not answer at startup: membership follows the snapshot until it does", r.url)
    return disc


def _run_controller(args: argparse.Namespace, cfg: Config, ctl: Controller) -> int:
    gcpolicy.tune()  # a tick's decoded answers would set the collector off many times a tick (controller/gcpolicy.py)
    if cfg.gateway.kind == "nginx":
        prepare_gateways(ctl)
    for problem in startup_checks(ctl):
        log.warning("%s", problem)
    if args.once:
        result = ctl.tick()
        print_plan(result)
        return 1 if result.held or result.errors else 0
    srv = None
    beat = Beat()
    if not args.no_http:
        from grayguard.controller.httpserver import serve
        limit = stall_limit_s(cfg.tick_interval_s, tick_budget_s(cfg))
        srv = serve(args.listen_address or cfg.listen_address, ctl.metrics.registry, ctl.status,
                    health=lambda: beat.health(limit), ready=lambda: readiness(beat.completed, ctl.knows_leadership))
        log.info("serving /metrics, /status, /healthz and /readyz on %s; /healthz fails when no tick has completed "
                 "for %gs (max(10 s, 10 ticks, 2 x the tick's deadlines))", args.listen_address or cfg.listen_address,
                 limit)
    stop = threading.Event()
    run_loop(ctl, cfg.tick_interval_s, stop, rerender=make_rerender(cfg, ctl.metrics), beat=beat)
    if srv:
        srv.shutdown()
    return 0


def make_rerender(cfg: Config, metrics: ControllerMetrics | None = None) -> Callable[[], None] | None:
    """The alert-rule re-render run_loop schedules every rules.rerender_interval_s, or None when it is off."""
    if cfg.rules.rerender_interval_s <= 0:
        return None
    from grayguard.rules.rerender import RuleRerenderer
    rr = RuleRerenderer(cfg)
    log.info("re-rendering alert rules into %s every %gs, off the tick; reload: %s", rr.out_dir,
             cfg.rules.rerender_interval_s, rr.reload_url and "POST " + str(redact_url(rr.reload_url)) or "none")

    def rerender() -> None:
        res = rr.rerender()  # the scheduler decides when: no due() check that an early wake-up would fail
        if res.reload_error and metrics is not None:
            metrics.rules_reload_errors.labels(res.reload_error).inc()
        if res.error:
            log.warning("rules: %s", res.error)
        elif res.changed:
            log.info("rules: rewrote %s; reloaded: %s", ", ".join(res.files), res.reloaded)

    return rerender


def tick_budget_s(cfg: Config) -> float:
    """The longest a healthy tick takes: every deadline it may wait on, one after the other (canaries run off the
    tick: none of theirs). NGINX: `nginx -t` and a reload for each pool."""
    gateway = (2 * cfg.gateway.nginx.timeout_s * len(cfg.pools) if cfg.gateway.kind == "nginx"
               else 2 * cfg.haproxy.timeout_s * len(cfg.haproxy.endpoints))
    return cfg.tick_interval_s + 2 * cfg.prometheus.timeout_s + gateway + 4 * cfg.registry.timeout_s


def prepare_gateways(ctl: Controller) -> None:
    """NGINX: write each pool's upstream file where there is none (its servers at full weight; NGINX cannot start
    without the files it includes); a dry run writes nothing."""
    from grayguard.controller.nginx import NginxGateway

    for gw in ctl.haproxies:
        if isinstance(gw, NginxGateway) and not ctl.dry_run:
            try:
                for path in gw.prepare():
                    log.info("wrote %s: every server of its pool at full weight", path)
            except GatewayError as e:
                log.error("gateway %s: %s", gw.endpoint, e)


def run_loop(ctl: Controller, interval_s: float, stop: threading.Event, rerender: Callable[[], None] | None = None,
             rerender_interval_s: float | None = None, beat: Beat | None = None) -> None:
    """Tick every interval_s until SIGINT/SIGTERM or stop is set. Ticks never overlap; late ones are skipped.

    Both schedules run on the monotonic clock (controller/ticker.py): a wall-clock step neither bursts nor
    freezes the ticks. The alert re-render (promtool may take a minute, a reload may time out) is a job of
    its own, every rerender_interval_s (default rules.rerender_interval_s): it never delays a tick and never
    overlaps itself. beat hears of every completed tick (/healthz and /readyz, grayguard/health.py).
    """
    from grayguard.controller.ticker import Periodic

    alive = [time.monotonic()]  # the tick job's last sign of life: the start or the end of a tick

    def job() -> None:
        alive[0] = time.monotonic()
        try:
            ctl.tick()
        except Exception:  # a bug must not kill the loop; it is logged and counted
            ctl.metrics.ticks.labels("error").inc()
            log.exception("tick failed")
        finally:
            alive[0] = time.monotonic()
            if beat is not None:
                beat.done()

    stuck_s = 2 * tick_budget_s(ctl.cfg)
    said: list[float] = []  # the beat a stuck tick was reported for

    def renew_lease() -> None:  # a wedged tick must not keep the leadership: a standby takes over
        if time.monotonic() - alive[0] <= stuck_s:
            ctl.leadership.renew()  # type: ignore[union-attr]
        elif alive[0] not in said:
            said[:] = [alive[0]]
            log.error("a tick has run for more than %gs: the lease is no longer renewed, a standby takes over", stuck_s)

    def rerender_job() -> None:
        try:
            rerender()  # type: ignore[misc]
        except Exception:  # a bug in the re-render must not stop the next one (or the ticks)
            log.exception("alert rule re-render failed")

    def skipped(n: int) -> None:  # a skipped re-render is no skipped tick: only the tick job reports
        ctl.metrics.ticks.labels("skipped").inc(n)
        log.warning("tick took longer than tick_interval_s=%gs: %d tick(s) skipped", interval_s, n)

    jobs = [Periodic("tick", job, interval_s, stop, on_skip=skipped)]
    if ctl.leadership is not None:  # the lease outlives a long tick: renewed every third of it, off the tick
        jobs.append(Periodic("lease", renew_lease, ctl.leadership.ttl / 3, stop))
    every = ctl.cfg.rules.rerender_interval_s if rerender_interval_s is None else rerender_interval_s
    if rerender is not None and every > 0:
        jobs.append(Periodic("rerender", rerender_job, every, stop))
    for j in jobs:
        j.start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    log.info("controller running: tick every %gs%s", interval_s, " (dry run)" if ctl.dry_run else "")
    terminate.wait(stop)  # timed: a SIGTERM delivered to a worker thread is still seen (grayguard/terminate.py)
    for j in jobs:  # a tick in flight finishes (its writes are never cut halfway)
        j.join()
    ctl.close()  # the canary workers: a canary in flight is not waited on (a hung engine's would hold the exit)
    log.info("controller stopped")
