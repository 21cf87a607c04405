"""`grayguard demo --compare`: the figures of the three runs (with grayguard, without it, without the fault) and the
report that puts them side by side. Pure: the runs' reports (and their client records) in, a dict and HTML out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grayguard.demo.report import rolling_percentile
from grayguard.demo.report_html import (
    after,
    fault_label,
    lat,
    markers,
    p99,
    run_parameters,
    story_line,
    timeline,
    verdict_class,
)
from grayguard.htmlpage import Html, e, page, table, value
from grayguard.svgplot import line_chart

RUNS = (("with", "with grayguard", "with-controller"), ("without", "without grayguard", "without-controller"),
        ("healthy", "no fault (healthy)", "healthy"))  # key, label, the run's own report dir
COLORS = {"with grayguard": "#2ca02c", "without grayguard": "#d62728", "no fault (healthy)": "#7f7f7f"}


def figures(on: Mapping[str, Any], off: Mapping[str, Any], healthy: Mapping[str, Any]) -> dict[str, Any]:
    """compare.json: client P99 TTFT over the fault window in each run, the ratios, the verdict."""
    on_f, off_f, base = p99(on, "fault"), p99(off, "fault"), p99(healthy, "fault")
    cmp: dict[str, Any] = {
        "p99_ttft_fault_with": on_f, "p99_ttft_fault_without": off_f, "p99_ttft_fault_window_healthy": base,
        "p99_ttft_baseline_phase_with": p99(on, "baseline"),
        "improvement_x": off_f / on_f if on_f and off_f else None,
        "fault_vs_healthy_with_x": on_f / base if on_f and base else None,
        "healthy_run_false_quarantines": list(healthy["false_quarantines"]) + (
            [healthy["faulty_node"]] if healthy["quarantine_s"] is not None else [])}
    ok = (cmp["improvement_x"] or 0) >= 3 and 0 < (cmp["fault_vs_healthy_with_x"] or 99) <= 1.5
    cmp["verdict"] = (f"{'PASS' if ok else 'MISS'}: P99 TTFT during the fault {cmp['improvement_x'] or 0:.1f}x "
                      f"better with grayguard (target >= 3x); {cmp['fault_vs_healthy_with_x'] or 0:.2f}x the healthy "
                      "run's P99 over the same window (target <= 1.5x)")
    return cmp


def _failed(r: Mapping[str, Any], phase: str) -> int | None:
    v = (r.get("phases") or {}).get(phase)
    return None if v is None else v["requests"] - v["ok"]


def side_by_side(runs: Mapping[str, Mapping[str, Any]]) -> Html:
    """One column per run: detection, client latency over the fault window, failures."""
    ref = runs["with"]["fault_start_s"]
    rows: list[list[object]] = []

    def row(label: str, f, faulted: bool = False) -> None:
        rows.append([label] + [("no fault" if faulted and runs[k].get("fault") == "none" else f(runs[k]))
                               for k, _, _ in RUNS])

    row("first weight cut (after the fault)", lambda r: after(r.get("first_weight_cut_s"), ref), True)
    row("quarantined", lambda r: after(r.get("quarantine_s"), ref), True)
    row("paged", lambda r: after(r.get("page_s"), ref), True)
    row("full weight again", lambda r: after(r.get("recovered_s"), ref), True)
    row("nodes quarantined that were not faulty", lambda r: value(r.get("false_quarantines") + [r["faulty_node"]] * (
        r.get("fault") == "none" and r.get("quarantine_s") is not None)))
    for q in ("p50", "p99", "p99.9"):
        row(f"client TTFT {q} over the fault window", lambda r, q=q: lat(
            ((r.get("phases") or {}).get("fault") or {}).get("ttft", {}).get(q)))
    row("client e2e p99 over the fault window", lambda r: lat(
        ((r.get("phases") or {}).get("fault") or {}).get("e2e", {}).get("p99")))
    row("failed requests over the fault window", lambda r: _failed(r, "fault"))
    row("failed requests, whole run", lambda r: sum(_failed(r, p) or 0 for p in (r.get("phases") or {})))
    return table(["", *(label for _, label, _ in RUNS)], rows)


def ratios(cmp: Mapping[str, Any]) -> Html:
    """The figures of compare.json."""
    return table(("figure", "value"), [
        ("P99 TTFT over the fault window, with grayguard", lat(cmp.get("p99_ttft_fault_with"))),
        ("… without grayguard", lat(cmp.get("p99_ttft_fault_without"))),
        ("… in the healthy run (same window, same traffic)", lat(cmp.get("p99_ttft_fault_window_healthy"))),
        ("P99 TTFT before the fault, with grayguard", lat(cmp.get("p99_ttft_baseline_phase_with"))),
        ("better with grayguard (without / with; target ≥ 3×)", _times(cmp.get("improvement_x"))),
        ("with grayguard against the healthy run (target ≤ 1.5×)", _times(cmp.get("fault_vs_healthy_with_x"))),
        ("quarantined in the healthy run", value(cmp.get("healthy_run_false_quarantines")))])


def _times(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def ttft_chart(runs: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[Any]]) -> str:
    """The clients' P99 TTFT of the three runs over time (10 s window), with the fault and grayguard's actions."""
    end = max(r.get("duration_s") or 1 for r in runs.values())
    series = {label: rolling_percentile(records.get(k, ()), "ttft_s", 99, 10, 1, end) for k, label, _ in RUNS}
    return line_chart(series, title="Client P99 TTFT over a 10 s window, three runs", ylabel="seconds", log=True,
                      markers=markers(runs["with"]), x_max=end, colors=COLORS)


def render(cmp: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]],
           records: Mapping[str, Sequence[Any]]) -> str:
    """The compare report.html: the story, the verdict, the plot, the runs side by side, the timeline."""
    on = runs["with"]
    title = f"grayguard demo --compare: {fault_label(on)} on {on.get('faulty_node')}"
    links = ", ".join(f'<a href="{d}/report.html">{e(label)}</a>' for _, label, d in RUNS)
    body = (f"<h1>{e(title)}</h1>{story_line(on, cmp)}"
            f'<p class="{verdict_class(str(cmp.get("verdict", "")))}"><b>{e(cmp.get("verdict", ""))}</b></p>'
            f"{ttft_chart(runs, records)}"
            f"<h2>The three runs side by side</h2>{side_by_side(runs)}"
            f"<h2>Figures</h2>{ratios(cmp)}"
            f"<p>Each run's own report: {links}.</p>"
            f"<h2>Timeline with grayguard</h2>"
            f"{timeline(on.get('events') or [], on['fault_start_s'], on.get('faulty_node'))}"
            f"<h2>Run parameters (with grayguard)</h2>{run_parameters(on)}")
    return page(title, body)
