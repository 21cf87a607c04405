"""`python -m grayguard.sim.traces --plot OUT.svg TRACE`: a trace next to the synthetic load at the same mean rate
(one SVG).

Three charts stacked: arrivals per second over time (bins of --bin seconds), and the distributions (CDF) of
prompt and output tokens; the synthetic series is sim.loadgen's default Poisson load, lognormal lengths.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grayguard.sim.loadgen import LoadConfig, arrival_plan
from grayguard.sim.traces import TraceError, TraceLoad, parse_window, plan_trace, summarize
from grayguard.svgplot import line_chart

WIDTH, HEIGHT = 900, 260


def _cdf(values: list[int], points: int = 120) -> list[tuple[float, float | None]]:
    xs = sorted(values)
    n = len(xs)
    return [(float(xs[min(n - 1, int(i * (n - 1) / points))]), i / points) for i in range(points + 1)] if n else []


def _stack(charts: list[str]) -> str:
    """One SVG document holding the charts one under another."""
    inner = []
    for i, c in enumerate(charts):
        inner.append(re.sub(r"^<svg ", f'<svg x="0" y="{i * HEIGHT}" ', c, count=1))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT * len(charts)}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT * len(charts)}">\n' + "\n".join(inner) + "\n</svg>\n")


def render(trace: str, window: str = "0:", rate: float | None = None, bin_s: float = 10.0,
           fmt: str | None = None) -> str:
    """The SVG: the trace's window (at its own pace, or compressed to `rate`) against Poisson at its mean rate."""
    start, dur = parse_window(window)
    plan = plan_trace(TraceLoad(trace, fmt, start, dur, rate=rate))
    run_s = plan.meta["run_s"]
    synth = list(arrival_plan(LoadConfig(url="http://x", rate=plan.meta["mean_rate"], duration_s=run_s, seed=1)))
    s = summarize(plan, bin_s)
    bins = [0] * len(s["rate"])
    for t, _, _ in synth:
        if int(t // bin_s) < len(bins):
            bins[int(t // bin_s)] += 1
    name = Path(trace).name
    trace_key, synth_key = "trace", "synthetic"  # the legend is narrow: the title names the file
    arrivals = {trace_key: [(i * bin_s, v) for i, v in enumerate(s["rate"])],
                synth_key: [(i * bin_s, b / bin_s) for i, b in enumerate(bins)]}
    w = plan.meta["window_s"]
    charts = [
        line_chart(arrivals, title=f"Arrivals per second ({bin_s:g} s bins): {name}, {w[0]:.0f}-{w[1]:.0f} s "
                   f"x{plan.meta['speedup']:g}", ylabel="requests/s", width=WIDTH,
                   height=HEIGHT),
        line_chart({trace_key: _cdf(list(plan.prompt)), synth_key: _cdf([p for _, p, _ in synth])},
                   title="Prompt tokens: share of requests at or below (synthetic: lognormal, median 200)",
                   ylabel="share", xlabel="prompt tokens",
                   width=WIDTH, height=HEIGHT),
        line_chart({trace_key: _cdf(list(plan.output)), synth_key: _cdf([c for _, _, c in synth])},
                   title="Output tokens: share of requests at or below (synthetic: lognormal, median 100)",
                   ylabel="share", xlabel="output tokens",
                   width=WIDTH, height=HEIGHT),
    ]
    return _stack(charts)


def main(argv: list[str] | None = None) -> int:
    """Write the plot; exit 2 with the reason on a bad trace or option."""
    p = argparse.ArgumentParser(prog="python -m grayguard.sim.traces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="trace file (Azure CSV, Mooncake JSON lines, BurstGPT CSV)")
    p.add_argument("--plot", required=True, metavar="OUT.svg", help="where the SVG goes")
    p.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt"], default=None,
                   help="override the format detected from the header")
    p.add_argument("--window", default="0:", help="START:DURATION in trace seconds (default: all of it)")
    p.add_argument("--rate", type=float, default=None, help="compress the window to this mean req/s")
    p.add_argument("--bin", type=float, default=10.0, help="seconds per arrival-rate bin (default 10)")
    args = p.parse_args(argv)
    try:
        svg = render(args.trace, args.window, args.rate, args.bin, args.trace_format)
    except TraceError as e:
        print(f"grayguard.sim.traces: {e}", file=sys.stderr)
        return 2
    Path(args.plot).write_text(svg)
    print(f"wrote {args.plot}")
    return 0
