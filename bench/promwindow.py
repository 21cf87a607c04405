"""The measuring half of bench/promcost.py: wait for the rules' data, then watch Prometheus while the
controller's observe code ticks; what was seen goes into a PromCost."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from grayguard.bench.promresult import PHASES, GroupCost, Phase, PromCost, QueryCost, findings
from grayguard.config import Config
from grayguard.controller.loop import Controller
from grayguard.localstack.services import Prometheus
from grayguard.promclient import PromError, PrometheusClient, Sample

METRICS_EVERY_S = 5.0  # how often Prometheus' own /metrics is read (resident memory)


class TimedClient(PrometheusClient):
    """The controller's Prometheus client, recording each instant query's wall time and answer size."""

    def __init__(self, cfg, queries: dict[str, QueryCost], names: Callable[[str], str]):
        super().__init__(cfg)
        self.costs, self.name, self.lock = queries, names, threading.Lock()

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        t0 = time.perf_counter()
        try:
            out = super().query(promql, at)
        except PromError as e:
            self._record(promql, time.perf_counter() - t0, None, e.kind)
            raise
        self._record(promql, time.perf_counter() - t0, len(out), None)
        return out

    def _record(self, promql: str, took: float, series: int | None, error: str | None) -> None:
        with self.lock:
            cost = self.costs.setdefault(self.name(promql), QueryCost(promql))
            cost.times.append(took)
            if error:
                cost.errors.append(error)
            else:
                cost.series = series


def signal_names(cfg: Config) -> Callable[[str], str]:
    """promql -> the signal it is configured as (latency, rate, live_itl, ...; timestamp(x): x_timestamp)."""
    sig = cfg.signals
    names = {getattr(sig, f.name): f.name.removesuffix("_query") for f in dataclasses.fields(sig)
             if f.name.endswith("_query")}

    def name(q: str) -> str:
        inner = q.removeprefix("timestamp(").removesuffix(")")
        return names[q] if q in names else f"{names[inner]}_timestamp" if inner in names else q
    return name


def prom_metrics(prom: Prometheus) -> dict[str, list[tuple[dict, float]]]:
    """A service's own /metrics (Prometheus, VictoriaMetrics, vmalert): sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(requests.get(prom.url + "/metrics", timeout=30).text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(m: dict, name: str, group: str | None = None) -> float:
    """The sum of a sample's values (of one rule group: rule_group is "<file>;<group>")."""
    return sum(v for labels, v in m.get(name, ())
               if group is None or labels.get("rule_group", "").endswith(";" + group))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class PoolFull(logging.Filter):
    """Counts urllib3's "Connection pool is full" warnings and keeps them out of the log: they come from the tick's
    concurrent queries outnumbering requests' connection pool, and the count is reported instead."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Connection pool is full"):
            self.count += 1
            return False
        return True


def poll_rules(prom: Prometheus, groups: dict[str, GroupCost], rules: dict[str, list[float]], seen: set,
               phase: str | None) -> None:
    """Add each group's evaluation not seen before to phase (None: only mark it seen), and each rule's time to
    rules ("group/rule" -> seconds); /api/v1/rules holds the last evaluation of each group."""
    for g in prom.get("/api/v1/rules")["groups"]:
        cost = groups.setdefault(g["name"], GroupCost(g["name"], float(g.get("interval", 0))))
        key = (g["name"], g.get("lastEvaluation"))
        if key not in seen and float(g.get("evaluationTime", 0)) > 0:  # 0: not evaluated yet
            seen.add(key)
            if phase:
                cost.evals[phase].append(float(g["evaluationTime"]))
                for r in g.get("rules", ()):
                    rules.setdefault(f"{g['name']}/{r['name']}", []).append(float(r.get("evaluationTime", 0)))


def scrape_health(prom: Prometheus, seconds: float) -> dict[str, tuple[int, int, float]]:
    """job -> (scrapes, failed scrapes, longest scrape in seconds) over the last seconds, from Prometheus' own up.

    One query: scrapes still being appended while separate queries ran would make them disagree.
    """
    w = f"{max(1, int(seconds))}s"
    parts = {"n": f"count_over_time(up[{w}])", "ok": f"sum_over_time(up[{w}])"}
    q = " or ".join(f'label_replace(sum by (job) ({e}), "what", "{k}", "", "")' for k, e in parts.items())
    q += f' or label_replace(max by (job) (max_over_time(scrape_duration_seconds[{w}])), "what", "longest", "", "")'
    got: dict[str, dict[str, float]] = {}
    for r in prom.query(q):
        got.setdefault(r["metric"].get("job", ""), {})[r["metric"]["what"]] = float(r["value"][1])
    return {job: (int(v.get("n", 0)), int(v.get("n", 0) - v.get("ok", 0)), v.get("longest", math.nan))
            for job, v in sorted(got.items())}


def warm_up(prom: Prometheus, cfg: Config, nodes: int, timeout_s: float) -> int:
    """Wait until the recorded latency and the live ITL cover every node (or timeout_s); the nodes covered."""
    q = f"count(({cfg.signals.latency_query}) and on (pool, instance) ({cfg.signals.live_itl_query}))"
    deadline, covered = time.monotonic() + timeout_s, 0
    while covered < nodes and time.monotonic() < deadline:
        time.sleep(2.0)
        with contextlib.suppress(requests.RequestException, ValueError):  # a busy Prometheus: ask again
            covered = int(next((float(r["value"][1]) for r in prom.query(q)), 0))
    return covered


def tick(ctl: Controller, cost: PromCost) -> None:
    """The Prometheus part of one controller tick's observe step, timed: a held tick skips the optional signals."""
    t0 = time.perf_counter()
    _, why = ctl.read_prometheus()
    if why:
        cost.held += 1
    else:
        ctl.read_optional()
    cost.ticks.append(time.perf_counter() - t0)


