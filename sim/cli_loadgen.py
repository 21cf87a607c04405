"""`grayguard loadgen`: open-loop Poisson (or production-trace) load against a URL, then a percentile report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from grayguard.sim.loadgen import LengthDist, LoadConfig, run_load
from grayguard.sim.loadstats import Phase
from grayguard.sim.traces import FORMATS, TraceError, TraceLoad, parse_window, plan_trace

HELP = "open-loop Poisson (or production-trace) load of streaming completions; prints TTFT/e2e percentiles per phase"
DESCRIPTION = """\
Send streaming /v1/completions at a Poisson rate to URL (HAProxy or a node) for a bounded time or count.
Arrivals never wait for answers; requests beyond --concurrency are counted as `overflow` errors.
Prompt and completion lengths are lognormal (median, coefficient of variation), clipped.
Latencies count from each request's scheduled arrival. Errors are classed as timeout, overflow,
connect, http_4xx, http_5xx, stream_error, garbage, protocol.

--trace FILE replays a production trace instead (sim/traces.py): the Azure LLM inference traces (CSV: TIMESTAMP,
ContextTokens, GeneratedTokens), Mooncake's (JSON lines: timestamp ms, input_length, output_length, hash_ids) or
BurstGPT's (CSV: Timestamp, Request tokens, Response tokens), the format read from the header. Its arrival times
and token counts replace the Poisson ones: --trace-window START:DURATION picks trace seconds, --trace-speedup X
plays them X times faster, or --trace-rate R / --trace-utilization U (of --trace-capacity-rps or
--trace-capacity-tps) compresses them to that mean; lengths are clipped to --trace-max-len (prompt + output).
Requests that share Mooncake hash ids share a prompt prefix (512 words a block: one token a word). --duration
still bounds the run (0: the whole window). The summary names the trace and its attribution.

examples:
  grayguard loadgen --url http://127.0.0.1:8080 --rate 20 --duration 60
  grayguard loadgen --url http://127.0.0.1:8080 --rate 30 --duration 120 \\
      --phase baseline:0:40 --phase fault:40:80 --phase recovery:80: --records run.csv
  grayguard loadgen --url http://127.0.0.1:8080 --trace azure-llm-inference-2023-conv.csv \
      --trace-window 600:300 --trace-rate 20 --duration 0
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
    t = p.add_argument_group("production trace (instead of Poisson arrivals and lognormal lengths)")
    t.add_argument("--trace", metavar="FILE", help="replay this trace (Azure CSV, Mooncake JSON lines, BurstGPT CSV)")
    t.add_argument("--trace-format", choices=FORMATS, default=None, help="override the format read from the header")
    t.add_argument("--trace-window", default="0:", metavar="START:DURATION",
                   help="trace seconds to replay (default 0: from the start, as long as the run needs)")
    pace = t.add_mutually_exclusive_group()
    pace.add_argument("--trace-speedup", type=float, default=None, metavar="X",
                      help="play the trace X times faster (default 1: its own pace)")
    pace.add_argument("--trace-rate", type=float, default=None, metavar="R",
                      help="compress the trace's time so its mean is R requests/s")
    pace.add_argument("--trace-utilization", type=float, default=None, metavar="U",
                      help="compress it to U x the pool's capacity (--trace-capacity-rps or --trace-capacity-tps)")
    cap = t.add_mutually_exclusive_group()
    cap.add_argument("--trace-capacity-rps", type=float, default=None, metavar="C",
                     help="the pool's capacity in requests/s (e.g. 11 per simulated h100 node)")
    cap.add_argument("--trace-capacity-tps", type=float, default=None, metavar="C",
                     help="the pool's capacity in tokens/s (prompt + output)")
    t.add_argument("--trace-max-len", type=int, default=8192, metavar="N",
                   help="the model's context: prompt + output are clipped to it (default 8192, the simulator's and "
                   "the real fleet's max_model_len)")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """LoadConfig from parsed options (raises ValueError on bad ones)."""
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep:
            raise ValueError(f"bad --header {h!r}: want 'Name: value'")
        headers[name.strip()] = value.strip()
    trace = trace_plan_from_args(args)
    return LoadConfig(
        url=args.url, rate=args.rate, duration_s=args.duration or None, count=args.count, trace=trace,
        max_concurrency=args.concurrency, timeout_s=args.timeout, seed=args.seed, model=args.model,
        stream=not args.no_stream, phases=tuple(Phase.parse(s) for s in args.phase), headers=headers,
        prompt_tokens=LengthDist(args.prompt_median, args.prompt_cv, 1, args.prompt_max),
        completion_tokens=LengthDist(args.completion_median, args.completion_cv, 1, args.completion_max))


def trace_plan_from_args(args: argparse.Namespace):
    """The trace's arrivals for --trace (None without it); TraceError on a bad file or option."""
    if not getattr(args, "trace", None):
        for opt in ("trace_speedup", "trace_rate", "trace_utilization", "trace_capacity_rps", "trace_capacity_tps"):
            if getattr(args, opt, None) is not None:
                raise TraceError(f"--{opt.replace('_', '-')} needs --trace")
        return None
    if args.trace_utilization is None and (args.trace_capacity_rps or args.trace_capacity_tps):
        raise TraceError("--trace-capacity-rps/--trace-capacity-tps: only with --trace-utilization")
    start, dur = parse_window(args.trace_window)
    load = TraceLoad(args.trace, args.trace_format, start, dur, speedup=args.trace_speedup, rate=args.trace_rate,
                     utilization=args.trace_utilization, max_model_len=args.trace_max_len)
    return plan_trace(load, args.duration or None, capacity_rps=args.trace_capacity_rps,
                      capacity_tps=args.trace_capacity_tps)


def trace_line(meta: dict) -> str:
    """One line for the report: which trace, which window, at what pace, and its attribution."""
    w = meta["window_s"]
    return (f"trace {meta['file']} ({meta['format']}): window {w[0]:g}-{w[1]:g} s x{meta['speedup']:g}, "
            f"{meta['requests']} requests over {meta['run_s']:g} s ({meta['mean_rate']} req/s, "
            f"{meta['clipped']} clipped to {meta['max_model_len']} tokens)\nsource: {meta['attribution']}")


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
    meta = result.config.get("trace")
    if args.json:
        print(json.dumps({**result.summary(), **({"trace": meta} if meta else {})}, indent=2))
    else:
        if meta:
            print(trace_line(meta))
        print(result.format_table())
    return 0 if result.select(statuses=("ok",)) else 1
