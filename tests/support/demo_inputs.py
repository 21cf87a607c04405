"""Synthetic demo runs for the report tests: what the Sampler and the load generator would have recorded in the
default scenario (thermal x10 on node3 from 30 s to 90 s, 8 nodes, 20 req/s, 150 s), without starting the stack."""

from __future__ import annotations

import io
import random
from pathlib import Path
from types import SimpleNamespace

from grayguard.demo import cli
from grayguard.demo.membership_report import client_failures, crash_milestones, join_milestones, verdict, write_report
from grayguard.sim.loadstats import LoadResult, Phase, RequestRecord

NODES = [f"node{i}" for i in range(1, 9)]
RUNBOOK = "https://github.com/grayguard/grayguard/blob/main/docs/runbook.md"
PHASES = (Phase("baseline", 0, 30), Phase("fault", 30, 90), Phase("recovery", 90, 1e9))


def _state(t: float, controller: bool, fault: bool) -> tuple[str, int]:
    """node3's state and weight at t."""
    if not (controller and fault) or t < 33:
        return "healthy", 100
    for until, state, w in ((43, "quarantined", 0), (117, "canary", 0), (137, "slow_start", 10 + int(t - 117) * 4)):
        if t < until:
            return state, w
    return "healthy", 100


def samples(controller: bool = True, fault: bool = True) -> list[dict]:
    out = []
    for t in range(151):
        slow = fault and 30 <= t < 90
        nodes = {n: {"weight": 100, "drained": False, "latency": 0.01 + 0.001 * (i % 3), "probe_ttft": 0.2,
                     "probe_result": "ok", "state": "healthy", "score": 0.1} for i, n in enumerate(NODES)}
        state, w = _state(t, controller, fault)
        nodes["node3"].update(latency=0.1 if slow else 0.01, probe_ttft=0.8 if slow else 0.2, weight=w,
                              drained=state in ("quarantined", "canary"), state=state)
        if not controller:
            for v in nodes.values():
                v.pop("state")
                v.pop("score")
        out.append({"t": float(t), "nodes": nodes})
    return out


def _alert(t: float, kind: str, status: str, alert: str, node: str, summary: str) -> dict:
    return {"t": t, "kind": kind, "text": f"{status} {alert} pool=chat node={node}", "node": node,
            "instance": None, "pool": "chat", "alert": alert, "status": status, "severity": kind,
            "summary": summary, "runbook_url": f"{RUNBOOK}#{alert.lower()}"}


def events(controller: bool = True, fault: bool = True) -> list[dict]:
    out = [{"t": 12.0, "kind": "controller", "text": "controller started (10s rate windows are full)"}] \
        if controller else []
    if fault:
        out += [{"t": 30.0, "kind": "fault", "text": "thermal injected on node3 k=10", "node": "node3",
                 "fault": "thermal", "action": "injected", "params": {"k": 10}},
                {"t": 90.0, "kind": "fault", "text": "thermal cleared on node3", "node": "node3", "fault": "thermal",
                 "action": "cleared"}]
    if controller and fault:
        steps = ((33.1, "healthy", "quarantined", "probe slow (788 ms vs peers 369 ms) with GPU evidence: GPU "
                  "throttling under load"),
                 (43.3, "quarantined", "canary", "drained 10s (probe); probing with canaries"),
                 (117.7, "canary", "slow_start", "3 good canaries in a row; slow start at 10%"),
                 (136.8, "slow_start", "healthy", "slow start complete"))
        out += [{"t": t, "kind": "transition", "text": f"node3: {a} -> {b}: {why}", "node": "node3", "state": b,
                 "from_state": a, "reason": why} for t, a, b, why in steps]
        q = "grayguard has drained a slow vLLM node and it has not come back."
        out += [_alert(38.2, "page", "firing", "GrayguardNodeQuarantined", "node3", q),
                _alert(43.3, "ticket", "firing", "GrayguardGpuThrottled", "node3",
                       "A busy GPU is thermally or power throttled."),
                _alert(119.7, "page", "resolved", "GrayguardNodeQuarantined", "node3", q)]
    if controller:  # a peer's brief slowness, before the fault
        why = "probe slow (302 ms vs peers 143 ms)"
        out.append({"t": 20.1, "kind": "transition", "text": f"node4: healthy -> degraded: {why}", "node": "node4",
                    "state": "degraded", "from_state": "healthy", "reason": why})
    return sorted(out, key=lambda e: e["t"])