# a signal that reads one metric's series: `max by (pool, instance) (<name>)`, fusable with the others into one query
ONE_METRIC = re.compile(r"max by \(pool, instance\) \(([a-zA-Z_:][a-zA-Z0-9_:]*)\)")


def fused_query(queries: dict[str, str]) -> tuple[str, dict[str, str]] | None:
    """The signals among queries that read one metric each, as one query that keeps each series' name: (the fused
    query, metric -> signal); None when fewer than two can be fused."""
    names = {m[1]: signal for signal, q in queries.items() if (m := ONE_METRIC.fullmatch(q))}
    if len(names) < 2:
        return None
    return f'max by (__name__, pool, instance) ({{__name__=~"{"|".join(sorted(names))}"}})', names


def fused_against_separate(cfg: Config, rounds: int) -> tuple[int, int, list[float], list[float]] | None:
    """The issue's one query a tick, measured: the one-metric signals of cfg fused into one query against the same
    signals as one query each, sent concurrently as the controller sends them, alternating, each answer decoded by the
    controller's client. (signals, series, fused wall seconds, separate wall seconds); None when nothing fuses."""
    queries = {f.name: getattr(cfg.signals, f.name) for f in dataclasses.fields(cfg.signals)
               if f.name.endswith("_query")}
    got = fused_query(queries)
    if got is None:
        return None
    fused, names = got
    client, separate = PrometheusClient(cfg.prometheus), [queries[s] for s in names.values()]
    times: dict[str, list[float]] = {"fused": [], "separate": []}
    series = 0
    with ThreadPoolExecutor(max_workers=len(separate)) as ex:
        for _ in range(rounds):
            t0 = time.perf_counter()
            series = len(client.query(fused))
            t1 = time.perf_counter()
            list(ex.map(client.query, separate))
            times["fused"].append(t1 - t0)
            times["separate"].append(time.perf_counter() - t1)
            time.sleep(0.2)
    return len(names), series, times["fused"], times["separate"]


