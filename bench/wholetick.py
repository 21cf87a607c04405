"""The whole control tick at scale on real parts (`grayguard bench-controller`, issue 18).

The stand-in target of bench/promcost.py serves N simulated nodes' series (pools of 20, a slow node in every
tenth pool) to a real Prometheus with grayguard's rendered rules at the shipped scrape intervals; a real HAProxy
has one backend per pool with a server per node, named and addressed as the stand-in labels them (no health
checks: HAProxy spends no CPU on addresses that do not exist). After the warm-up the real Controller, built
from a generated config with every pool and the shipped defaults, ticks every tick_interval_s; each part of its
tick is timed by wrapping its own methods on the instance (the controller code is unchanged), its memory is read
at the first, middle and last tick, and Prometheus' rule group evaluations are watched over the same ticks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import requests
import yaml

from grayguard.bench import promtarget
from grayguard.bench.promcost import job_intervals, prometheus_setup, render_rules, stand_in
from grayguard.bench.promresult import Phase, PromCost
from grayguard.bench.promwindow import (
    PoolFull,
    TimedClient,
    cpu_seconds,
    poll_rules,
    prom_metrics,
    scrape_health,
    signal_names,
    total,
    warm_up,
)
from grayguard.bench.scale import rss_bytes
from grayguard.bench.tickprobe import FixedRate, LogCount, Stopwatch, TimedRuntime, instrument, memory_mark, timed_tick
from grayguard.bench.tickresult import TickCost, all_notes
from grayguard.config import Config, load_config
from grayguard.controller import gcpolicy
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import free_port
from grayguard.localstack.services import Prometheus, start_prometheus

PROGRESS_EVERY = 10  # ticks between progress lines (and after every tick slower than SLOW_TICK_S)
SLOW_TICK_S = 5.0
BUDGET_S = 300.0  # no new tick after this many seconds of ticking: at 10,000 nodes on 2 cores a tick can take minutes


def fleet_backends(nodes: int) -> dict[str, list[tuple[str, str, int]]]:
    """backend (= pool) -> [(server, address, weight)]: one server per stand-in node, its address the node's
    instance label (how the controller joins a server to its series), named n<index>."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    for i, n in enumerate(promtarget.fleet(nodes)):
        out.setdefault(n.pool, []).append((f"n{i}", n.instance, 100))
    return out


def controller_config(wd: Path, prom_port: int, endpoint: str, pools: list[str]) -> Path:
    """A controller config with every pool (backend of the same name); every other field the shipped default."""
    path = wd / "grayguard.yaml"
    path.write_text(yaml.safe_dump({
        "prometheus": {"url": f"http://127.0.0.1:{prom_port}"}, "haproxy": {"endpoints": [endpoint]},
        "state_file": None, "pools": [{"name": p, "backend": p} for p in pools],
        "rules": {"output_dir": str(wd / "rules")}}))
    return path


def measure_tick(nodes: int, ticks: int = 30, progress: Callable[[str], None] = lambda s: None,
                 warmup_timeout_s: float | None = None, budget_s: float = BUDGET_S) -> TickCost:
    """Start the stand-in, Prometheus and HAProxy for nodes, warm up, run ticks real ticks (none started after
    budget_s of ticking); always stop all three."""
    with tempfile.TemporaryDirectory(prefix="grayguard-wholetick-") as d:
        wd, port = Path(d), free_port()
        backends = fleet_backends(nodes)
        hap = HaproxyProc(wd / "haproxy")
        hap.dir.mkdir()
        hap.cfg.write_text(haproxy_config(hap.sock, backends))
        cfg_file = controller_config(wd, port, hap.endpoint, list(backends))
        cfg = load_config(cfg_file)
        rule_files = render_rules(cfg_file, wd / "rules")
        with stand_in(nodes, wd, progress) as (target, ports):
            setup = prometheus_setup(ports)
            cost = TickCost(nodes, len(backends), cfg.tick_interval_s, ticks,
                            PromCost(nodes, len(ports), promtarget.series_per_node(), job_intervals(setup)),
                            budget_s=budget_s)
            progress(f"{nodes} nodes: starting Prometheus ({len(ports)} targets per job) and HAProxy "
                     f"({nodes} servers in {len(backends)} backends)")
            hap.start(timeout_s=30 + nodes / 100)
            try:
                prom = start_prometheus(setup, rule_files, workdir=wd / "prometheus", port=port)
                try:
                    run(cost, cfg, prom, hap, target.pid, progress,
                        warmup_timeout_s if warmup_timeout_s is not None else 30 + nodes / 100)
                finally:
                    prom.stop()
            finally:
                hap.stop()
    return cost


