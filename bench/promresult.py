"""The result of one Prometheus cost run (bench/promcost.py) and its report: plain data, no I/O."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from grayguard.bench.promtarget import POOL_SIZE
from grayguard.config import duration_seconds

HUMAN_WINDOW_S = 300.0  # the 5m windows of the human group and the alerts
# the window's two halves: Prometheus scraping and evaluating alone, then with the controller's queries every tick
PHASES = ("alone", "ticking")
SLOWEST_RULES = 5  # the report names the rules that cost most


@dataclass
class Phase:
    """Prometheus over one half of the window."""

    seconds: float = 0.0
    samples_per_s: float = 0.0  # prometheus_tsdb_head_samples_appended_total: scraped and recorded
    prometheus_cores: float = 0.0
    target_cores: float | None = None  # the stand-in's CPU (it shares the machine)


@dataclass
class GroupCost:
    """One rule group: its evaluation times in each phase and Prometheus' own counters over the window."""

    name: str
    interval_s: float
    evals: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    missed: float = 0.0  # iterations Prometheus skipped because the previous one ran late
    failures: float = 0.0
    last_duration_s: float | None = None  # prometheus_rule_group_last_duration_seconds at the end


@dataclass
class QueryCost:
    """One query of the tick: its wall time in each tick, the series in its last answer, its errors."""

    promql: str
    times: list[float] = field(default_factory=list)
    series: int | None = None
    errors: list[str] = field(default_factory=list)


