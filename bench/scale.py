"""The decision core at scale, on the realistic trace (bench/trace_large.py): time per tick, memory, and the
recorded decisions that every optimization must reproduce exactly.

    python -m grayguard.bench.scale                      # time per tick at 1,000 and 10,000 nodes, memory at 10,000
    python -m grayguard.bench.scale --verify             # the test trace's decisions against the recorded digests
    python -m grayguard.bench.scale --verify --full      # the same on the full trace (10,000 nodes, 1,000 ticks)
    python -m grayguard.bench.scale --record FIXTURE     # record the digests (only ever from unchanged decision code)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from grayguard.bench.trace_large import TraceParams, canonical, combine, digest, pool_digests, run
from grayguard.controller import gcpolicy
from grayguard.controller.export import NodeSeries, node_row
from grayguard.controller.metrics import ControllerMetrics

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "decisions_large_trace.json"
TRACES = {"test": TraceParams(pools=50, ticks=300), "full": TraceParams()}  # 1,000 nodes x 300 s; 10,000 x 1,000 s
SAMPLE_TICKS = (100, 200, 299)  # ticks of the test trace whose full decisions are kept (one pool each)


def record(params: TraceParams, sample_ticks: Iterable[int] = (), workers: int = 1) -> tuple[list[str], list[dict]]:
    """Every tick's digest, and at each sample tick the full decision of its busiest pool (most nodes not healthy).
    workers > 1: the pools are split across that many processes (no samples then)."""
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_pool_digests, [(params, range(i, params.pools, workers)) for i in range(workers)]))
        return [combine({p: d for part in parts for p, d in part[k].items()}) for k in range(params.ticks)], []
    want, digests, samples = set(sample_ticks), [], []
    for t in run(params):
        digests.append(digest(t))
        if t.k in want:
            pool = min(t.decisions, key=lambda p: (-sum(nd.state.state != "healthy"
                                                         for nd in t.decisions[p].nodes.values()), p))
            samples.append({"tick": t.k, "pool": pool, "decision": canonical(t, [pool])[pool]})
    return digests, samples


def _pool_digests(job: tuple[TraceParams, range]) -> list[dict[str, str]]:
    params, pools = job
    return [pool_digests(t) for t in run(params, pools=pools)]


def load(path: Path = FIXTURE) -> dict:
    return json.loads(path.read_text())


def params_of(entry: dict) -> TraceParams:
    """A recorded trace's parameters (JSON has lists where TraceParams has tuples)."""
    p = dict(entry["params"])
    for knobs in ("thresholds", "recovery"):
        p[knobs] = tuple((k, v) for k, v in p.get(knobs, ()))
    return TraceParams(**p)


