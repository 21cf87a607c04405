"""`python -m grayguard.localstack.soak`: the local stack under steady simulated traffic, no fault, for a long time.

The controller (`grayguard controller`, state file and all) and every node's exporter (the `grayguard
exporter` flags and code, a fake healthy GPU for NVML) run as child processes, so what is sampled is theirs
alone: VmRSS from /proc/<pid>/status and the entries of /proc/<pid>/fd, every --sample-s seconds. HAProxy's
`show servers state` is read at every sample too. With no fault every node is healthy, so any weight the
controller writes (its grayguard_haproxy_writes_total) and any server seen off its full weight is a weight
written to a healthy node.

Exit 0 when every process stayed flat and nothing was written; 1 otherwise; 2 when the stack cannot start.
The measured span starts once the controller runs and the warm-up (--warmup-minutes, default a quarter of
the run up to 3 minutes: imports, caches and allocator arenas settle) is over. Growth is the median RSS of
the last tenth of the measured samples minus that of the first tenth (at least 3 samples each), and for
file descriptors the smallest count of each (a leak raises the floor; a connection in flight does not).

example:
  python -m grayguard.localstack.soak --minutes 20 --out docs/soak.md
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from grayguard import terminate
from grayguard.config import duration_seconds

# ---- the analysis (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    max_rss_growth_mib: float = 4.0  # per process, over the measured span
    max_fd_growth: int = 2  # per process, floor of the last window minus floor of the first


@dataclass
class Series:
    """One process's samples: (seconds since the controller started, RSS in KiB, open fds)."""

    role: str
    points: list[tuple[float, int, int]] = field(default_factory=list)
    exited_at: float | None = None  # when it was first seen gone


