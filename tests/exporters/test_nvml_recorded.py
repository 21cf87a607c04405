"""The exporter's NVML collector on a real GPU's answers: an H200 recorded by `python -m
grayguard.localstack.gpurecord` on this
workplace's lent GPU machine (tests/fixtures/nvml_h200/: idle, under a bf16 matrix-product load, after).

NVML is the one part the project's tests otherwise fake (exporters/fakenvml.py); this is what a real driver
(580.159.04) said, replayed through the same collector, and what the shipped GPU-evidence queries and alerts make
of it on the real promtool."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grayguard.config import SignalsConfig
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.gpumetrics import describe_families
from grayguard.exporters.nvml import NvmlCollector
from grayguard.localstack.gpurecord import Recorder, page, replay_module
from grayguard.vocab import GPU_FLAGS
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "nvml_h200"
PHASES = ("idle", "load", "after")
BIT = dict(GPU_FLAGS)


@pytest.fixture(scope="module")
def recording() -> dict:
    return json.loads((FIXTURE / "nvml_calls.json").read_text())


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.mark.parametrize("phase", PHASES)
def test_the_collector_on_the_recorded_answers_gives_the_recorded_page(recording, phase):
    scrapes = sum(1 for c in recording["calls"] if c["phase"] == phase and c["fn"] == "nvmlSystemGetDriverVersion")
    assert scrapes >= 3
    col = NvmlCollector(nvml=replay_module(recording, phase), xid_events=False)
    assert col.start()
    for _ in range(scrapes):
        text = page(col)
    assert text == (FIXTURE / f"page_{phase}.prom").read_text()


def info(text: str) -> dict[str, str]:
    """The labels of the page's one grayguard_gpu_info series."""
    (labels,) = [dict(ls) for (n, ls) in samples(text) if n == "grayguard_gpu_info"]
    return labels


def test_what_a_real_h200_reports_idle_and_busy():
    idle, load, after = ((FIXTURE / f"page_{p}.prom").read_text() for p in PHASES)
    assert 'name="NVIDIA H200"' in idle and 'driver_version="580.159.04"' in idle
    for text in (idle, load, after):  # every family the collector exports is one it describes (docs/metrics.md)
        described = {m.name for m in describe_families()}
        names = {fam.name for fam in text_string_to_metric_families(text)}
        assert names <= described, names - described
        assert value(text, "grayguard_exporter_nvml_up") == 1
        assert value(text, "grayguard_gpu_flags", gpu="0") == 0  # not lost, no remap, not slowed, link at its max
        # the link stays at its maximum in this VM, idle or busy (bare metal often drops to Gen1 when idle: the
        # shipped link check looks only under load for that reason)
        assert value(text, "grayguard_gpu_pcie_link_generation") == int(info(text)["pcie_max_generation"]) == 5
        assert value(text, "grayguard_gpu_pcie_link_width") == int(info(text)["pcie_max_width"]) == 16
        assert value(text, "grayguard_gpu_ecc_errors", error_type="uncorrected", counter_type="volatile") == 0
    assert value(idle, "grayguard_gpu_clock_event_reasons") == 0x1  # gpu_idle alone
    assert value(idle, "grayguard_gpu_utilization_ratio") == 0
    # busy and healthy: at its power cap, SM clock well under its maximum, sw_power_cap the only reason
    assert value(load, "grayguard_gpu_utilization_ratio") == 1
    assert value(load, "grayguard_gpu_power_watts") > 0.95 * value(load, "grayguard_gpu_power_limit_watts")
    clock, top = value(load, "grayguard_gpu_sm_clock_hertz"), value(load, "grayguard_gpu_sm_clock_max_hertz")
    assert 0.6 * top < clock < 0.85 * top
    assert value(load, "grayguard_gpu_clock_event_reasons") == 0x4


