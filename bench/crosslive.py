"""The live side of `grayguard bench --cross-check`: one benchmark Scenario on the real local stack, in real time.

The local stack (localstack.LocalStack at the shipped timing: rules/prometheus.example.yml's intervals and jobs,
grayguard.example.yaml's controller, one process per exporter) gets the scenario's pool, balance algorithm, probe
interval, arrivals (bench.crossload: the sequence bench.spec.make_arrivals gives the engine), controller start and
fault schedule. What it did comes back as a bench.engine.RunResult, so bench.metrics.summarize computes the figures
of both sides with one definition: each request's outcome from the load generator's record, the weights and
drains as HAProxy showed them and the states as the controller held them (polled every SAMPLE_S).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from grayguard.bench.crossload import LoadProcess
from grayguard.bench.engine import ERROR, GARBAGE, OK, TIMEOUT, RunResult
from grayguard.bench.spec import Scenario, make_arrivals
from grayguard.sim.loadstats import RequestRecord

log = logging.getLogger("grayguard.bench.crosscheck")
SAMPLE_S = 0.2  # how often HAProxy's weights and the controller's states are read: detection times to ~0.2 s
STATUS = {"ok": OK, "timeout": TIMEOUT, "garbage": GARBAGE}  # anything else (5xx, connect, stream error): ERROR
BALANCER = "leastconn"  # the `grayguard` policy's balancer, and the shipped HAProxy config's


async def _loop_lag(out: list[float], every_s: float = 0.05) -> None:
    """Append how late each every_s sleep of this loop woke up (s), until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(every_s)
        out.append(max(0.0, loop.time() - t - every_s))


class _Timeline:
    """Polls HAProxy and the controller; appends (t, node index, weight, drained, state) on every change, and
    (t, node, old state, new state, the controller's reason) to events on every state change."""

    def __init__(self, stack, names: list[str], bases: list[int], events: list, note: Callable[[str], None]) -> None:
        self.stack, self.index = stack, {n: k for k, n in enumerate(names)}
        self.last = {k: (b, False, "healthy") for k, b in enumerate(bases)}
        self.rows: list[tuple[float, int, int, bool, str]] = [(0.0, k, b, False, "healthy")
                                                              for k, b in enumerate(bases)]
        self.events, self.note = events, note

    def sample(self, t: float) -> None:
        try:
            hap = self.stack.haproxy_weights()
        except Exception as e:  # noqa: BLE001 - one lost sample is no reason to lose the run
            log.debug("HAProxy read failed: %s", e)
            return
        ctl = self.stack.controller
        states = dict(ctl.states.get("chat", {})) if ctl is not None else {}
        for name, (w, drained) in hap.items():
            k = self.index.get(name)
            if k is None:
                continue
            st = states[name].state if name in states else "healthy"
            if st != self.last[k][2]:
                why = states[name].reason if name in states else ""
                self.events.append((t, name, self.last[k][2], st, why))
                self.note(f"t={t:5.1f}s {name}: {self.last[k][2]} -> {st}: {why}")
            if (w, drained, st) != self.last[k]:
                self.last[k] = (w, drained, st)
                self.rows.append((t, k, w, drained, st))

    def off(self, names: list[str]) -> dict[str, str]:
        """Nodes off full weight now: weight/drain/state."""
        return {names[k]: f"{w}{'/drain' if d else ''}/{st}" for k, (w, d, st) in self.last.items()
                if (w, d, st) != (100, False, "healthy")}


