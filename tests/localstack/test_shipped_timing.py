"""The local stack at the shipped timing (StackSpec(timing="shipped"), what `grayguard bench --cross-check` runs),
and the fault's GPU effects reaching exporters that run as child processes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from grayguard.config import load_config, parse_config
from grayguard.exporters.fakenvml import healthy_h100
from grayguard.localstack.procs import wait_until
from grayguard.localstack.stack import (
    REPO,
    LocalStack,
    StackSpec,
    apply_gpu_effects,
    follow_gpu_file,
    shipped_config_doc,
    shipped_prometheus_timing,
    write_gpu_state,
)
from grayguard.sim.faults import gpu_effects


def test_the_shipped_controller_config_is_the_example_with_only_the_stacks_addresses(tmp_path):
    cfg = parse_config(shipped_config_doc("http://127.0.0.1:9", ["unix:/x.sock"], "127.0.0.1:8", tmp_path, None))
    example = load_config(str(REPO / "grayguard.example.yaml"))
    assert cfg.thresholds == example.thresholds and cfg.recovery == example.recovery
    assert cfg.signals == example.signals and cfg.tick_interval_s == example.tick_interval_s == 1.0
    assert (cfg.rules.control_window, cfg.rules.control_interval) == ("30s", "5s")
    assert cfg.prometheus.url == "http://127.0.0.1:9" and tuple(cfg.haproxy.endpoints) == ("unix:/x.sock",)
    assert cfg.state_file is None and cfg.rules.rerender_interval_s == 0


def test_the_shipped_prometheus_timing_is_read_from_the_example():
    scrape, evaluation, fast = shipped_prometheus_timing()
    prom = yaml.safe_load((REPO / "rules" / "prometheus.example.yml").read_text())
    assert (scrape, evaluation) == (prom["global"]["scrape_interval"], prom["global"]["evaluation_interval"])
    assert (fast["metrics_path"], fast["scrape_interval"]) == ("/metrics/fast", "1s")


@pytest.mark.parametrize("scrape", ["1s", "2s"])
def test_the_hardware_signals_are_read_once_a_scrape_of_the_exporters_full_page_at_each_timing(tmp_path, scrape):
    """The controller reads the GPU evidence once in signals.hardware_every_s because the exporter's full page changes
    once a scrape: as shipped, 5 s and 5 s; the demo timing scrapes every job every scrape_interval, so its controller
    reads the evidence as often. Found on `make demo`: at the shipped 5 s over a 1 s page, the throttled node's GPU
    evidence waited up to 5 s and the demo's cut came at +3.1 s, over its 3 s target (+1.2 s once a scrape)."""
    prom = yaml.safe_load((REPO / "rules" / "prometheus.example.yml").read_text())
    exporter = next(j for j in prom["scrape_configs"] if j["job_name"] == "grayguard-exporter")
    full_page_every = exporter.get("scrape_interval", prom["global"]["scrape_interval"])
    shipped = parse_config(shipped_config_doc("http://127.0.0.1:9", ["unix:/x.sock"], "127.0.0.1:8", tmp_path, None))
    assert full_page_every == "5s" and shipped.signals.hardware_every_s == 5.0
    stack = LocalStack(StackSpec(scrape_interval=scrape, overrides={"haproxy": {"endpoints": ["unix:/x.sock"]}}))
    try:
        demo = stack._config("http://127.0.0.1:9", "127.0.0.1:8")
    finally:
        stack.stop()
    assert demo.signals.hardware_every_s == float(scrape.removesuffix("s"))


def test_an_unknown_timing_is_refused_before_anything_starts():
    stack = LocalStack(StackSpec(timing="fast"))
    with pytest.raises(ValueError, match="timing"):
        stack.start()


def test_an_exporter_child_follows_the_faults_gpu_effects(tmp_path: Path):
    gpu, path, stop = healthy_h100(0), tmp_path / "node3.gpu.json", threading.Event()
    healthy = dict(vars(gpu))
    xids: list[int] = []
    gpu.push_xid = xids.append  # what the XID thread would get
    t = threading.Thread(target=follow_gpu_file, args=(path, gpu, stop, 0.01), daemon=True)
    t.start()
    try:
        throttled = gpu_effects("thermal", {"k": 6})
        write_gpu_state(path, 1, throttled)
        wait_until(lambda: gpu.clock_event_reasons == throttled["clock_event_reasons"], 5, 0.01, "the throttle")
        write_gpu_state(path, 2, gpu_effects("cuda_error"))
        wait_until(lambda: xids == [31], 5, 0.01, "the XID")
        assert gpu.clock_event_reasons == healthy["clock_event_reasons"]  # the throttle is gone: one fault at a time
        write_gpu_state(path, 3, {})
        wait_until(lambda: {k: v for k, v in vars(gpu).items() if k in healthy} == healthy, 5, 0.01, "healthy")
        assert xids == [31]  # an event is delivered once
    finally:
        stop.set()
        t.join(5)


def test_apply_gpu_effects_resets_before_it_applies():
    gpu = healthy_h100(1)
    base = dict(vars(gpu))
    apply_gpu_effects(gpu, base, {"pcie_gen": 1})
    apply_gpu_effects(gpu, base, {"temperature_c": 90})
    assert (gpu.pcie_gen, gpu.temperature_c) == (base["pcie_gen"], 90)
