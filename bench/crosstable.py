"""The cross-check's table: each figure of the engine and of the live stack side by side, with a verdict.

A row compares one figure of one scenario: the engine's run at the live run's tick phase (its controller started
and its fault struck at the same instants) against the live run. The engine's spread over other draws of the
phases neither side controls (each exporter's probe and fast-scrape schedule, HAProxy's check and agent-check
schedule) says how far one live run may fall from it by chance. Verdicts:

- PASS: within one tick (detection times), 15 % (P99 TTFT ratios), or 15 % or 2 requests (counts) of the engine;
- SPREAD: not that, but within the same tolerance of the engine's range over the phase draws;
- DIFF: outside both.
"""

from __future__ import annotations

from collections.abc import Callable

RATIO_TOL = 0.15  # P99 TTFT ratios (and failed requests) agree within 15 % ...
COUNT_SLACK = 2  # ... or, for counts, within 2 requests (a handful is noise either way)


def _ratio(r: dict, h: dict) -> float | None:
    return r["ttft_p99"] / h["ttft_p99"] if r["ttft_p99"] and h["ttft_p99"] else None


# (figure, kind, value of a run given its healthy run, for fault scenarios only)
METRICS: list[tuple[str, str, Callable[[dict, dict], float | int | None], bool]] = [
    ("time to cut (s)", "time", lambda r, h: r["t_cut_s"], True),
    ("time to quarantine (s)", "time", lambda r, h: r["t_quarantine_s"], True),
    ("P99 TTFT / healthy run's", "ratio", _ratio, False),
    ("failed requests", "count", lambda r, h: r["failed"], False),
    ("false cuts + quarantines", "count", lambda r, h: r["false_cuts"] + r["false_quarantines"], False),
]


def agree(kind: str, b: float | int | None, x: float | int | None, tick_s: float) -> bool:
    """Does x agree with b within the tolerance of its kind?"""
    if b is None or x is None:
        return b is None and x is None
    if kind == "time":
        return abs(x - b) <= tick_s + 1e-6
    if kind == "ratio":
        return abs(x / b - 1) <= RATIO_TOL + 1e-9
    return abs(x - b) <= max(COUNT_SLACK, RATIO_TOL * max(b, x))


def within(kind: str, spread: list, x: float | int | None, tick_s: float) -> bool:
    """Does x agree with some value of the engine's range (its min to its max, or a draw without a value)?"""
    if x is None or any(v is None for v in spread):
        return any(agree(kind, v, x, tick_s) for v in spread)
    vals = [v for v in spread if v is not None]
    lo, hi = min(vals), max(vals)
    return lo <= x <= hi or agree(kind, lo, x, tick_s) or agree(kind, hi, x, tick_s)


def rows(name: str, fault: bool, tick_s: float, bench: dict, live: dict, healthy: dict,
         spread: list[tuple[dict, dict]]) -> list[dict]:
    """One scenario's rows. bench, live and healthy hold each side's figures (healthy: {"bench", "live"}, the
    healthy runs); spread: (run, its healthy run) of the engine for every phase draw."""
    out = []
    for metric, kind, f, fault_only in METRICS:
        if fault_only and not fault:
            continue
        b, x = f(bench, healthy["bench"]), f(live, healthy["live"])
        sp = [f(r, h) for r, h in spread]
        verdict = ("PASS" if agree(kind, b, x, tick_s) else "SPREAD" if spread and within(kind, sp, x, tick_s)
                   else "DIFF")
        delta = None if b is None or x is None else (x / b - 1 if kind == "ratio" else x - b)
        out.append({"scenario": name, "metric": metric, "kind": kind, "bench": b, "live": x, "delta": delta,
                    "spread": sp, "verdict": verdict, "detail": _detail(metric, bench, live, healthy)})
    return out


def _detail(metric: str, bench: dict, live: dict, healthy: dict) -> str:
    if metric.startswith("P99"):
        return (f"{_s(bench['ttft_p99'])} / {_s(healthy['bench']['ttft_p99'])} vs "
                f"{_s(live['ttft_p99'])} / {_s(healthy['live']['ttft_p99'])} s")
    if metric == "failed requests":
        return f"of {bench['requests']} / {live['requests']}"
    if metric.startswith("false"):
        return f"{bench['false_cuts']}+{bench['false_quarantines']} vs {live['false_cuts']}+{live['false_quarantines']}"
    return ""


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def value(kind: str, x: float | int | None) -> str:
    if x is None:
        return "–"
    if kind == "ratio":
        return f"{x:.2f}x"
    return str(x) if isinstance(x, int) else f"{x:.1f}"


def _spread(row: dict) -> str:
    vals = [v for v in row["spread"] if v is not None]
    if not row["spread"]:
        return ""
    none = len(row["spread"]) - len(vals)
    if not vals:
        return "– (all)"
    lo, hi = min(vals), max(vals)
    text = value(row["kind"], lo) if lo == hi else f"{value(row['kind'], lo)}–{value(row['kind'], hi)}"
    return text + (f", – in {none}" if none else "")


def _delta(row: dict) -> str:
    d = row["delta"]
    if d is None:
        return "–"
    if row["kind"] == "ratio":
        return f"{d * 100:+.0f} %"
    return f"{d:+d}" if isinstance(d, int) else f"{d:+.1f} s"


def markdown(table: list[dict], draws: int) -> str:
    """The side-by-side table (Markdown)."""
    lines = [f"| scenario | figure | bench | bench over {draws} phase draws | live stack | live - bench | | detail |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['scenario']} | {r['metric']} | {value(r['kind'], r['bench'])} | {_spread(r)} | "
                     f"{value(r['kind'], r['live'])} | {_delta(r)} | {r['verdict']} | {r['detail']} |")
    return "\n".join(lines)