def _healthy_probe_median(stack, scn: Scenario, wall0: float) -> float | None:
    """The median of the exporters' probe TTFT medians over the window, nodes without a fault (ms): the probes'
    baseline as the controller saw it (the engine's is ~25 ms at this load: one decode step and the prefill)."""
    lo, hi = scn.window
    faulty = {n.address for n in stack.nodes if n.name in scn.faulty}
    try:
        r = stack.prometheus.get("/api/v1/query_range", query="grayguard_probe_ttft_median_seconds",
                                 start=wall0 + lo, end=wall0 + hi, step=1)
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        log.debug("probe median query failed: %s", e)
        return None
    vals = sorted(float(v) for s in r["result"] if s["metric"].get("instance") not in faulty for _t, v in s["values"])
    return round(1000 * vals[len(vals) // 2], 1) if vals else None


def _result(scn: Scenario, records: list[RequestRecord], timeline: list, names: list[str], wall_s: float) -> RunResult:
    """The live run as the engine would have returned it (unanswered requests count as timeouts)."""
    index = {n: k for k, n in enumerate(names)}
    res = RunResult(scn, "grayguard (live)", [r.start_s for r in records],
                    [index.get(r.backend or "", -1) for r in records],
                    [TIMEOUT if r.status == "pending" else STATUS.get(r.status, ERROR) for r in records],
                    [r.ttft_s if r.ttft_s is not None else math.nan for r in records],
                    [r.e2e_s if r.e2e_s is not None else scn.load.timeout_s for r in records],
                    timeline=sorted(timeline, key=lambda x: x[0]), wall_s=wall_s)
    res.retried = bytearray(len(records))
    return res


def _check(scn: Scenario) -> list[str]:
    names = [n.name for n in scn.nodes]
    if any(p >= 0 for p in make_arrivals(scn).pin) or scn.absent or scn.slowdown_all or scn.drift:
        raise ValueError(f"{scn.name}: the live stack runs balanced traffic and node faults only")
    if names != [f"node{i + 1}" for i in range(len(names))] or {n.speed_class for n in scn.nodes} != {"h100"}:
        raise ValueError(f"{scn.name}: the live fleet is node1..nodeN, all h100")
    return names


def run_live(scn: Scenario, progress: Callable[[str], None] = lambda s: None, keep_workdir: bool = False,
             notes: dict | None = None, fleet: str = "sim") -> RunResult:
    """Run scn on the local stack; its faults are set (and cleared) at their times from the load's start.

    The returned RunResult's scenario carries the controller's start and the fault times as they happened (a few
    ms after the plan), so detection times count from the real injection and the engine can be run at the same
    phase of ticks against fault. notes, when given, receives `transitions`: the controller's state changes (t,
    node, old, new, reason); `loop_lag_ms`: how late the simulated fleet's event loop ran (p50, p99, max of a
    50 ms timer's overshoot), the simulator's own clock error on a busy machine, which virtual time does not
    have (the load generator's loop, with fleet="vllm": the servers are processes of their own);
    `probe_ttft_median_ms`: the healthy nodes' probe TTFT median over the window; `tick_ms`: the
    controller's mean tick duration (the engine decides in no time).
    """
    from grayguard.localstack.stack import LocalStack, StackSpec

    names = _check(scn)
    arr = make_arrivals(scn)
    plan = list(zip(arr.t, arr.prompt, arr.gen, strict=True))
    notes = notes if notes is not None else {}
    # one process per exporter, as on real nodes: in this process their /metrics parsing would hold the interpreter
    # the simulated fleet runs in, and every latency (the probes' first of all) would grow with it
    spec = StackSpec(nodes=len(names), seed=scn.seed, controller=False, balance=BALANCER, timing="shipped",
                     probe_interval_s=scn.probe_interval_s, exporter_processes=True, fleet=fleet)
    stack = LocalStack(spec, progress=lambda s: progress(f"{scn.name}: {s}"))
    load: LoadProcess | None = None
    lag = None  # the loop-lag probe's future
    faults = list(scn.faults)
    done_at: dict[int, float] = {}  # fault index -> when it was set (load seconds)
    cleared: set[int] = set()
    ctl_at: float | None = None
    t_start = time.monotonic()
    try:
        stack.start()
        tl = _Timeline(stack, names, [n.base_weight for n in scn.nodes], notes.setdefault("transitions", []),
                       lambda msg: progress(f"{scn.name}: {msg}"))
        lags: list[float] = []
        lag = stack.fleet.submit(_loop_lag(lags))
        load = LoadProcess(stack.gateway_url, plan, scn.load.timeout_s, scn.window, stack.dir)
        t0 = load.start()
        progress(f"{scn.name}: {len(plan)} requests over {scn.duration_s:g} s through HAProxy ({BALANCER}); "
                 f"controller from {scn.control_start_s:g} s"
                 + "".join(f"; {f.fault} on {f.node} at {f.at_s:g} s" for f in faults))
        next_note = 10.0
        while not load.poll(SAMPLE_S):
            el = time.monotonic() - t0
            if ctl_at is None and el >= scn.control_start_s:
                stack.start_controller()
                ctl_at = time.monotonic() - t0  # its first tick runs now, then every tick_interval_s
            for i, f in enumerate(faults):
                if i not in done_at and el >= f.at_s:
                    stack.set_fault(f.node, f.fault, **dict(f.params))
                    done_at[i] = time.monotonic() - t0
                    progress(f"{scn.name}: {f.fault} set on {f.node} at {done_at[i]:.2f} s")
                elif i in done_at and i not in cleared and f.until_s is not None and el >= f.until_s:
                    stack.clear_fault(f.node)
                    cleared.add(i)
            tl.sample(round(time.monotonic() - t0, 3))
            if el >= next_note:
                progress(f"{scn.name}: t={el:5.1f}s  {load.sent} sent, {load.ok} ok  off full weight: "
                         f"{tl.off(names) or 'none'}")
                next_note += 10.0
            if not load.running() and not load.poll(1.0):
                raise RuntimeError("the load process ended without its records")
        lag.cancel()
        notes["probe_ttft_median_ms"] = _healthy_probe_median(stack, scn, time.time() - (time.monotonic() - t0))
        n_ticks = stack.controller_metric("grayguard_tick_duration_seconds_count")
        notes["tick_ms"] = (round(1000 * stack.controller_metric("grayguard_tick_duration_seconds_sum") / n_ticks, 1)
                            if n_ticks else None)
        lags.sort()
        notes["loop_lag_ms"] = ([round(1000 * lags[int(q * (len(lags) - 1))], 1) for q in (0.5, 0.99, 1.0)]
                                if lags else None)
        progress(f"{scn.name}: healthy nodes' probe TTFT median {notes['probe_ttft_median_ms']} ms; a tick took "
                 f"{notes['tick_ms']} ms on average; the fleet's event loop ran late by {notes['loop_lag_ms']} ms "
                 "(p50, p99, max)")
    finally:
        if lag is not None:
            lag.cancel()
        if load is not None:
            load.stop()
        stack.stop(keep_workdir=keep_workdir)
        if keep_workdir:
            progress(f"{scn.name}: kept {stack.dir}")
    actual = tuple(replace(f, at_s=done_at.get(i, f.at_s)) for i, f in enumerate(faults))
    live = replace(scn, faults=actual, control_start_s=ctl_at if ctl_at is not None else scn.control_start_s)
    return _result(live, load.records or [], tl.rows, names, time.monotonic() - t_start)
