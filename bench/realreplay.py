"""Real-fleet evidence, decided again: demo runs on real vLLM, replayed through today's decision code.

    python -m grayguard.bench.realreplay [--config FILE] [RUN_DIR ...]
    python -m grayguard.bench.realreplay --save REPORT_DIR --name NAME   # keep a demo run as a committed run

A run directory is what `grayguard demo --fleet vllm --report-dir DIR` writes: recording.jsonl.gz (every tick the
controller saw, controller/recorder.py), grayguard.yaml (the config it ran with) and report.json (the fault, its node
and times). The committed runs are tests/fixtures/vllm/runs/*/ (the default). Each run is replayed with its own
config, or with --config (what another config would have done on the same real evidence), and judged by the
real-vLLM targets: the faulty node cut <= 5 s and quarantined <= 10 s after the fault; no other node quarantined
and no cut of another node longer than one tick. Printed, never asserted: a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grayguard.config import ConfigError, load_config
from grayguard.controller.recorder import read
from grayguard.controller.replay import recording_decisions
from grayguard.vocab import DrainCause, State

RUNS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm" / "runs"
CUT_S, QUARANTINE_S = 5.0, 10.0  # the real-vLLM issue's targets


def fault_window(report: dict, first_tick: float) -> tuple[str | None, float | None, float | None]:
    """(faulty node, fault start, fault end) on the recording's clock (Unix time), from the demo's report.

    t0_unix is the events' t = 0; a report written before it existed is aligned by the controller's start event
    (its first tick follows it)."""
    node = report.get("faulty_node") if report.get("fault", "none") != "none" else None
    t0 = report.get("t0_unix")
    if t0 is None:
        started = next((e["t"] for e in report.get("events", ()) if e.get("kind") == "controller"), None)
        if started is None:
            return node, None, None
        t0 = first_tick - started
    start, end = report.get("fault_start_s"), report.get("fault_end_s")
    return node, None if start is None else t0 + start, None if end is None else t0 + end


def judge(decisions: list[dict], node: str | None, start: float | None) -> dict:
    """The targets' figures for one replayed run."""
    by_node: dict[str, list[dict]] = {}
    for d in decisions:
        by_node.setdefault(d["node"], []).append(d)
    out: dict = {"ticks": len({d["t"] for d in decisions}), "false_quarantines": {}, "false_quarantines_gateway": {},
                 "false_cuts": {},
                 "false_cuts_over_one_tick": 0, "differs_from_live": sum(
                     1 for d in decisions if d["live"] is not None and d["live"] != d["state"])}
    for n, ds in sorted(by_node.items()):
        faulty = n == node
        prev, run = State.HEALTHY, 0
        for d in ds:
            before_fault = start is None or d["t"] < start
            if faulty and not before_fault:
                if d["state"] in (State.DEGRADED, State.QUARANTINED) and "cut_s" not in out:
                    out["cut_s"] = round(d["t"] - start, 1)
                if d["state"] == State.QUARANTINED and "quarantine_s" not in out:
                    out["quarantine_s"] = round(d["t"] - start, 1)
            elif not faulty or before_fault:
                if d["state"] == State.QUARANTINED and prev != State.QUARANTINED:
                    out["false_quarantines"][n] = out["false_quarantines"].get(n, 0) + 1
                    if d.get("cause") == DrainCause.GATEWAY:  # HAProxy's own reflex (the agent, the error limit)
                        gw = out["false_quarantines_gateway"]
                        gw[n] = gw.get(n, 0) + 1
                if d["cut"]:  # degraded, or cut in slow start (a warm-up's cut is one: its weight falls alike)
                    run += 1
                    if run == 1:
                        out["false_cuts"][n] = out["false_cuts"].get(n, 0) + 1
                    if run == 2:
                        out["false_cuts_over_one_tick"] += 1
                else:
                    run = 0
            prev = d["state"]
    out.setdefault("cut_s", None)
    out.setdefault("quarantine_s", None)
    return out


def verdict(j: dict, faulty: bool) -> str:
    missed = []
    if faulty and (j["cut_s"] is None or j["cut_s"] > CUT_S):
        missed.append(f"cut <= {CUT_S:g} s")
    if faulty and (j["quarantine_s"] is None or j["quarantine_s"] > QUARANTINE_S):
        missed.append(f"quarantine <= {QUARANTINE_S:g} s")
    if j["false_quarantines"]:
        missed.append("no false quarantine")
    if j["false_cuts_over_one_tick"]:
        missed.append("no false cut over one tick")
    return "met" if not missed else "MISSED: " + ", ".join(missed)


def replay_run(run: Path, config: str | None) -> dict:
    report = json.loads((run / "report.json").read_text())
    cfg = load_config(config or str(run / "grayguard.yaml"), series=False)  # the run's recorded inputs, no query
    ticks = list(read(run / "recording.jsonl.gz"))
    node, start, _ = fault_window(report, ticks[0].now if ticks else 0.0)
    decisions = list(recording_decisions(ticks, cfg))
    j = judge(decisions, node, start)
    j.update(run=run.name, fault=report.get("fault"), node=node, rate=report.get("rate"),
             engine=report.get("engine"), version=report.get("version"), verdict=verdict(j, node is not None))
    return j


def save_run(src: Path, name: str, dest_root: Path = RUNS) -> Path:
    """Copy a demo report directory's recording and config into dest_root/name, and its report.json without the
    per-second samples (the figures, events and phases stay)."""
    import shutil
    dest = dest_root / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("recording.jsonl.gz", "grayguard.yaml"):
        shutil.copyfile(src / f, dest / f)
    report = json.loads((src / "report.json").read_text())
    report.pop("samples", None)
    (dest / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grayguard.bench.realreplay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help=f"run directories (default: every one under {RUNS})")
    p.add_argument("--config", help="replay with this config instead of each run's own grayguard.yaml")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    p.add_argument("--save", type=Path, metavar="REPORT_DIR", help="keep this demo report directory as a run")
    p.add_argument("--name", help="with --save: the run's name (a directory under the runs)")
    args = p.parse_args(argv)
    if args.save:
        if not args.name:
            p.error("--save needs --name")
        print(save_run(args.save, args.name))
        return 0
    runs = args.runs or sorted(d for d in (RUNS.iterdir() if RUNS.is_dir() else ())
                               if (d / "recording.jsonl.gz").exists())
    if not runs:
        print(f"no runs under {RUNS}", file=sys.stderr)
        return 2
    for run in runs:
        try:
            j = replay_run(run, args.config)
        except (OSError, ConfigError, ValueError) as e:
            print(f"{run}: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(j))
            continue
        fq = ", ".join(f"{n} x{c}" for n, c in j["false_quarantines"].items()) or "none"
        if j["false_quarantines_gateway"]:
            fq += " (of them by HAProxy's reflexes, recorded, which a replay cannot change: " + ", ".join(
                f"{n} x{c}" for n, c in j["false_quarantines_gateway"].items()) + ")"
        fc = ", ".join(f"{n} x{c}" for n, c in j["false_cuts"].items()) or "none"
        print(f"{j['run']}: {j['fault']} on {j['node']} at {j['rate']} req/s, {j['ticks']} ticks "
              f"({j['engine'] or 'engine?'} {j['version'] or ''})")
        print(f"  faulty node: cut {j['cut_s']} s, quarantined {j['quarantine_s']} s after the fault")
        print(f"  other nodes: quarantines {fq}; cuts {fc} ({j['false_cuts_over_one_tick']} over one tick)")
        print(f"  {j['verdict']}; differs from the live controller on {j['differs_from_live']} node-tick(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
