"""Build a replay trace from Prometheus range queries of the controller's latency signal."""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import datetime
from typing import IO

from grayguard.config import Config
from grayguard.promclient import PromError, PrometheusClient, finite


def parse_time(text: str) -> float:
    """Unix seconds or RFC 3339 ("2026-11-20T10:00:00Z")."""
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def build_trace(client: PrometheusClient, cfg: Config, start: float, end: float, step: float, out: IO[str]) -> int:
    """Write a trace CSV (t relative to start); returns the number of rows."""
    series = client.query_range(cfg.signals.latency_query, start, end, step)
    default_pool = cfg.pools[0]
    by_label = {p.name: p for p in cfg.pools}
    w = csv.writer(out)
    w.writerow(["t", "pool", "node", "normalized_latency", "peer_group"])
    rows = []
    for labels, points in series:
        pool = by_label.get(labels.get("pool", ""), default_pool)
        node = labels.get(pool.series_label)
        if not node:
            continue
        group = next((o.peer_group for o in pool.servers.values() if o.series == node), None)
        for t, v in points:
            fv = finite(v)
            rows.append((round(t - start, 3), pool.name, node, "" if fv is None else repr(fv), group or ""))
    rows.sort()
    w.writerows(rows)
    return len(rows)


def build_trace_cli(cfg: Config, args: argparse.Namespace) -> int:
    """The --from-prometheus half of `grayguard replay`; 0 on success."""
    if not (args.start and args.end):
        print("grayguard: --from-prometheus needs --start and --end", file=sys.stderr)
        return 2
    try:
        start, end = parse_time(args.start), parse_time(args.end)
    except ValueError as e:
        print(f"grayguard: bad --start/--end: {e}", file=sys.stderr)
        return 2
    from dataclasses import replace
    client = PrometheusClient(replace(cfg.prometheus, url=args.from_prometheus))
    try:
        with open(args.trace, "w", newline="") as f:
            n = build_trace(client, cfg, start, end, args.step, f)
    except PromError as e:
        print(f"grayguard: Prometheus range query failed ({e.kind}): {e}", file=sys.stderr)
        return 1
    print(f"wrote {n} trace rows to {args.trace}", file=sys.stderr)
    return 0
