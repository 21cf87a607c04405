"""`grayguard bench`: every policy on every scenario of a suite, side by side, in virtual time.

Scenarios that share their traffic (same pool, load and seed; different faults) are run as one family:
the fault-free prefix once, then one branch per fault and one for the healthy baseline (bench.engine
run_family). Families run in worker processes; the report is written as Markdown, HTML and JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from grayguard.bench import report_html
from grayguard.bench.engine import run_family
from grayguard.bench.metrics import summarize
from grayguard.bench.report import add_baselines, markdown, targets
from grayguard.bench.scenarios import SuiteError, load_suite, suites
from grayguard.bench.spec import Scenario, trace_sources

HELP = "benchmark grayguard against round robin, least-connections, the seeds' Z-score and Envoy on fault scenarios"
DESCRIPTION = """\
Runs a scenario suite (bench/suites/<suite>.yaml) in virtual time: the simulator's latency model behind
a model of HAProxy's weighted leastconn/roundrobin, with each policy deciding weights on identical
traffic (grayguard runs the controller's own decide_pool). Per scenario and policy it measures the time
from fault to first weight cut and to quarantine, false cuts and quarantines, client P99/P99.9 TTFT and
end-to-end latency against the healthy baseline (the same scenario without the fault, same seed),
timeouts, errors and the capacity kept; then prints a summary and PASS/MISS per target.

--cross-check runs a few scenarios both in this engine and on the real local stack (simulated vLLM fleet,
an exporter per node, HAProxy leastconn with the shipped reflexes, Prometheus at the intervals of
rules/prometheus.example.yml, Alertmanager, the controller at grayguard.example.yaml: 1 s tick, 30 s window),
with the same pool (8 nodes), load (20 req/s, the very same arrivals), seed, fault and timing: a thermal
slowdown (x6), a hang, a CUDA error and a benign 2x traffic surge, each with the fault on node3 from 45 s and
measured over [45, 75) s, plus the healthy run they are compared with. The engine runs each scenario at the
live run's phase (its controller start and fault instant) and over 8 other draws of the probe, check and scrape
phases. It prints, side by side: time to cut, time to quarantine, P99 TTFT during the fault over the healthy
run's, failed requests and false cuts, the difference, and PASS (detection within one tick, P99 ratios within
15 %), SPREAD (within that of the engine's range over the phase draws) or DIFF. About 10 minutes of real time
(5 live runs); progress on stderr; --report-dir writes crosscheck.md and crosscheck.json (with each live run's
transitions and how late the simulated fleet ran).

examples:
  grayguard bench --suite smoke --report-dir /tmp/bench
  grayguard bench --suite default --report-dir bench-report --workers 2
  grayguard bench --suite default --report-dir /tmp/b --filter thermal/n8 --policies leastconn,grayguard
  grayguard bench --cross-check --report-dir /tmp/cross
  grayguard bench --cross-check --cross-scenarios thermal --cross-bench-only
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="smoke", help=f"suite name or YAML path (shipped: {', '.join(suites())})")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where report.md, report.html and report.json go (required, except with --cross-check)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: min(2, CPUs))")
    p.add_argument("--model", choices=MODELS, default="shipped",
                   help="the simulated vLLM's latency parameters: shipped (sim/model.py's defaults, the suite's "
                        "reference) or calibrated (fitted to published vLLM measurements of 8B-class models on H100, "
                        "sim/calibrate.py: about 2x faster steps, a steeper batch curve; speed classes apply on top)")
    p.add_argument("--policies", help="comma-separated policies instead of the suite's (see bench/policies.py)")
    p.add_argument("--filter", action="append", default=[], metavar="SUBSTR",
                   help="only scenarios whose name contains SUBSTR (repeatable: any of them)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed (with --cross-check: "
                   "when a row is DIFF)")
    p.add_argument("--no-live-signals", action="store_true",
                   help="every pool's engine without the exporter's live fast path: no live ITL, live TTFT, prompt "
                        "tokens/s or decode batch (Triton's profile, docs/engines.md), so the probes and the 30 s "
                        "window judge the nodes alone")
    from grayguard.bench.crosscheck import SCENARIOS, VLLM_SCENARIOS
    g = p.add_argument_group("cross-check (the benchmark against the real local stack)")
    g.add_argument("--cross-check", action="store_true",
                   help="run the cross-check scenarios in the engine and on the local stack, print the table")
    g.add_argument("--cross-scenarios", default=None, metavar="NAMES",
                   help=f"comma-separated, of {', '.join(SCENARIOS)} (with --fleet vllm: {', '.join(VLLM_SCENARIOS)}) "
                   "(default: all; the healthy run always runs)")
    g.add_argument("--fleet", choices=["sim", "vllm"], default="sim",
                   help="the live side's fleet: sim (the simulated fleet, 8 nodes at 20 req/s) or vllm (4 real vLLM "
                   "servers at 3 req/s, `make vllm`; the engine then models that node (sim.model.VLLM_CPU_TINY) and "
                   "the physical fault as measured, with no GPU evidence on either side); about 12 minutes")
    g.add_argument("--cross-seed", type=int, default=1, help="seed of the load and the fleet (default 1)")
    g.add_argument("--cross-bench-only", action="store_true",
                   help="the engine's side only (seconds): the figures, no table")
    g.add_argument("--keep-workdir", action="store_true",
                   help="keep each live run's temp dir (configs and logs of HAProxy, Prometheus, Alertmanager)")


