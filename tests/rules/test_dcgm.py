"""rules.gpu_source: dcgm: the GPU alerts and the GPU evidence the controller reads, fed by dcgm-exporter's own
series (tests/fixtures/dcgm, its default counters under both field-name versions) with no grayguard_gpu_* series
from the exporter, through promtool; scraped with honor_labels and without. Rules rendered at test time."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grayguard.config import DCGM_SIGNALS, ConfigError, SignalsConfig, parse_config
from grayguard.rules import dcgm
from grayguard.rules.render import ALERTS_FILE, RECORDING_FILE, render_alerts, render_all, render_dcgm
from grayguard.vocab import GPU_FLAGS
from tests.support.stack import require

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
PAGES = {"throttle_reasons": FIXTURES / "dcgm-exporter-throttle-reasons.prom",
         "clocks_event_reasons": FIXTURES / "dcgm-exporter-clocks-event-reasons.prom"}
DCGM_TARGET = {"job": "dcgm-exporter", "instance": "10.1.0.7:9400"}
# the dcgm-exporter pod's own labels, as a PodMonitor or ServiceMonitor adds them to its target
DCGM_POD = {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p", "container": "nvidia-dcgm-exporter"}
NODES = {"vllm-chat-0": "10.0.0.10:8000", "vllm-chat-1": "10.0.0.11:8000", "vllm-chat-2": "10.0.0.12:8000",
         "vllm-chat-9": "10.0.0.19:8000"}  # vllm-chat-9: a node whose pod holds no GPU of dcgm-exporter's
UUID = {p: f"GPU-6a3f2c1e-8b0d-4c55-9e11-0f7d2b9c4a0{i + 1}" for i, p in enumerate(NODES) if p != "vllm-chat-9"}
STEPS = 30  # minutes of input, one sample a minute
BUS_IDS = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0")


def dcgm_config(**rules):
    # the global evaluation interval (1m here) for every group, as promtool evaluates them
    return parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}],
                         "rules": {"gpu_source": "dcgm", "control_interval": None, "human_interval": None, **rules}})


def page_samples(path: Path) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a fixture page (counters keep their page name)."""
    text = path.read_text()
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name if s.name in text else s.name.removesuffix("_total")
            out.append((name, dict(s.labels), s.value))
    return out


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def scraped(labels: dict[str, str], honor_labels: bool) -> dict[str, str]:
    """A dcgm-exporter sample's labels as Prometheus stores them: with honor_labels its own win; without, its pod,
    namespace and container become exported_* and the target's (the dcgm-exporter pod's) take their place."""
    if honor_labels:
        return {**DCGM_TARGET, **labels}
    out = {**DCGM_TARGET, **DCGM_POD}
    for k, v in labels.items():
        out[f"exported_{k}" if k in DCGM_POD else k] = v
    return out


def pod_of(labels: dict[str, str]) -> str | None:
    return labels.get("pod")


# the scenario: name -> pod -> promtool values, over the fixture's own value elsewhere
def overrides(page: str) -> dict[tuple[str, str], str]:
    names = {n for n, _, _ in page_samples(PAGES[page])}
    xid = next(n for n in dcgm.XID if n in names)
    return {
        ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "vllm-chat-1"): f"8x{STEPS}",  # trained down to x8, under load
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "vllm-chat-0"): f"0 0 0 1x{STEPS - 3}",  # an uncorrectable error at 3m
        (xid, "vllm-chat-1"): f"0x9 79x{STEPS - 10}",  # XID 79 at 10m
        (xid, "vllm-chat-0"): f"43x{STEPS}",  # an old XID, from before the rules were loaded: never new
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", "vllm-chat-0"): f"0x5 1x{STEPS - 6}",  # a row remap pending from 6m
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "vllm-chat-1"): f"0x5 1x{STEPS - 6}",  # a failed row remap from 6m
    }


def input_series(page: str, honor_labels: bool) -> list[dict]:
    ov = overrides(page)
    out = []
    for name, labels, value in page_samples(PAGES[page]):
        values = ov.get((name, pod_of(labels)), f"{value:g}x{STEPS}")
        out.append({"series": _series(name, scraped(labels, honor_labels)), "values": values})
    for pod, instance in NODES.items():
        exporter = {"job": "grayguard-exporter", "pool": "chat", "instance": instance}
        # as a PodMonitor scrapes the sidecar without honor_labels: its pod labels become exported_*, the target's
        # pod and namespace are the same pod's
        info = ({**exporter, "namespace": "inference", "pod": pod} if honor_labels else
                {**exporter, "namespace": "inference", "pod": pod, "exported_namespace": "inference",
                 "exported_pod": pod})
        out.append({"series": _series("grayguard_node_pod_info", info), "values": f"1x{STEPS}"})
        out.append({"series": _series("up", exporter), "values": f"1x{STEPS}"})
    assert not [s for s in out if s["series"].startswith("grayguard_gpu_")], "no exporter GPU series in dcgm mode"
    return out


