"""Demo report: the headline figures (pure functions over samples and events) and an HTML page with SVG plots."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")


def first_time(samples: Sequence[dict], since: float, pred) -> float | None:
    """t of the first sample at or after `since` for which pred(sample) holds."""
    return next((s["t"] for s in samples if s["t"] >= since and pred(s)), None)


def headline(samples: Sequence[dict], events: Sequence[dict], faulty: str, fault_start: float,
             fault_end: float | None, base_weight: int = 100) -> dict[str, Any]:
    """The figures report.json leads with (seconds from the start of the run; None: did not happen)."""
    def node(s: dict) -> dict:
        return s["nodes"].get(faulty, {})
    def weight(s: dict) -> int:
        w = node(s).get("weight")
        return base_weight if w is None else w  # 0 is a weight, not a missing one
    cut = first_time(samples, fault_start, lambda s: weight(s) < base_weight)
    quarantine = first_time(samples, fault_start, lambda s: node(s).get("state") == "quarantined")
    page = next((e["t"] for e in events if e["kind"] == "page" and e.get("node") == faulty
                 and e.get("status") == "firing" and e["t"] >= fault_start), None)
    recovered = None
    if fault_end is not None:
        recovered = first_time(samples, fault_end, lambda s: node(s).get("weight") == base_weight
                               and node(s).get("state") in (None, "healthy") and not node(s).get("drained"))
    false_q = sorted({n for s in samples for n, v in s["nodes"].items()
                      if n != faulty and v.get("state") == "quarantined"})
    return {"faulty_node": faulty, "fault_start_s": fault_start, "fault_end_s": fault_end,
            "first_weight_cut_s": cut, "quarantine_s": quarantine, "page_s": page, "recovered_s": recovered,
            "false_quarantines": false_q}


def rolling_percentile(records: Iterable[Any], metric: str, q: float, window_s: float, step_s: float,
                       end_s: float) -> list[tuple[float, float | None]]:
    """(t, q-th percentile of `metric` over requests that started in (t - window, t]) every step."""
    pts = sorted((r.start_s, getattr(r, metric)) for r in records
                 if r.status == "ok" and getattr(r, metric) is not None)
    out = []
    t, lo = step_s, 0
    while t <= end_s + 1e-9:
        while lo < len(pts) and pts[lo][0] <= t - window_s:
            lo += 1
        vals = sorted(v for s, v in pts[lo:] if s <= t)
        out.append((t, _pct(vals, q) if vals else None))
        t += step_s
    return out


def _pct(sorted_vals: list[float], q: float) -> float:
    k = (len(sorted_vals) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(sorted_vals) - 1)
    return sorted_vals[f] + (sorted_vals[c] - sorted_vals[f]) * (k - f)


def svg_chart(series: dict[str, list[tuple[float, float | None]]], *, title: str, ylabel: str,
              markers: Sequence[tuple[float, str]] = (), log: bool = False, width: int = 900,
              height: int = 260, x_max: float | None = None) -> str:
    """A line chart as inline SVG (no plotting dependency); None values break the line."""
    ml, mr, mt, mb = 60, 150, 28, 32
    pts = [(t, v) for s in series.values() for t, v in s if v is not None and (not log or v > 0)]
    if not pts:
        return f"<p><b>{html.escape(title)}</b>: no data</p>"
    x1 = x_max or max(t for t, _ in pts)
    vals = [math.log10(v) if log else v for _, v in pts]
    y0, y1 = (min(vals), max(vals)) if log else (0.0, max(vals))
    if y1 - y0 < 1e-12:
        y1 = y0 + 1
    pw, ph = width - ml - mr, height - mt - mb

    def X(t: float) -> float:  # noqa: N802
        return ml + pw * t / x1

    def Y(v: float) -> float:  # noqa: N802
        return mt + ph * (1 - ((math.log10(v) if log else v) - y0) / (y1 - y0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{ml}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for i in range(5):
        fv = y0 + (y1 - y0) * i / 4
        v = 10 ** fv if log else fv
        y = mt + ph * (1 - i / 4)
        out.append(f'<text x="{ml - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for i in range(6):
        t = x1 * i / 5
        out.append(f'<text x="{X(t):.1f}" y="{height - 14}" text-anchor="middle">{t:.0f}s</text>')
    out.append(f'<text x="12" y="{mt + ph / 2}" transform="rotate(-90 12 {mt + ph / 2})" '
               f'text-anchor="middle">{html.escape(ylabel)}</text>')
    for k, (t, label) in enumerate(sorted(markers)):  # labels on staggered rows: events come seconds apart
        out.append(f'<line x1="{X(t):.1f}" y1="{mt}" x2="{X(t):.1f}" y2="{mt + ph}" stroke="#999" '
                   f'stroke-dasharray="4 3"/><text x="{X(t) + 3:.1f}" y="{mt + 10 + 12 * (k % 4)}" fill="#555">'
                   f'{html.escape(label)}</text>')
    for i, (name, s) in enumerate(sorted(series.items())):
        color = COLORS[i % len(COLORS)]
        segs, cur = [], []
        for t, v in s:
            if v is None or (log and v <= 0):
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(f"{X(t):.1f},{Y(v):.1f}")
        if cur:
            segs.append(cur)
        for seg in segs:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
        ly = mt + 12 + 14 * i
        out.append(f'<rect x="{width - mr + 10}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
                   f'<text x="{width - mr + 24}" y="{ly - 3}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_report(report: dict, samples: Sequence[dict], records: Sequence[Any], out_dir: Path) -> None:
    """report.json (figures, phases, events, time series) and report.html (plots)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps({**report, "samples": list(samples)}, indent=1, default=str))
    h = report
    nodes = sorted({n for s in samples for n in s["nodes"]}, key=lambda n: (len(n), n))
    end = report.get("duration_s") or (samples[-1]["t"] if samples else 1)
    markers = [(h["fault_start_s"], f"fault {report.get('fault', '')}")]
    if h.get("fault_end_s") is not None:
        markers.append((h["fault_end_s"], "fault cleared"))
    for key, label in (("first_weight_cut_s", "cut"), ("quarantine_s", "quarantine"), ("page_s", "page"),
                       ("recovered_s", "recovered")):
        if h.get(key) is not None:
            markers.append((h[key], label))

    def per_node(field: str) -> dict[str, list]:
        return {n: [(s["t"], s["nodes"].get(n, {}).get(field)) for s in samples] for n in nodes}

    p99 = {"client P99 TTFT": rolling_percentile(records, "ttft_s", 99, 10, 1, end),
           "client P50 TTFT": rolling_percentile(records, "ttft_s", 50, 10, 1, end)}
    charts = [
        svg_chart(per_node("latency"), title="Normalized latency per node (s per weighted token, Prometheus)",
                  ylabel="s/token", markers=markers, log=True, x_max=end),
        svg_chart(per_node("weight"), title="HAProxy weight per node", ylabel="weight", markers=markers, x_max=end),
        svg_chart(p99, title="Client TTFT over a 10 s window", ylabel="seconds", markers=markers, log=True, x_max=end),
        svg_chart(per_node("probe_ttft"), title="Probe TTFT per node (exporter)", ylabel="seconds",
                  markers=markers, log=True, x_max=end),
    ]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in h.items())
    phases = report.get("phases", {})
    prow = "".join(
        f"<tr><td>{p}</td><td>{v['requests']}</td><td>{v['ok']}</td>"
        + "".join(f"<td>{_fmt(v['ttft'].get(q))}</td>" for q in ("p50", "p95", "p99", "p99.9"))
        + "".join(f"<td>{_fmt(v['e2e'].get(q))}</td>" for q in ("p50", "p99")) + "</tr>"
        for p, v in phases.items())
    ev = "".join(f"<tr><td>{e['t']:.1f}</td><td>{html.escape(e['kind'])}</td><td>{html.escape(e['text'])}</td></tr>"
                 for e in report.get("events", []))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>grayguard demo report</title>
<style>body{{font-family:sans-serif;margin:20px}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:2px 8px;text-align:left}}</style></head><body>
<h1>grayguard demo: {html.escape(str(report.get('fault', '')))} on {html.escape(str(h.get('faulty_node')))}</h1>
<p>{html.escape(report.get('verdict', ''))}</p>
<h2>Headline</h2><table>{rows}</table>
<h2>Client latency per phase (seconds)</h2><table><tr><th>phase</th><th>requests</th><th>ok</th><th>TTFT p50</th>
<th>p95</th><th>p99</th><th>p99.9</th><th>e2e p50</th><th>e2e p99</th></tr>{prow}</table>
<h2>Plots</h2>{''.join(charts)}
<h2>Events</h2><table><tr><th>t (s)</th><th>kind</th><th>what</th></tr>{ev}</table>
</body></html>"""
    (out_dir / "report.html").write_text(page)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"
