"""The calibration report: the table (published vs shipped defaults vs fitted) and the plot, as SVG.

The plot is hand-drawn SVG (no plotting dependency), one row per GPU: decode time per token against the batch
size, and TTFT against the prompt length. Model curves come from `sim.calibrate.simulate`, so they are the
engine's own numbers; filled markers are fitted points, hollow ones are shown but kept out of the fit.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from grayguard.sim.calibrate import EXACT, Point, simulate
from grayguard.sim.model import SPEED_CLASSES, ModelParams

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
PROMPTS = (256, 2000, 4000, 6000, 8000, 10000, 12000, 16000, 20000)
PANEL_W, PANEL_H = 470, 300
ML, MR, MT, MB = 58, 26, 30, 40
DEFAULT_STYLE = 'stroke="#888" stroke-dasharray="6 4"'
FITTED_STYLE = 'stroke="#1f77b4"'


# -- the tables -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    point: Point
    default: float  # shipped ModelParams at the GPU's speed class
    fitted: float

    @staticmethod
    def err(model: float, published: float) -> float:
        return model / published - 1.0


def rows(points: Sequence[Point], fitted: dict[str, ModelParams]) -> list[Row]:
    return [Row(p, simulate(p, EXACT, SPEED_CLASSES[p.gpu]), simulate(p, fitted[p.gpu])) for p in points]


def _cite(p: Point) -> str:
    r = p.ref
    where = p.source.get("url") or r.get("url") or (f"{r.get('repo')} {r.get('path')} @{r.get('commit', '')[:7]}"
                                                      if r.get("repo") else "")
    return f"{p.source.get('ref', '')}: {where}"


def table(rs: Sequence[Row], markdown: bool = False) -> str:
    head = ["point", "workload", "published", "default model (err)", "fitted model (err)", "in fit", "source"]
    lines = []
    for r in rs:
        p, w = r.point, r.point.workload
        wl = " ".join(f"{k}={v}" for k, v in w.items())
        cells = [p.id, wl, f"{p.published:g} {p.unit}".strip(),
                 f"{r.default:.4g} ({100 * Row.err(r.default, p.published):+.0f} %)",
                 f"{r.fitted:.4g} ({100 * Row.err(r.fitted, p.published):+.0f} %)",
                 "yes" if p.fit else "no: " + p.reason.split(":")[0], _cite(p)]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head[:-1])]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head[:-1])] + [fmt.format(*c[:-1]) for c in lines])


def params_table(fitted: dict[str, ModelParams]) -> str:
    d = ModelParams()
    out = ["| knob | shipped default (h100; a100 = x1.6) | fitted h100 | fitted a100 |", "|---|---|---|---|"]
    for name, unit in (("decode_s_base", "ms"), ("decode_s_per_seq", "ms"), ("prefill_s_per_token", "us")):
        k = 1e3 if unit == "ms" else 1e6
        dv = getattr(d, name) * k
        out.append(f"| `{name}` | {dv:.3g} {unit} ({dv * SPEED_CLASSES['a100']:.3g}) | "
                   f"{getattr(fitted['h100'], name) * k:.3g} {unit} | {getattr(fitted['a100'], name) * k:.3g} {unit} |")
    return "\n".join(out)



# -- the plot -------------------------------------------------------------------------------------
def _curve_point(gpu: str, kind: str, x: float) -> Point:
    workload = {"kind": "decode_at_batch", "batch": x} if kind == "decode" else \
        {"kind": "single", "prompt": int(x), "output": 1}
    return Point("curve", gpu, "tpot" if kind == "decode" else "ttft", workload, 1.0, False, {})


def _short(point_id: str) -> str:
    return point_id.split("-", 1)[1]


def _published_xy(p: Point, kind: str) -> tuple[float, float, str] | None:
    """Where a published point sits on a panel: (x, y in ms, label), or None when it belongs elsewhere."""
    w = p.workload
    if kind == "decode" and p.metric in ("itl", "tpot"):
        x = {"single": 1, "decode_at_batch": w.get("batch"), "closed_loop": w.get("concurrency")}.get(w["kind"])
        return (x, p.published, _short(p.id)) if x else None
    if kind == "decode" and p.metric == "e2e":  # a whole batch: per step, the (tiny) prefill included
        return w["n"], p.published / w["output"], _short(p.id) + " (e2e/128)"
    if kind == "ttft" and p.metric == "ttft" and w["kind"] == "single":
        return w["prompt"], p.published, _short(p.id)
    return None


def _ticks(top: float) -> list[float]:
    """0, step, ..., covering `top`, with step 1, 2, 2.5 or 5 x 10^k (about 4-6 ticks)."""
    raw = top / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 2.5, 5, 10) if k * mag >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _panel(ox: float, oy: float, title: str, xlabel: str, curves: dict[str, tuple[str, list[tuple[float, float]]]],
           marks: Sequence[tuple[float, float, str, bool]], note: str = "",
           xt: Sequence[float] | None = None) -> list[str]:
    xs = [x for _, pts in curves.values() for x, _ in pts] + [m[0] for m in marks]
    ys = [y for _, pts in curves.values() for _, y in pts] + [m[1] for m in marks]
    xt, yt = xt or _ticks(max(xs)), _ticks(max(ys) * 1.05)
    x1, y1 = xt[-1], yt[-1]
    pw, ph = PANEL_W - ML - MR, PANEL_H - MT - MB

    def X(x: float) -> float:  # noqa: N802
        return ox + ML + pw * x / x1

    def Y(y: float) -> float:  # noqa: N802
        return oy + MT + ph * (1 - y / y1)

    out = [f'<text x="{ox + ML}" y="{oy + 18}" font-size="13" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{ox + ML}" y="{oy + MT}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for y in yt:
        out.append(f'<line x1="{ox + ML}" y1="{Y(y):.1f}" x2="{ox + ML + pw}" y2="{Y(y):.1f}" stroke="#eee"/>'
                   f'<text x="{ox + ML - 4}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xt:
        out.append(f'<text x="{X(x):.1f}" y="{oy + PANEL_H - 24}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{ox + ML + pw / 2}" y="{oy + PANEL_H - 8}" text-anchor="middle">{html.escape(xlabel)}</text>')
    cy = oy + MT + ph / 2
    out.append(f'<text x="{ox + 12}" y="{cy}" transform="rotate(-90 {ox + 12} {cy})" text-anchor="middle">ms</text>')
    for style, pts in curves.values():
        line = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" {style} stroke-width="1.8" points="{line}"/>')
    # Labels in a column to the right of the points, top to bottom, with leader lines: points crowd at small x.
    col_x, last = ox + ML + 0.45 * pw, -math.inf
    for x, y, label, fitted in sorted(marks, key=lambda m: -m[1]):
        px, py = X(x), Y(y)
        right = px > col_x - 20
        lx, ly = (px - 8, py - 8) if right else (col_x, max(py - 14, last + 13))
        last = ly if not right else last
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{"#000" if fitted else "#fff"}" stroke="#000"/>')
        if not right:
            out.append(f'<line x1="{px + 4:.1f}" y1="{py:.1f}" x2="{lx - 2:.1f}" y2="{ly - 3:.1f}" stroke="#bbb"/>')
        out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" font-size="10" fill="#333" '
                   f'text-anchor="{"end" if right else "start"}">{html.escape(label)}</text>')
    if note:
        out.append(f'<text x="{ox + ML + 8}" y="{oy + MT + 16}" font-size="10" fill="#a33">{html.escape(note)}</text>')
    return out


def svg(points: Sequence[Point], fitted: dict[str, ModelParams]) -> str:
    """Two rows (h100, a100) of two panels: decode ms/token vs batch, TTFT vs prompt length."""
    width, height = 2 * PANEL_W, 2 * PANEL_H + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">', f'<rect width="{width}" height="{height}" fill="#fff"/>']
    for row, gpu in enumerate(("h100", "a100")):
        speed = SPEED_CLASSES[gpu]
        for col, kind in enumerate(("decode", "ttft")):
            grid = BATCHES if kind == "decode" else PROMPTS
            curves = {
                "default": (DEFAULT_STYLE, [(x, simulate(_curve_point(gpu, kind, x), EXACT, speed)) for x in grid]),
                "fitted": (FITTED_STYLE, [(x, simulate(_curve_point(gpu, kind, x), fitted[gpu])) for x in grid]),
            }
            marks = [(*xy, p.fit) for p in points if p.gpu == gpu and (xy := _published_xy(p, kind))]
            title = f"{gpu.upper()}: " + ("decode time per token vs batch" if kind == "decode"
                                          else "TTFT of one request vs prompt length")
            note = "" if marks else "no published point: prefill tied to h100's by the decode ratio"
            out += _panel(col * PANEL_W, row * PANEL_H, title, "sequences in the batch" if kind == "decode"
                          else "prompt tokens", curves, marks, note, (0, 16, 32, 48, 64) if kind == "decode" else None)
    ly = 2 * PANEL_H + 20
    out.append(f'<line x1="20" y1="{ly}" x2="50" y2="{ly}" {DEFAULT_STYLE} stroke-width="1.8"/>'
               f'<text x="56" y="{ly + 4}">model, shipped defaults (x speed class: h100 1.0, a100 1.6)</text>'
               f'<line x1="400" y1="{ly}" x2="430" y2="{ly}" {FITTED_STYLE} stroke-width="1.8"/>'
               f'<text x="436" y="{ly + 4}">model, fitted</text>'
               f'<circle cx="540" cy="{ly}" r="4" fill="#000"/><text x="548" y="{ly + 4}">published, fitted</text>'
               f'<circle cx="660" cy="{ly}" r="4" fill="#fff" stroke="#000"/>'
               f'<text x="668" y="{ly + 4}">published, not fitted (see the table)</text>')
    out.append("</svg>")
    return "\n".join(out)
