"""The real fleet's floor: what the best threshold detector, tuned in hindsight, could do on the recorded evidence.

    python -m grayguard.bench.realfloor [--json] [RUN_DIR ...]

The real-vLLM targets ask for two things at once on 4 CPU vLLM servers sharing 2 cores: the throttled node cut
within 5 s of the fault, and no healthy node cut for more than one tick. This measures whether the evidence the
controller reads allows both, whatever the detector.

For each committed run (tests/fixtures/vllm/runs, the default), every tick: each node's live ITL and probe TTFT
median at the node's own load (the controller's own model, `controller/loadmodel.py`, at the run's
`live_batch_slope` prior) as a ratio to the median of the other nodes with a value that tick (leave-one-out), among the
nodes HAProxy has in rotation as recorded (a drained node cannot be cut, and its held values are no evidence). Four
families of detectors fire on a tick when a ratio has been at or above r on each of the last d ticks with data:

- itl: the live ITL ratio; probe: the probe ratio;
- both: the smaller of the two (both witnesses agree); either: the larger (either witness is enough).

For each family and d, r is chosen in hindsight on the runs themselves: the smallest r at which no benign node (any
node but the faulty one; the faulty one before its fault) in rotation fires on two ticks in a row, the benign target.
The faulty node's first firing at or after the fault's start, in rotation or not (the recorded controller's own drain
does not hide its evidence), is the cut that detector gets. Tuned on the data it is judged on,
per run and over all runs at once (one r, as a shipped default must be), it bounds that family from the optimistic
side: a detector of the family that meets the benign target cannot cut sooner. A cut of None: no r that keeps
the benign target lets this family cut the faulty node at all. Printed, never asserted: a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grayguard.bench.realreplay import RUNS, fault_window
from grayguard.config import ConfigError, load_config
from grayguard.controller import loadmodel
from grayguard.controller.recorder import read

FAMILIES = ("itl", "probe", "both", "either")
DURATIONS = (1, 2, 3, 5)
CUT_S = 5.0  # the real-vLLM issue's cut target
ONSET_RATIOS = (1.5, 3.0)  # the shipped live_cut_ratio, and twice it


@dataclass(frozen=True)
class Tick:
    t: float  # Unix time of the tick
    ratios: Mapping[str, tuple[float | None, float | None]]  # node -> (live ITL ratio, probe ratio); None: no value
    rotating: frozenset[str] = frozenset()  # the nodes HAProxy had in rotation (UP, not drained)


@dataclass(frozen=True)
class Run:
    name: str
    ticks: Sequence[Tick]
    faulty: str | None
    start: float | None  # the fault's start, on the ticks' clock


def _by_instance(samples: Iterable) -> dict[str, float]:
    out = {}
    for s in samples:
        inst = s.labels.get("instance")
        if inst is not None and math.isfinite(s.value) and s.value > 0:
            out[inst] = s.value
    return out


def leave_one_out(vals: Mapping[str, float], peers: Collection[str] | None = None) -> dict[str, float]:
    """Each node's value over the median of the others' among `peers` (default: all), where there are at least
    two of them."""
    out = {}
    for n, v in vals.items():
        others = [x for m, x in vals.items() if m != n and (peers is None or m in peers)]
        if len(others) >= 2:
            out[n] = v / statistics.median(others)
    return out


def in_rotation(sv) -> bool:
    """A server HAProxy sends traffic to: UP, not drained, weight above 0. A drained or DOWN node cannot be cut (its
    exporter's live values are its last window's, held), and is no peer of the others either, as in the controller."""
    return sv.status in (None, "UP") and not sv.drain and not sv.maint and sv.weight > 0


def tick_ratios(obs, slope: float) -> tuple[dict[str, tuple[float | None, float | None]], frozenset[str]]:
    """(node -> (live ITL ratio, probe TTFT median ratio), the nodes HAProxy had in rotation) of one recorded tick,
    at each node's load (controller/loadmodel.py); every node with a value is compared with the peers in rotation."""
    names, rotating = {}, set()
    for po in obs.pools.values():
        for name, sv in po.servers.items():
            names[sv.address] = name
            if in_rotation(sv):
                rotating.add(name)
    batch = _by_instance(obs.optional.get("live_decode_batch", ()))
    prefill = _by_instance(obs.optional.get("live_prefill_rate", ()))
    load = {n: loadmodel.load_of(batch.get(a), prefill.get(a)) for a, n in names.items()}
    vals = [{names[a]: v for a, v in _by_instance(obs.optional.get(sig, ())).items() if a in names}
            for sig in ("live_itl", "probe_ttft_median")]
    g = loadmodel.at_load(vals[0], set(vals[1]), load, slope)
    out: dict[str, list[float | None]] = {n: [None, None] for n in names.values()}
    for i, v in enumerate(vals):
        # a node at capacity by its load (g infinite) is unjudged and no peer, as in the controller
        for n, r in leave_one_out({n: x / g[n] for n, x in v.items() if g[n] < math.inf}, rotating).items():
            out[n][i] = r
    return {n: (a, b) for n, (a, b) in out.items()}, frozenset(rotating)


