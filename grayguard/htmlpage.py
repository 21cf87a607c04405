"""HTML report building blocks: the page, tables, readable values, a Markdown subset. Pure.

Values are written for a person: None is a dash, a dict is `key=value, ...`, a list is comma-separated, never a
Python repr (a browser test checks that no `{'` reaches the page).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping, Sequence

CSS = """body{font-family:sans-serif;margin:20px;max-width:1250px;color:#222}
table{border-collapse:collapse;margin:6px 0 14px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;
vertical-align:top}td:not(:last-child){white-space:nowrap}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.story{font-size:1.15em;line-height:1.5}.pass{color:#1a7f37}.miss{color:#c62828}
tr.faulty td{background:#fff4e5}tr.page td{background:#fdecea}.muted{color:#777}
svg.plot{display:block;margin:10px 0}code{background:#f4f4f4;padding:0 3px}"""


class Html(str):
    """Markup that is already HTML: table() and value() pass it through unescaped."""


def e(x: object) -> str:
    """Escaped text."""
    return html.escape(str(x))


def value(x: object, digits: int = 3) -> str:
    """A value as a person reads it (plain text, not escaped): -, 1.23, yes/no, k=v, a, b."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(x, Mapping):
        return ", ".join(f"{k}={value(v, digits)}" for k, v in x.items()) or "none"
    if isinstance(x, list | tuple | set | frozenset):
        return ", ".join(value(v, digits) for v in x) or "none"
    return str(x)


def cell(x: object) -> str:
    """One table cell's content: Html as is, anything else as a readable, escaped value."""
    return x if isinstance(x, Html) else e(value(x))


def table(header: Sequence[str], rows: Iterable[Sequence[object]], row_class: Sequence[str] | None = None) -> Html:
    """A table; numeric cells are right-aligned; row_class gives each row a class (or '')."""
    body = []
    for i, row in enumerate(rows):
        cls = row_class[i] if row_class and row_class[i] else ""
        tds = "".join(f'<td class="num">{cell(c)}</td>' if isinstance(c, int | float) and not isinstance(c, bool)
                      else f"<td>{cell(c)}</td>" for c in row)
        body.append(f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>")
    return Html("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>" + "".join(body) + "</table>")


def label(key: str) -> str:
    """A field name as a person reads it: fault_start_s -> fault start (s)."""
    return key[:-2].replace("_", " ") + " (s)" if key.endswith("_s") else key.replace("_", " ")


def kv_table(d: Mapping[str, object], labels: Mapping[str, str] | None = None) -> Html:
    """A two-column table of name and readable value."""
    return table(("what", "value"), [((labels or {}).get(k) or label(k), v) for k, v in d.items()])


def link(url: str | None, text: str) -> Html:
    """An <a> to an http(s) URL (anything else is shown as plain text)."""
    if not url or not re.match(r"https?://", url):
        return Html(e(text))
    return Html(f'<a href="{e(url)}">{e(text)}</a>')


def page(title: str, body: str) -> str:
    """A whole HTML document."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head><body>\n{body}\n</body></html>\n")


def _inline(text: str) -> str:
    out = e(text)
    out = re.sub(r"\*\*(PASS|MISS)\*\*", lambda m: f'<b class="{m[1].lower()}">{m[1]}</b>', out)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def markdown_html(md: str) -> str:
    """The Markdown subset the reports write (#-headings, paragraphs, `- ` lists, pipe tables, **b**, `code`)."""
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif m := re.match(r"(#{1,4}) (.*)", line):
            out.append(f"<h{len(m[1])}>{_inline(m[2])}</h{len(m[1])}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            head, *body = rows
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>" + "".join(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body) + "</table>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not re.match(r"#{1,4} |\||- ", lines[i]):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)