def gpu(pod: str, **extra) -> dict[str, str]:
    i = list(NODES).index(pod)
    return {"pool": "chat", "instance": NODES[pod], "gpu": str(i), "uuid": UUID[pod], **extra}


def samples(name: str, rows: list[tuple[dict[str, str], float]]) -> list[dict]:
    return [{"labels": _series(name, labels), "value": v} for labels, v in rows]


def expr_tests(cfg) -> list[dict]:
    sig = cfg.signals
    node = {p: {"pool": "chat", "instance": NODES[p]} for p in NODES}
    firing = {"alertstate": "firing"}
    t = []

    def at(minutes, expr, exp):
        t.append({"expr": expr, "eval_time": f"{minutes}m", "exp_samples": exp})

    pods = ("vllm-chat-0", "vllm-chat-1", "vllm-chat-2")
    # GPU 3 holds no pod: no series; the node of vllm-chat-9 has no GPU
    util = [(gpu(p), v) for p, v in zip(pods, (0.93, 0.91, 0.92), strict=True)]
    at(2, "grayguard_gpu_utilization_ratio", samples("grayguard_gpu_utilization_ratio", util))
    at(2, "grayguard_gpu_info", samples("grayguard_gpu_info", [(gpu(p, name="NVIDIA H100 80GB HBM3", pci_bus_id=b,
                                                                    driver_version=""), 1)
                                                               for p, b in zip(pods, BUS_IDS, strict=True)]))
    # the reasons: the mask itself, one series a GPU; GPU 2 (0x44) hw_thermal_slowdown and sw_power_cap
    at(2, 'grayguard_gpu_clock_event_reasons{gpu="2"}',
       samples("grayguard_gpu_clock_event_reasons", [(gpu("vllm-chat-2"), 0x44)]))
    # the exporter's judgements as one mask (GPU_FLAGS): GPU 2 slowed under load (0x8); GPU 1's link at x8 of x16
    # under load (0x10 pcie_below_max, 0x20 pcie_degraded_under_load); from 6m GPU 0's row remap pending (0x2) and
    # GPU 1's failed (0x4); never lost (0x1: DCGM has no such field)
    bit = dict(GPU_FLAGS)
    before = {"vllm-chat-0": 0, "vllm-chat-1": bit["pcie_below_max"] + bit["pcie_degraded_under_load"],
              "vllm-chat-2": bit["slowed_under_load"]}
    after = {**before, "vllm-chat-0": bit["row_remap_pending"],
             "vllm-chat-1": before["vllm-chat-1"] + bit["row_remap_failure"]}
    at(2, dcgm.FLAGS, samples(dcgm.FLAGS, [(gpu(p), before[p]) for p in pods]))
    at(6, dcgm.FLAGS, samples(dcgm.FLAGS, [(gpu(p), after[p]) for p in pods]))
    at(2, 'grayguard_gpu_ecc_errors{error_type="uncorrected"}', samples("grayguard_gpu_ecc_errors", [
        (gpu(p, error_type="uncorrected", counter_type="volatile"), 0) for p in pods]))
    at(4, 'grayguard_gpu_ecc_errors{error_type="uncorrected"} > 0', samples("grayguard_gpu_ecc_errors", [
        (gpu("vllm-chat-0", error_type="uncorrected", counter_type="volatile"), 1)]))
    at(2, "grayguard_gpu_memory_used_bytes", samples("grayguard_gpu_memory_used_bytes",
                                                     [(gpu(p), 74797 * 1048576) for p in pods]))
    # XID 79 at 10m is new for one window (5m); the old XID 43 never is
    for m, exp in ((9, []), (10, [(gpu("vllm-chat-1"), 79)]), (14, [(gpu("vllm-chat-1"), 79)]), (15, [])):
        at(m, dcgm.XID_NEW, samples(dcgm.XID_NEW, exp))
    # the controller's default GPU queries, as it sends them, read the recorded series
    at(12, sig.gpu_throttled_query, samples("", [(node[p], int(p == "vllm-chat-2")) for p in pods]))
    at(12, sig.pcie_degraded_query, samples("", [(node[p], int(p == "vllm-chat-1")) for p in pods]))
    at(12, sig.gpu_ecc_query, samples("", [(node[p], int(p == "vllm-chat-0")) for p in pods]))
    at(12, sig.gpu_xid_query, samples("", [(node["vllm-chat-1"], 79)]))
    at(12, sig.peer_group_query, samples("", [({**node[p], "name": "NVIDIA H100 80GB HBM3"}, 1) for p in pods]))
    # the GPU alerts: a firing and a silent case each, around their `for:`
    alert = 'ALERTS{alertname="%s", alertstate="firing"}'

    def fires_at(m: int, name: str, pod: str, severity: str, **labels) -> None:
        """The GPU alert is silent at minute m - 1 and fires at m for pod's GPU."""
        at(m - 1, alert % name, [])
        at(m, alert % name, samples("ALERTS", [(gpu(pod, alertname=name, severity=severity, **labels, **firing), 1)]))

    fires_at(10, "GrayguardGpuThrottled", "vllm-chat-2", "ticket", reason="hw_thermal_slowdown")
    fires_at(10, "GrayguardGpuPcieLinkDegraded", "vllm-chat-1", "ticket")
    fires_at(4, "GrayguardGpuEccUncorrectable", "vllm-chat-0", "page")
    fires_at(11, "GrayguardGpuXidError", "vllm-chat-1", "page")
    at(16, alert % "GrayguardGpuXidError", [])
    # no GPU of dcgm-exporter's joins vllm-chat-9: no GPU evidence for that node (the sidecar runs no NVML)
    down = {**node["vllm-chat-9"], "alertname": "GrayguardNvmlDown", "severity": "ticket", **firing}
    at(4, alert % "GrayguardNvmlDown", [])
    at(5, alert % "GrayguardNvmlDown", samples("ALERTS", [(down, 1)]))
    fires_at(7, "GrayguardGpuRowRemapFailure", "vllm-chat-1", "page")
    fires_at(21, "GrayguardGpuRowRemapPending", "vllm-chat-0", "ticket")
    at(21, alert % "GrayguardGpuLost", [])
    return t


