"""Every query of the runbook's promql blocks parses in a real Prometheus (HTTP 200, not 400 bad_data): what the person
paged pastes into the expression browser works. A block holds one query a line; an indented line, or one inside
open brackets, continues the query above; `a, b` at the top level is two queries; `#` starts a comment (PromQL's)."""

from __future__ import annotations

from pathlib import Path

import requests

from tests.rules.test_removed_series import runbook_blocks
from tests.support.stack import prometheus_config, require, start_prometheus

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
OPEN, CLOSE = "([{", ")]}"


def _code(line: str) -> str:
    """The line up to its comment (a `#` outside a string)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'`":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def _split_top(code: str) -> list[str]:
    """code split at its top-level commas."""
    out, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(code):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'`":
            quote = c
        elif c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
        elif c == "," and depth == 0:
            out.append(code[start:i])
            start = i + 1
    return [q.strip() for q in [*out, code[start:]] if q.strip()]


def _depth(code: str) -> int:
    return sum(code.count(c) for c in OPEN) - sum(code.count(c) for c in CLOSE)


def queries(block: str) -> list[str]:
    out: list[list[str]] = []
    depth = 0
    for line in block.splitlines():
        code = _code(line).rstrip()
        if not code.strip():
            continue
        if out and (depth > 0 or line[0].isspace()):
            out[-1].append(code)
        else:
            out.append([code])
        depth += _depth(code)
    return [q for lines in out for q in _split_top("\n".join(lines))]


def test_the_splitter():
    block = ('a{x="1, 2"} # one, with a comment\nb, c / d\n(  # open\n    e\n) / (f > 0)\n'
             "g\n  / on (pool) group_left () h\n")
    assert queries(block) == ['a{x="1, 2"}', "b", "c / d", "(\n    e\n) / (f > 0)",
                              "g\n  / on (pool) group_left () h"]


def test_every_runbook_query_parses_in_prometheus():
    require("prometheus")
    all_queries = [q for block in runbook_blocks(RUNBOOK.read_text()) for q in queries(block)]
    assert len(all_queries) > 60
    with start_prometheus(prometheus_config([])) as prom:
        broken = requests.get(prom.url + "/api/v1/query", params={"query": "sum(rate(x[1m])"}, timeout=10)
        assert broken.status_code == 400 and broken.json()["errorType"] == "bad_data"  # the check can fail
        bad = []
        for q in all_queries:
            r = requests.get(prom.url + "/api/v1/query", params={"query": q}, timeout=10)
            if r.status_code != 200 or r.json().get("status") != "success":
                bad.append(f"HTTP {r.status_code} {r.text[:200]}\n{q}")
        assert bad == []
