"""Checks on rendered dashboard JSON (pure): Grafana's model, layout, and every PromQL expression it carries."""

from __future__ import annotations

import re
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


# ---- links and variables across the rendered dashboards ----------------------------------------------------

# Grafana's own variables: the query ones, and those of data links (${__field.labels.pool}, ${__value.raw}, ...)
BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__url_time_range",
            "__field", "__data", "__value", "__series", "__all_variables", "__dashboard", "__org", "__user",
            "__from", "__to", "__timeFilter"}
# $name, ${name}, ${name:format}, ${name.path}, [[name]]; $1 (a regex group of label_replace) is no variable
_USE = re.compile(r"\$\{([A-Za-z_]\w*)[^}]*\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)[^\]]*\]\]")
_DASH_URL = re.compile(r"^/d/([^/?#]+)(?:/[^?#]*)?(?:\?(.*))?$")


def variables(doc: dict) -> set[str]:
    """Names of a dashboard's template variables."""
    return {v["name"] for v in doc.get("templating", {}).get("list", [])}


def used_variables(text: str) -> set[str]:
    """Template variables a string refers to (Grafana's syntaxes)."""
    return {a or b or c for a, b, c in _USE.findall(text)}


def links(doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, link) for every dashboard link, panel link, data link and cell link of a dashboard."""
    for lk in doc.get("links", []):
        yield f"dashboard link {lk.get('title')!r}", lk
    for p in doc.get("panels", []):
        where = f"panel {p.get('title')!r}"
        for lk in p.get("links", []):
            yield f"{where} link {lk.get('title')!r}", lk
        fc = p.get("fieldConfig", {})
        for lk in fc.get("defaults", {}).get("links", []):
            yield f"{where} data link {lk.get('title')!r}", lk
        for o in fc.get("overrides", []):
            for prop in o.get("properties", []):
                if prop.get("id") == "links":
                    for lk in prop.get("value", []):
                        yield f"{where} column {o['matcher'].get('options')!r} link {lk.get('title')!r}", lk


def _texts(doc: dict) -> Iterator[tuple[str, str]]:
    """(where, text) of everything Grafana interpolates: queries, legends, titles, variable queries, links."""
    for where, expr in expressions(doc):
        yield where, expr
    for v in doc.get("templating", {}).get("list", []):
        q = v.get("query")
        yield f"variable ${v['name']}", q.get("query", "") if isinstance(q, dict) else str(q or "")
    for p in doc.get("panels", []):
        yield f"panel {p.get('title')!r} title", p.get("title", "")
        for t in p.get("targets", []):
            yield f"panel {p.get('title')!r} {t.get('refId')} legend", t.get("legendFormat", "")
    for where, lk in links(doc):
        yield where, lk.get("url", "")


def link_problems(docs: dict[str, dict]) -> list[str]:
    """What does not resolve across the rendered dashboards (file name -> JSON): a variable used but not defined, a
    link to a uid none of them has, a var-<name> its target does not define, a tag no other dashboard carries, a
    multi-value variable matched with = (one value only), a link that drops the time range."""
    by_uid = {d["uid"]: d for d in docs.values()}
    out = []
    for name, doc in docs.items():
        own = variables(doc)
        multi = {v["name"] for v in doc.get("templating", {}).get("list", []) if v.get("multi")}
        for where, text in _texts(doc):
            out += [f"{name}: {where}: ${u} is not a variable" for u in sorted(used_variables(text) - own - BUILTINS)]
            for m in sorted(multi):
                if re.search(rf'(?<![=!])(=|!=)\s*"\$\{{?{m}\b', text):
                    out.append(f"{name}: {where}: ${m} takes several values: match it with =~, not =")
        for where, lk in links(doc):
            if lk.get("type") == "dashboards":
                tags = set(lk.get("tags", []))
                if not any(tags <= set(d.get("tags", [])) for d in docs.values() if d is not doc):
                    out.append(f"{name}: {where}: no other dashboard has the tags {sorted(tags)}")
                continue
            m = _DASH_URL.match(lk.get("url", ""))
            if not m:
                out.append(f"{name}: {where}: {lk.get('url')!r} is no /d/<uid> link")
                continue
            target = by_uid.get(m.group(1))
            if target is None:
                out.append(f"{name}: {where}: no rendered dashboard has uid {m.group(1)!r}")
                continue
            params = [kv.split("=", 1)[0] for kv in (m.group(2) or "").split("&") if kv]
            for var in (p.removeprefix("var-") for p in params if p.startswith("var-")):
                if var not in variables(target):
                    out.append(f"{name}: {where}: {target['uid']} has no variable {var!r}")
            if not (lk.get("keepTime") or "${__url_time_range}" in lk.get("url", "")):
                out.append(f"{name}: {where}: drops the time range")
    return out
