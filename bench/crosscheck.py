"""`grayguard bench --cross-check`: the same scenarios in the benchmark engine and on the live local stack.

One description per scenario (CrossScenario, over a Setup both sides share: pool, rate, seed, timing, the
measurement window) becomes one bench.spec.Scenario; the engine runs it in virtual time (policy `grayguard`:
leastconn behind HAProxy's reflexes, the shipped timing of bench.spec.Scenario) and bench.crosslive runs the same
Scenario on the real stack (HAProxy leastconn with the shipped reflexes, Prometheus at rules/prometheus.example.yml's
intervals, the controller at grayguard.example.yaml, the exporters probing every second, the same arrivals).
bench.metrics.summarize computes the figures of both. The live run goes first; the engine then runs the scenario
at the live run's phase (its controller's first tick and its fault, as they happened) and over PHASE_DRAWS other
draws of the phases neither side controls (PhasedRun). bench.crosstable puts the figures side by side with the
difference and a verdict per row (PASS, SPREAD, DIFF). docs/benchmarks.md, "Cross-check", has a measured table.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from grayguard.bench.crosstable import markdown, rows, value
from grayguard.bench.engine import Run, RunResult, run
from grayguard.bench.metrics import summarize
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario
from grayguard.sim.model import VLLM_CPU_TINY, ModelParams

PHASE_DRAWS = 8  # the engine's runs of each scenario over other probe, check and scrape phases


@dataclass(frozen=True)
class Setup:
    """What every cross-check run shares: the pool, the load, the timing and the measurement window."""

    nodes: int = 8  # node1..nodeN, all h100 (the demo's fleet)
    rate: float = 20.0  # req/s through HAProxy, Poisson, the load generator's size mix
    seed: int = 1
    duration_s: float = 80.0  # arrivals stop here
    control_start_s: float = 30.0  # the controller's first tick: the 30 s window is full by then
    fault_at_s: float = 45.0
    window_s: float = 30.0  # measured: requests that arrive in [fault_at_s, fault_at_s + window_s)
    timeout_s: float = 30.0  # the clients' deadline
    fleet: str = "sim"  # the live side's fleet: sim (the simulator) or vllm (real servers, localstack/vllmfleet.py)


# --fleet vllm: 4 real servers on 2 cores take about a third of the simulated fleet's pace per node
VLLM_SETUP = Setup(nodes=4, rate=3.0, fleet="vllm")


@dataclass(frozen=True)
class CrossScenario:
    """One row group: a fault on one node (or a whole-pool surge: no fault at all)."""

    name: str
    fault: str | None = None  # a sim.faults name; None: benign
    params: dict = field(default_factory=dict)
    node: str = "node3"
    until_s: float | None = None  # None: the fault lasts to the end of the run
    surge: float | None = None  # benign: the whole pool's traffic x this over the measurement window
    # the engine's equivalent of the live fault when they differ (the real fleet's physical faults): (fault, params)
    engine: tuple[str, dict] | None = None


SCENARIOS = {
    "thermal": CrossScenario("thermal", "thermal", {"k": 6}),  # every phase x6 (the default suite's)
    "hang": CrossScenario("hang", "hang"),  # the engine freezes; /health stays 200
    "cuda_error": CrossScenario("cuda_error", "cuda_error"),  # every request: HTTP 500 before any output
    "traffic_surge": CrossScenario("traffic_surge", surge=2.0),  # 2x traffic for 30 s: load, nothing to drain
}
# On the real fleet: its thermal k=10 is a CPU quota of 0.1 core, which bench.vllmshapes measured as decode x41 and
# prefill x19 (docs/simulator.md): the engine runs it as that (`pcie`'s two factors; no GPU evidence either side).
VLLM_SCENARIOS = {
    "thermal": CrossScenario("thermal", "thermal", {"k": 10}, engine=("pcie", {"k": 41, "prefill_k": 19})),
    "hang": SCENARIOS["hang"],
    "traffic_surge": SCENARIOS["traffic_surge"],
}


def scenarios_of(setup: Setup) -> dict[str, CrossScenario]:
    """The cross-check scenarios the setup's fleet can run."""
    return VLLM_SCENARIOS if setup.fleet == "vllm" else SCENARIOS