def verify(entry: dict, samples: Iterable[dict] = ()) -> tuple[int | None, list[tuple[dict, dict]]]:
    """Replay one recorded trace: (the first tick whose digest differs, or None; the samples that differ as
    (recorded, now) pairs for a readable diff). Stops at the first differing tick past the last sample."""
    by_tick = {s["tick"]: s for s in samples}
    first, diffs = None, []
    for t in run(params_of(entry)):
        if t.k in by_tick:
            s = by_tick[t.k]
            now = json.loads(json.dumps(canonical(t, [s["pool"]])[s["pool"]]))
            if now != s["decision"]:
                diffs.append((s, now))
        if first is None and digest(t) != entry["digests"][t.k]:
            first = t.k
        if first is not None and t.k >= max(by_tick, default=-1):
            break
    return first, diffs


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak from getrusage)."""
    import resource
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def deep_size(obj) -> int:
    """Bytes of every object reachable from obj (each counted once): what the controller keeps between ticks."""
    seen, todo, size = set(), [obj], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, type):
            continue
        seen.add(id(o))
        size += sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return size


def measure_scale(sizes: Iterable[int] = (1000, 10000), ticks: int = 1000, pool_size: int = 20,
                  memory_at: Iterable[int] = (1, 100, 1000), seed: int = TraceParams.seed,
                  collect_between_ticks: bool = False) -> dict:
    """Decision time per tick (decide_pools + plan_backend over every pool: wall, CPU, and the part of the wall time
    Python's cyclic garbage collector took) at each size on the realistic trace, in one run; at the largest size
    also the controller's memory after the ticks in memory_at (1-based): the states it keeps and its last
    decisions (deep size), its metrics (the registry with every node's series, as the controller exports them
    after each tick: controller/export.py) and the process' RSS. The export is timed on its own (export_median_s),
    outside the decision's window. collect_between_ticks: gc.collect() after every tick, outside the timed window
    (as a shell that collects while it waits for the next tick would).

    Returns {"sizes": [{nodes, pools, ticks, median_s, p90_s, max_s, cpu_median_s, gc_median_s, gc_share,
    changes, export_median_s, export_first_s}], "ratio": median at the largest size / median at the smallest,
    "memory": [{tick, nodes, kept_bytes, metrics_bytes, series, rss_bytes}]}.
    """
    sizes, marks = sorted(sizes), set(memory_at)
    out: dict = {"sizes": [], "memory": [], "collect_between_ticks": collect_between_ticks}
    pauses: list[tuple[float, float]] = []  # (start, end) of every collection, perf_counter
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((began[0], time.perf_counter()))

    gc.callbacks.append(on_gc)
    thresholds = gcpolicy.tune()  # the collector's thresholds of the controller's process
    try:
        for n in sizes:
            params = TraceParams(seed=seed, pools=max(1, n // pool_size), pool_size=pool_size, ticks=ticks)
            wall, cpu, in_gc, changes, export = [], [], [], 0, []
            metrics = ControllerMetrics.create()
            series = NodeSeries(metrics)
            for t in run(params):
                end = t.started + t.seconds
                e0 = time.perf_counter()
                for p, d in t.decisions.items():
                    rows = {n: node_row(nd, t.servers[p][n].initial_weight, p, t.servers[p][n].address)
                            for n, nd in d.nodes.items()}
                    series.export(p, rows, set(d.nodes) | set(d.retained))
                export.append(time.perf_counter() - e0)
                wall.append(t.seconds)
                cpu.append(t.cpu_seconds)
                in_gc.append(sum(min(b, end) - max(a, t.started) for a, b in pauses if b > t.started and a < end))
                pauses.clear()
                changes += sum(len(p) for p in t.plans.values())
                if n == sizes[-1] and t.k + 1 in marks:
                    kept, nodes = (t.states, t.decisions), sum(len(d.nodes) for d in t.decisions.values())
                    del t
                    gc.collect()
                    out["memory"].append({"tick": len(wall), "nodes": nodes, "kept_bytes": deep_size(kept),
                                          "metrics_bytes": deep_size((metrics.registry, series.rows,
                                                                      series.children)),
                                          "series": _series_count(metrics), "rss_bytes": rss_bytes()})
                    del kept
                elif collect_between_ticks:
                    gc.collect()
                pauses.clear()
            out["sizes"].append({"nodes": params.pools * pool_size, "pools": params.pools, "ticks": len(wall),
                                 "median_s": statistics.median(wall), "p90_s": _p90(wall), "max_s": max(wall),
                                 "cpu_median_s": statistics.median(cpu), "gc_median_s": statistics.median(in_gc),
                                 "gc_share": sum(in_gc) / sum(wall), "changes": changes,
                                 "export_median_s": statistics.median(export[1:] or export),
                                 "export_first_s": export[0]})
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
    out["ratio"] = out["sizes"][-1]["median_s"] / out["sizes"][0]["median_s"]
    return out


def _series_count(metrics: ControllerMetrics) -> int:
    return sum(len(f.samples) for f in metrics.registry.collect())


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def format_scale(r: dict) -> list[str]:
    """measure_scale's result as the lines `grayguard bench-controller` prints."""
    how = "; gc.collect() between ticks" if r.get("collect_between_ticks") else ""
    lines = [f"decision time per tick on the realistic trace (decide_pools + plan_backend, every pool{how}):"]
    for s in r["sizes"]:
        lines.append(f"  {s['nodes']:>6} nodes in {s['pools']:>4} pools: median {s['median_s'] * 1000:7.1f} ms, "
                     f"p90 {s['p90_s'] * 1000:7.1f} ms, max {s['max_s'] * 1000:7.1f} ms over {s['ticks']} ticks "
                     f"(CPU median {s['cpu_median_s'] * 1000:.1f} ms; garbage collector {s['gc_share']:.0%} of the "
                     f"time); {s['changes']} changes planned; metrics export median "
                     f"{s['export_median_s'] * 1000:.1f} ms (first tick {s['export_first_s'] * 1000:.0f} ms)")
    if len(r["sizes"]) > 1:
        a, b = r["sizes"][0], r["sizes"][-1]
        lines.append(f"  {b['nodes']} / {a['nodes']} nodes: {r['ratio']:.1f}x the median time")
    for m in r["memory"]:
        lines.append(f"  memory after tick {m['tick']:>4} ({m['nodes']} nodes): controller states and decisions "
                     f"{m['kept_bytes'] / 2**20:6.1f} MiB, metrics {m['metrics_bytes'] / 2**20:6.1f} MiB "
                     f"({m['series']:,} samples), process RSS {m['rss_bytes'] / 2**20:6.1f} MiB")
    return lines


def profile_core(nodes: int = 10000, ticks: int = 60, top: int = 25, pool_size: int = 20) -> str:
    """cProfile of the decision code alone (decide_pool + plan_backend) over the trace's first `ticks` ticks."""
    prof = cProfile.Profile()
    for _ in run(TraceParams(pools=max(1, nodes // pool_size), pool_size=pool_size, ticks=ticks), profile=prof):
        pass
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.bench.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000", help="comma-separated node counts (default 1000,10000)")
    ap.add_argument("--ticks", type=int, default=1000, help="ticks per size (default 1000)")
    ap.add_argument("--collect-between-ticks", action="store_true",
                    help="gc.collect() after every tick, outside the timed window")
    ap.add_argument("--profile", action="store_true", help="cProfile the decision code over --ticks ticks")
    ap.add_argument("--verify", action="store_true", help="replay the recorded trace and compare every decision")
    ap.add_argument("--full", action="store_true", help="with --verify: the full trace, not the test trace")
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="the recorded digests (default: %(default)s)")
    ap.add_argument("--record", type=Path, metavar="FIXTURE", help="record the traces' digests into FIXTURE")
    ap.add_argument("--traces", default="test,full", help="with --record: which traces (default test,full)")
    ap.add_argument("--workers", type=int, default=1, help="with --record: processes for the full trace (default 1)")
    a = ap.parse_args(argv)
    if a.record:
        fx: dict = load(a.record) if a.record.exists() else {"traces": {}, "samples": []}
        fx["about"] = ("each tick's SHA-256 over its pools' SHA-256 of their canonical decisions and plans "
                       "(bench.trace_large.digest) on the traces of bench/trace_large.py, recorded from unchanged "
                       "decision code; samples: full decisions of the test trace's busiest pool at a few ticks")
        for name in a.traces.split(","):
            params = TRACES[name].pinned()
            print(f"recording {name}: {params.pools * params.pool_size} nodes x {params.ticks} ticks", file=sys.stderr)
            digests, samples = (record(params, SAMPLE_TICKS) if name == "test" else record(params, workers=a.workers))
            fx["traces"][name] = {"params": dataclasses.asdict(params), "digests": digests}
            if name == "test":
                fx["samples"] = samples
        a.record.write_text(json.dumps(fx, indent=1, sort_keys=True, allow_nan=True) + "\n")
        return 0
    if a.profile:
        print(profile_core(int(a.nodes.split(",")[-1]), a.ticks))
        return 0
    if a.verify:
        fx = load(a.fixture)
        first, diffs = verify(fx["traces"]["full" if a.full else "test"], () if a.full else fx["samples"])
        print("identical decisions on every tick" if first is None else f"decisions differ from tick {first}")
        return 0 if first is None and not diffs else 1
    sizes = [int(x) for x in a.nodes.split(",")]
    print("\n".join(format_scale(measure_scale(sizes, a.ticks, collect_between_ticks=a.collect_between_ticks))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