def run_window(cost: PromCost, cfg: Config, prom: Prometheus, target_pid: int, seconds: float,
               progress: Callable[[str], None], warmup_timeout_s: float, fused_rounds: int = 0) -> None:
    """Warm up, watch Prometheus alone for half of seconds, then with the controller ticking; fill cost. After the
    window, fused_rounds rounds of fused_against_separate (0: none)."""
    started = time.monotonic()
    cost.version = prom.get("/api/v1/status/buildinfo").get("version", "")
    progress(f"{cost.nodes} nodes: waiting until the rules and the fast path have data for every node")
    cost.nodes_with_data = warm_up(prom, cfg, cost.nodes, warmup_timeout_s)
    cost.warmup_s = time.monotonic() - started
    pool_full, urllib3_log = PoolFull(), logging.getLogger("urllib3.connectionpool")
    ctl = Controller(cfg, TimedClient(cfg.prometheus, cost.queries, signal_names(cfg)), [], state_file=None)
    seen: set = set()
    poll_rules(prom, cost.groups, cost.rules, seen, None)  # evaluations before the window do not count
    first, rss = prom_metrics(prom), []
    last = first
    urllib3_log.addFilter(pool_full)
    try:
        for phase, ticking in zip(PHASES, (None, ctl), strict=True):
            progress(f"{cost.nodes} nodes: {phase} for {seconds / 2:g} s (after {time.monotonic() - started:.0f} s; "
                     f"{cost.nodes_with_data} nodes with data)")
            last = watch(cost, phase, ticking, prom, target_pid, seconds / 2, seen, last, rss)
    finally:
        urllib3_log.removeFilter(pool_full)
    cost.discarded_connections = pool_full.count
    cost.data_span_s = time.monotonic() - started
    cost.head_series = total(last, "prometheus_tsdb_head_series")
    cost.rss_max = max(rss)
    for name, g in cost.groups.items():
        g.missed = total(last, "prometheus_rule_group_iterations_missed_total", name) - \
            total(first, "prometheus_rule_group_iterations_missed_total", name)
        g.failures = total(last, "prometheus_rule_evaluation_failures_total", name) - \
            total(first, "prometheus_rule_evaluation_failures_total", name)
        g.last_duration_s = total(last, "prometheus_rule_group_last_duration_seconds", name)
    cost.scrapes = scrape_health(prom, cost.window_s)
    cost.load_average, cost.cpus = os.getloadavg()[0], os.cpu_count()
    if fused_rounds:
        progress(f"{cost.nodes} nodes: the one-metric signals fused into one query against one query each "
                 f"({fused_rounds} rounds)")
        cost.fused = fused_against_separate(cfg, fused_rounds)
    cost.notes += findings(cost)


def watch(cost: PromCost, phase: str, ctl: Controller | None, prom: Prometheus, target_pid: int, seconds: float,
          seen: set, m0: dict, rss: list[float]) -> dict:
    """One phase: poll the rule groups every second, tick every tick_interval_s when ctl is given, read
    Prometheus' memory every METRICS_EVERY_S; record the phase in cost; Prometheus' /metrics at its end."""
    cpu0, t0 = cpu_seconds(target_pid), time.monotonic()
    interval = ctl.cfg.tick_interval_s if ctl else 1.0
    next_tick, next_metrics, end = t0, t0 + METRICS_EVERY_S, t0 + seconds
    while (now := time.monotonic()) < end:
        if now >= next_tick:
            if ctl:
                tick(ctl, cost)
            next_tick = max(next_tick + interval, time.monotonic())  # a late tick is skipped, not queued
        with contextlib.suppress(requests.RequestException):  # a busy Prometheus: the next poll sees the group
            poll_rules(prom, cost.groups, cost.rules, seen, phase)
        if now >= next_metrics:
            next_metrics += METRICS_EVERY_S
            with contextlib.suppress(requests.RequestException):
                rss.append(total(prom_metrics(prom), "process_resident_memory_bytes"))
        time.sleep(max(0.0, min(next_tick, end) - time.monotonic()))
    m1, cpu1 = prom_metrics(prom), cpu_seconds(target_pid)
    span = time.monotonic() - t0
    rss.append(total(m1, "process_resident_memory_bytes"))

    def rate(name: str) -> float:
        return (total(m1, name) - total(m0, name)) / span
    cost.phases[phase] = Phase(span, rate("prometheus_tsdb_head_samples_appended_total"),
                               rate("process_cpu_seconds_total"),
                               (cpu1 - cpu0) / span if cpu0 is not None and cpu1 is not None else None)
    return m1