def records(controller: bool = True, fault: bool = True, seed: int = 1) -> list[RequestRecord]:
    """20 req/s round robin; node3 answers 10x slower while faulty and in rotation."""
    rng = random.Random(seed)
    out = []
    for i in range(150 * 20):
        t = i / 20
        node = NODES[i % 8]
        slow = fault and node == "node3" and 30 <= t < 90 and (not controller or t < 33)
        ttft = (2.0 if slow else 0.2) * rng.uniform(0.8, 1.2)
        status = "timeout" if slow and i % 97 == 0 else "ok"
        out.append(RequestRecord(index=i, start_s=t, status=status, prompt_tokens=500, max_tokens=100,
                                 ttft_s=ttft if status == "ok" else None, e2e_s=ttft * 8, http_status=200,
                                 backend=node))
    return out


def run(opts: cli.DemoOptions, report_dir: Path | None, out=None, sink: list | None = None) -> dict:
    """grayguard.demo.cli.run_scenario's stand-in: the synthetic run of opts through the demo's own _finish."""
    controller, fault = opts.controller, opts.fault != "none"
    recs = records(controller, fault)
    if sink is not None:
        sink.extend(recs)
    sampler = SimpleNamespace(samples=samples(controller, fault), events=events(controller, fault))
    result = LoadResult(recs, PHASES, 150.0)
    return cli._finish(opts, report_dir, sampler, recs, result, False, out or io.StringIO())


def membership(report_dir: Path) -> dict:
    """A membership run (node9 joins at 30 s, node8 is killed at 90 s) written by the scenario's write_report."""
    hap = [{"t": t, "node": n, "present": p, "weight": w, "admin": a, "op": op, "status": ""}
           for t, n, p, w, a, op in ((33.4, "node9", True, 10, 0, 0), (33.9, "node9", True, 10, 0, 2),
                                     (45.5, "node9", True, 15, 0, 2), (62.7, "node9", True, 100, 0, 2),
                                     (92.2, "node8", True, 100, 0, 0), (92.6, "node8", True, 100, 8, 0),
                                     (94.5, "node8", False, 0, 0, 0))]
    reg = [{"t": 32.9, "kind": "put", "node": "node9", "state": "serving", "ttl_s": 10, "registered_at_s": 32.9,
            "prev_state": None},
           {"t": 93.6, "kind": "delete", "node": "node8", "state": None, "ttl_s": None, "registered_at_s": None,
            "prev_state": "serving"}]
    recs = records(controller=True, fault=False)
    for r in recs[1790:1796]:
        r.status, r.ttft_s, r.backend = "protocol", None, "node8"
    report = {"scenario": "membership", "join_at_s": 30.0, "crash_at_s": 90.0,
              "join": join_milestones(hap, reg, "node9", 30.1, 10, 100),
              "crash": crash_milestones(hap, reg, "node8", 90.2, 3, 1.0),
              "clients": client_failures(recs, "node8", 90.2), "leader": "vm:1", "nodes": 8, "rate": 20.0,
              "duration_s": 150.0, "seed": 1, "balance": "roundrobin", "interrupted": False,
              "phases": LoadResult(recs, PHASES[:1] + (Phase("fault", 30, 1e9),), 150.0).summary(),
              "events": [{"t": 30.1, "kind": "join", "text": "node9: starting its node and exporter", "node": "node9"},
                         {"t": 32.9, "kind": "registry", "text": "node9: registered (TTL 10s)", "node": "node9"},
                         {"t": 90.2, "kind": "crash", "text": "node8: SIGKILL (lease TTL 3s)", "node": "node8"},
                         {"t": 98.3, "kind": "page", "text": "firing GrayguardNodeQuarantined node8",
                          "alert": "GrayguardNodeQuarantined", "status": "firing", "node": "node8"}]}
    report["phases"].pop("all", None)
    report["verdict"], report["checks"] = verdict(report)
    ms = [{"t": float(t), "leader": "vm:1", "nodes": {n: {"weight": 100} for n in NODES
                                                      if not (n == "node8" and t > 94)}} for t in range(151)]
    write_report(report, ms, recs, report_dir)
    return report