def run(cost: TickCost, cfg: Config, prom: Prometheus, hap: HaproxyProc, target_pid: int,
        progress: Callable[[str], None], warmup_timeout_s: float) -> None:
    """Warm up, then tick cost.ticks_asked times on the controller's schedule; fill cost."""
    started = time.monotonic()
    p = cost.prom
    p.version = prom.get("/api/v1/status/buildinfo").get("version", "")
    runtime = RuntimeClient(hap.endpoint, 30.0)
    info = runtime.execute(["show info"])[0]
    cost.servers = len(runtime.show_servers_state())
    cost.haproxy_version = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                                 if ln.startswith("Version:")), "")
    progress(f"{cost.nodes} nodes: waiting until the rules and the fast path have data for every node")
    p.nodes_with_data = warm_up(prom, cfg, cost.nodes, warmup_timeout_s)
    p.warmup_s = time.monotonic() - started
    watch = Stopwatch()
    ctl = Controller(cfg, TimedClient(cfg.prometheus, p.queries, signal_names(cfg)),
                     [TimedRuntime(ep, cfg.haproxy.timeout_s, watch) for ep in cfg.haproxy.endpoints], state_file=None)
    instrument(ctl, watch)
    seen: set = set()
    with contextlib.suppress(requests.RequestException):
        poll_rules(prom, p.groups, p.rules, seen, None)  # evaluations before the ticks do not count
    m0, t0 = prom_metrics(prom), time.monotonic()
    pids = {"controller (this process)": os.getpid(), "Prometheus": prom.proc.pid, "HAProxy": hap.proc.pid,
            "stand-in": target_pid}
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    progress(f"{cost.nodes} nodes: {cost.ticks_asked} ticks (after {t0 - started:.0f} s; "
             f"{p.nodes_with_data} nodes with data)")
    counted, pool_full = LogCount(), PoolFull()
    ctl_log, urllib3_log = logging.getLogger("grayguard.controller"), logging.getLogger("urllib3.connectionpool")
    ctl_log.addFilter(counted)
    urllib3_log.addFilter(pool_full)
    try:
        with gcpolicy.tuned():  # the collector's thresholds the controller's process runs with
            tick_loop(cost, ctl, watch, prom, seen, progress)
    finally:
        ctl_log.removeFilter(counted)
        urllib3_log.removeFilter(pool_full)
    span = time.monotonic() - t0
    m1 = prom_metrics(prom)
    cost.cores = {k: (cpu_seconds(pid) - cpu0[k]) / span for k, pid in pids.items()
                  if cpu0[k] is not None and cpu_seconds(pid) is not None}
    cost.logged = dict(counted.counts)
    p.discarded_connections = pool_full.count
    p.ticks = cost.times("prometheus")
    p.phases["ticking"] = Phase(span, (total(m1, "prometheus_tsdb_head_samples_appended_total")
                                       - total(m0, "prometheus_tsdb_head_samples_appended_total")) / span,
                                cost.cores.get("Prometheus", 0.0), cost.cores.get("stand-in"))
    p.data_span_s = time.monotonic() - started
    p.head_series = total(m1, "prometheus_tsdb_head_series")
    p.rss_max = total(m1, "process_resident_memory_bytes")
    for name, g in p.groups.items():
        for metric, attr in (("prometheus_rule_group_iterations_missed_total", "missed"),
                             ("prometheus_rule_evaluation_failures_total", "failures")):
            setattr(g, attr, total(m1, metric, name) - total(m0, metric, name))
        g.last_duration_s = total(m1, "prometheus_rule_group_last_duration_seconds", name)
    with contextlib.suppress(requests.RequestException):
        p.scrapes = scrape_health(prom, span)
    cost.load_average, cost.cpus = os.getloadavg()[0], os.cpu_count()
    cost.notes += all_notes(cost)


def tick_loop(cost: TickCost, ctl: Controller, watch: Stopwatch, prom: Prometheus, seen: set,
              progress: Callable[[str], None]) -> None:
    """cost.ticks_asked ticks on a fixed-rate schedule (a late tick skips slots, as controller/ticker.py does), no
    new one after cost.budget_s; memory at the first, middle and last tick; the rule groups polled between ticks."""
    n = cost.ticks_asked
    marks = {1, (n + 1) // 2, n}
    schedule = FixedRate(cost.interval_s)
    for k in schedule.ticks(n):
        tick = timed_tick(ctl, watch)
        took = tick.seconds["tick"]
        tick.rss_bytes = rss_bytes()
        cost.ticks.append(tick)
        last = k == n or time.monotonic() - schedule.start >= cost.budget_s
        if k in marks or last:
            cost.memory.append(memory_mark(ctl, k))
        with contextlib.suppress(requests.RequestException):  # a busy Prometheus: the next poll sees the group
            poll_rules(prom, cost.prom.groups, cost.prom.rules, seen, "ticking")
        if k % PROGRESS_EVERY == 0 or last or took > SLOW_TICK_S:
            progress(f"{cost.nodes} nodes: tick {k}/{n}: {took * 1000:.0f} ms, {tick.commands} commands"
                     + (f", held: {tick.held[:120]}" if tick.held else ""))
        if last:
            break
    cost.skipped += schedule.skipped
    for g in cost.prom.groups.values():
        g.evals.setdefault("ticking", [])