def load_run(run: Path) -> Run:
    report = json.loads((run / "report.json").read_text())
    cfg = load_config(str(run / "grayguard.yaml"), series=False)  # a recorded run: its inputs, no query
    slope = cfg.thresholds.live_batch_slope
    obs = list(read(run / "recording.jsonl.gz"))
    faulty, start, _ = fault_window(report, obs[0].now if obs else 0.0)
    return Run(run.name, [Tick(o.now, *tick_ratios(o, slope)) for o in obs], faulty, start)


def value(pair: tuple[float | None, float | None], family: str) -> float | None:
    itl, probe = pair
    if family == "itl":
        return itl
    if family == "probe":
        return probe
    if family == "both":
        return min(itl, probe) if itl is not None and probe is not None else None
    vals = [v for v in pair if v is not None]
    return max(vals) if vals else None  # either


def trailing_min(run: Run, family: str, d: int) -> dict[str, list[tuple[int, float, float, bool]]]:
    """node -> [(tick index, t, the smallest of its last d values, in rotation then)], over the ticks where the last d
    ticks all had a value (a tick without one breaks the run: the detector has nothing to fire on)."""
    out: dict[str, list[tuple[int, float, float, bool]]] = {}
    last: dict[str, list[float]] = {}
    for i, tk in enumerate(run.ticks):
        for n, pair in tk.ratios.items():
            v = value(pair, family)
            if v is None:
                last[n] = []
                continue
            seq = last.setdefault(n, [])
            seq.append(v)
            del seq[:-d]
            if len(seq) == d:
                out.setdefault(n, []).append((i, tk.t, min(seq), n in tk.rotating))
    return out


def benign_floor(run: Run, family: str, d: int) -> float:
    """The smallest r at which no benign node fires on two ticks in a row: just above the largest value a benign
    node held on two consecutive ticks (the smaller of the pair: both must fire)."""
    worst = 0.0
    for n, seq in trailing_min(run, family, d).items():
        ok = [(i, v) for i, t, v, rot in seq if rot and (n != run.faulty or run.start is None or t < run.start)]
        for (i0, a), (i1, b) in zip(ok, ok[1:], strict=False):
            if i1 == i0 + 1:  # two ticks in a row (a tick without a value between them breaks the pair)
                worst = max(worst, min(a, b))
    return math.nextafter(worst, math.inf)


def cut_after(run: Run, family: str, d: int, r: float) -> float | None:
    """Seconds from the fault's start to the faulty node's first firing at r; None: it never fires."""
    if run.faulty is None or run.start is None:
        return None
    for _, t, v, _ in trailing_min(run, family, d).get(run.faulty, ()):
        if t >= run.start and v >= r:
            return round(t - run.start, 1)
    return None


def onset(run: Run, family: str, r: float) -> float | None:
    """Seconds from the fault's start to the first tick the faulty node's value is at least r at all (d = 1, no
    benign constraint): how long the fault takes to show in the signal, whatever the detector."""
    return cut_after(run, family, 1, r)


