"""What a tick cannot go below in CPython on this machine, next to issue 18's targets at 10,000 nodes.

    python -m grayguard.bench.floor                  # 10,000 nodes in pools of 20
    python -m grayguard.bench.floor --nodes 1000 --repeat 5

Not the controller's code: each line times the smallest piece of work the real tick cannot skip, written as plainly
and cheaply as Python allows, with the controller's own building blocks:
  * a decision pass: every pool's node names sorted, each node's input read, its state copied once with its new
    EMA (frozen.replaced, the one copy a tick the decision core makes), one NodeDecision a node;
  * the same with each pool's latencies scored against its peers (scoring.leave_one_out_logs, the core's own);
  * Prometheus' answers: json.loads of the 18 answers the controller's default config asks for, as bench/answers.py
    serves them for the stand-in fleet (a series a node each), then the same with the checks and Samples of
    promclient's general path (json, element by element: the client's only path before msgspec), then the client's
    own decoding (promclient.decode_instant: msgspec's typed decoding, the same Samples); all of a tick's answers
    held together, as the tick holds them.
Timed with the garbage collector's thresholds of the controller's process (controller/gcpolicy.py).
The decision core does all of the first two and much more (every signal, the state machine, the safeguard cap,
the weights, the plan), and the whole tick all of the last and much more (the HAProxy read, the matching, the
export): when a floor is near its target, the target needs less work per node than the tick does, or another
language for that work, not a faster way of writing the same Python.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from grayguard.bench import answers
from grayguard.bench.controller import noisy_pools
from grayguard.bench.promtarget import fleet
from grayguard.bench.wholetick import controller_config, fleet_backends
from grayguard.config import load_config
from grayguard.controller import gcpolicy
from grayguard.controller.policy import NodeDecision, NodeInput, NodeState
from grayguard.controller.scoring import leave_one_out_logs
from grayguard.frozen import replaced
from grayguard.promclient import _instant, decode_instant

DECISION_TARGET_MS, TICK_TARGET_MS = 100.0, 500.0  # issue 18, at 10,000 nodes


def pools_of(nodes: int, per_pool: int, seed: int = 1) -> tuple[list[dict[str, NodeInput]], list[dict[str, NodeState]]]:
    """The decision benchmark's pools (bench.controller.noisy_pools), each node's state with an EMA."""
    inputs = list(noisy_pools(max(1, nodes // per_pool), per_pool, random.Random(seed)).values())
    return inputs, [{n: NodeState(since=1.0, ema=0.02) for n in p} for p in inputs]


def decision_pass(inputs: list[dict[str, NodeInput]], states: list[dict[str, NodeState]], score: bool) -> int:
    """The least a decision does a node; with score, each pool's latencies scored against the peers too."""
    made = 0
    for p, st in zip(inputs, states, strict=True):
        if score:
            leave_one_out_logs({n: i.latency for n, i in p.items()}, 0.05)  # type: ignore[misc]
        for n in sorted(p):
            i, s = p[n], st[n]
            x = 0.3 * i.latency + 0.7 * s.ema  # type: ignore[operator]
            NodeDecision(replaced(s, {"ema": x, "latency_seen_at": i.latency_at}), s.state, i.base_weight, False)
            made += 1
    return made


def answer_bodies(nodes: int, seed: int = 1) -> list[bytes]:
    """The 18 answers the default config's queries get from bench/answers.py for nodes stand-in nodes."""
    with tempfile.TemporaryDirectory(prefix="grayguard-floor-") as d:
        cfg = load_config(controller_config(Path(d), 9, "127.0.0.1:1", list(fleet_backends(nodes))))
    rnd, fleet_nodes, now = random.Random(seed), fleet(nodes), repr(time.time()).encode()
    return [answers.body(q, s, fleet_nodes, rnd).replace(answers.NOW, now).replace(answers.DATA, now)
            for q, s in answers.queries(cfg).items()]


def median_ms(work: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(nodes: int, per_pool: int = 20, repeat: int = 7) -> dict[str, float]:
    """Median ms of each floor over repeat runs, with the collector's thresholds of the controller's process."""
    inputs, states = pools_of(nodes, per_pool)
    bodies = answer_bodies(nodes)
    with gcpolicy.tuned():
        return _measure(inputs, states, bodies, repeat)


def _measure(inputs: list[dict[str, NodeInput]], states: list[dict[str, NodeState]], bodies: list[bytes],
             repeat: int) -> dict[str, float]:
    return {
        "decision pass": median_ms(lambda: decision_pass(inputs, states, False), repeat),
        "decision pass + peer scoring": median_ms(lambda: decision_pass(inputs, states, True), repeat),
        f"json.loads of {len(bodies)} answers": median_ms(lambda: [json.loads(b) for b in bodies], repeat),
        f"{len(bodies)} answers, json + checks": median_ms(
            lambda: [_instant(json.loads(b)["data"]) for b in bodies], repeat),
        f"{len(bodies)} answers, the client's decoding": median_ms(
            lambda: [decode_instant(b) for b in bodies], repeat),
        "answer bytes": float(sum(map(len, bodies))),
    }


def format_floor(nodes: int, per_pool: int, r: dict[str, float]) -> list[str]:
    size = r.pop("answer bytes")
    out = [f"  {nodes} nodes in pools of {per_pool} (answers: {size / 2**20:.1f} MiB of JSON a tick):"]
    for what, ms in r.items():
        target = DECISION_TARGET_MS if what.startswith("decision") else TICK_TARGET_MS
        share = f"  ({ms / target:.0%} of the {target:.0f} ms target)" if nodes == 10000 else ""
        out.append(f"    {what:<40} {ms:8.1f} ms{share}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.bench.floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10000, help="simulated nodes (default 10000)")
    ap.add_argument("--pool-size", type=int, default=20, help="nodes per pool (default 20)")
    ap.add_argument("--repeat", type=int, default=7, help="runs of each piece; the median is shown (default 7)")
    a = ap.parse_args(argv)
    if a.nodes < a.pool_size or a.pool_size < 2 or a.repeat < 1:
        ap.error("--nodes at least --pool-size, --pool-size at least 2, --repeat at least 1")
    print(f"the least work of a tick in CPython {sys.version.split()[0]}, median of {a.repeat} runs:", flush=True)
    print("\n".join(format_floor(a.nodes, a.pool_size, measure(a.nodes, a.pool_size, a.repeat))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
