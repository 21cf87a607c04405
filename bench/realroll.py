"""A rolling restart with a slowdown in it, on real vLLM: what the weight the pool holds back costs its clients.

    python -m grayguard.bench.realroll --out DIR [--policy grayguard|off] [--k 10] [--rate 1.5]
    python -m grayguard.bench.realroll --summary DIR [DIR ...]      # the phases of runs already made

Four real vLLM servers (the local vLLM tier: `make vllm`) behind the shipped HAProxy (`balance leastconn`) and
Prometheus, at the shipped timing; the controller (grayguard.example.yaml's defaults) joins once its 30 s window is
full, or never with --policy off (least connections alone: doing nothing). At 60 s node1 is killed and started again
in place; once it serves again, node2 the same; once node2 serves, node3 is throttled (a CPU quota of 1/k of a core).
The clients' TTFT (a failed or timed-out request counts as the 30 s timeout) is printed over three phases: before
the first restart, the restarts, and the 90 s after the slowdown. A restart takes 2-3 minutes on a 2-core machine
that four servers share, so a run takes about 10 minutes; the phase before the first restart, the same for every
policy, shows the machine's own noise (docs/benchmarks.md, "twenty-fifth round").

DIR gets run.json (the events, HAProxy's weights every second, every request) and, with the controller, its
recording and config (`grayguard replay --recording DIR/recording.jsonl.gz --config.file DIR/grayguard.yaml`
decides it again). Printed, never asserted: a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from grayguard.config import duration_seconds

TIMEOUT_S = 30.0  # the clients' deadline; a request without a first token counts as this
FIRST_RESTART_S = 60.0
SETTLE_S = 5.0  # from a node serving again to the next step
FAULT_WINDOW_S = 90.0


def phases(records: Sequence[Mapping], events: Sequence[Mapping]) -> dict[str, dict]:
    """TTFT over the run's three phases (pure): {phase: {n, failed, mean_s, p90_s, p99_s}}; a phase without a request,
    or whose bounds the events lack (a run stopped early), is absent."""
    at = {(e["kind"], e.get("node")): e["t"] for e in events}
    restart, thermal = at.get(("restart", "node1")), at.get(("thermal", "node3"))
    bounds = {"before": (0.0, restart),
              "restarts": (restart, thermal),
              "fault": (thermal, None if thermal is None else thermal + FAULT_WINDOW_S)}
    out = {}
    for name, (lo, hi) in bounds.items():
        if lo is None or hi is None:
            continue
        rs = [r for r in records if lo <= r["start_s"] < hi]
        if not rs:
            continue
        ttft = sorted(TIMEOUT_S if r["status"] != "ok" or r["ttft_s"] is None else r["ttft_s"] for r in rs)
        out[name] = {"n": len(rs), "failed": sum(1 for r in rs if r["status"] != "ok"),
                     "mean_s": statistics.fmean(ttft), "p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
                     "p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]}
    return out


def summary_line(name: str, ph: Mapping[str, Mapping]) -> str:
    parts = [f"{p} n={v['n']} mean={v['mean_s']:.2f} p90={v['p90_s']:.2f} p99={v['p99_s']:.2f} failed={v['failed']}"
             for p, v in ph.items()]
    return f"{name}: " + (" | ".join(parts) if parts else "no phase measured")


def run(out: Path, policy: str, k: float, rate: float, progress=print) -> dict:
    """One run (about 10 minutes); returns what run.json holds."""
    import requests

    from grayguard.controller.haproxy import RuntimeClient
    from grayguard.localstack.stack import BACKEND, LocalStack, StackSpec
    from grayguard.sim.loadgen import LoadConfig, run_load

    out.mkdir(parents=True, exist_ok=True)
    spec = StackSpec(nodes=4, seed=1, controller=False, balance="leastconn", control_window="30s", fleet="vllm",
                     timing="shipped", probe_interval_s=1.0,
                     record=str(out / "recording.jsonl.gz") if policy == "grayguard" else None)
    stack = LocalStack(spec, progress=lambda m: progress(f"[setup] {m}"))
    events: list[dict] = []
    samples: list[dict] = []
    records: list = []
    stop = threading.Event()
    t0 = time.time()

    def event(kind: str, node: str | None) -> None:
        events.append({"t": round(time.time() - t0, 2), "kind": kind, "node": node})
        progress(f"  {events[-1]['t']:6.1f}s {kind} {node or ''}")

    def sampler() -> None:  # HAProxy's weights once a second: what the clients were sent to
        c = RuntimeClient(stack.haproxy.endpoint)
        while not stop.is_set():
            try:
                servers = {s.name: [s.weight, s.drain, s.op_state] for s in c.show_servers_state(BACKEND)}
                samples.append({"t": round(time.time() - t0, 2), "servers": servers})
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the timeline, never the end of the run
                pass
            stop.wait(1.0)

    def until(t: float) -> None:
        while time.time() - t0 < t:
            time.sleep(0.2)

    try:
        stack.start()
        if policy == "grayguard":
            (out / "grayguard.yaml").write_text(stack.controller_config_yaml())
        nodes = stack.fleet.fleet.nodes  # type: ignore[union-attr]

        def serving(name: str) -> bool:
            try:
                return requests.get(nodes[name].url + "/v1/models", timeout=2).ok
            except requests.RequestException:
                return False

        load = LoadConfig(url=stack.gateway_url, rate=rate, duration_s=3600.0, seed=1, timeout_s=TIMEOUT_S)
        t0 = time.time()
        fut = stack.fleet.submit(run_load(load, sink=records))
        threading.Thread(target=sampler, daemon=True, name="realroll-sampler").start()
        until(duration_seconds(spec.control_window) + 2.0)
        if policy == "grayguard":
            stack.start_controller()
            event("controller", None)
        until(FIRST_RESTART_S)
        for name in ("node1", "node2"):
            event("restart", name)
            stack.set_fault(name, "restart")
            while not serving(name):
                time.sleep(0.5)
            event("serving", name)
            time.sleep(SETTLE_S)
        stack.set_fault("node3", "thermal", k=k)
        event("thermal", "node3")
        until(events[-1]["t"] + FAULT_WINDOW_S + TIMEOUT_S + SETTLE_S)  # every request of the fault window has ended
        fut.cancel()
    finally:
        stop.set()
        stack.stop()
    recs = [{"start_s": r.start_s, "status": r.status, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "backend": r.backend}
            for r in records]
    doc = {"policy": policy, "k": k, "rate": rate, "events": events, "samples": samples, "records": recs}
    (out / "run.json").write_text(json.dumps(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    from grayguard import terminate
    p = argparse.ArgumentParser(prog="python -m grayguard.bench.realroll", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="the run's directory (run.json, the recording, the config)")
    p.add_argument("--policy", choices=("grayguard", "off"), default="grayguard",
                   help="grayguard: the controller at the shipped defaults (default); off: least connections alone")
    p.add_argument("--k", type=float, default=10.0, help="node3's slowdown: a CPU quota of 1/k of a core (default 10)")
    p.add_argument("--rate", type=float, default=1.5,
                   help="requests per second through HAProxy (default 1.5: about half of a 2-core machine)")
    p.add_argument("--summary", type=Path, nargs="+", metavar="DIR", help="print the phases of runs already made")
    args = p.parse_args(argv)
    if args.summary:
        for d in args.summary:
            try:
                doc = json.loads((d / "run.json").read_text())
            except (OSError, ValueError) as e:
                print(f"realroll: {d}: no readable run.json ({e})", file=sys.stderr)
                return 2
            print(summary_line(f"{d.name} ({doc['policy']}, k={doc['k']:g})", phases(doc["records"], doc["events"])))
        return 0
    if args.out is None:
        p.error("--out is needed to make a run (or --summary DIR to print runs already made)")
    if not args.k > 1 or not args.rate > 0:
        p.error("--k must be above 1 and --rate above 0")
    previous = terminate.install()
    try:
        doc = run(args.out, args.policy, args.k, args.rate, progress=lambda m: print(m, flush=True))
    except KeyboardInterrupt as e:
        return terminate.exit_status(e)
    finally:
        terminate.restore(previous)
    print(summary_line(f"{args.out.name} ({args.policy}, k={args.k:g})", phases(doc["records"], doc["events"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