def engine_side(scn: Scenario, cs: CrossScenario | None) -> Scenario:
    """scn as the engine runs it: the live fault's engine equivalent at the same times (the GPU evidence is the
    scenario's own: `scenario` turns it off for the real fleet)."""
    if cs is not None and cs.engine is not None:
        fault, params = cs.engine
        scn = replace(scn, faults=tuple(replace(f, fault=fault, params=dict(params)) for f in scn.faults))
    return scn


def scenario(setup: Setup, cs: CrossScenario | None) -> Scenario:
    """The benchmark Scenario of cs (None: the healthy run, no fault and no surge), at the shipped timing."""
    lo, hi = setup.fault_at_s, setup.fault_at_s + setup.window_s
    surges = ((lo, hi, cs.surge),) if cs is not None and cs.surge else ()
    faults = ((FaultSpec(cs.node, cs.fault, lo, cs.until_s, dict(cs.params)),)
              if cs is not None and cs.fault else ())
    return Scenario(
        name=cs.name if cs is not None else "healthy", group="benign" if not faults else "fault",
        nodes=tuple(NodeSpec(f"node{i + 1}") for i in range(setup.nodes)),
        load=LoadSpec(utilization=None, rate=setup.rate, surges=surges, timeout_s=setup.timeout_s),
        faults=faults, duration_s=setup.duration_s, seed=setup.seed, control_start_s=setup.control_start_s,
        measure_from_s=lo, measure_to_s=hi, policies=("grayguard",), gpu_evidence=setup.fleet != "vllm")


def figures(res: RunResult) -> dict:
    """The figures the table compares, from bench.metrics.summarize (one definition for both sides)."""
    s = summarize(res)
    return {"t_cut_s": s["t_cut_s"], "t_quarantine_s": s["t_quarantine_s"], "ttft_p99": s["ttft_p99"],
            "requests": s["requests"], "failed": s["requests"] - s["ok"], "false_cuts": s["false_cuts"],
            "false_quarantines": s["false_quarantines"], "t_agent_down_s": s["t_agent_down_s"]}


class PhasedRun(Run):
    """The engine's run of scn with another draw of the phases the live stack draws anew on every run: each
    exporter's probe schedule, fast-path and full-page scrapes, HAProxy's health and agent checks. The traffic, the
    tick phase, the fault's instant and the nodes' step jitter stay: only when things happen relative to each other
    moves."""

    def __init__(self, scn: Scenario, policy: str, phase_seed: int, params: ModelParams | None = None) -> None:
        super().__init__(scn, policy, params)
        rng = self.probe_rng = random.Random(phase_seed)

        def due(every_s: float) -> list[tuple[float, int]]:
            h = [(rng.uniform(0, every_s), k) for k in range(len(self.nodes))]
            heapq.heapify(h)
            return h

        if self.probe_due:
            self.probe_due = due(scn.probe_interval_s)
        if self.gw is not None:
            self.check_due = due(self.gw.rx.check_inter_s)
            if self.agent_due:
                self.agent_due = due(self.gw.rx.agent_inter_s)
        for n in self.nodes:
            n.live.phase = rng.uniform(0, scn.fast_scrape_s)
        for n in self.nodes:
            n.gpu.phase = rng.uniform(0, scn.full_scrape_s)


