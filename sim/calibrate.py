"""Calibrate the latency model against published vLLM measurements (8B-class models, H100 and A100).

Each published point names a workload; `simulate` runs the pure `EngineModel` on it in virtual time (no
jitter) and reads the same statistic, so model and measurement are compared like for like. `fit` finds, per
GPU, the `ModelParams` step costs that minimise the squared log-errors of the points marked `fit: true`.
The shipped defaults in sim/model.py are not touched: the fitted sets are in `CALIBRATED` for later use.

    python -m grayguard.sim.calibrate                      # table: published vs default vs fitted, and the fits
    python -m grayguard.sim.calibrate --markdown --svg docs/calibration.svg
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from grayguard.sim.model import EngineModel, Finished, ModelParams, RequestStats

DATA = Path(__file__).with_name("calibration") / "vllm_published.yaml"
FIT_ACCEPT = 0.20  # the acceptance bound on |model / published - 1| for fitted points
EXACT = replace(ModelParams(), jitter=0.0)  # calibration runs are deterministic

# Fitted step costs (seconds), rounded; `python -m grayguard.sim.calibrate` refits them from DATA and the tests check
# that the refit agrees. Only the three step costs differ from the shipped defaults.
CALIBRATED: dict[str, ModelParams] = {
    "h100": replace(ModelParams(), decode_s_base=6.57e-3, decode_s_per_seq=0.186e-3, prefill_s_per_token=25.0e-6),
    "a100": replace(ModelParams(), decode_s_base=10.9e-3, decode_s_per_seq=0.369e-3, prefill_s_per_token=41.6e-6),
}


@dataclass(frozen=True)
class Point:
    """One published measurement and the workload that reproduces it."""

    id: str
    gpu: str
    metric: str  # itl | tpot | ttft | e2e | throughput_ratio
    workload: dict
    published: float  # ms, or unitless for throughput_ratio
    fit: bool
    source: dict
    reason: str = ""  # why a point is kept out of the fit
    variant: str = ""
    ref: dict = field(default_factory=dict)  # the `sources` entry the point cites

    @property
    def unit(self) -> str:
        return "" if self.metric == "throughput_ratio" else "ms"


def load(path: Path = DATA) -> list[Point]:
    """The data file's points, each with its cited source entry attached."""
    doc = yaml.safe_load(path.read_text())
    sources = doc.get("sources", {})
    out = []
    for p in doc["points"]:
        ref = sources.get(p["source"].get("ref", ""), {})
        out.append(Point(p["id"], p["gpu"], p["metric"], p["workload"], float(p["published"]), bool(p["fit"]),
                         p["source"], p.get("reason", ""), p.get("variant", ""), ref))
    return out


# -- running the engine in virtual time ---------------------------------------------------------
def closed_loop(params: ModelParams, concurrency: int, prompt: int, output: int, total: int,
                speed: float = 1.0) -> tuple[list[RequestStats], float]:
    """`concurrency` clients, each sending its next request when the last one finishes; (stats, end time)."""
    eng = EngineModel(params, speed=speed)
    sent = 0
    for _ in range(min(concurrency, total)):
        eng.submit(f"r{sent}", prompt, output, 0.0)
        sent += 1
    stats: list[RequestStats] = []
    now = 0.0
    events = eng.advance(now)
    while True:
        for e in events:
            if isinstance(e, Finished):
                stats.append(e.stats)
                if sent < total:
                    eng.submit(f"r{sent}", prompt, output, e.time)
                    sent += 1
        t = eng.next_event_time()
        if t == math.inf:
            return stats, now
        now = max(now, t)
        events = eng.advance(now)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _tpot(stats: Sequence[RequestStats]) -> float:
    return _mean([s.tpot for s in stats if s.tpot is not None])


def simulate(point: Point, params: ModelParams, speed: float = 1.0) -> float:
    """The model's value of the point's statistic (ms, or a ratio), without jitter."""
    params = replace(params, jitter=0.0)
    w = point.workload
    kind = w["kind"]
    if kind == "throughput_ratio":
        a, b = w["concurrency"]
        rates = []
        for c in (a, b):
            stats, end = closed_loop(params, c, w["prompt"], w["output"], c * w.get("requests_per_client", 5), speed)
            rates.append(sum(s.generation_tokens for s in stats) / end)
        return rates[0] / rates[1]
    if kind == "decode_at_batch":  # exact: the step time is linear in the batch
        lo = max(1, math.floor(w["batch"]))
        vals = [_tpot(closed_loop(params, n, 16, 64, n, speed)[0]) for n in (lo, lo + 1)]
        return 1e3 * (vals[0] + (vals[1] - vals[0]) * (w["batch"] - lo))
    if kind == "single":
        stats, _ = closed_loop(params, 1, w["prompt"], w["output"], 1, speed)
    elif kind == "batch":
        stats, _ = closed_loop(params, w["n"], w["prompt"], w["output"], w["n"], speed)
    elif kind == "closed_loop":
        c = w["concurrency"]
        stats, _ = closed_loop(params, c, w["prompt"], w["output"], c * w.get("requests_per_client", 5), speed)
    else:
        raise ValueError(f"{point.id}: unknown workload kind {kind!r}")
    metric = point.metric
    if metric in ("itl", "tpot"):
        return 1e3 * _tpot(stats)
    if metric == "ttft":
        return 1e3 * _mean([s.ttft for s in stats])
    if metric == "e2e":
        return 1e3 * (max(s.last_token for s in stats) - min(s.arrival for s in stats))
    raise ValueError(f"{point.id}: metric {metric!r} does not fit workload {kind!r}")


