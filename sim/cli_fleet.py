"""`grayguard fleet`: run a simulated vLLM fleet until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import replace

from grayguard.sim.faults import FAULTS, FaultError, ScheduledFault
from grayguard.sim.fleet import Fleet
from grayguard.sim.model import SPEED_CLASSES, ModelParams

log = logging.getLogger(__name__)

HELP = "run a simulated vLLM fleet (OpenAI API + vLLM /metrics per node) with injectable faults"
DESCRIPTION = f"""\
Run N simulated vLLM nodes in one process, each on its own port with vLLM's OpenAI-compatible API
(/v1/completions, /v1/models, /health, /version) and vLLM's /metrics. Prints the nodes as one JSON
line on stdout, then serves until Ctrl-C.

Faults (--fault node:fault:at_s[:until_s][:k=v,...], times from start, until '-' = never):
  {", ".join(FAULTS)}
Live faults on any node's port:
  curl -XPOST http://HOST:PORT/admin/fault -d '{{"fault": "thermal", "k": 6}}'
  curl -XDELETE http://HOST:PORT/admin/fault ; curl http://HOST:PORT/admin/fault
Speed classes ({", ".join(f"{k}={v}" for k, v in SPEED_CLASSES.items())} time multipliers):
  --speed-class a100 | --speed-class h100,h100,a100 (cycled) | --speed-class node7=a100,node8=a100
See docs/simulator.md.

examples:
  grayguard fleet --nodes 8 --base-port 8001 --fault node3:thermal:30:90:k=6
  grayguard fleet --nodes 4 --fault node2:hang:10 --fault node4:pcie:20:-:k=4,prefill_k=2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `grayguard fleet`."""
    d = ModelParams()
    p.add_argument("--nodes", type=int, default=8, help="number of nodes, named node1..nodeN (default 8)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=0,
                   help="node i listens on base-port+i-1; 0 picks free ports (default 0)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for step jitter and fault sampling (default 0)")
    p.add_argument("--speed-class", default="h100", metavar="SPEC",
                   help="a class for all, a comma list cycled over nodes, or node=class pairs (default h100)")
    p.add_argument("--fault", action="append", default=[], metavar="NODE:FAULT:AT[:UNTIL][:K=V,...]",
                   help="schedule a fault (repeatable)")
    p.add_argument("--model-name", default=None, help="served model name (default a Llama-3.1-8B name)")
    g = p.add_argument_group("latency model (docs/simulator.md)")
    g.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_s_per_token * 1000,
                   help=f"prefill time per prompt token (default {d.prefill_s_per_token * 1000:g} ms)")
    g.add_argument("--decode-ms", type=float, default=d.decode_s_base * 1000,
                   help=f"decode step at batch 1 (default {d.decode_s_base * 1000:g} ms)")
    g.add_argument("--decode-ms-at-max-batch", type=float, default=None,
                   help="decode step at batch max-num-seqs (default 2x --decode-ms)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"running batch cap (default {d.max_num_seqs})")
    g.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens,
                   help=f"KV-cache capacity in tokens (default {d.kv_cache_tokens})")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help=f"prompt + completion limit (default {d.max_model_len})")
    g.add_argument("--jitter", type=float, default=d.jitter, help=f"step-time lognormal sigma (default {d.jitter})")
    g.add_argument("--emit-interval-ms", type=float, default=d.emit_interval_s * 1000,
                   help=f"stream chunk coalescing interval (default {d.emit_interval_s * 1000:g} ms)")


def parse_speed_classes(spec: str) -> str | list[str] | dict[str, str]:
    """'a100' | 'h100,a100' | 'node3=a100,node4=a100'."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if any("=" in s for s in items):
        pairs = [s.partition("=") for s in items]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(f"--speed-class {spec!r}: mix of node=class and plain classes")
        return {k.strip(): v.strip() for k, _, v in pairs}
    return items[0] if len(items) == 1 else items


def params_from_args(args: argparse.Namespace) -> ModelParams:
    """ModelParams from the latency-model options."""
    base = args.decode_ms / 1000
    top = (args.decode_ms_at_max_batch / 1000) if args.decode_ms_at_max_batch is not None else 2 * base
    per_seq = (top - base) / max(1, args.max_num_seqs - 1)
    return replace(ModelParams(), prefill_s_per_token=args.prefill_ms_per_token / 1000, decode_s_base=base,
                   decode_s_per_seq=max(0.0, per_seq), max_num_seqs=args.max_num_seqs,
                   kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len, jitter=args.jitter,
                   emit_interval_s=args.emit_interval_ms / 1000)


def build_fleet(args: argparse.Namespace) -> Fleet:
    """A Fleet from parsed options (raises ValueError/FaultError on bad ones)."""
    schedule = [ScheduledFault.parse(s) for s in args.fault]
    kwargs = {"model_name": args.model_name} if args.model_name else {}
    return Fleet(args.nodes, seed=args.seed, host=args.host, base_port=args.base_port,
                 speed_classes=parse_speed_classes(args.speed_class), params=params_from_args(args),
                 schedule=schedule, **kwargs)


async def _serve(fleet: Fleet) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nodes = await fleet.start()
    try:
        first = fleet.nodes[nodes[0].name]
        print(json.dumps({"model": first.model_name, "nodes": [n.to_dict() for n in nodes]}), flush=True)
        log.info("fleet of %d nodes up; Ctrl-C to stop", len(nodes))
        await stop.wait()
    finally:
        await fleet.stop()


def run(args: argparse.Namespace) -> int:
    """Build the fleet, print its nodes as JSON, serve until SIGINT/SIGTERM."""
    try:
        fleet = build_fleet(args)
    except (ValueError, FaultError) as e:
        print(f"grayguard fleet: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(fleet))
    except OSError as e:
        print(f"grayguard fleet: cannot listen: {e}", file=sys.stderr)
        return 1
    return 0
