"""What grayguard's shipped defaults cost VictoriaMetrics, the single-engine alternative, beside Prometheus.

The same stand-in target as bench/promcost.py (N nodes' vLLM and exporter pages), scraped by a single-node
VictoriaMetrics with the jobs, intervals and drops of rules/prometheus.example.yml (`-promscrape.config`), the rules
`grayguard rules render` makes from the default config evaluated by vmalert against it (their groups' own intervals,
the global 15 s for the alerts), and the controller's own observe code querying VictoriaMetrics every tick after
the warm-up: half of the window alone, half ticking. Measured: the CPU of VictoriaMetrics and vmalert together (Linux
/proc), their resident memory at most, rows ingested per second, each rule group's evaluation time (vmalert's
/api/v1/rules: the last evaluation of each group, as on Prometheus), the tick's reads and whether scrapes failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from grayguard.bench.promcost import prometheus_setup, render_rules, stand_in
from grayguard.bench.promresult import PHASES, median_max
from grayguard.bench.promwindow import TimedClient, cpu_seconds, prom_metrics, signal_names, tick, total, warm_up
from grayguard.config import PrometheusConfig, load_config
from grayguard.controller.loop import Controller
from grayguard.localstack.services import HOST
from grayguard.localstack.victoria import scrape_only, start_victoria_metrics, start_vmalert


@dataclass
class VmCost:
    """One run on VictoriaMetrics: plain data, printed by format_vm_cost."""

    nodes: int
    version: str = ""
    warmup_s: float = 0.0
    nodes_with_data: int = 0
    cores: dict[str, float] = field(default_factory=dict)  # phase -> VictoriaMetrics + vmalert CPU, cores
    rows_per_s: dict[str, float] = field(default_factory=dict)  # phase -> rows ingested per second
    rss_max: float = 0.0  # bytes, VictoriaMetrics + vmalert
    groups: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # group -> phase -> evaluation seconds
    intervals: dict[str, float] = field(default_factory=dict)  # group -> its interval, s
    ticks: list[float] = field(default_factory=list)  # wall seconds of each tick's queries
    held: int = 0
    queries: dict = field(default_factory=dict)  # signal -> QueryCost
    scrape_errors: float = 0.0  # vm_promscrape_scrapes_failed_total over the window
    notes: list[str] = field(default_factory=list)


def _poll_groups(vmalert_url: str, cost: VmCost, seen: set, phase: str | None) -> None:
    """Each group's evaluation not seen before, added to phase (None: only marked seen)."""
    r = requests.get(vmalert_url + "/api/v1/rules", timeout=10)
    r.raise_for_status()
    for g in r.json()["data"]["groups"]:
        cost.intervals[g["name"]] = float(g.get("interval", 0))
        rules = g.get("rules", ())
        last = max((r.get("lastEvaluation", "") for r in rules), default="")
        took = sum(float(r.get("evaluationTime", 0) or 0) for r in rules)  # the rules run one after another
        key = (g["name"], last)
        if key not in seen and took > 0:
            seen.add(key)
            if phase:
                cost.groups.setdefault(g["name"], {p: [] for p in PHASES})[phase].append(took)


def measure_victoria(nodes: int, seconds: float = 60.0, progress: Callable[[str], None] = lambda s: None,
                     warmup_timeout_s: float | None = None) -> VmCost:
    """Start the stand-in, VictoriaMetrics and vmalert for nodes, wait for data, measure for seconds; stop all."""
    cost = VmCost(nodes)
    with tempfile.TemporaryDirectory(prefix="grayguard-vmcost-") as d:
        wd = Path(d)
        cfg_file = wd / "grayguard.yaml"
        cfg_file.write_text(yaml.safe_dump({"prometheus": {"url": "http://127.0.0.1:9"}, "state_file": None,
                                            "pools": [{"name": "pool0", "backend": "pool0"}],
                                            "rules": {"output_dir": str(wd / "rules")}}))
        rule_files = render_rules(cfg_file, wd / "rules")
        with stand_in(nodes, wd, progress) as (target, ports):
            setup = prometheus_setup(ports)
            (wd / "scrape.yml").write_text(yaml.safe_dump(scrape_only(setup), sort_keys=False))
            progress(f"{nodes} nodes: starting VictoriaMetrics and vmalert")
            vm = start_victoria_metrics(workdir=wd / "vm", extra_args=[f"-promscrape.config={wd / 'scrape.yml'}"])
            try:
                # no Alertmanager: vmalert needs a notifier to load alert rules; one that nobody answers
                alert = start_vmalert(rule_files, vm.url, [f"http://{HOST}:9"], evaluation_interval=setup["global"].get(
                    "evaluation_interval", "15s"), workdir=wd / "vmalert")
                try:
                    cfg = load_config(cfg_file)
                    cfg = dataclasses.replace(cfg, prometheus=PrometheusConfig(url=vm.url))
                    _window(cost, cfg, vm, alert, seconds, progress,
                            warmup_timeout_s if warmup_timeout_s is not None else 60 + nodes / 100)
                finally:
                    alert.stop()
            finally:
                vm.stop()
    return cost


