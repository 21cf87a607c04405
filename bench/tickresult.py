"""The result of one whole-tick run (bench/wholetick.py) and its report: plain data, no I/O."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from grayguard.bench.promresult import PromCost, findings, median_max

TARGET_S = 0.5  # issue 18: the whole tick at 10,000 nodes, median
# the tick's parts, in the order they run: (key, label); "rest" is the tick less every other part
PARTS = (("haproxy_read", "HAProxy read (show servers state + show stat)"),
         ("prometheus", "Prometheus queries (read_prometheus + read_optional)"),
         ("pool_data", "pool data checks (series matched to servers)"),
         ("observe_rest", "rest of observe (tier view, states)"),
         ("decide", "decide (decide_tick, every pool)"),
         ("plan", "plan (plan_backend, every pool written)"),
         ("write", "runtime-API writes (one batch per backend)"),
         ("export", "metrics export"),
         ("rest", "rest of the tick"))
GROWTH_NOTE_BYTES = 8 * 2**20  # RSS growth over the second half of the ticks worth a note


@dataclass
class TickSample:
    """One Controller.tick(): seconds per part (a part absent: it did not run, e.g. a held tick decides nothing)."""

    seconds: dict[str, float]  # "tick" and the PARTS keys that ran
    cpu_s: float  # CPU of this process over the tick, every thread (the queries' own threads too)
    commands: int = 0  # runtime-API commands sent
    batches: int = 0  # runtime-API connections that wrote
    refused: int = 0  # commands HAProxy refused
    decided: int = 0  # pools decided
    held: str | None = None  # why the whole tick held, if it did
    rss_bytes: int = 0  # this process' resident memory after the tick


def part_times(ticks: list[TickSample], key: str) -> list[float]:
    """Seconds of one part (or "tick", or "decision": decide + plan) in every tick that ran it."""
    if key == "decision":
        return [t.seconds["decide"] + t.seconds.get("plan", 0.0) for t in ticks if "decide" in t.seconds]
    return [t.seconds[key] for t in ticks if key in t.seconds]


@dataclass
class MemoryMark:
    """The controller's memory after one tick (after a gc.collect())."""

    tick: int
    rss_bytes: int  # the process' resident memory
    blocks: int  # sys.getallocatedblocks(): Python objects and buffers alive
    kept_bytes: int  # deep size of what the controller keeps between ticks: states, decisions, metrics


@dataclass
class TickCost:
    """One run at one fleet size: the real Controller.tick() against a real HAProxy and Prometheus."""

    nodes: int
    backends: int
    interval_s: float  # tick_interval_s
    ticks_asked: int
    prom: PromCost  # Prometheus' side over the same ticks: rule groups, each query, scrapes, notes
    budget_s: float = math.inf  # no tick started after this many seconds of ticking
    haproxy_version: str = ""
    servers: int = 0  # servers HAProxy reported in the first tick
    ticks: list[TickSample] = field(default_factory=list)
    skipped: int = 0  # tick slots passed over because a tick ran past them (the ticker skips, never queues)
    memory: list[MemoryMark] = field(default_factory=list)
    logged: dict[str, int] = field(default_factory=dict)  # level -> controller log records (counted, not printed)
    cores: dict[str, float] = field(default_factory=dict)  # process -> CPU cores over the ticks
    load_average: float | None = None
    cpus: int | None = None
    notes: list[str] = field(default_factory=list)

    def times(self, key: str) -> list[float]:
        return part_times(self.ticks, key)

    @property
    def held(self) -> int:
        return sum(1 for t in self.ticks if t.held)


def p90(xs: list[float]) -> float:
    """The 90th percentile (NaN when empty)."""
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0] if xs else float("nan")


def verdict(c: TickCost) -> str:
    """The whole tick's median against TARGET_S, said plainly, and whether the ticks were whole ticks."""
    m, _ = median_max(c.times("tick"))
    what = f"whole tick median {m * 1000:.0f} ms at {c.nodes} nodes"
    if not c.ticks:
        return "verdict: no tick ran"
    if c.held or len(c.times("decide")) < len(c.ticks):
        return (f"verdict: not a whole tick: {c.held} of {len(c.ticks)} ticks held every weight (no decision, no "
                f"write); {what}")
    ok = m <= TARGET_S
    return f"verdict: {what}: {'within' if ok else 'OVER'} the {TARGET_S * 1000:.0f} ms target" + \
        ("" if ok else f" ({m / TARGET_S:.1f}x)")


