"""The controller's own work in a whole tick at scale: real HAProxy, the real Controller, Prometheus' answers served.

`bench/wholetick.py` runs the whole tick against a real Prometheus; on the project's 2 cores that Prometheus
does not keep up at 10,000 nodes (its rule groups take minutes, the queries time out), so that run measures
Prometheus. This one puts bench/answers.py in Prometheus' place (a child process serving, over Prometheus'
HTTP API, what it would answer for the stand-in fleet) and measures what is the controller's: HAProxy's
`show servers state` for 10,000 servers, 18 answers of 10,000 series fetched and parsed, the series matched to
the servers, the decisions, the writes through the runtime API and the metrics export. Timed as in wholetick
(bench/tickprobe.py: the controller's own methods wrapped on the instance), on the controller's fixed-rate
schedule. The answer server's CPU is its own process's and is reported apart.

    python -m grayguard.bench.ticklocal --nodes 1000,10000 --ticks 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from grayguard.bench.answers import led_pools
from grayguard.bench.promwindow import cpu_seconds
from grayguard.bench.tickprobe import FixedRate, LogCount, Stopwatch, TimedRuntime, instrument, memory_mark, timed_tick
from grayguard.bench.tickresult import PARTS, MemoryMark, TickSample, _row, median_max, part_times
from grayguard.bench.wholetick import controller_config, fleet_backends
from grayguard.config import load_config
from grayguard.controller import gcpolicy
from grayguard.controller.leader import Turn
from grayguard.controller.loop import Controller
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import ManagedProcess
from grayguard.promclient import PrometheusClient

TARGET_S = 0.5  # issue 18: the whole tick at 10,000 nodes


@dataclass
class LocalTick:
    nodes: int
    backends: int
    ticks: list[TickSample] = field(default_factory=list)
    first: TickSample | None = None  # the first tick: it creates every metric series and seeds every state
    memory: list[MemoryMark] = field(default_factory=list)  # the first, middle and last tick's
    cores: dict[str, float] = field(default_factory=dict)
    skipped: int = 0
    logged: dict[str, int] = field(default_factory=dict)
    led: int | None = None  # pools the controller leads as a sharded replica; None: every pool, no registry

    def times(self, key: str) -> list[float]:
        return part_times(self.ticks, key)


def measure(nodes: int, ticks: int, progress: Callable[[str], None] = lambda s: None,
            lead_share: float | None = None) -> LocalTick:
    """Start HAProxy and the answer server for nodes, tick ticks times after a first tick; stop both. lead_share:
    the controller is a replica leading that share of the pools (registry.shard_pools; answers.led_pools), its
    queries scoped to them (controller/readscope.py) and answered so; None: it leads every pool, no registry."""
    with tempfile.TemporaryDirectory(prefix="grayguard-ticklocal-") as d:
        wd = Path(d)
        backends = fleet_backends(nodes)
        hap = HaproxyProc(wd / "haproxy")
        hap.dir.mkdir()
        hap.cfg.write_text(haproxy_config(hap.sock, backends))
        draft = controller_config(wd, 9, hap.endpoint, list(backends))  # its queries are what the server answers
        ready = wd / "answers.json"
        progress(f"{nodes} nodes: starting HAProxy ({nodes} servers in {len(backends)} backends) and the answers")
        share = [] if lead_share is None else ["--lead-share", repr(lead_share)]
        server = ManagedProcess([sys.executable, "-m", "grayguard.bench.answers", "--config", str(draft),
                                 "--nodes", str(nodes), "--ready-file", str(ready), *share], wd / "answers.log")
        try:
            hap.start(timeout_s=30 + nodes / 100)
            try:
                server.wait_for(ready.exists, timeout_s=60 + nodes / 100, what="the answer server")
                port = json.loads(ready.read_text())["port"]
                cfg = load_config(controller_config(wd, port, hap.endpoint, list(backends)))
                led = None if lead_share is None else led_pools([p.name for p in cfg.pools], lead_share)
                with gcpolicy.tuned():  # the collector's thresholds the controller's process runs with
                    return run(cfg, nodes, len(backends), ticks, {"HAProxy": hap.proc.pid, "answers": server.pid},
                               progress, led)
            finally:
                hap.stop()
        finally:
            server.stop()


class Leads:
    """The leadership seam of a replica that leads `led` for good (no etcd: the benchmark times the tick's own work;
    tests/controller/test_readscope.py drives the controller with it too). Leading nothing, it stands by."""

    def __init__(self, led: Iterable[str]):
        self.led = frozenset(led)

    def begin_tick(self) -> Turn:
        return Turn(self.led, {}, "" if self.led else "another replica leads every pool", True)

    def publish(self, pool: str, states, desired=None) -> None:
        return None

    def may_write(self, pool: str, budget_s: float) -> None:
        return None

    def status(self) -> dict:
        return {"led": sorted(self.led)}


def run(cfg, nodes: int, n_backends: int, ticks: int, pids: dict[str, int],
        progress: Callable[[str], None], led: list[str] | None = None) -> LocalTick:
    out = LocalTick(nodes, n_backends, led=None if led is None else len(led))
    watch = Stopwatch()
    ctl = Controller(cfg, PrometheusClient(cfg.prometheus),
                     [TimedRuntime(ep, cfg.haproxy.timeout_s, watch) for ep in cfg.haproxy.endpoints],
                     state_file=None, leadership=None if led is None else Leads(led))  # type: ignore[arg-type]
    instrument(ctl, watch)
    counted = LogCount()
    log = logging.getLogger("grayguard.controller")
    log.addFilter(counted)
    try:
        out.first = timed_tick(ctl, watch)
        pids = {"controller (this process)": os.getpid(), **pids}
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        marks = {1, (ticks + 1) // 2, ticks}
        schedule = FixedRate(cfg.tick_interval_s)
        for k in schedule.ticks(ticks):
            t = timed_tick(ctl, watch)
            out.ticks.append(t)
            if k in marks:
                out.memory.append(memory_mark(ctl, k))
            if k % 10 == 0 or k == ticks:
                progress(f"{nodes} nodes: tick {k}/{ticks}: {t.seconds['tick'] * 1000:.0f} ms"
                         + (f", held: {t.held[:100]}" if t.held else ""))
        out.skipped = schedule.skipped
        span = time.monotonic() - schedule.start
        out.cores = {k: (cpu_seconds(pid) - cpu0[k]) / span for k, pid in pids.items()
                     if cpu0[k] is not None and cpu_seconds(pid) is not None}
    finally:
        log.removeFilter(counted)
    out.logged = dict(counted.counts)
    return out


def format_local(r: LocalTick) -> list[str]:
    held = sum(1 for t in r.ticks if t.held)
    lead = "" if r.led is None else f", a replica leading {r.led} of them (its queries scoped)"
    out = [f"  {r.nodes} nodes in {r.backends} backends{lead} ({len(r.ticks)} ticks after the first; "
           f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):",
           f"      {'per tick, ms':<56} {'median':>9} {'p90':>9} {'max':>9}   (ticks)",
           _row("whole tick (Controller.tick)", r.times("tick"))]
    for key, label in PARTS:
        if key == "prometheus":
            label = "Prometheus answers (18 queries: fetched and parsed)"
        out.append(_row("  " + label, r.times(key)))
    out += [_row("decision (decide + plan)", r.times("decision")),
            _row("controller CPU in the tick (every thread)", [t.cpu_s for t in r.ticks])]
    if r.first is not None:
        f = r.first.seconds
        out.append(f"    first tick (seeds every state, creates every metric series): {f['tick'] * 1000:.0f} ms, "
                   f"of which metrics export {f.get('export', 0.0) * 1000:.0f} ms; {r.first.commands} runtime-API "
                   f"commands")
    cmds = [t.commands for t in r.ticks]
    out.append(f"    runtime-API commands: {sum(cmds)} in all, max {max(cmds, default=0)} a tick; pools decided per "
               f"tick: median {sorted(t.decided for t in r.ticks)[len(r.ticks) // 2] if r.ticks else 0} "
               f"of {r.backends}; {held} of {len(r.ticks)} ticks held")
    out.append("    controller memory: " + ", ".join(
        f"tick {m.tick}: RSS {m.rss_bytes / 2**20:.1f} MiB, kept {m.kept_bytes / 2**20:.1f} MiB, Python blocks "
        f"{m.blocks:,}" for m in r.memory) + " (after gc)")
    out.append("    CPU over the ticks, cores: " + ", ".join(f"{k} {v:.2f}" for k, v in r.cores.items()))
    if r.skipped:
        out.append(f"    note: {r.skipped} tick slots passed over: a tick ran past the next one")
    if r.logged:
        out.append("    controller log records (counted, not printed): "
                   + ", ".join(f"{n} {lvl}" for lvl, n in sorted(r.logged.items())))
    m, _ = median_max(r.times("tick"))
    if r.ticks and not held:
        verdict = "meets" if m <= TARGET_S else f"OVER ({m / TARGET_S:.1f}x)"
        out.append(f"    verdict: the controller's whole tick, median {m * 1000:.0f} ms at {r.nodes} nodes: {verdict} "
                   f"the {TARGET_S * 1000:.0f} ms target (Prometheus' own time not included: answers served)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.bench.ticklocal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000", help="comma-separated node counts (default 1000,10000)")
    ap.add_argument("--ticks", type=int, default=30, help="ticks per size after the first (default 30)")
    ap.add_argument("--lead-share", type=float, default=None, metavar="F",
                    help="the controller is a replica (registry.shard_pools) leading this share of the pools, 0-1: "
                         "its queries ask for their series only (controller/readscope.py); default: every pool")
    a = ap.parse_args(argv)
    try:
        sizes = sorted(int(x) for x in a.nodes.split(","))
    except ValueError:
        ap.error(f"--nodes: comma-separated integers, got {a.nodes!r}")
    if a.ticks < 1:
        ap.error("--ticks: at least 1")
    if a.lead_share is not None and not 0 < a.lead_share <= 1:
        ap.error("--lead-share: a share of the pools above 0, at most 1")
    print("the controller's own tick on real parts (HAProxy with a server per node, 20 per backend; the real "
          "Controller.tick(); Prometheus' answers served by bench/answers.py):", flush=True)
    for n in sizes:
        r = measure(n, a.ticks, lambda s: print(f"  ... {s}", file=sys.stderr, flush=True), a.lead_share)
        print("\n".join(format_local(r)), flush=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
