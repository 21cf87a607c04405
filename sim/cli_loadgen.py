"""`grayguard loadgen`: open-loop Poisson load against a URL, then a percentile report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from sim.loadgen import LengthDist, LoadConfig, run_load
from sim.loadstats import Phase

HELP = "open-loop Poisson load of streaming completions; prints TTFT/e2e percentiles per phase"
DESCRIPTION = """\
Send streaming /v1/completions at a Poisson rate to URL (HAProxy or a node) for a bounded time or count.
Arrivals never wait for answers; requests beyond --concurrency are counted as `overflow` errors.
Prompt and completion lengths are lognormal (median, coefficient of variation), clipped.
Latencies count from each request's scheduled arrival. Errors are classed as timeout, overflow,
connect, http_4xx, http_5xx, stream_error, garbage, protocol.

examples:
  grayguard loadgen --url http://127.0.0.1:8080 --rate 20 --duration 60
  grayguard loadgen --url http://127.0.0.1:8080 --rate 30 --duration 120 \\
      --phase baseline:0:40 --phase fault:40:80 --phase recovery:80: --records run.csv
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `grayguard loadgen`."""
    p.add_argument("--url", required=True, help="base URL; /v1/completions is appended")
    p.add_argument("--rate", type=float, default=20.0, help="mean requests per second (default 20)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60; 0: unbounded)")
    p.add_argument("--count", type=int, default=None, help="stop after this many arrivals")
    p.add_argument("--concurrency", type=int, default=512, help="cap on requests in flight (default 512)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request deadline in seconds (default 30)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of arrivals and lengths (default 0)")
    p.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (no client TTFT)")
    p.add_argument("--prompt-median", type=float, default=200, help="median prompt tokens (default 200)")
    p.add_argument("--prompt-cv", type=float, default=1.0, help="prompt length CV (default 1.0)")
    p.add_argument("--prompt-max", type=int, default=4000, help="prompt length cap (default 4000)")
    p.add_argument("--completion-median", type=float, default=100, help="median max_tokens (default 100)")
    p.add_argument("--completion-cv", type=float, default=1.0, help="completion length CV (default 1.0)")
    p.add_argument("--completion-max", type=int, default=1024, help="completion length cap (default 1024)")
    p.add_argument("--phase", action="append", default=[], metavar="NAME:START:END",
                   help="a named time range for separate percentiles (repeatable; END empty = open)")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="extra request header (repeatable)")
    p.add_argument("--records", metavar="PATH", help="write per-request records (.csv, else JSON lines)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """LoadConfig from parsed options (raises ValueError on bad ones)."""
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep:
            raise ValueError(f"bad --header {h!r}: want 'Name: value'")
        headers[name.strip()] = value.strip()
    return LoadConfig(
        url=args.url, rate=args.rate, duration_s=args.duration or None, count=args.count,
        max_concurrency=args.concurrency, timeout_s=args.timeout, seed=args.seed, model=args.model,
        stream=not args.no_stream, phases=tuple(Phase.parse(s) for s in args.phase), headers=headers,
        prompt_tokens=LengthDist(args.prompt_median, args.prompt_cv, 1, args.prompt_max),
        completion_tokens=LengthDist(args.completion_median, args.completion_cv, 1, args.completion_max))


def run(args: argparse.Namespace) -> int:
    """Run the load, print the report; exit 1 when no request succeeded."""
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"grayguard loadgen: {e}", file=sys.stderr)
        return 2
    result = asyncio.run(run_load(cfg))
    if args.records:
        result.write_records(args.records)
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        print(result.format_table())
    return 0 if result.select(statuses=("ok",)) else 1
