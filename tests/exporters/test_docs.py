"""docs/metrics.md documents every series the exporter and the controller export."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.fastpath import FAST_SERIES
from grayguard.exporters.nvml import NvmlCollector
from grayguard.exporters.prober import Prober
from grayguard.exporters.server import Exporter

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "metrics.md").read_text()


def exposed_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for collector in list(registry._collector_to_names):
        for family in collector.describe():
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_exporter_series_is_documented():
    exporter = Exporter("http://127.0.0.1:1", port=0, nvml=FakeNvml([healthy_h100(0)]), agent=("127.0.0.1", 0))
    names = exposed_names(exporter.registry)
    assert len(names) >= 35
    assert {"grayguard_agent_down", "grayguard_agent_answers_total"} <= names
    for name in sorted(names):
        assert f"`{name}`" in DOC, name


# what the controller reads every second: the fast page's series, exactly (issue 34)
FAST = {"grayguard_live_itl_seconds", "grayguard_live_ttft_seconds", "grayguard_live_prompt_tokens_per_second",
        "grayguard_live_decode_batch", "grayguard_live_kv_cache_usage_ratio", "grayguard_probe_ttft_median_seconds",
        "grayguard_probe_last_result", "grayguard_probe_last_sent_timestamp_seconds",
        "grayguard_probe_consecutive_failures"}
# on the full page only, and dropped there by the shipped scrape configs: served for a person with curl
FULL_ONLY_UNSTORED = {"grayguard_live_generation_tokens_per_second", "grayguard_live_requests_running",
                      "grayguard_live_requests_waiting", "grayguard_live_window_seconds", "grayguard_agent_down"}
# the full page of an exporter with one GPU, the prober and the agent check, exactly
FULL = FAST | FULL_ONLY_UNSTORED | {
    "grayguard_agent_answers_total", "grayguard_exporter_nvml_errors_total", "grayguard_exporter_nvml_up",
    "grayguard_exporter_probe_errors_total", "grayguard_exporter_scrape_duration_seconds",
    "grayguard_gpu_clock_event_reasons", "grayguard_gpu_ecc_errors", "grayguard_gpu_energy_joules_total",
    "grayguard_gpu_flags", "grayguard_gpu_info", "grayguard_gpu_memory_clock_hertz",
    "grayguard_gpu_memory_clock_max_hertz", "grayguard_gpu_memory_temperature_celsius",
    "grayguard_gpu_memory_total_bytes", "grayguard_gpu_memory_used_bytes", "grayguard_gpu_pcie_link_generation",
    "grayguard_gpu_pcie_link_width", "grayguard_gpu_pcie_replay_total", "grayguard_gpu_power_limit_watts",
    "grayguard_gpu_power_watts", "grayguard_gpu_remapped_rows", "grayguard_gpu_sm_clock_hertz",
    "grayguard_gpu_sm_clock_max_hertz", "grayguard_gpu_temperature_celsius", "grayguard_gpu_utilization_ratio",
    "grayguard_gpu_xid_errors_total", "grayguard_node_pod_info", "grayguard_probe_last_timestamp_seconds",
    "grayguard_probe_last_ttft_seconds", "grayguard_probe_results_total", "grayguard_probe_ttft_seconds",
    "grayguard_traffic_generation_tokens_total", "grayguard_traffic_prompt_tokens_total",
    "grayguard_traffic_request_seconds_total", "grayguard_traffic_requests_total"}


def test_the_fast_page_carries_what_the_controller_reads_every_second_and_the_full_page_the_rest():
    exporter = Exporter("http://127.0.0.1:1", port=0, nvml=FakeNvml([healthy_h100(0)]), agent=("127.0.0.1", 0))
    assert exposed_names(exporter.fast_registry) == FAST == set(FAST_SERIES)
    assert {f.name for f in exporter.fast_registry.collect()} <= FAST  # what it serves, not only what it describes
    assert exposed_names(exporter.registry) == FULL
    assert exposed_names(Exporter("http://127.0.0.1:1", port=0, nvml=None, probe=None).fast_registry) == set()


def _drops(relabels: list[dict]) -> re.Pattern:
    (drop,) = [r for r in relabels if r.get("action") == "drop"]
    return re.compile(drop["regex"])


def test_the_full_job_drops_exactly_the_fast_pages_series_in_the_shipped_scrape_configs():
    """rules/prometheus.example.yml and the Kubernetes PodMonitor store the fast page's series once, from the 1 s
    job: the full job drops every one of them, and the full page's live values the controller does not read, and
    nothing else the exporter exports."""
    exporter = Exporter("http://127.0.0.1:1", port=0, nvml=FakeNvml([healthy_h100(0)]), agent=("127.0.0.1", 0))
    fast, full = exposed_names(exporter.fast_registry), exposed_names(exporter.registry)
    prom = {j["job_name"]: j for j in yaml.safe_load((REPO / "rules" / "prometheus.example.yml").read_text())
            ["scrape_configs"]}
    monitor = yaml.safe_load((REPO / "deploy" / "kubernetes" / "base" / "monitoring" / "podmonitor-fleet.yaml")
                             .read_text())
    (full_endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"]
                        if e["port"] == "exporter" and e["path"] == "/metrics"]
    for pattern in (_drops(prom["grayguard-exporter"]["metric_relabel_configs"]),
                    _drops(full_endpoint["metricRelabelings"])):
        assert {n for n in full if pattern.fullmatch(n)} == fast | FULL_ONLY_UNSTORED  # Prometheus anchors it
    assert "metric_relabel_configs" not in prom["grayguard-exporter-fast"]


def test_fixed_names_from_the_issue_are_exported():
    registry = CollectorRegistry()
    registry.register(NvmlCollector(nvml=FakeNvml([healthy_h100(0)]), xid_events=False))
    Prober("http://127.0.0.1:1", registry=registry)
    fixed = [
        "grayguard_exporter_nvml_up", "grayguard_gpu_info", "grayguard_gpu_sm_clock_hertz",
        "grayguard_gpu_sm_clock_max_hertz", "grayguard_gpu_memory_clock_hertz",
        "grayguard_gpu_memory_clock_max_hertz", "grayguard_gpu_clock_event_reasons",
        "grayguard_gpu_temperature_celsius", "grayguard_gpu_memory_temperature_celsius",
        "grayguard_gpu_power_watts", "grayguard_gpu_power_limit_watts",
        "grayguard_gpu_energy_joules_total", "grayguard_gpu_pcie_link_generation",
        "grayguard_gpu_pcie_link_width", "grayguard_gpu_pcie_replay_total", "grayguard_gpu_ecc_errors",
        "grayguard_gpu_remapped_rows", "grayguard_gpu_xid_errors_total",
        "grayguard_gpu_utilization_ratio", "grayguard_gpu_memory_used_bytes",
        "grayguard_gpu_memory_total_bytes", "grayguard_gpu_flags", "grayguard_probe_ttft_seconds",
        "grayguard_probe_results_total", "grayguard_probe_last_result",
        "grayguard_probe_last_ttft_seconds", "grayguard_probe_consecutive_failures",
        "grayguard_probe_last_timestamp_seconds", "grayguard_exporter_probe_errors_total",
    ]
    assert set(fixed) <= exposed_names(registry)


def test_every_controller_series_is_documented():
    metrics = pytest.importorskip("grayguard.controller.metrics")
    registry = metrics.ControllerMetrics.create().registry
    for name in sorted(exposed_names(registry)):
        assert f"`{name}`" in DOC, name
