"""`grayguard bench-controller`: measured cost of the decision code and of HAProxy batch writes."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from grayguard.bench.promcost import measure
from grayguard.bench.promresult import format_cost, format_side_by_side
from grayguard.bench.scale import format_scale, measure_scale
from grayguard.bench.ticklocal import format_local
from grayguard.bench.ticklocal import measure as measure_local
from grayguard.bench.tickresult import format_tick
from grayguard.bench.vmcost import format_vm_cost, measure_victoria
from grayguard.bench.wholetick import measure_tick
from grayguard.controller import gcpolicy
from grayguard.controller.haproxy import Command, RuntimeClient, ServerState
from grayguard.controller.plan import plan_backend
from grayguard.controller.policy import NodeInput, Policy, decide_pools

HELP = ("benchmark the controller: decision time per tick at scale, HAProxy batch write throughput, "
        "what the shipped rules and queries cost Prometheus")
DESCRIPTION = """\
Prints measured numbers (this machine, now):
  * decide + plan time for one whole tick over N nodes split into pools (default 1,000 and 10,000
    nodes in pools of 20), with noisy latencies and one slow node in every tenth pool; the ratio of the
    largest size to the smallest, and 10,000 nodes against the 100 ms target (issue 18);
  * the same on the realistic trace (bench/trace_large.py: every signal the shipped defaults read, faults
    on single nodes and whole pools coming and going, the loop closed), --scale-ticks ticks per size:
    median, p90, CPU, the garbage collector's share, memory (the decision core's memory over 1,000 ticks
    and the replay against recorded decisions: python -m grayguard.bench.scale);
  * one HAProxy runtime-API batch of 1,000 weight changes over one connection, next to the same
    1,000 changes sent one connection each (needs the haproxy binary);
  * what grayguard's shipped defaults cost a real Prometheus (needs the prometheus binary) at
    --prometheus-nodes simulated nodes (pools of 20, one slow node in every tenth pool): a stand-in
    target serves each node's vLLM and exporter series (bench/promtarget.py), Prometheus scrapes them
    with the jobs and intervals of rules/prometheus.example.yml (vLLM and the exporter every 5 s, the
    fast path every second) and evaluates the rules `grayguard rules render` makes from the default
    config. After a warm-up (until every node has a recorded latency and a live ITL) it watches
    Prometheus for --prometheus-seconds: the first half alone, the second half with the controller's
    own observe code sending the queries of the default config every tick_interval_s (1 s). It reports
    each rule group's evaluation time (count, median and max, from /api/v1/rules) in both halves, the
    tick's query time and each query's series and time, samples appended per second against those the
    scrapes offer, head series, resident memory, CPU, and notes on whatever fell behind (skipped
    evaluations, failed or late scrapes, failed queries, a warm-up cut short). The stand-in and the
    controller's client run on the same machine as Prometheus and take their share of its CPU. The same is
    measured first for the signals issue 34 started from (bench/before34: their frozen rules and queries, the
    exporter's pages of then) and the two are printed side by side with the shipped design's ratios and its
    1,000-node targets (the control group and the reads <= 150 ms, grayguard's series <= 30 a node). Then the
    shipped signals on VictoriaMetrics, the single-engine alternative (bench/vmcost.py: it scrapes the same
    stand-in with the same jobs, vmalert evaluates the same rules, the controller queries it), beside Prometheus:
    CPU, memory, samples/s, each rule group's evaluation, the tick's reads (--no-victoria skips it). About
    4.5 minutes at 1,000 nodes and 10 at 10,000 on 2 cores; --no-prometheus skips it all.
  * the whole tick at scale on real parts (needs the haproxy and prometheus binaries; bench/wholetick.py): the
    same stand-in target and Prometheus at --whole-tick-nodes nodes, a real HAProxy with one backend per pool
    and a server per node (20 per backend: 10,000 servers in 500 backends at 10,000 nodes), and the real
    Controller, configured with every pool and the shipped defaults, running --whole-tick-ticks ticks of its
    own Controller.tick() every tick_interval_s after the warm-up. Per tick: the HAProxy read, the Prometheus
    queries, the decision (decide + plan), the runtime-API writes and their commands, the whole tick and the
    controller's CPU (median, p90, max); the controller's memory at the first, middle and last tick; each rule
    group's evaluation time in Prometheus over the same ticks; a verdict against the 500 ms target (issue 18);
    notes on whatever fell behind. No tick starts after --whole-tick-seconds of ticking. --no-whole-tick skips it.
  * the controller's own tick at --local-tick-nodes (bench/ticklocal.py): the same HAProxy and real Controller,
    with Prometheus' answers to its queries served over Prometheus' HTTP API by a child process
    (bench/answers.py), so what is measured is the controller's work (the HAProxy read, the answers fetched
    and parsed, the matching, the decisions, the writes, the metrics export) where a real Prometheus on this
    machine would not keep up; a verdict against the 500 ms target. --no-local-tick skips it.
Timings are medians over --ticks runs; compare ratios, not absolute numbers, on a noisy machine.
"""


def noisy_pools(n_pools: int, per_pool: int, rnd: random.Random, slow_every: int = 10) -> dict[str, dict]:
    """pool -> node -> NodeInput: latencies 0.02 with 5 % noise, node n0 of every slow_every-th pool 4x slower."""
    pools = {}
    for p in range(n_pools):
        nodes = {}
        for i in range(per_pool):
            v = 0.02 * (1 + rnd.gauss(0, 0.05))
            if p % slow_every == 0 and i == 0:
                v *= 4
            nodes[f"n{i}"] = NodeInput(100, v, request_rate=5.0)
        pools[f"pool{p}"] = nodes
    return pools


def bench_decide(n_nodes: int, per_pool: int, ticks: int, seed: int = 1) -> dict:
    """Median and max seconds of one tick's decide_pools + plan_backend over every pool."""
    rnd = random.Random(seed)
    n_pools = max(1, n_nodes // per_pool)
    policy = Policy()
    states: dict[str, dict] = {}
    times = []
    changes = 0
    with gcpolicy.tuned():  # the collector's thresholds of the controller's process
        for k in range(ticks):
            pools = noisy_pools(n_pools, per_pool, rnd)
            actual = {p: {n: ServerState(p, n, "h:1", 100, 100, 0, 2) for n in nodes} for p, nodes in pools.items()}
            t0 = time.perf_counter()
            decided = decide_pools([(states.get(p, {}), inputs, policy) for p, inputs in pools.items()], 1000.0 + 5 * k)
            for p, d in zip(pools, decided, strict=True):
                states[p] = {n: nd.state for n, nd in d.nodes.items()}
                changes += len(plan_backend(p, p, d.nodes, actual[p]))
            times.append(time.perf_counter() - t0)
    return {"nodes": n_pools * per_pool, "pools": n_pools, "ticks": ticks,
            "median_s": statistics.median(times), "max_s": max(times), "planned_changes": changes}


def bench_haproxy(n: int = 1000, rounds: int = 5) -> dict:
    """One batch of n weight changes on one connection vs n connections (median of rounds)."""
    from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
    with tempfile.TemporaryDirectory(prefix="grayguard-bench-") as d:
        servers = [(f"n{i}", f"127.0.0.1:{20000 + i}", 100) for i in range(n)]
        hap = HaproxyProc(Path(d), haproxy_config(Path(d) / "admin.sock", {"big": servers}))
        hap.start()
        try:
            c = RuntimeClient(hap.endpoint)
            batch, single = [], []
            for r in range(rounds):
                cmds = [Command("big", f"n{i}", "weight", (i + r) % 256 + 1) for i in range(n)]
                t0 = time.perf_counter()
                res = c.apply(cmds)
                batch.append(time.perf_counter() - t0)
                assert all(x.ok for x in res), "HAProxy refused a write"
                t0 = time.perf_counter()
                for cmd in cmds:
                    c.apply([cmd])
                single.append(time.perf_counter() - t0)
            got = {s.name: s.weight for s in c.show_servers_state("big")}
            assert got == {f"n{i}": (i + rounds - 1) % 256 + 1 for i in range(n)}, "weights not applied"
        finally:
            hap.stop()
    b, s = statistics.median(batch), statistics.median(single)
    return {"changes": n, "batch_s": b, "separate_connections_s": s, "ratio": s / b}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="1000,10000", help="comma-separated node counts (default 1000,10000)")
    p.add_argument("--pool-size", type=int, default=20, help="nodes per pool (default 20: 10,000 nodes = 500 pools)")
    p.add_argument("--ticks", type=int, default=5, help="ticks per measurement (default 5)")
    p.add_argument("--scale-ticks", type=int, default=30, metavar="K",
                   help="ticks per size of the realistic trace (bench/trace_large.py: every signal, faults coming "
                        "and going, closed loop; 0: skip; memory over 1,000 ticks: python -m grayguard.bench.scale)")
    p.add_argument("--haproxy-batch", type=int, default=1000, help="weight changes in the HAProxy batch (0: skip)")
    p.add_argument("--no-prometheus", action="store_true", help="skip the Prometheus cost measurement")
    p.add_argument("--no-victoria", action="store_true",
                   help="skip the shipped signals' cost on VictoriaMetrics + vmalert (beside Prometheus' at each "
                        "--prometheus-nodes size; needs the victoria-metrics and vmalert binaries)")
    p.add_argument("--no-before", action="store_true",
                   help="measure the shipped signals' Prometheus cost alone, not beside those issue 34 started from "
                        "(bench/before34: their frozen rules, queries and exporter pages; halves that part's time)")
    p.add_argument("--prometheus-nodes", default="1000,10000", metavar="N,N",
                   help="comma-separated simulated node counts for the Prometheus cost (default 1000,10000)")
    p.add_argument("--prometheus-seconds", type=float, default=60.0, metavar="S",
                   help="window per node count after the warm-up, half without and half with the controller's "
                        "queries (default 60: each half sees two evaluations of the 15 s groups)")
    p.add_argument("--no-whole-tick", action="store_true", help="skip the whole tick on real parts")
    p.add_argument("--whole-tick-nodes", default="1000,10000", metavar="N,N",
                   help="comma-separated simulated node counts for the whole tick (default 1000,10000)")
    p.add_argument("--whole-tick-ticks", type=int, default=30, metavar="K",
                   help="controller ticks per node count after the warm-up (default 30; the decision core's "
                        "memory over 1,000 ticks: python -m grayguard.bench.scale)")
    p.add_argument("--whole-tick-seconds", type=float, default=300.0, metavar="S",
                   help="no new tick after S seconds of ticking, per node count (default 300: a tick that is slow "
                        "at 10,000 nodes ends the run early rather than after hours)")
    p.add_argument("--no-local-tick", action="store_true",
                   help="skip the controller's own tick with Prometheus' answers served (bench/ticklocal.py)")
    p.add_argument("--local-tick-nodes", default="1000,10000", metavar="N,N",
                   help="comma-separated node counts for the controller's own tick (default 1000,10000)")
    p.add_argument("--local-tick-ticks", type=int, default=30, metavar="K",
                   help="its ticks per node count after the first (default 30)")


DECISION_TARGET_S = 0.1  # issue 18: decide + plan for 10,000 nodes in 500 pools, median


def decision_verdict(results: list[dict], ratio: bool = True) -> list[str]:
    """The ratio of the largest size's median to the smallest's, and the median at 10,000 nodes against the 100 ms
    target (only when 10,000 nodes were measured)."""
    lines = []
    if ratio and len(results) > 1:
        a, b = results[0], results[-1]
        lines.append(f"  {b['nodes']} / {a['nodes']} nodes: {b['median_s'] / a['median_s']:.1f}x the median time")
    for r in results:
        if r["nodes"] == 10000:
            x = r["median_s"] / DECISION_TARGET_S
            lines.append(f"  verdict: median {r['median_s'] * 1000:.0f} ms at 10000 nodes: "
                         + ("within the 100 ms target" if x <= 1 else f"OVER the 100 ms target ({x:.1f}x)"))
    return lines


def run(args: argparse.Namespace) -> int:
    print("decision time per tick (decide + plan, every pool):", flush=True)
    sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    results = []
    for n in sizes:
        print(f"  measuring {n} nodes...", file=sys.stderr, flush=True)
        r = bench_decide(n, args.pool_size, args.ticks)
        results.append(r)
        print(f"  {r['nodes']:>6} nodes in {r['pools']:>4} pools: median {r['median_s'] * 1000:8.1f} ms, "
              f"max {r['max_s'] * 1000:8.1f} ms over {r['ticks']} ticks ({r['planned_changes']} changes planned)",
              flush=True)
    print("\n".join(decision_verdict(results)), flush=True)
    if args.scale_ticks:
        print(f"  measuring the realistic trace ({args.scale_ticks} ticks per size)...", file=sys.stderr, flush=True)
        r = measure_scale(sizes, ticks=args.scale_ticks, pool_size=args.pool_size, memory_at=(1, args.scale_ticks))
        print("\n".join(format_scale(r)), flush=True)
        print("\n".join(decision_verdict(r["sizes"], ratio=False)), flush=True)
    rc = 0
    if args.haproxy_batch:
        try:
            h = bench_haproxy(args.haproxy_batch)
            print(f"HAProxy runtime API, {h['changes']} weight changes: one batch {h['batch_s'] * 1000:.1f} ms, "
                  f"one connection each {h['separate_connections_s'] * 1000:.1f} ms ({h['ratio']:.1f}x slower)",
                  flush=True)
        except FileNotFoundError as e:
            print(f"HAProxy batch: skipped ({e})", flush=True)
            rc = 1
    if not args.no_prometheus:
        rc = max(rc, run_prometheus([int(x) for x in args.prometheus_nodes.split(",") if x.strip()],
                                    args.prometheus_seconds, before=not args.no_before,
                                    victoria=not args.no_victoria))
    if not args.no_whole_tick:
        rc = max(rc, run_whole_tick([int(x) for x in args.whole_tick_nodes.split(",") if x.strip()],
                                    args.whole_tick_ticks, args.whole_tick_seconds))
    if not args.no_local_tick:
        rc = max(rc, run_local_tick([int(x) for x in args.local_tick_nodes.split(",") if x.strip()],
                                    args.local_tick_ticks))
    return rc


def run_local_tick(sizes: list[int], ticks: int) -> int:
    """Print the controller's own tick (real HAProxy, Prometheus' answers served) at each size; 1 when a size
    could not be measured."""
    print("the controller's own tick on real parts (HAProxy with a server per node, 20 per backend; the real "
          f"Controller.tick(), {ticks} ticks per size; Prometheus' answers served by bench/answers.py):", flush=True)
    rc = 0
    for n in sizes:
        try:
            r = measure_local(n, ticks, lambda s: print(f"  own tick: {s}", file=sys.stderr, flush=True))
        except (OSError, RuntimeError, TimeoutError) as e:  # BinaryMissing is an OSError
            print(f"  {n} nodes: not measured: {e}", flush=True)
            rc = 1
            continue
        print("\n".join(format_local(r)), flush=True)
    return rc


def run_prometheus(sizes: list[int], seconds: float, before: bool = True, victoria: bool = True) -> int:
    """Print the Prometheus cost at each size, of the signals issue 34 started from and of the shipped ones (before:
    False, the shipped ones alone), then the two side by side, then the shipped ones on VictoriaMetrics beside
    Prometheus (victoria: False, not); 1 when a size could not be measured."""
    print("Prometheus cost of the shipped rules, scrape intervals and controller queries"
          + (", and of those issue 34 started from (bench/before34), in the same run:" if before else ":"), flush=True)
    rc, header = 0, False
    for n in sizes:
        costs = {}
        for design in ("before", "shipped") if before else ("shipped",):
            try:
                costs[design] = cost = measure(n, seconds, design=design, progress=lambda s: print(
                    f"  prometheus cost: {s}", file=sys.stderr, flush=True))
            except (OSError, RuntimeError, TimeoutError, requests.RequestException) as e:  # BinaryMissing: OSError
                print(f"  {n} nodes, {design} signals: not measured: {e}", flush=True)
                rc = 1
                continue
            if not header:
                header = True
                print(f"  (Prometheus {cost.version}; scrape intervals: "
                      + ", ".join(f"{job} {i}" for job, i in cost.intervals.items()) + ")")
            print("\n".join(format_cost(cost)), flush=True)
        if len(costs) == 2:
            print("\n".join(format_side_by_side(costs["before"], costs["shipped"])), flush=True)
        if victoria:
            try:
                vm = measure_victoria(n, seconds, progress=lambda s: print(f"  victoria cost: {s}", file=sys.stderr,
                                                                          flush=True))
            except (OSError, RuntimeError, TimeoutError, requests.RequestException) as e:  # BinaryMissing: OSError
                print(f"  {n} nodes on VictoriaMetrics: not measured: {e}", flush=True)
                rc = 1
                continue
            print("\n".join(format_vm_cost(vm, costs.get("shipped"))), flush=True)
    return rc


def run_whole_tick(sizes: list[int], ticks: int, budget_s: float = 300.0) -> int:
    """Print the whole tick on real parts at each size; 1 when a size could not be measured."""
    print(f"whole tick on real parts (stand-in target -> Prometheus with grayguard's rules; HAProxy with a server per "
          f"node, 20 per backend; the real Controller.tick(), {ticks} ticks per size):", flush=True)
    rc = 0
    for n in sizes:
        try:
            cost = measure_tick(n, ticks, lambda s: print(f"  whole tick: {s}", file=sys.stderr, flush=True),
                                budget_s=budget_s)
        except (OSError, RuntimeError, TimeoutError, requests.RequestException) as e:  # BinaryMissing is an OSError
            print(f"  {n} nodes: not measured: {e}", flush=True)
            rc = 1
            continue
        print("\n".join(format_tick(cost)), flush=True)
    return rc