@dataclass(frozen=True)
class ProcResult:
    role: str
    rss_start_mib: float
    rss_end_mib: float
    rss_max_mib: float
    rss_growth_mib: float
    rss_slope_mib_per_10min: float
    fds_start: int
    fds_end: int
    fds_max: int
    fd_growth: int
    problems: tuple[str, ...]


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def analyze_series(s: Series, warmup_s: float, th: Thresholds) -> ProcResult:
    """Start, end, max, growth and slope of one process's RSS and fds over the span after warmup_s."""
    problems = []
    if s.exited_at is not None:
        problems.append(f"exited at {s.exited_at:.0f} s")
    if not s.points:
        return ProcResult(s.role, math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0, 0, 0,
                          (*problems, "no samples"))
    measured = [p for p in s.points if p[0] >= warmup_s]
    if len(measured) < 2:
        measured = s.points
        problems.append("no sample after the warm-up: growth measured over the whole run")
    k = min(max(3, len(measured) // 10), max(1, len(measured) // 2))
    first, last = measured[:k], measured[-k:]
    mib = 1 / 1024
    rss_start = statistics.median(r for _, r, _ in first) * mib
    rss_end = statistics.median(r for _, r, _ in last) * mib
    fds_start, fds_end = min(f for _, _, f in first), min(f for _, _, f in last)
    slope = _slope([t for t, _, _ in measured], [r * mib for _, r, _ in measured]) * 600
    growth, fd_growth = rss_end - rss_start, fds_end - fds_start
    if growth > th.max_rss_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB (limit {th.max_rss_growth_mib:g})")
    if fd_growth > th.max_fd_growth:
        problems.append(f"open fds grew by {fd_growth} (limit {th.max_fd_growth})")
    return ProcResult(s.role, rss_start, rss_end, max(r for _, r, _ in s.points) * mib, growth, slope,
                      fds_start, fds_end, max(f for _, _, f in s.points), fd_growth, tuple(problems))


@dataclass
class SoakReport:
    processes: list[ProcResult]
    writes: float  # the controller's weight and state writes during the run
    off_weight: list[tuple[float, str, int, bool]]  # (t, node, weight, drained) seen off full weight
    transitions: dict[str, float]  # "node: from -> to" -> count
    ticks: dict[str, float]  # result -> count
    requests: dict[str, int]  # status -> count
    meta: dict

    @property
    def problems(self) -> list[str]:
        out = [f"{p.role}: {x}" for p in self.processes for x in p.problems]
        if self.writes:
            out.append(f"the controller wrote {self.writes:g} weight/state change(s) to healthy nodes")
        if self.off_weight:
            nodes = sorted({n for _, n, _, _ in self.off_weight})
            out.append(f"HAProxy showed healthy node(s) off full weight: {', '.join(nodes)}")
        return out


def render_markdown(r: SoakReport) -> str:
    """The report: how it ran, a table per process, the writes, the verdict."""
    m = r.meta
    lines = [f"# Soak ({m['date']})", "",
             f"`{m['command']}` on {m['host']}, commit {m['commit']}: {m['nodes']} simulated vLLM nodes, "
             f"{m['rate']:g} req/s through HAProxy, no fault, {m['minutes']:g} min with the controller running "
             f"({m.get('timing', 'demo timing: 1 s ticks and scrapes, 10 s rate windows, 0.5 s probes')}); "
             f"sampled every {m['sample_s']:g} s; "
             f"the first {_duration(m['warmup_s'])} are warm-up, left out of growth and slope.", "",
             "| process | RSS start (MiB) | RSS end (MiB) | RSS max (MiB) | growth (MiB) | slope (MiB/10 min) "
             "| fds start | fds end | fds max | |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in r.processes:
        lines.append(f"| {p.role} | {p.rss_start_mib:.1f} | {p.rss_end_mib:.1f} | {p.rss_max_mib:.1f} | "
                     f"{p.rss_growth_mib:+.1f} | {p.rss_slope_mib_per_10min:+.2f} | {p.fds_start} | {p.fds_end} | "
                     f"{p.fds_max} | {'; '.join(p.problems) or 'flat'} |")
    lines += ["", "Processes: " + "; ".join(f"{role} = `{cmd}`" for role, cmd in m["processes"].items()) + "."]
    th = m["thresholds"]
    off = sorted({n for _, n, _, _ in r.off_weight})
    lines += ["",
              f"- Weights written to healthy nodes: **{r.writes:g}** (the controller's "
              f"`grayguard_haproxy_writes_total`); servers seen off full weight in HAProxy: "
              f"{', '.join(off) if off else 'none'}.",
              "- Node transitions: " + (", ".join(f"{k} ({v:g})" for k, v in sorted(r.transitions.items()))
                                        or "none") + ".",
              "- Ticks: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r.ticks.items())) + ".",
              "- Requests: " + ", ".join(f"{k} {v}" for k, v in sorted(r.requests.items())) + ".",
              f"- Limits: RSS growth at most {th.max_rss_growth_mib:g} MiB per process (median of the last "
              f"tenth of the measured samples minus that of the first), open fds at most +{th.max_fd_growth} "
              "(smallest count of each), no weight written.", "",
              "**" + ("PASS" if not r.problems else "FAIL") + "**" +
              (": " + "; ".join(r.problems) if r.problems else ": memory and open fds flat, nothing written.")]
    return "\n".join(lines) + "\n"


# ---- the run (I/O) ---------------------------------------------------------------------------------


def read_proc(pid: int) -> tuple[int, int] | None:
    """(VmRSS in KiB, open fds) of a live process, None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    rss = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), None)
    return None if rss is None else (rss, fds)  # a zombie has no VmRSS


def _commit() -> str:
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + (" (with uncommitted changes)" if dirty else "")


def _counter_by(stack, name: str, *labels: str) -> dict[str, float]:
    """A controller counter summed by labels, as "a b" -> value (only what is above 0)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(stack.controller_url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.value:
                key = " ".join(s.labels.get(k, "") for k in labels)
                out[key] = out.get(key, 0) + s.value
    return out


def stack_spec(args: argparse.Namespace):
    """The stack the soak runs: the shipped production timing by default, or the demo's compressed one."""
    from grayguard.config import RecoveryConfig
    from grayguard.exporters.prober import ProbeConfig
    from grayguard.localstack.stack import StackSpec

    spec = StackSpec(nodes=args.nodes, seed=args.seed, controller=False, controller_process=True,
                     exporter_processes=True)
    if getattr(args, "timing", "production") == "demo":
        return spec
    r = RecoveryConfig()  # the shipped defaults, as grayguard.example.yaml has them (the thresholds: the stack's own)
    return replace(spec, tick_s=5.0, control_window="30s", scrape_interval="5s",
                   probe_interval_s=ProbeConfig().interval,
                   overrides={"recovery": {f: getattr(r, f) for f in ("min_quarantine_s", "canary_interval_s",
                                           "canary_successes", "canary_timeout_s", "slow_start_initial",
                                           "slow_start_step_per_min")},
                              "rules": {"control_interval": "5s"}, "stale_after_s": 60})


def run_soak(args: argparse.Namespace, out: TextIO | None = None) -> SoakReport:
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    from grayguard.localstack.stack import LocalStack
    from grayguard.sim.loadgen import LoadConfig, run_load

    def say(msg: str) -> None:
        print(f"[soak] {msg}", file=out, flush=True)

    th = Thresholds(args.max_rss_growth_mib, args.max_fd_growth)
    run_s = args.minutes * 60
    warmup_s = args.warmup_minutes * 60 if args.warmup_minutes is not None else min(180.0, run_s / 4)
    stack = LocalStack(stack_spec(args), progress=say)
    records: list = []
    series: dict[str, Series] = {}
    cmdlines: dict[str, str] = {}
    off: list[tuple[float, str, int, bool]] = []
    load = None
    writes0 = writes = 0.0
    ticks: dict[str, float] = {}
    transitions: dict[str, float] = {}
    try:
        stack.start()
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=args.rate, seed=args.seed,
                                                      duration_s=run_s + 60, timeout_s=60), sink=records))
        window_s = duration_seconds(stack.spec.control_window)
        say(f"warming the {window_s:g} s rate windows up before the controller starts")
        time.sleep(window_s + 2 * duration_seconds(stack.spec.scrape_interval))
        stack.start_controller()
        writes0 = stack.controller_metric("grayguard_haproxy_writes_total") or 0.0
        t0 = time.monotonic()
        say(f"running {args.minutes:g} min; sampling every {args.sample_s:g} s; progress every minute")
        roles = {role: pid for role, pid in stack.pids().items() if not role.startswith("haproxy")}
        series = {role: Series(role) for role in roles}
        cmdlines = {role: _cmdline(pid) for role, pid in roles.items()}
        next_progress = 60.0
        while (t := time.monotonic() - t0) < run_s:
            for role, pid in roles.items():
                got = read_proc(pid)
                if got is None:
                    series[role].exited_at = series[role].exited_at or t
                else:
                    series[role].points.append((t, *got))
            with contextlib.suppress(Exception):  # a sample must not end the soak: the next one retries
                off += [(t, n, w, d) for n, (w, d) in stack.haproxy_weights().items() if (w, d) != (100, False)]
                writes = (stack.controller_metric("grayguard_haproxy_writes_total") or 0.0) - writes0
            if t >= next_progress:
                say(_progress(t, series, writes, records))
                next_progress += 60
            time.sleep(max(0.0, args.sample_s - (time.monotonic() - t0 - t)))
        with contextlib.suppress(Exception):
            ticks = _counter_by(stack, "grayguard_ticks_total", "result")
            transitions = {k.replace(" ", ": ", 1).replace(" ", " -> ", 1): v for k, v in _counter_by(
                stack, "grayguard_node_transitions_total", "node", "from_state", "to_state").items()}
    finally:
        if load is not None:
            load.cancel()
            deadline = time.monotonic() + 10  # requests in flight end within their 6 s deadline
            while time.monotonic() < deadline and any(r.status == "pending" for r in records[:-1]):
                time.sleep(0.2)
        stack.stop()
    requests_by: dict[str, int] = {}
    for r in records:
        if r.status != "pending":  # the arrival the end of the run cancelled
            requests_by[r.status] = requests_by.get(r.status, 0) + 1
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": _command(args),
            "host": f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python "
                    f"{platform.python_version()}", "commit": _commit(), "nodes": args.nodes, "rate": args.rate,
            "minutes": args.minutes, "sample_s": args.sample_s, "warmup_s": warmup_s, "thresholds": th,
            "processes": cmdlines,
            "timing": f"{args.timing} timing: {stack.spec.tick_s:g} s ticks, {stack.spec.scrape_interval} scrapes, "
                      f"{stack.spec.control_window} rate windows, {stack.spec.probe_interval_s:g} s probes"}
    return SoakReport([analyze_series(s, warmup_s, th) for s in series.values()], writes, off, transitions,
                      ticks, requests_by, meta)