@dataclass
class PromCost:
    """One run at one fleet size."""

    nodes: int
    targets: int  # scrape targets per job (ports of the stand-in)
    series_per_node: dict[str, int]  # job -> series
    intervals: dict[str, str]  # job -> scrape interval
    version: str = ""  # Prometheus' version
    warmup_s: float = 0.0
    nodes_with_data: int = 0  # nodes with a recorded latency and a live ITL after the warm-up
    data_span_s: float = 0.0  # age of the oldest scraped data at the end
    phases: dict[str, Phase] = field(default_factory=dict)
    groups: dict[str, GroupCost] = field(default_factory=dict)
    rules: dict[str, list[float]] = field(default_factory=dict)  # "group/rule" -> evaluation seconds, both phases
    ticks: list[float] = field(default_factory=list)  # wall seconds of each tick's queries
    held: int = 0  # ticks whose latency or rate query failed
    queries: dict[str, QueryCost] = field(default_factory=dict)  # signal name -> cost
    head_series: float = 0.0
    rss_max: float = 0.0
    scrapes: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # job -> (scrapes, failed, longest s)
    discarded_connections: int = 0  # urllib3 "Connection pool is full" while ticking
    load_average: float | None = None  # the machine's 1-minute load average at the end
    cpus: int | None = None
    notes: list[str] = field(default_factory=list)
    design: str = "shipped"  # the signals measured: shipped, or those issue 34 started from (bench/before34)
    # the one-metric signals fused into one query against one query each (bench/promwindow.fused_against_separate):
    # (signals, series, fused wall seconds, separate wall seconds)
    fused: tuple[int, int, list[float], list[float]] | None = None

    @property
    def pools(self) -> int:
        return -(-self.nodes // POOL_SIZE)

    @property
    def window_s(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def offered_samples_per_s(self) -> float:
        """Samples per second the scrape jobs offer when every scrape succeeds (recording rules not counted)."""
        return sum(self.nodes * n / duration_seconds(self.intervals[job]) for job, n in self.series_per_node.items())


def findings(c: PromCost) -> list[str]:
    """What the numbers do not say by themselves: overload, missing data, a window too short."""
    out = []
    if c.nodes_with_data < c.nodes:
        out.append(f"only {c.nodes_with_data} of {c.nodes} nodes had a recorded latency and a live ITL after "
                   f"{c.warmup_s:.0f} s of warm-up")
    for g in c.groups.values():
        if not any(g.evals.values()):
            out.append(f"no evaluation of {g.name} finished within the window")
        if g.missed or g.failures:
            out.append(f"{g.name}: Prometheus skipped {g.missed:.0f} evaluations (the previous one ran late) and "
                       f"{g.failures:.0f} rule evaluations failed")
    for job, (n, failed, longest) in c.scrapes.items():
        expected = c.window_s / duration_seconds(c.intervals[job]) * c.targets
        if failed or n < 0.9 * expected:
            out.append(f"{job}: {n} scrapes of {expected:.0f} due, {failed} failed, the longest took {longest:.1f} s")
    if c.held:
        out.append(f"{c.held} of {len(c.ticks)} ticks held every weight: the latency or rate query failed")
    errors = {name: Counter(q.errors) for name, q in c.queries.items() if q.errors}
    if errors:
        out.append("failed queries: " + ", ".join(f"{name} {n}x {kind}" for name, kinds in errors.items()
                                                 for kind, n in kinds.items()))
    if c.discarded_connections:
        out.append(f"the tick's concurrent queries outnumber its requests.Session's connection pool (10): "
                   f"{c.discarded_connections} connections discarded in {len(c.ticks)} ticks, each one a urllib3 "
                   "WARNING in the controller's log")
    if c.data_span_s < HUMAN_WINDOW_S:
        out.append(f"the 5m windows held {c.data_span_s:.0f} s of data ({c.data_span_s / HUMAN_WINDOW_S:.0%} of their "
                   "steady-state samples): grayguard-human and the 5m alerts cost more once they are full")
    return out


def median_max(xs: list[float]) -> tuple[float, float]:
    """(median, max) of xs; NaNs when empty."""
    return (statistics.median(xs), max(xs)) if xs else (float("nan"), float("nan"))


def _ms(xs: list[float], width: int = 7) -> str:
    m, mx = median_max(xs)
    return f"{len(xs):>2} x {m * 1000:{width}.1f} / {mx * 1000:{width}.1f} ms"


def format_cost(c: PromCost) -> list[str]:
    """The report of one run, as printed by `grayguard bench-controller`."""
    alone, ticking = (c.phases.get(p, Phase()) for p in PHASES)
    target = "" if alone.target_cores is None or ticking.target_cores is None else \
        f"; the stand-in target used {alone.target_cores:.2f} / {ticking.target_cores:.2f}"
    load = f"; load average {c.load_average:.1f} on {c.cpus} CPUs" if c.load_average is not None else ""
    out = [f"  {c.nodes} nodes in {c.pools} pools, {c.design} signals ({c.targets} "
           f"target{'s' if c.targets > 1 else ''} per job; "
           f"series per node: " + ", ".join(f"{job} {n}" for job, n in c.series_per_node.items())
           + f"; warm-up {c.warmup_s:.0f} s, then {alone.seconds:.0f} s alone and {ticking.seconds:.0f} s with the "
           f"controller ticking{load}):",
           f"    samples/s: {c.offered_samples_per_s:,.0f} offered by the scrapes, {alone.samples_per_s:,.0f} appended "
           f"alone, {ticking.samples_per_s:,.0f} ticking (recording rules included)",
           f"    Prometheus: {c.head_series:,.0f} head series, resident memory {c.rss_max / 2**20:,.0f} MiB at most, "
           f"CPU {alone.prometheus_cores:.2f} cores alone, {ticking.prometheus_cores:.2f} ticking{target}",
           "    scrapes: " + ", ".join(f"{job} {n - failed}/{n} ok (longest {longest:.2f} s, every {c.intervals[job]})"
                                      for job, (n, failed, longest) in c.scrapes.items()),
           f"    rule group evaluation, count x median / max:  {'Prometheus alone':>26}  {'controller ticking':>26}"
           "  last (/metrics)"]
    for g in c.groups.values():
        last = f"{g.last_duration_s * 1000:10.1f} ms" if g.last_duration_s else f"{'-':>10}"
        out.append(f"      {g.name:<28} every {g.interval_s:>3g}s {_ms(g.evals['alone'], 8):>28}  "
                   f"{_ms(g.evals['ticking'], 8):>28}  {last}")
    slowest = sorted(c.rules.items(), key=lambda kv: -median_max(kv[1])[0])[:SLOWEST_RULES]
    out.append(f"    the {len(slowest)} slowest rules, median / max of their evaluations in the window:")
    out += [f"      {name:<80} {median_max(ts)[0] * 1000:8.1f} / {median_max(ts)[1] * 1000:8.1f} ms"
            for name, ts in slowest]
    n_queries = sum(1 for q in c.queries.values() if q.times)
    m, mx = median_max(c.ticks)
    sends = sum(len(q.times) for q in c.queries.values()) / len(c.ticks) if c.ticks else float("nan")
    out.append(f"    controller tick, its {n_queries} queries (Controller.read_prometheus + read_optional; {sends:.1f} "
               f"sent a tick on average): median {m * 1000:.1f} ms, max {mx * 1000:.1f} ms over {len(c.ticks)} ticks")
    out.append(f"      {'query':<24} {'series':>7} {'median ms':>10} {'max ms':>9} {'sent':>5}")
    for name, q in sorted(c.queries.items(), key=lambda kv: -median_max(kv[1].times)[0]):
        m, mx = median_max(q.times)
        out.append(f"      {name:<24} {q.series if q.series is not None else '-':>7} {m * 1000:>10.1f} "
                   f"{mx * 1000:>9.1f} {len(q.times):>5}")
    if c.fused:
        n, series, fused, separate = c.fused
        f, s = median_max(fused)[0], median_max(separate)[0]
        out.append(f"    the {n} signals that read one metric each, after the window ({len(fused)} rounds, "
                   f"alternating): fused into one query (max by (__name__, pool, instance), {series:,} series) median "
                   f"{f * 1000:.1f} ms, as {n} concurrent queries (the controller's way) {s * 1000:.1f} ms: fused "
                   f"{f / s:.2f}x")
    return out + [f"    note: {n}" for n in c.notes]


def own_series_per_node(c: PromCost) -> float:
    """grayguard's series per node in Prometheus' head: the head less vLLM's own series (the exporter's stored series
    and the recording rules' per-node and per-pool outputs, spread over the nodes)."""
    return c.head_series / c.nodes - c.series_per_node.get("vllm", 0)


def format_side_by_side(before: PromCost, shipped: PromCost) -> list[str]:
    """The same measurements of two designs in one table, and the shipped one against issue 34's 1,000-node targets."""
    alone_b, tick_b = (before.phases.get(p, Phase()) for p in PHASES)
    alone_s, tick_s = (shipped.phases.get(p, Phase()) for p in PHASES)

    def row(what: str, b: float, s: float, fmt: str = ",.0f") -> str:
        ratio = f"{s / b:7.2f}x" if b and math.isfinite(b) and math.isfinite(s) else f"{'-':>8}"
        return f"    {what:<56} {b:>12{fmt}} {s:>12{fmt}} {ratio}"

    def med(xs: list[float]) -> float:
        return median_max(xs)[0] * 1000

    def sends(c: PromCost) -> float:
        return sum(len(q.times) for q in c.queries.values()) / len(c.ticks) if c.ticks else float("nan")

    def read(c: PromCost) -> float:
        return sum((q.series or 0) * len(q.times) for q in c.queries.values()) / len(c.ticks) if c.ticks \
            else float("nan")
    out = [f"  {shipped.nodes} nodes, side by side in one run (before: the signals issue 34 started from, "
           "bench/before34/README.md):",
           f"    {'':<56} {'before':>12} {'shipped':>12} {'ratio':>8}",
           row("head series", before.head_series, shipped.head_series),
           row("grayguard's series per node (head less vLLM's)", own_series_per_node(before),
               own_series_per_node(shipped), ".1f"),
           row("samples/s appended, controller ticking", tick_b.samples_per_s, tick_s.samples_per_s),
           row("Prometheus CPU alone (cores)", alone_b.prometheus_cores, alone_s.prometheus_cores, ".2f"),
           row("Prometheus CPU, controller ticking (cores)", tick_b.prometheus_cores, tick_s.prometheus_cores, ".2f"),
           row("resident memory at most (MiB)", before.rss_max / 2**20, shipped.rss_max / 2**20)]
    for name in dict.fromkeys([*before.groups, *shipped.groups]):
        gb, gs = before.groups.get(name), shipped.groups.get(name)
        for phase in PHASES:
            out.append(row(f"{name} median, {phase} (ms)", med(gb.evals[phase]) if gb else float("nan"),
                           med(gs.evals[phase]) if gs else float("nan"), ".1f"))
    out += [row("queries sent a tick, on average", sends(before), sends(shipped), ".1f"),
            row("series read a tick, on average", read(before), read(shipped)),
            row("the tick's reads (queries + decoding), median (ms)", med(before.ticks), med(shipped.ticks), ".1f")]
    if shipped.nodes == 1000:
        control = med(shipped.groups["grayguard-control"].evals["alone"]) if "grayguard-control" in shipped.groups \
            else float("nan")
        out.append("    issue 34's targets at 1,000 nodes, shipped: " + "; ".join(
            f"{what} {v:.1f} {'<=' if v <= t else 'OVER'} {t:g}" for what, v, t in (
                ("grayguard-control median alone (ms)", control, 150),
                ("reads median (ms)", med(shipped.ticks), 150),
                ("own series per node", own_series_per_node(shipped), 30))))
    return out
