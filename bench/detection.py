"""Issue 13's targets (detection in seconds), measured over a bench run's rows: PASS/MISS lines and the 90th
percentiles per fault type and pool size. Pure.

A slowdown that was never cut (or never quarantined) counts as infinitely late: it raises the median and the
90th percentile instead of leaving them. A false cut is measured from the weight's fall to its return to full
(a quarantine's slow start included); the target allows one tick.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from operator import itemgetter

from grayguard.sim.faults import LATENCY_FAULTS

by_size = itemgetter("size")

GG = "grayguard"
REFERENCES = frozenset({"oracle"})  # knows the fault schedule: a floor to read against, not a rival to beat
Target = Callable[[str, bool | None, str, str], dict]


def quantile(vals: Iterable[float], q: float) -> float | None:
    """The nearest-rank quantile (the value of a run, never an interpolation); inf counts as the largest."""
    v = sorted(vals)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else None


def _late(x: float | None) -> float:
    return math.inf if x is None else x


def _s(x: float | None) -> str:
    return "–" if x is None else "never" if math.isinf(x) else f"{x:.0f} s"


def _slow(gg: list[dict], lo: float, hi: float = math.inf) -> list[dict]:
    return [r for r in gg if r["group"] in ("fault", "sensitivity") and lo <= (r.get("slowdown") or 0) < hi]


def detection_targets(rows: list[dict], target: Target) -> list[dict]:
    """The PASS/MISS lines of issue 13's bench targets (`target` builds one line, as bench/report.py's)."""
    gg = [r for r in rows if r["policy"] == GG]
    out = []
    big = _slow(gg, 2.0)
    cuts, qs = [_late(r["t_cut_s"]) for r in big], [_late(r["t_quarantine_s"]) for r in big]
    mc, mq = statistics.median(cuts) if cuts else None, statistics.median(qs) if qs else None
    out.append(target("slowdowns >= 2x: median time to first cut <= 5 s and to quarantine <= 10 s",
                      None if not big else mc <= 5 and mq <= 10,
                      f"cut median {_s(mc)} (p90 {_s(quantile(cuts, 0.9))}), quarantine median {_s(mq)} "
                      f"(p90 {_s(quantile(qs, 0.9))}) over {len(big)} scenarios",
                      "per fault type and pool size: the table 'Detection: 90th percentiles'"))
    mid = _slow(gg, 1.5, 2.0)
    late = [r for r in mid if _late(r["t_cut_s"]) > 20]
    out.append(target("1.5x slowdowns cut within 20 s", None if not mid else not late,
                      ", ".join(f"n{r['size']} {_s(_late(r['t_cut_s']))}" for r in sorted(mid, key=by_size)),
                      ", ".join(r["scenario"] for r in late)))
    small = [r for r in _slow(gg, 1.25, 1.5) if r["size"] in (8, 32)]
    missed = [r for r in small if r["t_cut_s"] is None]
    out.append(target("1.25x slowdowns cut in the 8- and 32-node pools", None if not small else not missed,
                      ", ".join(f"n{r['size']} {_s(_late(r['t_cut_s']))}" for r in sorted(small, key=by_size)),
                      ", ".join(r["scenario"] for r in missed)))
    benign = [r for r in gg if r["group"] == "benign"]
    bad = [r for r in benign if r["false_quarantines"] or r.get("false_agent_downs")
           or (r.get("false_cut_longest_s") or 0.0) > r.get("tick_s", 0.0) + 1e-9]
    longest = max((x for r in benign if (x := r.get("false_cut_longest_s")) is not None), default=None)
    out.append(target("benign scenarios: zero false quarantines, no false cut longer than one tick",
                      None if not benign else not bad,
                      f"{sum(r['false_quarantines'] for r in benign)} false quarantine(s), "
                      f"{sum(r['false_cuts'] for r in benign)} false cut(s), the longest "
                      f"{'–' if longest is None else f'{longest:.0f} s'}, in {len(benign)} scenarios",
                      ", ".join(f"{r['scenario']} ({r['false_quarantines']} quarantine(s), longest cut "
                                f"{r.get('false_cut_longest_s') or 0:.0f} s)" for r in bad)))
    out += _p99_targets(rows, gg, target)
    return out


def _p99_targets(rows: list[dict], gg: list[dict], target: Target) -> list[dict]:
    slow = [r for r in gg if r["group"] == "fault" and r["fault"] in LATENCY_FAULTS]
    m = statistics.median(x for r in slow if (x := r["ttft_p99_x"]) is not None) if slow else None
    out = [target("slowdown faults: P99 TTFT <= 1.1x the healthy baseline (median)",
                  None if m is None else m <= 1.1, f"median {m:.3f}x over {len(slow)} scenarios" if m else "–", "")]
    n4 = [r for r in slow if r["size"] == 4]
    by = {(r["scenario"], r["policy"]): r for r in rows}
    others = sorted({r["policy"] for r in rows if r["group"] == "fault"} - {GG} - REFERENCES)
    parts, worse, ok = [], [], bool(n4 and others)
    for p in others:
        rel = [(r["ttft_p99"] / o["ttft_p99"], r["scenario"]) for r in n4
               if (o := by.get((r["scenario"], p))) and o["ttft_p99"] and r["ttft_p99"] is not None]
        med = statistics.median(x for x, _ in rel) if rel else None
        ok = ok and med is not None and med < 1.0
        parts.append(f"{p} {med:.2f}x" if med is not None else f"{p} –")
        worse += [f"{s} vs {p} {x:.2f}x" for x, s in rel if x > 1.0]
    out.append(target("4-node pools, slowdown faults: P99 TTFT better than every other policy's (median of "
                      "grayguard/other)", None if not n4 or not others else ok,
                      ", ".join(parts) + f" over {len(n4)} scenarios",
                      f"scenarios where grayguard's P99 TTFT was worse: {len(worse)} of {len(n4) * len(others)} "
                      "pairs" + (f": {', '.join(worse)}" if worse else "")))
    return out


def percentile_table(rows: list[dict]) -> list[str]:
    """Markdown: median and 90th percentile time to cut and to quarantine, per fault type and pool size (>= 2x)."""
    big = _slow([r for r in rows if r["policy"] == GG], 2.0)
    if not big:
        return []
    keys = sorted({(r["fault"], r["size"]) for r in big})
    lines = ["### Detection: 90th percentiles (grayguard, slowdowns >= 2x; never = not within the fault window)", "",
             "| fault | nodes | scenarios | cut median | cut p90 | quarantine median | quarantine p90 |",
             "|---|---|---|---|---|---|---|"]
    for f, n in keys:
        rs = [r for r in big if (r["fault"], r["size"]) == (f, n)]
        c, q = [_late(r["t_cut_s"]) for r in rs], [_late(r["t_quarantine_s"]) for r in rs]
        lines.append(f"| {f} | {n} | {len(rs)} | {_s(statistics.median(c))} | {_s(quantile(c, 0.9))} | "
                     f"{_s(statistics.median(q))} | {_s(quantile(q, 0.9))} |")
    return lines + [""]