# -- fitting ------------------------------------------------------------------------------------
def _towards(centre: list[float], worst: list[float], k: float) -> list[float]:
    return [c + k * (w - c) for c, w in zip(centre, worst, strict=True)]


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.3,
                iters: int = 400, tol: float = 1e-10) -> list[float]:
    """Minimise f from x0 (plain Nelder-Mead; a few parameters, no dependency)."""
    pts = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]
        refl = _towards(centre, pts[-1], -1.0)
        fr = f(refl)
        if fr < vals[0]:
            exp = _towards(centre, pts[-1], -2.0)
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = _towards(centre, pts[-1], 0.5)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best
                pts = [pts[0]] + [[b + 0.5 * (v - b) for b, v in zip(pts[0], p, strict=True)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(len(pts)), key=vals.__getitem__)]


def loss(points: Sequence[Point], params: ModelParams) -> float:
    """Sum of squared log-errors over the fitted points (relative: a 10 % miss counts alike everywhere)."""
    return sum(math.log(simulate(p, params) / p.published) ** 2 for p in points if p.fit)


def fit_h100(points: Sequence[Point], start: ModelParams = EXACT) -> ModelParams:
    """Decode base, decode per sequence and prefill per token, from the h100 points."""
    pts = [p for p in points if p.gpu == "h100"]

    def build(x: list[float]) -> ModelParams:
        return replace(start, decode_s_base=math.exp(x[0]), decode_s_per_seq=math.exp(x[1]),
                       prefill_s_per_token=math.exp(x[2]))

    x = nelder_mead(lambda x: loss(pts, build(x)), [math.log(start.decode_s_base),
                                                    math.log(start.decode_s_per_seq),
                                                    math.log(start.prefill_s_per_token)])
    return build(x)


def fit_a100(points: Sequence[Point], h100: ModelParams, start: ModelParams = EXACT) -> ModelParams:
    """Decode base and per sequence from the a100 points; prefill (no published a100 point constrains it) is
    h100's scaled by the a100/h100 decode-base ratio, as the sim's speed classes scale every phase alike."""
    pts = [p for p in points if p.gpu == "a100"]

    def build(x: list[float]) -> ModelParams:
        base = math.exp(x[0])
        return replace(start, decode_s_base=base, decode_s_per_seq=math.exp(x[1]),
                       prefill_s_per_token=h100.prefill_s_per_token * base / h100.decode_s_base)

    x = nelder_mead(lambda x: loss(pts, build(x)), [math.log(1.6 * h100.decode_s_base),
                                                    math.log(1.6 * h100.decode_s_per_seq)])
    return build(x)


def fit_all(points: Sequence[Point]) -> dict[str, ModelParams]:
    h100 = fit_h100(points)
    return {"h100": h100, "a100": fit_a100(points, h100)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.sim.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (as in docs/simulator.md)")
    ap.add_argument("--svg", type=Path, help="write the model-vs-published plot here")
    ap.add_argument("--no-fit", action="store_true", help="use the CALIBRATED constants instead of refitting")
    args = ap.parse_args(argv)
    from grayguard.sim.calibrate_report import Row, params_table, rows, svg, table  # the report imports this module

    points = load(args.data)
    fitted = CALIBRATED if args.no_fit else fit_all(points)
    rs = rows(points, fitted)
    print(table(rs, markdown=args.markdown))
    print()
    print(params_table(fitted))
    bad = [r.point.id for r in rs if r.point.fit and abs(Row.err(r.fitted, r.point.published)) > FIT_ACCEPT]
    print(f"\nfitted points within {FIT_ACCEPT:.0%}: {sum(r.point.fit for r in rs) - len(bad)}"
          f"/{sum(r.point.fit for r in rs)}" + (f"; outside: {', '.join(bad)}" if bad else ""))
    if args.svg:
        args.svg.write_text(svg(points, fitted))
        print(f"wrote {args.svg}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
