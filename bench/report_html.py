"""The benchmark's report.html: report.md's targets and tables, and the time to detect per fault type and policy.
Pure: the rows, targets and meta of report.json in, HTML out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from grayguard.bench.report import _order, markdown_parts
from grayguard.htmlpage import markdown_html, page
from grayguard.svgplot import bar_chart


def detect_s(row: dict) -> float | None:
    """Seconds from the fault to the policy's first action on the faulty node (a weight cut or a quarantine)."""
    times = [t for t in (row.get("t_cut_s"), row.get("t_quarantine_s")) if t is not None]
    return min(times) if times else None


def detect_times(rows: Sequence[dict]) -> tuple[dict[str, dict[str, float | None]], list[str]]:
    """Per fault type, per policy: the median time to detect over the fault scenarios that detected it (None: it
    detected none); and the policies in report order."""
    faults = [r for r in rows if r["group"] == "fault"]
    policies = _order({r["policy"] for r in faults})
    out: dict[str, dict[str, float | None]] = {}
    for f in sorted({r["fault"] for r in faults}):
        out[f] = {}
        for p in policies:
            ts = [t for r in faults if r["fault"] == f and r["policy"] == p if (t := detect_s(r)) is not None]
            out[f][p] = statistics.median(ts) if ts else None
    return out, policies


def detect_chart(rows: Sequence[dict]) -> str:
    """Grouped bars: median time to detect, per fault type (x) and policy (bars)."""
    times, policies = detect_times(rows)
    return bar_chart(times, series_order=policies, title="Median time to detect per fault type (first weight cut "
                     "or quarantine)", ylabel="seconds from the fault",
                     xlabel="fault type (fault scenarios)", missing="never detected")


def render(rows: Sequence[dict], tgt: Sequence[dict], meta: dict) -> str:
    """report.html: the targets, the time-to-detect plot, the summary tables, every run (folded)."""
    head, tables, details = markdown_parts(list(rows), list(tgt), meta)
    chart = detect_chart(rows) if any(r["group"] == "fault" for r in rows) else ""
    body = (markdown_html("\n".join(head)) + ("<h3>Time to detect</h3>" + chart if chart else "")
            + markdown_html("\n".join(tables))
            + f"<details><summary>Every run ({len(rows)})</summary>{markdown_html(chr(10).join(details))}</details>")
    return page(f"grayguard bench: suite {meta.get('suite')}", body)