def families(scenarios: list[Scenario], policy_override: list[str] | None = None) -> list[tuple[str, list[Scenario]]]:
    """(policy, scenarios sharing their traffic) work items; each fault family gets its healthy twin."""
    by: dict[tuple[str, str], list[Scenario]] = {}
    for s in scenarios:
        for pol in policy_override or s.policies:
            by.setdefault((pol, s.traffic_key()), []).append(s)
    out = []
    for (pol, _key), members in by.items():
        if any(m.faults for m in members):
            first = next(m for m in members if m.faults)
            lo, hi = first.window  # the baseline is measured over the same window as the faults
            twin = replace(first.healthy_twin(), name="healthy/" + "/".join(first.name.split("/")[1:]),
                           group="healthy", tags=tuple({**first.tag, "fault": "healthy", "slowdown": None}.items()),
                           measure_from_s=lo, measure_to_s=hi)
            members = [*members, twin]
        out.append((pol, members))
    # biggest first: keeps both workers busy until the end
    out.sort(key=lambda f: -sum(len(s.nodes) * s.duration_s for s in f[1]))
    return out


MODELS = ("shipped", "calibrated")
# the calibrated H100 saturates at about 2x the shipped one's rate with the default mix (sim/calibrate.py: 20.5 vs
# 10.3 req/s, measured in virtual time): --model calibrated scales a suite's utilization by it, so a pool is as
# loaded relative to its capacity as with the shipped model (absolute rates, pinned tenants included, stay)
CALIBRATED_CAPACITY_X = 2.0


def model_params(model: str):
    """The engine's ModelParams for --model (None: sim/model.py's defaults)."""
    if model == "shipped":
        return None
    from grayguard.sim.calibrate import CALIBRATED
    return CALIBRATED["h100"]


def for_model(s: Scenario, model: str) -> Scenario:
    """The scenario as run under --model: the same share of the pool's capacity."""
    if model == "shipped" or s.load.rate is not None or s.load.utilization is None:
        return s
    return replace(s, load=replace(s.load, utilization=s.load.utilization * CALIBRATED_CAPACITY_X))


def run_one(item: tuple) -> tuple[str, list[dict], float]:
    """Worker: run one family under one policy (and model); returns (label, summaries, seconds)."""
    pol, members, *rest = item
    model = rest[0] if rest else "shipped"
    t0 = time.perf_counter()
    results = run_family([for_model(s, model) for s in members], pol, model_params(model))
    rows = [summarize(r) for r in results]
    for s, row in zip(members, rows, strict=True):
        row["traffic_key"] = s.traffic_key()
    label = f"{pol} {'/'.join(members[0].name.split('/')[1:])} ({len(members)} runs)"
    return label, rows, time.perf_counter() - t0


def _bar(done: int, total: int, width: int = 30) -> str:
    k = round(width * done / total) if total else width
    return "[" + "#" * k + "." * (width - k) + "]"


