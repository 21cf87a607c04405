"""The benchmark's timing is the shipped one: issue targets are measured at the defaults people deploy
(grayguard.example.yaml, rules/prometheus.example.yml, the exporter's flags), never at settings tuned for the suite."""

from __future__ import annotations

from pathlib import Path

import yaml

from grayguard.bench.spec import Scenario
from grayguard.config import load_config
from grayguard.exporters.live import LIVE_WINDOW_S
from grayguard.exporters.prober import ProbeConfig

ROOT = Path(__file__).resolve().parents[2]


def _seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for u in ("ms", "s", "m"):
        if text.endswith(u):
            return float(text[: -len(u)]) * units[u]
    raise ValueError(text)


def test_the_benchmark_runs_at_the_shipped_defaults():
    cfg = load_config(str(ROOT / "grayguard.example.yaml"))
    prom = yaml.safe_load((ROOT / "rules" / "prometheus.example.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    scrape = _seconds(prom["global"]["scrape_interval"])
    scn = Scenario("x", ())
    assert scn.tick_s == cfg.tick_interval_s
    assert scn.window_s == _seconds(cfg.rules.control_window)
    assert scn.rule_eval_s == _seconds(cfg.rules.control_interval or prom["global"]["evaluation_interval"])
    assert scn.signal_lag_s == scrape  # the newest sample in the window is up to one scrape old at the evaluation
    assert scn.gauge_lag_s == scrape / 2  # a gauge is on average half a scrape old
    assert scn.fast_scrape_s == _seconds(jobs["grayguard-exporter-fast"]["scrape_interval"])
    assert jobs["grayguard-exporter-fast"]["metrics_path"] == "/metrics/fast"
    # the GPU evidence: the exporter's full page at its job's interval, read once in signals.hardware_every_s
    full_page = jobs["grayguard-exporter"].get("scrape_interval", prom["global"]["scrape_interval"])
    assert scn.full_scrape_s == _seconds(full_page)
    assert scn.hardware_every_s == cfg.signals.hardware_every_s
    probe = ProbeConfig()
    assert (scn.probe_interval_s, scn.probe_deadline_s, scn.probe_slow_s) == (probe.interval, probe.deadline,
                                                                              probe.slow_threshold)
    assert scn.live_window_s == LIVE_WINDOW_S == probe.live_window
