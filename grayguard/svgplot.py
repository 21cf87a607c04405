"""Inline SVG plots for the HTML reports (no plotting dependency): line and grouped-bar charts. Pure.

Every chart carries the same markup so a browser test can check it: `<svg class="plot">` with a `<title>`,
`<g class="axis x">` and `<g class="axis y">` (ticks `.tick`, the label `.axis-label`), the data in
`<g class="series">` and `<g class="legend">` with one `.legend-item` per series.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")
Series = Mapping[str, Sequence[tuple[float, float | None]]]


def _e(s: object) -> str:
    return html.escape(str(s))


def _open(title: str, width: int, height: int, left: int) -> list[str]:
    return [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
            f"<title>{_e(title)}</title>",
            f'<text class="plot-title" x="{left}" y="16" font-size="13" font-weight="bold">{_e(title)}</text>']


def _legend(names: Sequence[str], colors: Sequence[str], x: float, y: float) -> str:
    items = [f'<g class="legend-item"><rect x="{x}" y="{y + 16 * i - 9}" width="12" height="4" fill="{c}"/>'
             f'<text x="{x + 16}" y="{y + 16 * i - 3}">{_e(n)}</text></g>' for i, (n, c) in enumerate(zip(names, colors,
                                                                                                        strict=True))]
    return '<g class="legend">' + "".join(items) + "</g>"


def _y_axis(ticks: Sequence[tuple[float, str]], label: str, left: int, top: int, ph: float, pw: float) -> str:
    out = ['<g class="axis y">']
    for y, text in ticks:
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text class="tick" x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{_e(text)}</text>')
    cy = top + ph / 2
    out.append(f'<text class="axis-label" x="12" y="{cy:.1f}" transform="rotate(-90 12 {cy:.1f})" '
               f'text-anchor="middle">{_e(label)}</text></g>')
    return "".join(out)


def _x_axis(ticks: Sequence[tuple[float, str]], label: str, left: int, pw: float, height: int) -> str:
    out = ['<g class="axis x">']
    out += [f'<text class="tick" x="{x:.1f}" y="{height - 24}" text-anchor="middle">{_e(t)}</text>'
            for x, t in ticks]
    out.append(f'<text class="axis-label" x="{left + pw / 2:.1f}" y="{height - 6}" text-anchor="middle">'
               f"{_e(label)}</text></g>")
    return "".join(out)


def line_chart(series: Series, *, title: str, ylabel: str, xlabel: str = "seconds since the load started",
               markers: Sequence[tuple[float, str]] = (), log: bool = False, width: int = 900, height: int = 280,
               x_max: float | None = None, colors: Mapping[str, str] | None = None) -> str:
    """A line chart over time; None values break the line; markers are labelled vertical lines."""
    ml, mr, mt, mb = 60, 170, 28, 44
    pts = [(t, v) for s in series.values() for t, v in s if v is not None and (not log or v > 0)]
    if not pts:
        return f'<p class="no-data"><b>{_e(title)}</b>: no data</p>'
    x1 = x_max or max(t for t, _ in pts) or 1.0
    vals = [math.log10(v) if log else v for _, v in pts]
    y0, y1 = (min(vals), max(vals)) if log else (0.0, max(vals))
    if y1 - y0 < 1e-12:
        y1 = y0 + 1
    pw, ph = width - ml - mr, height - mt - mb

    def X(t: float) -> float:  # noqa: N802
        return ml + pw * t / x1

    def Y(v: float) -> float:  # noqa: N802
        return mt + ph * (1 - ((math.log10(v) if log else v) - y0) / (y1 - y0))

    yt = [(mt + ph * (1 - i / 4), f"{(10 ** (y0 + (y1 - y0) * i / 4)) if log else y0 + (y1 - y0) * i / 4:.3g}")
          for i in range(5)]
    xt = [(X(x1 * i / 5), f"{x1 * i / 5:.0f}") for i in range(6)]
    out = _open(title, width, height, ml)
    out.append(_y_axis(yt, ylabel + (" (log scale)" if log else ""), ml, mt, ph, pw))
    out.append(_x_axis(xt, xlabel, ml, pw, height))
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    out.append('<g class="markers">')
    for k, (t, label) in enumerate(sorted(markers)):  # labels on staggered rows: events come seconds apart
        out.append(f'<line x1="{X(t):.1f}" y1="{mt}" x2="{X(t):.1f}" y2="{mt + ph}" stroke="#999" '
                   f'stroke-dasharray="4 3"/><text x="{X(t) + 3:.1f}" y="{mt + 10 + 12 * (k % 4)}" fill="#555">'
                   f"{_e(label)}</text>")
    out.append('</g><g class="series">')
    names = sorted(series)
    palette = [(colors or {}).get(n, COLORS[i % len(COLORS)]) for i, n in enumerate(names)]
    for name, color in zip(names, palette, strict=True):
        segs, cur = [], []
        for t, v in series[name]:
            if v is None or (log and v <= 0):
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(f"{X(t):.1f},{Y(v):.1f}")
        if cur:
            segs.append(cur)
        out += [f'<polyline data-series="{_e(name)}" fill="none" stroke="{color}" stroke-width="1.5" '
                f'points="{" ".join(seg)}"/>' for seg in segs]
    out.append("</g>" + _legend(names, palette, width - mr + 12, mt + 12) + "</svg>")
    return "\n".join(out)


def bar_chart(groups: Mapping[str, Mapping[str, float | None]], *, title: str, ylabel: str, xlabel: str,
              series_order: Sequence[str] | None = None, missing: str = "none", height: int = 300) -> str:
    """Grouped bars: one group per category (x), one bar per series; a None value is drawn as an x (`missing`)."""
    names = list(series_order or sorted({s for g in groups.values() for s in g}))
    vals = [v for g in groups.values() for v in g.values() if v is not None]
    if not groups or not names:
        return f'<p class="no-data"><b>{_e(title)}</b>: no data</p>'
    ml, mr, mt, mb, bw = 60, 190, 28, 44, 12
    # room for the category's name under its bars, and for the title
    pw = max(len(title) * 7 - mr, len(groups) * max(100, len(names) * bw + 24))
    width, ph = ml + pw + mr, height - mt - mb
    y1 = max(vals, default=1.0) * 1.1 or 1.0
    yt = [(mt + ph * (1 - i / 4), f"{y1 * i / 4:.3g}") for i in range(5)]
    step = pw / len(groups)
    xt = [(ml + step * (i + 0.5), cat) for i, cat in enumerate(groups)]
    out = _open(title, width, height, ml)
    out.append(_y_axis(yt, ylabel, ml, mt, ph, pw))
    out.append(_x_axis(xt, xlabel, ml, pw, height))
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/><g class="series">')
    palette = [COLORS[i % len(COLORS)] for i in range(len(names))]
    for i, (cat, g) in enumerate(groups.items()):
        x0 = ml + step * (i + 0.5) - len(names) * bw / 2
        for j, (name, color) in enumerate(zip(names, palette, strict=True)):
            v, x = g.get(name), x0 + j * bw
            if v is None:
                out.append(f'<text x="{x + bw / 2:.1f}" y="{mt + ph - 3}" text-anchor="middle" fill="{color}">'
                           f"×<title>{_e(cat)}, {_e(name)}: {_e(missing)}</title></text>")
                continue
            h = ph * v / y1
            out.append(f'<rect data-series="{_e(name)}" x="{x:.1f}" y="{mt + ph - h:.1f}" width="{bw - 2}" '
                       f'height="{h:.1f}" fill="{color}"><title>{_e(cat)}, {_e(name)}: {v:.3g}</title></rect>')
    out.append("</g>" + _legend([*names, f"× {missing}"], [*palette, "#fff"], ml + pw + 12, mt + 12) + "</svg>")
    return "\n".join(out)
