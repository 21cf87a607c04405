"""components/exporter-sidecar-dcgm: the exporter sidecar for rules.gpu_source: dcgm (probes only, no NVML, no GPU
mounted), rendered by the real `kubectl kustomize` into the production overlay."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest

from grayguard.exporters import cli as exporter_cli
from grayguard.exporters.podinfo import NAMESPACE_ENV, POD_ENV
from tests.support.kube import kustomize

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
SIDECAR = "../../components/exporter-sidecar"


def sidecars(objs: list[dict]) -> list[dict]:
    return [c for o in objs if o["kind"] in ("StatefulSet", "Deployment")
            for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "grayguard-exporter"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The production overlay as shipped, and with the dcgm component after the sidecar's."""
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(K8S, tree)
    kfile = tree / "overlays" / "production" / "kustomization.yaml"
    text = kfile.read_text()
    assert text.count(f"  - {SIDECAR}\n") == 1
    kfile.write_text(text.replace(f"  - {SIDECAR}\n", f"  - {SIDECAR}\n  - {SIDECAR}-dcgm\n"))
    return sidecars(kustomize(K8S / "overlays" / "production")), sidecars(kustomize(kfile.parent))


def test_the_dcgm_sidecar_is_the_shipped_one_with_the_nvml_collector_off_and_no_gpu(rendered):
    shipped, dcgm = rendered
    assert len(dcgm) == len(shipped) >= 1
    for base, c in zip(shipped, dcgm, strict=True):
        # the same arguments but one: a list is replaced whole, so the component must not drift from the sidecar's
        assert [a for a in c["args"] if a != "--no-collector.nvml"] == base["args"]
        assert "--no-collector.nvml" in c["args"] and "--no-collector.nvml" not in base["args"]
        env = {e["name"] for e in c["env"]}
        assert {POD_ENV, NAMESPACE_ENV} <= env
        assert not {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"} & env
        assert {"NVIDIA_VISIBLE_DEVICES", POD_ENV, NAMESPACE_ENV} <= {e["name"] for e in base["env"]}


def test_the_dcgm_sidecars_command_line_parses_with_the_collector_off(rendered, monkeypatch):
    monkeypatch.setenv(POD_ENV, "vllm-chat-0")
    monkeypatch.setenv(NAMESPACE_ENV, "inference")
    sample = {"POD_NAME": "vllm-chat-0", "POD_IP": "10.0.0.7", "GRAYGUARD_POOL": "chat",
              "GRAYGUARD_REGISTRY_URL": "http://grayguard-etcd.grayguard.svc:2379"}
    for c in rendered[1]:
        argv = [re.sub(r"\$\((\w+)\)", lambda m: sample[m.group(1)], a) for a in c["args"]]
        assert argv[0] == "exporter"
        parser = argparse.ArgumentParser()
        exporter_cli.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        assert exporter_cli.config_error(args) is None
        assert args.nvml is False and (args.pod_namespace, args.pod_name) == ("inference", "vllm-chat-0")
