"""Sharded reads: a replica that leads some of the pools asks Prometheus for those pools' series only.

With registry.shard_pools each pool is led by exactly one replica, but a tick looks only at the series of the
pools it leads (decide.by_pool: a pool's own series, and those without a pool label, which are matched by key
alone). Reading the whole fleet's answers anyway costs every replica the whole fleet's decoding: at 10,000 nodes
18 answers of 10,000 series, 0.28 s decoded (msgspec; python -m grayguard.bench.floor), and ten times that at 100,000
nodes, however many replicas share the pools. So each query is wrapped for Prometheus to return only those series:

    (<query>) and on(pool) (vector(1) or label_replace(vector(1), "pool", "a", "", "") or ...)

`and` keeps the left side's series as they are (labels, metric name, values); `on(pool)` compares the pool label
alone: vector(1) has none (so the series without one still come) and each label_replace term has one led pool.
timestamp() stays inside the wrapper: it gives a selector's own sample times only when applied to the selector.
What a tick decides is the same (tests/controller/test_readscope.py evaluates the wrapped queries with promtool).
HAProxy is read the same way: the backends of the led pools only (RuntimeClient.show_backends_state), not the
whole `show servers state` table.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from grayguard.controller.decide import POOL_LABEL


def scoped(expr: str, pools: Collection[str] | None) -> str:
    """expr limited to the series of pools and those without a pool label; expr itself when pools is None."""
    if pools is None:
        return expr
    terms = ["vector(1)", *(f'label_replace(vector(1), "{POOL_LABEL}", "{_literal(p)}", "", "")'
                            for p in sorted(pools))]
    return f"({expr}) and on({POOL_LABEL}) ({' or '.join(terms)})"


def _literal(s: str) -> str:
    """s inside a double-quoted PromQL string (pool names are HAProxy names: nothing to escape, but never trusted)."""
    return s.replace("\\", "\\\\").replace('"', '\\"')


_SCOPED = re.compile(r'\((?P<inner>.*)\) and on\(' + POOL_LABEL + r'\) \(vector\(1\)(?P<terms>(?: or label_replace\('
                     r'vector\(1\), "' + POOL_LABEL + r'", "(?:[^"\\]|\\.)*", "", ""\))*)\)')
_LED = re.compile(r'"' + POOL_LABEL + r'", "((?:[^"\\]|\\.)*)"')


def parse_scoped(q: str) -> tuple[str, list[str]] | None:
    """(the query, the pools) of a query scoped() wrapped, None for any other: what the stand-ins of Prometheus (the
    benchmarks' answer server, the tests' FakeProm) evaluate the wrapper with."""
    m = _SCOPED.fullmatch(q)
    if m is None:
        return None
    return m["inner"], [re.sub(r"\\(.)", r"\1", p) for p in _LED.findall(m["terms"])]


def unscoped(q: str) -> str:
    """The query inside scoped()'s wrapper; q itself when it has none."""
    got = parse_scoped(q)
    return q if got is None else got[0]