def cross_check(setup: Setup, names: list[str], live: Callable[[Scenario], RunResult] | None,
                progress: Callable[[str], None] = lambda s: None, draws: int = PHASE_DRAWS) -> dict:
    """Run every named scenario and the healthy run on both sides (live=None: the benchmark only).

    The live run comes first; the engine then runs the scenario at its phase (the controller's first tick and the
    fault as they happened live), and again over `draws` other draws of the probe, check and scrape phases.
    """
    known = scenarios_of(setup)
    todo: list[tuple[str, CrossScenario | None]] = [("healthy", None), *((n, known[n]) for n in names)]
    params = VLLM_CPU_TINY if setup.fleet == "vllm" else None
    out: dict = {"setup": asdict(setup), "draws": draws, "scenarios": {}}
    for name, cs in todo:
        scn = scenario(setup, cs)
        entry: dict = {}
        if live is not None:
            progress(f"live: {name} on the local stack (about {setup.duration_s + 15:.0f} s)")
            lres = live(scn)
            entry["live"] = figures(lres)
            scn = lres.scenario  # the engine runs at the live run's phase: its controller's first tick, its fault
            entry["phase"] = {"control_start_s": round(scn.control_start_s, 3),
                              "fault_at_s": [round(f.at_s, 3) for f in scn.faults]}
        progress(f"bench: {name} ({len(scn.nodes)} nodes, {setup.rate:g} req/s, {setup.duration_s:g} s, virtual "
                 f"time; {draws} more phase draws)")
        scn = engine_side(scn, cs)
        entry["bench"] = figures(run(scn, "grayguard", params=params))
        entry["spread"] = [figures(PhasedRun(scn, "grayguard", seed, params).execute()) for seed in range(draws)]
        out["scenarios"][name] = entry
        progress(f"{name}: " + json.dumps({k: entry[k] for k in ("bench", "live", "phase") if k in entry},
                                          default=lambda x: None))
    if live is None:
        return out
    h = out["scenarios"]["healthy"]
    tick = scenario(setup, None).tick_s
    table = rows("healthy", False, tick, h["bench"], h["live"], h, list(zip(h["spread"], h["spread"], strict=True)))
    table = [r for r in table if r["metric"].startswith("false")]
    for name, cs in todo[1:]:
        e = out["scenarios"][name]
        table += rows(name, cs is not None and cs.fault is not None, tick, e["bench"], e["live"], h,
                      list(zip(e["spread"], h["spread"], strict=True)))
    out["table"] = table
    return out


def report(result: dict, report_dir: Path | None, out=None) -> int:
    """Print (and write) the table; the number of DIFF rows."""
    out = out or sys.stdout
    s = result["setup"]
    head = (f"cross-check: {s['nodes']} nodes, {s['rate']:g} req/s, seed {s['seed']}, faults on node3 at "
            f"{s['fault_at_s']:g} s, measured over [{s['fault_at_s']:g}, {s['fault_at_s'] + s['window_s']:g}) s")
    if "table" not in result:
        lines = ["| scenario | time to cut (s) | time to quarantine (s) | P99 TTFT (s) | failed | false cuts + q. |",
                 "|---|---|---|---|---|---|"]

        def cell(key: str, e: dict) -> str:
            vals = [x[key] for x in e["spread"]]
            got = [v for v in vals if v is not None]
            if not got:
                return f"{value('time', e['bench'][key])} (– in all)"
            none = f", – in {len(vals) - len(got)}" if len(got) < len(vals) else ""
            return f"{value('time', e['bench'][key])} ({min(got):.1f}–{max(got):.1f}{none})"

        for name, e in result["scenarios"].items():
            b = e["bench"]
            lines.append(f"| {name} | {cell('t_cut_s', e)} | {cell('t_quarantine_s', e)} | {b['ttft_p99']:.3f} | "
                         f"{b['failed']} of {b['requests']} | {b['false_cuts']} + {b['false_quarantines']} |")
        print(f"{head} (the benchmark only; in brackets: over {result['draws']} phase draws)\n\n" + "\n".join(lines),
              file=out)
        return 0
    md = markdown(result["table"], result["draws"])
    verdicts = [r["verdict"] for r in result["table"]]
    print(f"{head}\n\n{md}\n\n{verdicts.count('PASS')} PASS, {verdicts.count('SPREAD')} SPREAD, "
          f"{verdicts.count('DIFF')} DIFF of {len(verdicts)} rows", file=out)
    diffs = verdicts.count("DIFF")
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "crosscheck.md").write_text(head + "\n\n" + md + "\n")
        (report_dir / "crosscheck.json").write_text(json.dumps(result, indent=1, default=_json) + "\n")
        print(f"report: {report_dir / 'crosscheck.md'}, {report_dir / 'crosscheck.json'}", file=out)
    return diffs


def _json(x: object) -> object:
    return None if isinstance(x, float) and math.isnan(x) else str(x)
