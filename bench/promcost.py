"""What grayguard's shipped defaults cost a real Prometheus at N simulated nodes (`grayguard bench-controller`).

The stand-in target (bench/promtarget.py, a child process) serves the nodes' series on one port per SHARD_SIZE
nodes. A real Prometheus scrapes them with the jobs and intervals of rules/prometheus.example.yml (with
honor_labels, so every series keeps its node's pool and instance) and evaluates the rules that `grayguard rules
render` makes from the default config. Every tick_interval_s the controller's own observe code runs
(Controller.read_prometheus, then read_optional: every query of the default config, so a new signal is
measured as soon as it exists). Measured over the window: each rule group's evaluation time, the tick's query
time and each query's answer, samples appended per second, head series, resident memory and CPU.

design="before" measures the signals issue 34 started from instead (bench/before34/README.md: their frozen rules and
queries, the exporter's pages of then, the scrape jobs without the drop of the fast series' copies), on the same
stand-in, Prometheus and controller code, so that `grayguard bench-controller` prints the two side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from grayguard.bench import promtarget
from grayguard.bench.promresult import PromCost
from grayguard.bench.promwindow import run_window
from grayguard.config import Config, SignalsConfig, load_config
from grayguard.localstack.procs import ManagedProcess, free_port
from grayguard.localstack.services import start_prometheus

EXAMPLE_PROMETHEUS = Path(__file__).resolve().parents[1] / "rules" / "prometheus.example.yml"
BEFORE = Path(__file__).resolve().parent / "before34"  # the signals issue 34 started from (frozen)
DESIGNS = promtarget.DESIGNS
FUSED_ROUNDS = 20  # rounds of the fused query against the separate ones, after the shipped design's window


def render_rules(config: Path, out: Path) -> list[Path]:
    """`grayguard rules render` (a child process: bench does not import rules); the rule files."""
    r = subprocess.run([sys.executable, "-m", "grayguard.cli", "rules", "render", "--config", str(config),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"grayguard rules render failed ({r.returncode}): {r.stderr or r.stdout}")
    return sorted(out.glob("*.yml"))


def prometheus_setup(ports: list[int], example: Path = EXAMPLE_PROMETHEUS, design: str = "shipped") -> dict:
    """The example's global section and its vLLM and exporter jobs (their intervals and what they drop; before:
    nothing dropped), pointed at the stand-in's ports."""
    ex = yaml.safe_load(example.read_text())
    shipped = {sc["job_name"]: sc for sc in ex["scrape_configs"]}
    keep = ("scrape_interval", "scrape_timeout") + (("metric_relabel_configs",) if design == "shipped" else ())
    jobs = []
    for job, (path, _) in promtarget.pages(design).items():
        sc = {"job_name": job, "honor_labels": True, "metrics_path": path,
              "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
        sc.update({k: v for k, v in shipped[job].items() if k in keep})
        jobs.append(sc)
    return {"global": ex["global"], "scrape_configs": jobs}


def job_intervals(setup: dict) -> dict[str, str]:
    """job -> its scrape interval in a prometheus_setup."""
    return {sc["job_name"]: sc.get("scrape_interval", setup["global"]["scrape_interval"])
            for sc in setup["scrape_configs"]}


def design_inputs(design: str, cfg_file: Path, cfg: Config, out: Path) -> tuple[list[Path], Config]:
    """The rule files (in out) and the controller's config of a design: the shipped ones rendered from cfg_file now,
    or the frozen ones issue 34 started from."""
    if design == "shipped":
        return render_rules(cfg_file, out), cfg
    if design != "before":
        raise ValueError(f"design {design!r} is none of {DESIGNS}")
    out.mkdir(parents=True, exist_ok=True)
    files = [Path(shutil.copy(f, out)) for f in sorted(BEFORE.glob("*.rules.yml"))]
    signals = SignalsConfig(**yaml.safe_load((BEFORE / "signals.yaml").read_text()))
    return files, dataclasses.replace(cfg, signals=signals)


def measure(nodes: int, seconds: float = 60.0, progress: Callable[[str], None] = lambda s: None,
            warmup_timeout_s: float | None = None, design: str = "shipped") -> PromCost:
    """Start the stand-in and Prometheus for nodes, wait for data, measure for seconds; always stop both. design:
    the shipped signals, or those issue 34 started from ("before")."""
    with tempfile.TemporaryDirectory(prefix="grayguard-promcost-") as d:
        wd, port = Path(d), free_port()
        cfg_file = wd / "grayguard.yaml"
        cfg_file.write_text(yaml.safe_dump({
            "prometheus": {"url": f"http://127.0.0.1:{port}"}, "state_file": None,
            "pools": [{"name": "pool0", "backend": "pool0"}], "rules": {"output_dir": str(wd / "rules")}}))
        rule_files, cfg = design_inputs(design, cfg_file, load_config(cfg_file), wd / "rules")  # else: defaults
        with stand_in(nodes, wd, progress, design) as (target, ports):
            setup = prometheus_setup(ports, design=design)
            cost = PromCost(nodes, len(ports), promtarget.series_per_node(design), job_intervals(setup), design=design)
            progress(f"{nodes} nodes, {design}: starting Prometheus (scrape targets per job: {len(ports)})")
            prom = start_prometheus(setup, rule_files, workdir=wd / "prometheus", port=port)
            try:
                run_window(cost, cfg, prom, target.pid, seconds, progress,
                           warmup_timeout_s if warmup_timeout_s is not None else 30 + nodes / 100,
                           fused_rounds=FUSED_ROUNDS if design == "shipped" else 0)
            finally:
                prom.stop()
    return cost


@contextlib.contextmanager
def stand_in(nodes: int, wd: Path, progress: Callable[[str], None] = lambda s: None, design: str = "shipped"
             ) -> Iterator[tuple[ManagedProcess, list[int]]]:
    """The stand-in target serving nodes (a child process, its log in wd): (the process, its ports); stopped after."""
    progress(f"{nodes} nodes: starting the stand-in target")
    ready = wd / "ports.json"
    target = ManagedProcess([sys.executable, "-m", "grayguard.bench.promtarget", "--nodes", str(nodes),
                             "--ready-file", str(ready), "--design", design], wd / "promtarget.log")
    try:
        target.wait_for(ready.exists, timeout_s=60 + nodes / 100, what="the stand-in target")
        yield target, yaml.safe_load(ready.read_text())["ports"]
    finally:
        target.stop()