def _window(cost: VmCost, cfg, vm, alert, seconds: float, progress: Callable[[str], None],
            warmup_timeout_s: float) -> None:
    started = time.monotonic()
    with contextlib.suppress(requests.RequestException, ValueError, KeyError):
        cost.version = requests.get(vm.url + "/metrics", timeout=10).text.split('short_version="', 1)[1].split('"')[0]
    progress(f"{cost.nodes} nodes: waiting until the rules and the fast path have data for every node "
             "(VictoriaMetrics)")
    cost.nodes_with_data = warm_up(vm, cfg, cost.nodes, warmup_timeout_s)
    cost.warmup_s = time.monotonic() - started
    ctl = Controller(cfg, TimedClient(cfg.prometheus, cost.queries, signal_names(cfg)), [], state_file=None)
    pids = [vm.proc.pid, alert.proc.pid]
    seen: set = set()
    _poll_groups(alert.url, cost, seen, None)
    m0 = prom_metrics(vm)
    for phase, ticking in zip(PHASES, (None, ctl), strict=True):
        progress(f"{cost.nodes} nodes: {phase} for {seconds / 2:g} s on VictoriaMetrics")
        cpu0, t0, rows0 = sum(cpu_seconds(p) or 0 for p in pids), time.monotonic(), m0
        next_tick, end = t0, t0 + seconds / 2
        while (now := time.monotonic()) < end:
            if now >= next_tick:
                if ticking:
                    tick(ticking, cost)  # type: ignore[arg-type]
                next_tick = max(next_tick + cfg.tick_interval_s, time.monotonic())
            with contextlib.suppress(requests.RequestException):
                _poll_groups(alert.url, cost, seen, phase)
            time.sleep(max(0.0, min(next_tick, end) - time.monotonic()))
        span = time.monotonic() - t0
        m0 = prom_metrics(vm)
        cost.cores[phase] = (sum(cpu_seconds(p) or 0 for p in pids) - cpu0) / span
        cost.rows_per_s[phase] = (total(m0, "vm_rows_inserted_total") - total(rows0, "vm_rows_inserted_total")) / span
    cost.scrape_errors = total(m0, "vm_promscrape_scrapes_failed_total")
    cost.rss_max = total(m0, "process_resident_memory_bytes") + total(prom_metrics(alert),
                                                                        "process_resident_memory_bytes")
    for name, evals in cost.groups.items():
        if not any(evals.values()):
            cost.notes.append(f"no evaluation of {name} finished within the window")
    if cost.nodes_with_data < cost.nodes:
        cost.notes.append(f"only {cost.nodes_with_data} of {cost.nodes} nodes had data after the warm-up")


def format_vm_cost(c: VmCost, prom=None) -> list[str]:
    """The run's report; with prom (the shipped design's PromCost at the same size), the two side by side."""
    def ms(xs: list[float]) -> float:
        return median_max(xs)[0] * 1000
    version = f" {c.version}" if c.version else ""
    out = [f"  {c.nodes} nodes on VictoriaMetrics{version} + vmalert (the shipped signals; warm-up "
           f"{c.warmup_s:.0f} s, {c.nodes_with_data} nodes with data):",
           f"    {'':<48} {'VictoriaMetrics':>16}" + (f" {'Prometheus':>12}" if prom else "")]

    def row(what: str, vm: float, p: float | None, fmt: str) -> str:
        return f"    {what:<48} {vm:>16{fmt}}" + (f" {p:>12{fmt}}" if prom is not None and p is not None else "")
    pp = prom.phases if prom else {}
    out += [row("CPU alone (cores)", c.cores.get("alone", float("nan")),
                pp["alone"].prometheus_cores if "alone" in pp else None, ".2f"),
            row("CPU, controller ticking (cores)", c.cores.get("ticking", float("nan")),
                pp["ticking"].prometheus_cores if "ticking" in pp else None, ".2f"),
            row("resident memory at most (MiB)", c.rss_max / 2**20, prom.rss_max / 2**20 if prom else None, ",.0f"),
            row("samples/s appended, controller ticking", c.rows_per_s.get("ticking", float("nan")),
                pp["ticking"].samples_per_s if "ticking" in pp else None, ",.0f")]
    for name, evals in c.groups.items():
        pg = prom.groups.get(name) if prom else None
        for phase in PHASES:
            out.append(row(f"{name} median, {phase} (ms)", ms(evals[phase]),
                           ms(pg.evals[phase]) if pg else None, ".1f"))
    out.append(row("the tick's reads (queries + decoding), median (ms)", ms(c.ticks),
                   ms(prom.ticks) if prom else None, ".1f"))
    out.append(f"    failed scrapes (VictoriaMetrics): {c.scrape_errors:.0f}; ticks held: {c.held}"
               + (f"; CPU counts VictoriaMetrics and vmalert together on {HOST}" if c.cores else ""))
    return out + [f"    note: {n}" for n in c.notes]
