"""What grayguard's shipped defaults cost a real Prometheus at N simulated nodes (`grayguard bench-controller`).

The stand-in target (bench/promtarget.py, a child process) serves the nodes' series on one port per SHARD_SIZE
nodes. A real Prometheus scrapes them with the jobs and intervals of rules/prometheus.example.yml (with
honor_labels, so every series keeps its node's pool and instance) and evaluates the rules that `grayguard rules
render` makes from the default config. Every tick_interval_s the controller's own observe code runs
(Controller.read_prometheus, then read_optional: every query of the default config, so a new signal is
measured as soon as it exists). Measured over the window: each rule group's evaluation time, the tick's query
time and each query's answer, samples appended per second, head series, resident memory and CPU.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from bench import promtarget
from bench.promresult import PromCost
from bench.promwindow import run_window
from grayguard.config import load_config
from localstack.procs import ManagedProcess, free_port
from localstack.services import start_prometheus

EXAMPLE_PROMETHEUS = Path(__file__).resolve().parents[1] / "rules" / "prometheus.example.yml"


def render_rules(config: Path, out: Path) -> list[Path]:
    """`grayguard rules render` (a child process: bench does not import rules); the rule files."""
    r = subprocess.run([sys.executable, "-m", "grayguard.cli", "rules", "render", "--config", str(config),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"grayguard rules render failed ({r.returncode}): {r.stderr or r.stdout}")
    return sorted(out.glob("*.yml"))


def prometheus_setup(ports: list[int], example: Path = EXAMPLE_PROMETHEUS) -> dict:
    """The example's global section and its vLLM and exporter jobs (their intervals and what they drop), pointed at
    the stand-in's ports."""
    ex = yaml.safe_load(example.read_text())
    shipped = {sc["job_name"]: sc for sc in ex["scrape_configs"]}
    jobs = []
    for job, (path, _) in promtarget.pages().items():
        sc = {"job_name": job, "honor_labels": True, "metrics_path": path,
              "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
        sc.update({k: v for k, v in shipped[job].items()
                   if k in ("scrape_interval", "scrape_timeout", "metric_relabel_configs")})
        jobs.append(sc)
    return {"global": ex["global"], "scrape_configs": jobs}


def job_intervals(setup: dict) -> dict[str, str]:
    """job -> its scrape interval in a prometheus_setup."""
    return {sc["job_name"]: sc.get("scrape_interval", setup["global"]["scrape_interval"])
            for sc in setup["scrape_configs"]}


def measure(nodes: int, seconds: float = 60.0, progress: Callable[[str], None] = lambda s: None,
            warmup_timeout_s: float | None = None) -> PromCost:
    """Start the stand-in and Prometheus for nodes, wait for data, measure for seconds; always stop both."""
    with tempfile.TemporaryDirectory(prefix="grayguard-promcost-") as d:
        wd, port = Path(d), free_port()
        cfg_file = wd / "grayguard.yaml"
        cfg_file.write_text(yaml.safe_dump({
            "prometheus": {"url": f"http://127.0.0.1:{port}"}, "state_file": None,
            "pools": [{"name": "pool0", "backend": "pool0"}], "rules": {"output_dir": str(wd / "rules")}}))
        cfg = load_config(cfg_file)  # every other field: the shipped default
        rule_files = render_rules(cfg_file, wd / "rules")
        with stand_in(nodes, wd, progress) as (target, ports):
            setup = prometheus_setup(ports)
            cost = PromCost(nodes, len(ports), promtarget.series_per_node(), job_intervals(setup))
            progress(f"{nodes} nodes: starting Prometheus (scrape targets per job: {len(ports)})")
            prom = start_prometheus(setup, rule_files, workdir=wd / "prometheus", port=port)
            try:
                run_window(cost, cfg, prom, target.pid, seconds, progress,
                           warmup_timeout_s if warmup_timeout_s is not None else 30 + nodes / 100)
            finally:
                prom.stop()
    return cost


@contextlib.contextmanager
def stand_in(nodes: int, wd: Path, progress: Callable[[str], None] = lambda s: None
             ) -> Iterator[tuple[ManagedProcess, list[int]]]:
    """The stand-in target serving nodes (a child process, its log in wd): (the process, its ports); stopped after."""
    progress(f"{nodes} nodes: starting the stand-in target")
    ready = wd / "ports.json"
    target = ManagedProcess([sys.executable, "-m", "bench.promtarget", "--nodes", str(nodes),
                             "--ready-file", str(ready)], wd / "promtarget.log")
    try:
        target.wait_for(ready.exists, timeout_s=60 + nodes / 100, what="the stand-in target")
        yield target, yaml.safe_load(ready.read_text())["ports"]
    finally:
        target.stop()