@pytest.fixture(scope="module")
def promtool():
    require("promtool")
    return shutil.which("promtool")


DCGM_FILE = "grayguard-dcgm.rules.yml"


def run_promtool(promtool: str, tmp_path: Path, cfg, page: str, honor_labels: bool) -> subprocess.CompletedProcess:
    """promtool test rules on dcgm-exporter's group and the alerts, fed by the page's series."""
    return promtool_case(promtool, tmp_path, cfg, input_series(page, honor_labels), expr_tests(cfg))


def promtool_case(promtool: str, tmp_path: Path, cfg, series: list[dict], tests: list[dict]):
    """promtool test rules on dcgm-exporter's group (render_dcgm: what render_recording appends in dcgm mode) and
    the alerts: the vLLM recording rules are not needed (the alerts' load test is the GPU's utilization here)."""
    files = {DCGM_FILE: "groups:\n" + render_dcgm(cfg), ALERTS_FILE: render_alerts(cfg)}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    groups = [g["name"] for name in files for g in yaml.safe_load(files[name])["groups"]]
    test = {"rule_files": list(files), "evaluation_interval": "1m", "group_eval_order": groups,
            "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    (tmp_path / "dcgm.test.yml").write_text(yaml.safe_dump(test, sort_keys=False, width=1000))
    return subprocess.run([promtool, "test", "rules", "dcgm.test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_a_restarted_pod_does_not_make_an_old_xid_new(promtool, tmp_path):
    """GPU 0 holds XID 43 from long ago. Its pod is replaced at 10m (a Deployment: a new pod, a new node): the new
    pod's series carry the old code from their first sample, and no XID is new, for the old node or the new one. A
    new XID after that (31 at 20m) is."""
    page = page_samples(PAGES["throttle_reasons"])
    gpu0 = {n: labels for n, labels, _ in page if labels.get("pod") == "vllm-chat-0"}
    old, new = "vllm-chat-0", "vllm-chat-5d9f7"
    nodes = {old: "10.0.0.10:8000", new: "10.0.0.30:8000"}
    series = []
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_XID_ERRORS"):
        values = ("93", "93") if name == "DCGM_FI_DEV_GPU_UTIL" else ("43", "43")
        later = "93x10" if name == "DCGM_FI_DEV_GPU_UTIL" else "43x9 31x10"
        series.append({"series": _series(name, {**DCGM_TARGET, **gpu0[name]}), "values": f"{values[0]}x9"})
        series.append({"series": _series(name, {**DCGM_TARGET, **gpu0[name], "pod": new}),
                       "values": "_x10 " + later})
    for pod, values in ((old, "1x9"), (new, "_x10 1x20")):
        info = {"job": "grayguard-exporter", "pool": "chat", "instance": nodes[pod], "namespace": "inference",
                "pod": pod}
        series.append({"series": _series("grayguard_node_pod_info", info), "values": values})
    uuid = gpu0["DCGM_FI_DEV_GPU_UTIL"]["UUID"]
    at_new = {"pool": "chat", "instance": nodes[new], "gpu": "0", "uuid": uuid}
    tests = [{"expr": dcgm.XID_NEW, "eval_time": f"{m}m", "exp_samples": []} for m in (5, 9, 10, 11, 15, 19)]
    tests += [{"expr": dcgm.XID_NEW, "eval_time": "20m", "exp_samples": samples(dcgm.XID_NEW, [(at_new, 31)])},
              {"expr": "grayguard_gpu_utilization_ratio", "eval_time": "12m",
               "exp_samples": samples("grayguard_gpu_utilization_ratio", [(at_new, 0.93)])}]
    res = promtool_case(promtool, tmp_path, dcgm_config(), series, tests)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_flags_of_a_gpu_without_the_optional_fields(promtool, tmp_path):
    """A dcgm-exporter that exports only the utilization and the clock-event mask (no row remap or PCIe fields, as
    with a counters CSV that leaves them out): grayguard_gpu_flags is still recorded for the GPU, the bits it cannot
    tell 0 (clear, as the sidecar's collector does when NVML cannot tell), slowed_under_load from what it has."""
    page = page_samples(PAGES["clocks_event_reasons"])
    gpu0 = {n: labels for n, labels, _ in page if labels.get("pod") == "vllm-chat-0"}
    series = [{"series": _series("DCGM_FI_DEV_GPU_UTIL", {**DCGM_TARGET, **gpu0["DCGM_FI_DEV_GPU_UTIL"]}),
               "values": "93x9 10x10"},  # busy, then idle from 10m
              {"series": _series("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                                 {**DCGM_TARGET, **gpu0["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]}),
               "values": "0x4 72x15"},  # 0x48: hw_slowdown and hw_thermal_slowdown from 5m
              {"series": _series("grayguard_node_pod_info", {"job": "grayguard-exporter", "pool": "chat",
                                                             "instance": NODES["vllm-chat-0"],
                                                             "namespace": "inference", "pod": "vllm-chat-0"}),
               "values": "1x20"}]
    at = gpu("vllm-chat-0")
    tests = [{"expr": dcgm.FLAGS, "eval_time": f"{m}m", "exp_samples": samples(dcgm.FLAGS, [(at, v)])}
             for m, v in ((2, 0), (6, dict(GPU_FLAGS)["slowed_under_load"]), (12, 0))]
    res = promtool_case(promtool, tmp_path, dcgm_config(), series, tests)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("honor_labels", [True, False], ids=["honor_labels", "exported_pod"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_gpu_alerts_and_evidence_from_dcgm_exporter_series(promtool, tmp_path, page, honor_labels):
    res = run_promtool(promtool, tmp_path, dcgm_config(), page, honor_labels)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_rule_test_catches_a_lost_bit(promtool, tmp_path, monkeypatch):
    """Not vacuous: a throttle decode that reads the wrong bit for hw_thermal_slowdown (0x20, sw_thermal) fails."""
    wrong = tuple((r, 0x20 if r == "hw_thermal_slowdown" else b) for r, b in dcgm.CLOCK_EVENT_REASONS)
    monkeypatch.setattr(dcgm, "CLOCK_EVENT_REASONS", wrong)
    res = run_promtool(promtool, tmp_path, dcgm_config(), "clocks_event_reasons", True)
    assert res.returncode != 0
    assert "grayguard_gpu_flags" in res.stdout + res.stderr


def test_dcgm_rules_pass_promtool_check(promtool, tmp_path):
    cfg = dcgm_config(control_interval="5s")
    for name, text in {DCGM_FILE: "groups:\n" + render_dcgm(cfg), ALERTS_FILE: render_alerts(cfg)}.items():
        (tmp_path / name).write_text(text)
    res = subprocess.run([promtool, "check", "rules", "--lint-fatal", *(str(p) for p in tmp_path.iterdir())],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


# pure: the switch, its validation and what it changes


def test_the_fixture_pages_are_dcgm_exporters_default_counters_under_both_names():
    names = {p: {n for n, _, _ in page_samples(path)} for p, path in PAGES.items()}
    assert "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" in names["throttle_reasons"]
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in names["clocks_event_reasons"]
    assert "DCGM_FI_DEV_XID_ERRORS" in names["throttle_reasons"]
    assert "DCGM_FI_DEV_XID_ERROR" in names["clocks_event_reasons"]
    for p, path in PAGES.items():
        head = path.read_text().split("\n\n", 1)[0]
        assert "NVIDIA/dcgm-exporter" in head and "etc/default-counters.csv" in head
        assert re.search(r"commit [0-9a-f]{40}", head)
        for name, labels, _ in page_samples(path):
            assert {"gpu", "UUID", "modelName"} <= set(labels), name
        # every field the rules read is on the page under one of its names, or is one DCGM leaves out on H100
        read = dcgm.field_names()
        assert {n for n in names[p] if n in read} >= {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                                                      "DCGM_FI_DEV_PCIE_LINK_GEN", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"}


def test_the_rules_decode_the_reasons_with_the_exporters_bits():
    from grayguard.exporters.gpumetrics import SLOWDOWN_BITS

    assert sum(bit for _, bit in dcgm.slowdown_bits()) == SLOWDOWN_BITS
    assert [bit for _, bit in dcgm.CLOCK_EVENT_REASONS] == [1 << k for k in range(9)]  # NVML's bits, in order
    # the alerts template decodes each slowdown reason with its bit
    alerts = render_alerts(parse_config({"pools": [{"name": "a", "backend": "b"}]}))
    for reason, bit in dcgm.slowdown_bits():
        decode = rf'\(grayguard_gpu_clock_event_reasons\) / {bit}\) % 2 == 1,\s+"reason", "{reason}"'
        assert len(re.findall(decode, alerts)) == 2, reason  # the alert's two load conditions
    assert alerts.count("(grayguard_gpu_clock_event_reasons) / ") == 2 * len(dcgm.slowdown_bits())


def test_gpu_source_is_validated_and_names_the_field():
    with pytest.raises(ConfigError) as e:
        parse_config({"pools": [{"name": "a", "backend": "b"}], "rules": {"gpu_source": "nvml"}})
    assert e.value.path == "rules.gpu_source" and "exporter, dcgm" in e.value.problem


def test_dcgm_switches_the_xid_query_unless_it_is_given():
    assert parse_config({"pools": [{"name": "a", "backend": "b"}]}).signals.gpu_xid_query == \
        SignalsConfig().gpu_xid_query
    cfg = dcgm_config()
    assert cfg.signals.gpu_xid_query == DCGM_SIGNALS["gpu_xid_query"]
    # the other GPU signals read grayguard_gpu_* series, which the dcgm rules record under the exporter's names
    for name in ("gpu_throttled_query", "pcie_degraded_query", "gpu_ecc_query", "peer_group_query"):
        assert getattr(cfg.signals, name) == getattr(SignalsConfig(), name)
    given = parse_config({"pools": [{"name": "a", "backend": "b"}], "rules": {"gpu_source": "dcgm"},
                          "signals": {"gpu_xid_query": "max by (pool, instance) (my_xids)"}})
    assert given.signals.gpu_xid_query == "max by (pool, instance) (my_xids)"


def test_every_series_the_controller_and_alerts_read_is_recorded_in_dcgm_mode():
    cfg = dcgm_config()
    recorded = {r["record"] for r in yaml.safe_load("groups:\n" + render_dcgm(cfg))["groups"][0]["rules"]}
    for name in ("grayguard_gpu_flags", "grayguard_gpu_info", "grayguard_gpu_ecc_errors",
                 "grayguard_gpu_clock_event_reasons", "grayguard_gpu_utilization_ratio",
                 "grayguard_gpu_pcie_link_generation", "grayguard_gpu_pcie_link_width", dcgm.XID_NEW):
        assert name in recorded
    for query in (cfg.signals.gpu_throttled_query, cfg.signals.pcie_degraded_query, cfg.signals.gpu_ecc_query,
                  cfg.signals.gpu_xid_query, cfg.signals.peer_group_query):
        assert any(n in query for n in recorded), query


def test_exporter_mode_renders_no_dcgm_rules():
    cfg = parse_config({"pools": [{"name": "a", "backend": "b"}]})
    files = render_all(cfg)
    assert "DCGM_FI" not in files[RECORDING_FILE] + files[ALERTS_FILE]
    assert "grayguard_exporter_nvml_up" in files[ALERTS_FILE]
    dcgm_files = render_all(dcgm_config())
    assert dcgm_files[RECORDING_FILE].endswith(render_dcgm(dcgm_config()))
    assert "grayguard_exporter_nvml_up" not in dcgm_files[ALERTS_FILE]