def _promtool_inputs(text: str, overrides: dict[str, float]) -> list[dict]:
    """The page's GPU series as promtool input series of one node (pool p, instance n0), constant for 20 minutes;
    overrides: 'name{reason="x"}'-style keys set to another value."""
    out = []
    for (name, ls), v in sorted(samples(text).items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
        if not name.startswith("grayguard_"):
            continue
        labels = dict(ls, pool="p", instance="n0")
        series = name + "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}"
        for key, new in overrides.items():
            oname, _, olabel = key.partition("{")
            if oname == name and all(part in series for part in olabel.rstrip("}").split(",") if part):
                v = new
        out.append({"series": series, "values": f"{v:g}x20"})
    return out


def _evaluate(tmp_path: Path, text: str, overrides: dict[str, float], throttled: int, pcie: int,
              alerts: list[str]) -> subprocess.CompletedProcess:
    sig = SignalsConfig()
    exp = {"throttled": throttled, "pcie": pcie}
    tests = [{
        "interval": "1m",
        "input_series": _promtool_inputs(text, overrides),
        "promql_expr_test": [
            {"expr": q, "eval_time": "15m",
             "exp_samples": [{"labels": "{instance=\"n0\", pool=\"p\"}", "value": exp[k]}]}
            for k, q in (("throttled", sig.gpu_throttled_query), ("pcie", sig.pcie_degraded_query))],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": name,
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": THROTTLED_ANNOTATIONS}
                            for n, labels in _fired(alerts) if n == name]}
            for name in ("GrayguardGpuThrottled", "GrayguardGpuPcieLinkDegraded")],
    }]
    shutil.copy(REPO / "rules" / "grayguard-alerts.rules.yml", tmp_path / "alerts.rules.yml")
    (tmp_path / "t.test.yml").write_text(yaml.safe_dump({"rule_files": ["alerts.rules.yml"], "tests": tests}))
    return subprocess.run([shutil.which("promtool"), "test", "rules", "t.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _fired(alerts: list[str]) -> list[tuple[str, dict]]:
    labels = {"pool": "p", "instance": "n0", "gpu": "0", "uuid": "GPU-5c3e1299-eb94-fea4-e583-ded9ada3b9ff",
              "severity": "ticket"}
    return [(a, {**labels, **({"reason": "hw_slowdown"} if a == "GrayguardGpuThrottled" else {})}) for a in alerts]


THROTTLED_ANNOTATIONS = {
    "summary": "A busy GPU is thermally or power throttled.",
    "description": "GPU 0 (GPU-5c3e1299-eb94-fea4-e583-ded9ada3b9ff) of n0 in pool p is throttled under load (reason "
                   "hw_slowdown): it runs slower than its peers.",
    "runbook_url": "https://github.com/grayguard/grayguard/blob/main/docs/runbook.md#grayguardgputhrottled",
    # no controller series in this test: the node is unknown, and the alert says so (rules/render.py)
    "node": "", "reason": "unknown (the controller does not track this node)"}


@pytest.mark.parametrize("phase", PHASES)
def test_the_shipped_gpu_evidence_calls_a_real_h200_healthy_idle_or_at_its_power_cap(tmp_path, phase):
    require("promtool")
    res = _evaluate(tmp_path, (FIXTURE / f"page_{phase}.prom").read_text(), {}, 0, 0, [])
    assert res.returncode == 0, res.stdout + res.stderr


def _page_with(recording: dict, phase: str, **results: int) -> str:
    """The collector's page of a phase whose recorded answers of the named NVML calls are replaced: the same
    driver, a reading it could have given."""
    calls = [dict(c, result=results[c["fn"]]) if c["phase"] == phase and c["fn"] in results else c
             for c in recording["calls"]]
    col = NvmlCollector(nvml=replay_module({**recording, "calls": calls}, phase), xid_events=False)
    assert col.start()
    scrapes = sum(1 for c in calls if c["phase"] == phase and c["fn"] == "nvmlSystemGetDriverVersion")
    for _ in range(scrapes):
        text = page(col)
    return text


def test_the_same_busy_gpu_with_a_hardware_slowdown_is_throttled_evidence(tmp_path, recording):
    """The check above can fail: the recorded busy GPU whose clock-event answer adds hw_slowdown (0x8) to its
    sw_power_cap (0x4) is throttled, by the exporter's flag the controller reads, and alerts; idle, it is not."""
    require("promtool")
    text = _page_with(recording, "load", nvmlDeviceGetCurrentClocksEventReasons=0x4 | 0x8)
    assert value(text, "grayguard_gpu_flags") == BIT["slowed_under_load"]
    assert value(text, "grayguard_gpu_clock_event_reasons") == 0x4 | 0x8
    res = _evaluate(tmp_path, text, {}, 1, 0, ["GrayguardGpuThrottled"])
    assert res.returncode == 0, res.stdout + res.stderr
    wrong = _evaluate(tmp_path, text, {}, 0, 0, [])
    assert wrong.returncode != 0
    idle = _page_with(recording, "idle", nvmlDeviceGetCurrentClocksEventReasons=0x1 | 0x8)
    assert value(idle, "grayguard_gpu_flags") == 0  # an idle GPU's slowdown is no evidence


def test_a_busy_gpu_on_a_narrower_link_is_pcie_evidence(recording):
    text = _page_with(recording, "load", nvmlDeviceGetCurrPcieLinkWidth=4)
    assert value(text, "grayguard_gpu_flags") == BIT["pcie_below_max"] | BIT["pcie_degraded_under_load"]
    assert value(_page_with(recording, "idle", nvmlDeviceGetCurrPcieLinkWidth=4),
                 "grayguard_gpu_flags") == BIT["pcie_below_max"]  # an idle link below its max: no load evidence


def test_a_recording_of_the_fake_replays_to_the_same_pages():
    """The recorder and the replay themselves, on the fake: two GPUs, a field the driver does not support, a value
    that changes between scrapes, the XID watcher's calls recorded beside the reads."""
    fake = FakeNvml([healthy_h100(0, unsupported={"pcie_replay"}), healthy_h100(1, pcie_gen=1)])
    rec = Recorder(fake)
    col = NvmlCollector(nvml=rec, xid_events=True)
    assert col.start()
    rec.phase = "a"
    first = page(col)
    fake.gpus[0].sm_clock_mhz = 1200
    rec.phase = "b"
    second = page(col)
    col.stop()
    assert first != second
    recording = json.loads(json.dumps({"constants": rec.constants, "calls": rec.calls}))
    assert any(c["fn"] == "nvmlDeviceGetPcieReplayCounter" and c.get("error") == "NVMLError_NotSupported"
               for c in recording["calls"])
    again = NvmlCollector(nvml=replay_module(recording), xid_events=False)
    assert again.start()
    assert [page(again), page(again)] == [first, second]
    only_b = NvmlCollector(nvml=replay_module(recording, "b"), xid_events=False)
    assert only_b.start() and page(only_b) == second