def _worker_signals() -> None:
    """In a pool worker: SIGTERM kills it at once (the default; not grayguard.terminate's unwinding handler, which a
    fork inherits: a worker that unwound, or ignored the signal after the first, mid-write to the pool's queues could
    hang the parent's Pool.terminate, the workers running the rest of the suite), and Ctrl-C is the parent's to
    handle (a terminal sends SIGINT to the whole process group)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def execute(items: list, workers: int, progress=None) -> tuple[list[dict], float]:
    """Run the work items (in a process pool when workers > 1), reporting progress (default: sys.stderr as it is at
    the call, not at import: a stream replaced since, as pytest's capture does between tests, may be closed); (rows,
    wall seconds)."""
    progress = progress or sys.stderr
    rows: list[dict] = []
    t0 = time.perf_counter()
    total = len(items)

    def report(i: int, label: str, secs: float) -> None:
        el = time.perf_counter() - t0
        print(f"bench {_bar(i, total)} {i}/{total} {el:6.1f}s  {label}: {secs:.1f}s", file=progress, flush=True)

    if workers <= 1:
        for i, item in enumerate(items, 1):
            label, r, secs = run_one(item)
            rows += r
            report(i, label, secs)
    else:
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ctx.Pool(workers, initializer=_worker_signals) as pool:
            for i, (label, r, secs) in enumerate(pool.imap_unordered(run_one, items), 1):
                rows += r
                report(i, label, secs)
    return rows, time.perf_counter() - t0


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_cross_check(args: argparse.Namespace) -> int:
    """`--cross-check`: the table of bench.crosscheck; 2 on a bad scenario name, 1 if a binary is missing."""
    import logging

    from grayguard.bench.crosscheck import VLLM_SETUP, Setup, cross_check, report, scenarios_of
    from grayguard.bench.crosslive import run_live
    from grayguard.binaries import BinaryMissing

    setup = replace(VLLM_SETUP if args.fleet == "vllm" else Setup(), seed=args.cross_seed)
    known = scenarios_of(setup)
    names = [n.strip() for n in (args.cross_scenarios or ",".join(known)).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"grayguard bench: unknown cross-check scenario(s) {unknown} for --fleet {args.fleet}; known: "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    if logging.getLogger().level > logging.DEBUG:  # the stack's per-tick logs would drown the progress lines
        for name in ("aiohttp", "grayguard", "exporters", "rules", "sim", "localstack", "controller"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("urllib3").setLevel(logging.ERROR)  # "connection pool is full": concurrent queries

    def progress(msg: str) -> None:
        print(f"cross-check {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    notes: dict[str, dict] = {}

    def live(scn: Scenario):
        return run_live(scn, progress, keep_workdir=args.keep_workdir, notes=notes.setdefault(scn.name, {}),
                        fleet=setup.fleet)

    t0 = time.perf_counter()
    try:
        result = cross_check(setup, names, None if args.cross_bench_only else live, progress)
    except BinaryMissing as e:
        print(f"grayguard bench: {e}", file=sys.stderr)
        return 1
    result["live_notes"] = notes  # per run: the controller's transitions with reasons, the fleet loop's lag
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["commit"] = _git("rev-parse", "--short", "HEAD")
    diffs = report(result, Path(args.report_dir) if args.report_dir else None)
    progress(f"done in {result['wall_s']:.0f} s")
    return 1 if args.strict and diffs else 0


def run(args: argparse.Namespace) -> int:
    if args.cross_check:
        return run_cross_check(args)
    if not args.report_dir:
        print("grayguard bench: --report-dir is required (except with --cross-check)", file=sys.stderr)
        return 2
    try:
        scenarios, spec = load_suite(args.suite)
    except SuiteError as e:
        print(f"grayguard bench: {e}", file=sys.stderr)
        return 2
    if args.filter:
        scenarios = [s for s in scenarios if any(f in s.name for f in args.filter)]
    if args.no_live_signals:
        scenarios = [replace(s, live_signals=False) for s in scenarios]
    override = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    if not scenarios:
        print("grayguard bench: no scenario left after --filter", file=sys.stderr)
        return 2
    try:
        from grayguard.bench.policies import make_policy
        for pol in override or sorted({p for s in scenarios for p in s.policies}):
            make_policy(pol, scenarios[0].nodes, scenarios[0])
    except ValueError as e:
        print(f"grayguard bench: {e}", file=sys.stderr)
        return 2
    workers = args.workers or min(2, os.cpu_count() or 1)
    items = [(pol, members, args.model) for pol, members in families(scenarios, override)]
    n_runs = sum(len(item[1]) for item in items)
    suite = spec.get("suite", args.suite) + (" (no live signals)" if args.no_live_signals else "")
    print(f"bench: suite {suite}: {len(scenarios)} scenarios, {n_runs} runs in {len(items)} families, {workers} "
          "worker(s)", file=sys.stderr)
    rows, wall = execute(items, workers)
    rows.sort(key=lambda r: (r["group"], r["scenario"], r["policy"]))
    add_baselines(rows)
    tgt = targets(rows)
    meta = {"suite": suite, "scenarios": len(scenarios), "runs": n_runs,
            "families": len(items), "workers": workers, "wall_s": round(wall, 1), "model": args.model,
            "cpu_s": round(sum(r["wall_s"] for r in rows), 1),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "controller_dirty": bool(_git("status", "--porcelain", "--", "controller")),
            "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "traces": trace_sources(scenarios)}  # production traces replayed, with the attribution they require
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, tgt, meta)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(report_html.render(rows, tgt, meta))
    (out / "report.json").write_text(json.dumps({"meta": meta, "targets": tgt, "runs": rows}, indent=1,
                                                default=str) + "\n")
    print(md.split("\n## Per scenario")[0])
    print(f"report: {out / 'report.md'}, {out / 'report.html'}, {out / 'report.json'}  ({wall:.0f}s wall, "
          f"{workers} worker(s))")
    missed = [t for t in tgt if t["status"] == "MISS"]
    return 1 if args.strict and missed else 0