def _duration(s: float) -> str:
    return f"{s / 60:g} min" if s >= 60 else f"{s:g} s"


def _cmdline(pid: int) -> str:
    """The process's command line, shortened: what was measured, for the record."""
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return f"pid {pid}: " + " ".join(Path(a.decode()).name if i == 0 else a.decode()
                                         for i, a in enumerate(argv) if a)
    return f"pid {pid}"


def _progress(t: float, series: dict[str, Series], writes: float, records: list) -> str:
    def last(role_prefix: str) -> tuple[list[float], list[int]]:
        pts = [s.points[-1] for r, s in series.items() if r.startswith(role_prefix) and s.points]
        return [p[1] / 1024 for p in pts], [p[2] for p in pts]
    c_rss, c_fds = last("controller")
    e_rss, e_fds = last("exporter")
    ok = sum(r.status == "ok" for r in records)

    def span(xs: Sequence[float], fmt: str) -> str:
        return "-" if not xs else format(min(xs), fmt) + ("" if min(xs) == max(xs) else "-" + format(max(xs), fmt))
    return (f"{t / 60:5.1f} min  controller RSS {span(c_rss, '.1f')} MiB fds {span(c_fds, 'd')} | exporters RSS "
            f"{span(e_rss, '.1f')} MiB fds {span(e_fds, 'd')} | writes {writes:g} | requests {len(records)} "
            f"({ok} ok)")