def tick_findings(c: TickCost) -> list[str]:
    """What the tick numbers do not say by themselves: held ticks, late ticks, nothing written, memory growth."""
    out = []
    if c.held:
        reasons = sorted({t.held for t in c.ticks if t.held})
        out.append(f"{c.held} of {len(c.ticks)} ticks held every weight: " + "; ".join(r[:200] for r in reasons[:3]))
    if len(c.ticks) < c.ticks_asked:
        out.append(f"{len(c.ticks)} of {c.ticks_asked} ticks ran: no tick starts after {c.budget_s:g} s of ticking")
    if c.skipped:
        out.append(f"{c.skipped} tick slots passed over: a tick ran past the next one ({c.interval_s:g} s apart)")
    if c.ticks and not any(t.commands for t in c.ticks):
        out.append("no tick wrote HAProxy: nothing to measure in the runtime-API part")
    if sum(t.refused for t in c.ticks):
        out.append(f"HAProxy refused {sum(t.refused for t in c.ticks)} commands")
    if len(c.memory) >= 2 and c.memory[-1].rss_bytes - c.memory[-2].rss_bytes > GROWTH_NOTE_BYTES:
        a, b = c.memory[-2], c.memory[-1]
        out.append(f"resident memory grew {(b.rss_bytes - a.rss_bytes) / 2**20:.1f} MiB between tick {a.tick} and "
                   f"tick {b.tick} (pools decided: {c.ticks[a.tick - 1].decided} and {c.ticks[b.tick - 1].decided})")
    return out


def _row(label: str, xs: list[float]) -> str:
    m, mx = median_max(xs)
    return f"      {label:<56} {m * 1000:9.1f} {p90(xs) * 1000:9.1f} {mx * 1000:9.1f}   ({len(xs)})"


def format_tick(c: TickCost) -> list[str]:
    """The report of one run, as printed by `grayguard bench-controller`."""
    p = c.prom
    load = f"; load average {c.load_average:.1f} on {c.cpus} CPUs" if c.load_average is not None else ""
    n_queries = sum(1 for q in p.queries.values() if q.times)
    out = [f"  {c.nodes} nodes in {c.backends} backends (HAProxy {c.haproxy_version}: {c.servers} servers; "
           f"Prometheus {p.version}: {p.targets} target{'s' if p.targets > 1 else ''} per job; warm-up "
           f"{p.warmup_s:.0f} s, {p.nodes_with_data} nodes with data; {len(c.ticks)} ticks, one every "
           f"{c.interval_s:g} s{load}):",
           f"      {'per tick, ms':<56} {'median':>9} {'p90':>9} {'max':>9}   (ticks)",
           _row("whole tick (Controller.tick)", c.times("tick"))]
    for key, label in PARTS:
        if key == "prometheus":
            label = f"Prometheus queries ({n_queries}: read_prometheus + read_optional)"
        out.append(_row("  " + label, c.times(key)))
    out += [_row("decision (decide + plan)", c.times("decision")),
            _row("controller CPU in the tick (every thread)", [t.cpu_s for t in c.ticks])]
    cmds = [t.commands for t in c.ticks]
    if cmds:
        out.append(f"    runtime-API commands per tick: median {statistics.median(cmds):g}, max {max(cmds)}, "
                   f"{sum(cmds)} in all, in {sum(t.batches for t in c.ticks)} batches ({sum(1 for x in cmds if x)} of "
                   f"{len(cmds)} ticks wrote, {sum(t.refused for t in c.ticks)} refused); pools decided per tick: "
                   f"median {statistics.median([t.decided for t in c.ticks]):g}, max {max(t.decided for t in c.ticks)} "
                   f"of {c.backends}")
    out.append("    " + verdict(c))
    if c.memory:
        mib = ", ".join(f"{m.rss_bytes / 2**20:.1f} (tick {m.tick})" for m in c.memory)
        kept = ", ".join(f"{m.kept_bytes / 2**20:.1f}" for m in c.memory)
        blocks = ", ".join(f"{m.blocks:,}" for m in c.memory)
        rss = [t.rss_bytes for t in c.ticks]
        out.append(f"    controller memory (this process, after gc): RSS MiB {mib}; kept between ticks (states, "
                   f"decisions, metrics) MiB {kept}; Python blocks {blocks}; RSS over every tick "
                   f"{min(rss) / 2**20:.1f} to {max(rss) / 2**20:.1f} MiB")
    if c.cores:
        out.append("    CPU over the ticks, cores: " + ", ".join(f"{k} {v:.2f}" for k, v in c.cores.items()))
    out.append("    Prometheus rule group evaluation over the ticks, count x median / max (last from /metrics):")
    for g in p.groups.values():
        m, mx = median_max(g.evals["ticking"])
        last = f"{g.last_duration_s * 1000:.1f} ms" if g.last_duration_s else "-"
        out.append(f"      {g.name:<28} every {g.interval_s:>3g}s {len(g.evals['ticking']):>3} x {m * 1000:8.1f} / "
                   f"{mx * 1000:8.1f} ms  (last {last}; {g.missed:.0f} skipped)")
    slow = sorted(((name, median_max(q.times)[0]) for name, q in p.queries.items() if q.times), key=lambda kv: -kv[1])
    if slow:
        out.append("    slowest queries (median ms, concurrent within the tick): "
                   + ", ".join(f"{name} {m * 1000:.0f}" for name, m in slow[:5]))
    if c.logged:
        out.append("    controller log records (counted, not printed): "
                   + ", ".join(f"{n} {level}" for level, n in sorted(c.logged.items())))
    return out + [f"    note: {n}" for n in c.notes]


def all_notes(c: TickCost) -> list[str]:
    """The tick's findings and Prometheus' (bench/promresult.findings) over the same window."""
    return tick_findings(c) + findings(c.prom)