def measure(runs: Sequence[Run]) -> dict:
    """Per family and d: the hindsight r over all runs at once and each run's cut at it, and each run's own r and
    cut."""
    out: dict = {}
    for family in FAMILIES:
        for d in DURATIONS:
            own = {r.name: benign_floor(r, family, d) for r in runs}
            pooled = max(own.values()) if own else math.inf
            out[f"{family}/{d}"] = {
                "pooled_r": round(pooled, 2),
                "pooled_cut_s": {r.name: cut_after(r, family, d, pooled) for r in runs},
                "own_r": {n: round(v, 2) for n, v in own.items()},
                "own_cut_s": {r.name: cut_after(r, family, d, own[r.name]) for r in runs}}
    return out


def best(m: dict, runs: Sequence[Run], key: str) -> dict[str, tuple[str, float | None]]:
    """For each run: the family/d whose cut (key: pooled_cut_s or own_cut_s) is earliest, and that cut."""
    out = {}
    for r in runs:
        if r.faulty is None:
            continue
        cands = [(v[key][r.name], fd) for fd, v in m.items() if v[key][r.name] is not None]
        out[r.name] = (min(cands)[1], min(cands)[0]) if cands else ("none", None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grayguard.bench.realfloor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help=f"run directories (default: every one under {RUNS})")
    p.add_argument("--json", action="store_true", help="the measurement as one JSON object")
    args = p.parse_args(argv)
    dirs = args.runs or sorted(d for d in (RUNS.iterdir() if RUNS.is_dir() else ())
                               if (d / "recording.jsonl.gz").exists())
    if not dirs:
        print(f"no runs under {RUNS}", file=sys.stderr)
        return 2
    try:
        runs = [load_run(d) for d in dirs]
    except (OSError, ConfigError, ValueError, KeyError) as e:
        print(f"{e}", file=sys.stderr)
        return 2
    m = measure(runs)
    if args.json:
        print(json.dumps({"measure": m, "onset": {f"{fam}/{r0:g}": {r.name: onset(r, fam, r0) for r in runs}
                                                  for fam in ("itl", "probe") for r0 in ONSET_RATIOS},
                          "best_pooled": best(m, runs, "pooled_cut_s"),
                          "best_own": best(m, runs, "own_cut_s")}))
        return 0
    names = [r.name for r in runs]
    print("cut of the faulty node (s after the fault) by the best detector of each family that keeps every benign node")
    print("to at most one tick cut; r chosen in hindsight over all runs at once (pooled) and per run (own)")
    print(f"{'family/d':10s} {'pooled r':>8s}  " + "  ".join(f"{n[:22]:>22s}" for n in names))
    for fd, v in m.items():
        cells = []
        for n in names:
            pc, oc = v["pooled_cut_s"][n], v["own_cut_s"][n]
            cells.append(f"{'-' if pc is None else pc:>5} | {'-' if oc is None else oc:>5} @{v['own_r'][n]:<6}")
        print(f"{fd:10s} {v['pooled_r']:8.2f}  " + "  ".join(f"{c:>22s}" for c in cells))
    print("cells: pooled cut | own cut @ own r ('-': never cut at that r)")
    for family in ("itl", "probe"):
        for r0 in ONSET_RATIOS:
            cells = "  ".join(f"{'-' if (c := onset(r, family, r0)) is None else c:>22}" for r in runs)
            print(f"{'onset ' + family + ' ' + format(r0, 'g') + 'x':19s}  {cells}")
    print("onset rows: the first tick at or after the fault at which the faulty node's ratio reaches that at all")
    for label, key in (("pooled r", "pooled_cut_s"), ("own r", "own_cut_s")):
        for n, (fd, c) in best(m, runs, key).items():
            met = c is not None and c <= CUT_S
            print(f"best at the {label}: {n}: {fd} cuts at {c} s ({'within' if met else 'beyond'} {CUT_S:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