def _command(args: argparse.Namespace) -> str:
    return (f"python -m grayguard.localstack.soak --minutes {args.minutes:g} --nodes {args.nodes} --rate {args.rate:g} "
            f"--sample-s {args.sample_s:g}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grayguard.localstack.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long the controller runs (default 20)")
    p.add_argument("--out", metavar="FILE", help="write the Markdown report here too (e.g. docs/soak.md)")
    p.add_argument("--nodes", type=int, default=5, help="simulated vLLM nodes, one exporter each (default 5)")
    p.add_argument("--rate", type=float, default=12.0, help="requests per second through HAProxy (default 12)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fleet and the load (default 1)")
    p.add_argument("--timing", choices=("production", "demo"), default="production",
                   help="production (default): the shipped timing of grayguard.example.yaml and "
                        "rules/prometheus.example.yml (5 s scrape and ticks, 30 s windows, default thresholds, "
                        "3 s probes); demo: the demo's compressed one (1 s, 10 s windows)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="left out of growth and slope (default: a quarter of the run, at most 3)")
    p.add_argument("--max-rss-growth-mib", type=float, default=Thresholds.max_rss_growth_mib,
                   help="fail when a process's RSS grows more than this (default %(default)s)")
    p.add_argument("--max-fd-growth", type=int, default=Thresholds.max_fd_growth,
                   help="fail when a process's open fds grow more than this (default %(default)s)")
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    args = build_parser().parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.nodes < 3 or args.rate <= 0:
        print("soak: --minutes, --sample-s and --rate must be positive, --nodes at least 3", file=sys.stderr)
        return 2
    try:
        report = run_soak(args, out)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (terminate.Terminated): the stack is down already (run_soak's
        print("soak: interrupted", file=sys.stderr)  # finally)
        return terminate.exit_status(e)
    except (OSError, RuntimeError, TimeoutError) as e:  # the stack did not start (a missing binary, a port)
        print(f"soak: {e}", file=sys.stderr)
        return 2
    text = render_markdown(report)
    print("\n" + text, file=out, flush=True)
    if args.out:
        Path(args.out).write_text(text)
        print(f"[soak] wrote {args.out}", file=out, flush=True)
    return 1 if report.problems else 0


if __name__ == "__main__":
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so run_soak's finally stops the stack: Python's default
    # died at once and left HAProxy, Prometheus, Alertmanager, the controller and every exporter running
    terminate.install()
    sys.exit(main())
