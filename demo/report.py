"""Demo report: the headline figures (pure functions over samples and events); report.json and report.html."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def first_time(samples: Sequence[dict], since: float, pred) -> float | None:
    """t of the first sample at or after `since` for which pred(sample) holds."""
    return next((s["t"] for s in samples if s["t"] >= since and pred(s)), None)


def headline(samples: Sequence[dict], events: Sequence[dict], faulty: str, fault_start: float,
             fault_end: float | None, base_weight: int = 100, marks: Sequence[dict] = ()) -> dict[str, Any]:
    """The figures report.json leads with (seconds from the start of the run; None: did not happen).

    marks: demo.watch's changes of weights and states, timestamped to a tenth of a second; read with the
    once-a-second samples, whichever saw a change first.
    """
    samples = sorted([*samples, *marks], key=lambda s: s["t"]) if marks else samples
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


def write_report(report: dict, samples: Sequence[dict], records: Sequence[Any], out_dir: Path) -> None:
    """report.json (figures, phases, events, time series) and report.html (demo/report_html.py)."""
    from grayguard.demo.report_html import render  # it imports this module's figures
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps({**report, "samples": list(samples)}, indent=1, default=str))
    (out_dir / "report.html").write_text(render(report, samples, records))


