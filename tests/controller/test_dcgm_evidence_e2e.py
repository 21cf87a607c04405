"""rules.gpu_source: dcgm end to end: dcgm-exporter's page (tests/fixtures/dcgm) and three grayguard exporters with the
NVML collector off, scraped by a real Prometheus with the rendered rules; the controller reads its GPU evidence
(read_optional, its default queries) from that Prometheus, and the evidence names the throttled node, then an XID."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from grayguard.config import parse_config
from grayguard.controller import signals
from grayguard.controller.loop import Controller
from grayguard.exporters.server import Exporter
from grayguard.httpserve import serve
from grayguard.promclient import PrometheusClient
from grayguard.rules.render import render_all
from tests.support.stack import prometheus_config, require, start_prometheus, static_job, wait_until

pytestmark = pytest.mark.e2e

PAGE = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "dcgm-exporter-clocks-event-reasons.prom"
PODS = {"vllm-chat-0": "10.0.0.10:8000", "vllm-chat-1": "10.0.0.11:8000", "vllm-chat-2": "10.0.0.12:8000"}
XID_GPU1 = 'DCGM_FI_DEV_XID_ERROR{gpu="1",'


class DcgmPage:
    """dcgm-exporter stand-in: serves the fixture page, with GPU 1's last XID settable."""

    def __init__(self):
        self.text = PAGE.read_text()
        self._lock = threading.Lock()
        self.server = serve(("127.0.0.1", 0), {"GET /metrics": self._get}, name="dcgm")

    def _get(self, req):
        with self._lock:
            return 200, "text/plain; version=0.0.4", self.text.encode()

    def set_xid(self, code: int) -> None:
        with self._lock:
            lines = [ln.rsplit(" ", 1)[0] + f" {code}" if ln.startswith(XID_GPU1) else ln
                     for ln in self.text.splitlines()]
            self.text = "\n".join(lines) + "\n"


def by_instance(samples) -> dict[str, float]:
    return {s.labels["instance"]: s.value for s in samples}


def evidence(got: dict, instance: str) -> tuple[str, ...]:
    """The controller's evidence names for one node from the signals read (a value > 0 is the flag)."""
    flag = {k: by_instance(got.get(k, [])).get(instance, 0) > 0 for k in ("gpu_throttled", "pcie_degraded",
                                                                         "gpu_ecc", "gpu_xid")}
    return signals.evidence(flag["gpu_throttled"], flag["pcie_degraded"], flag["gpu_ecc"], flag["gpu_xid"])


def test_the_controller_reads_gpu_evidence_from_dcgm_exporter_with_the_nvml_collector_off(tmp_path):
    require("prometheus")
    page = DcgmPage()
    exporters = [Exporter(port=0, nvml=None, probe=None, pod=("inference", pod)).start() for pod in PODS]
    try:
        # one job, a static config a node: each target's instance is its vLLM's address
        exporter_job = static_job("grayguard-exporter", [])
        exporter_job["static_configs"] = [
            {"targets": [e.url.removeprefix("http://")], "labels": {"pool": "chat", "instance": inst}}
            for e, inst in zip(exporters, PODS.values(), strict=True)]
        jobs = [exporter_job]
        # dcgm-exporter scraped without honor_labels, its target labelled with its own pod: its pod labels are
        # stored as exported_pod and exported_namespace, as a ServiceMonitor of the GPU operator's has them
        jobs.append(static_job("dcgm-exporter", [page.server.netloc],
                               {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p"}))
        doc = {"pools": [{"name": "chat", "backend": "vllm_chat", "peer_group_label": "name"}],
               "rules": {"gpu_source": "dcgm", "control_window": "10s", "human_window": "10s",
                         "control_interval": "1s", "human_interval": "1s"},
               "signals": {"hardware_every_s": 0}}
        rules = tmp_path / "rules"
        rules.mkdir()
        cfg0 = parse_config(doc)
        for name, text in render_all(cfg0).items():
            (rules / name).write_text(text)
        with start_prometheus(prometheus_config(jobs), sorted(rules.iterdir())) as prom:
            cfg = parse_config({**doc, "prometheus": {"url": prom.url}})
            ctl = Controller(cfg, PrometheusClient(cfg.prometheus), [])
            want = {PODS["vllm-chat-0"]: 0, PODS["vllm-chat-1"]: 0, PODS["vllm-chat-2"]: 1}

            def throttled():
                got = ctl.read_optional()
                return got if by_instance(got.get("gpu_throttled", [])) == want else None

            got = wait_until(throttled, timeout_s=30, what="GPU 2's throttling read by the controller")
            # the NVML collector is off: every grayguard_gpu_* series is recorded by the dcgm rules (no job label)
            assert prom.query('count({__name__=~"grayguard_gpu_.+", job!=""})') == []
            assert by_instance(got["pcie_degraded"]) == dict.fromkeys(PODS.values(), 0)
            assert by_instance(got["gpu_ecc"]) == dict.fromkeys(PODS.values(), 0)
            assert got.get("gpu_xid", []) == []
            assert {(s.labels["instance"], s.labels["name"]) for s in got["peer_group"]} == {
                (inst, "NVIDIA H100 80GB HBM3") for inst in PODS.values()}
            assert {inst: evidence(got, inst) for inst in PODS.values()} == {
                PODS["vllm-chat-0"]: (), PODS["vllm-chat-1"]: (), PODS["vllm-chat-2"]: ("GPU throttling under load",)}
            # an XID on GPU 1 (vllm-chat-1's): new for one human window, its code the value
            page.set_xid(79)
            xid = wait_until(lambda: by_instance(ctl.read_optional().get("gpu_xid", [])) or None, timeout_s=30,
                             what="the XID read by the controller")
            assert xid == {PODS["vllm-chat-1"]: 79}
            assert evidence({"gpu_xid": ctl.read_optional()["gpu_xid"]}, PODS["vllm-chat-1"]) == ("XID errors",)
    finally:
        for e in exporters:
            e.stop()
        page.server.stop()
