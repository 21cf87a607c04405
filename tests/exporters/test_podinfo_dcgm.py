"""grayguard_node_pod_info: the sidecar's pod, which joins dcgm-exporter's GPUs to the node (rules.gpu_source: dcgm)."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from grayguard.exporters import cli
from grayguard.exporters.podinfo import NAME, PodInfoCollector
from grayguard.exporters.server import Exporter


def registry_with(collector) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(collector)
    return r


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_pod_is_one_series_of_value_one():
    r = registry_with(PodInfoCollector("inference", "vllm-chat-0"))
    assert r.get_sample_value(NAME, {"namespace": "inference", "pod": "vllm-chat-0"}) == 1


@pytest.mark.parametrize("namespace, pod", [(None, "vllm-chat-0"), ("inference", None), ("", ""), (None, None)])
def test_an_unknown_pod_is_absent_not_empty(namespace, pod):
    assert list(PodInfoCollector(namespace, pod).collect()) == []


def test_the_exporter_with_the_nvml_collector_off_exports_its_pod_and_no_gpu_series():
    e = Exporter(nvml=None, probe=None, pod=("inference", "vllm-chat-1"))
    assert e.registry.get_sample_value(NAME, {"namespace": "inference", "pod": "vllm-chat-1"}) == 1
    page = generate_latest(e.registry).decode()
    assert "grayguard_gpu_" not in page
    assert e.registry.get_sample_value("grayguard_exporter_nvml_up") == 0


def test_the_flags_default_to_the_downward_apis_variables(monkeypatch):
    monkeypatch.setenv("POD_NAME", "vllm-chat-2")
    monkeypatch.setenv("POD_NAMESPACE", "inference")
    args = parse("--no-collector.nvml", "--no-probe")
    assert (args.pod_name, args.pod_namespace) == ("vllm-chat-2", "inference")
    e = cli.build_exporter(args)
    assert e.registry.get_sample_value(NAME, {"namespace": "inference", "pod": "vllm-chat-2"}) == 1
    args = parse("--no-probe", "--pod.name", "other", "--pod.namespace", "ns")
    assert (args.pod_name, args.pod_namespace) == ("other", "ns")


def test_without_the_variables_there_is_no_pod_info(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    e = cli.build_exporter(parse("--no-collector.nvml", "--no-probe"))
    assert f"\n{NAME}{{" not in generate_latest(e.registry).decode()
