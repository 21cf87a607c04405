"""Checks on rendered dashboard JSON (pure): Grafana's model, layout, and every PromQL expression it carries."""

from __future__ import annotations

from collections.abc import Iterator

from grayguard.dashboards.promql import label_values_selector

GRID_WIDTH = 24


def problems(doc: dict) -> list[str]:
    """What breaks Grafana's dashboard model: missing uid/schemaVersion, duplicate ids, overlapping panels."""
    out = []
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "annotations"):
        if key not in doc:
            out.append(f"missing {key}")
    uid = doc.get("uid", "")
    if not isinstance(uid, str) or not 1 <= len(uid) <= 40:
        out.append(f"uid {uid!r} must be a string of 1-40 characters")
    seen: dict[int, str] = {}
    cells: dict[tuple[int, int], str] = {}
    for p in doc.get("panels", []):
        title, pid, g = p.get("title", "?"), p.get("id"), p.get("gridPos") or {}
        if not isinstance(pid, int) or pid in seen:
            out.append(f"panel {title!r}: id {pid!r} missing or also used by {seen.get(pid)!r}")
        else:
            seen[pid] = title
        x, y, w, h = (g.get(k) for k in ("x", "y", "w", "h"))
        if not all(isinstance(v, int) for v in (x, y, w, h)) or w < 1 or h < 1 or x < 0 or y < 0:
            out.append(f"panel {title!r}: bad gridPos {g}")
            continue
        if x + w > GRID_WIDTH:
            out.append(f"panel {title!r}: gridPos {g} is wider than the {GRID_WIDTH}-column grid")
        for cx in range(x, x + w):
            for cy in range(y, y + h):
                if (cx, cy) in cells:
                    out.append(f"panel {title!r} overlaps {cells[(cx, cy)]!r} at x={cx} y={cy}")
                    break
                cells[(cx, cy)] = title
            else:
                continue
            break
        if p.get("type") != "row" and not p.get("targets"):
            out.append(f"panel {title!r} has no query")
    return out


def expressions(doc: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel query, annotation and label_values variable of a dashboard."""
    for p in doc.get("panels", []):
        for t in p.get("targets", []):
            yield f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]
    for a in doc.get("annotations", {}).get("list", []):
        if a.get("expr"):
            yield f"annotation {a.get('name')!r}", a["expr"]
    for v in doc.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        sel = label_values_selector(q) if v.get("type") == "query" and isinstance(q, str) else None
        if sel:
            yield f"variable ${v['name']}", sel
