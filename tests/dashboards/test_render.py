"""Dashboards rendered from the config: committed JSON current, Grafana's model, config knobs, CLI, provisioning."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

from grayguard.cli import build_parser
from grayguard.config import load_config, parse_config
from grayguard.dashboards import cli, gpu, pool
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import expressions, problems
from grayguard.dashboards.render import BUILDERS, DASHBOARDS_DIR, render_all

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "grayguard.example.yaml"
PROVISIONING = DASHBOARDS_DIR / "provisioning"


def dash(argv):
    """`grayguard dashboards ARGV` without the dispatcher (which imports every component, mid-edit ones too)."""
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(argv))


def docs(cfg=None):
    return {name: json.loads(text) for name, text in render_all(cfg).items()}


def panel(doc, title):
    (p,) = [p for p in doc["panels"] if p.get("title") == title]
    return p


def test_committed_json_is_the_render_of_the_defaults_and_of_the_example_config():
    committed = {name: (DASHBOARDS_DIR / name).read_text() for name in BUILDERS}
    hint = "dashboards/*.json are stale: run grayguard dashboards render"
    assert render_all() == committed, hint
    assert render_all(DashboardConfig.from_config(load_config(EXAMPLE))) == committed, hint


def test_cli_rerender_changes_nothing_and_check_passes(capsys):
    before = {name: (DASHBOARDS_DIR / name).read_bytes() for name in BUILDERS}
    assert dash(["render", "--check"]) == 0
    assert dash(["render"]) == 0
    assert "unchanged" in capsys.readouterr().out
    assert {name: (DASHBOARDS_DIR / name).read_bytes() for name in BUILDERS} == before


def test_render_writes_then_reports_unchanged(tmp_path, capsys):
    assert dash(["render", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("written") == len(BUILDERS)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(BUILDERS)
    assert dash(["render", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("unchanged") == len(BUILDERS)


def test_check_reports_a_stale_file_and_writes_nothing(tmp_path, capsys):
    assert dash(["render", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "grayguard-gpu-health.json"
    stale.write_text("{}\n")
    assert dash(["render", "--out", str(tmp_path), "--check"]) == 1
    assert f"{stale}: would change" in capsys.readouterr().out
    assert stale.read_text() == "{}\n"


def test_bad_config_names_the_field_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "g.yaml"
    bad.write_text("pools: [{name: chat, backend: b}]\nthresholds: {quarantine_score: 1.0}\n")
    assert dash(["render", "--config.file", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "thresholds.quarantine_score" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_action_exits_2(capsys):
    assert dash([]) == 2


def test_dispatcher_has_the_subcommand():
    args = build_parser().parse_args(["dashboards", "render", "--out", "x", "--config.file", "y"])
    assert (args.out, args.config, args.check) == ("x", "y", False)
    assert all(name in cli.DESCRIPTION for name in BUILDERS) and cli.DASHBOARDS_DIR == DASHBOARDS_DIR


def test_without_the_sdk_the_cli_still_loads_and_render_says_what_to_install(monkeypatch, capsys):
    for m in [m for m in sys.modules if m.startswith(("grafana_foundation_sdk", "grayguard.dashboards."))
              and m not in ("grayguard.dashboards.cli", "grayguard.dashboards.config")]:
        monkeypatch.delitem(sys.modules, m)
        if m.startswith("grayguard.dashboards."):
            monkeypatch.delattr(sys.modules["grayguard.dashboards"], m.split(".")[2], raising=False)
    monkeypatch.setitem(sys.modules, "grafana_foundation_sdk", None)  # import raises ModuleNotFoundError
    p = argparse.ArgumentParser()
    cli.add_arguments(p)  # what the dispatcher calls for every subcommand: `grayguard controller` keeps working
    assert dash(["render", "--check"]) == 1
    assert "grafana-foundation-sdk==1769699379!11.6.0" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BUILDERS))
def test_grafana_dashboard_model(name):
    doc = docs()[name]
    assert problems(doc) == []
    assert isinstance(doc["schemaVersion"], int) and doc["schemaVersion"] >= 36
    assert doc["uid"] in (pool.UID, gpu.UID) and doc["title"].startswith("grayguard / ")
    assert "id" not in doc or doc["id"] is None  # provisioning and import assign their own
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p.get("description"), f"{p['title']} needs a description"
            assert all(t["refId"] and t["expr"] for t in p["targets"])
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "pool" in variables


def test_layout_problems_are_found():
    doc = docs()["grayguard-pool-overview.json"]
    a, b = doc["panels"][1], doc["panels"][2]
    b["gridPos"] = dict(a["gridPos"])
    b["id"] = a["id"]
    doc["panels"].append({"type": "timeseries", "title": "wide", "id": 999, "targets": [{"expr": "x"}],
                          "gridPos": {"x": 20, "y": 500, "w": 8, "h": 2}})
    found = " | ".join(problems(doc))
    assert f"id {a['id']}" in found and "overlaps" in found and "wider than" in found
    assert problems({"panels": []})[:1] == ["missing uid"]


def test_pool_overview_has_what_the_pager_needs():
    doc = docs()["grayguard-pool-overview.json"]
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"pool", "node", "instance"} <= names
    score = panel(doc, "Peer score")
    steps = [s["value"] for s in score["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 2.0, 3.5]
    assert score["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    exprs = "\n".join(e for _, e in expressions(doc))
    for series in ("grayguard_node_score", "grayguard_node_state", "grayguard_node_weight",
                   "grayguard_pool_ejected_nodes", "grayguard_pool_max_ejected_nodes", "grayguard_pool_nodes",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "grayguard_probe_ttft_seconds_bucket", "grayguard_probe_results_total",
                   "grayguard_tick_duration_seconds_bucket", "grayguard_last_successful_tick_timestamp_seconds",
                   "grayguard_prometheus_errors_total", "grayguard_haproxy_errors_total",
                   "instance:vllm_normalized_latency_seconds_per_token:rate30s",
                   "pool:vllm_normalized_latency_seconds_per_token:median_rate30s",
                   "pool:vllm_request_rate:rate5m", "grayguard_traffic_requests_total",
                   "grayguard_canary_requests_total", 'vllm:request_success_total{finished_reason="error"'):
        assert series in exprs, series
    # per-node series the rules no longer record: the panels compute them for the pools shown (docs/rules.md)
    for gone in ("instance:vllm_request_rate:rate5m", "instance:vllm_request_errors:ratio_rate5m",
                 "instance:grayguard_probe_failures:", "instance:vllm_normalized_latency_to_pool_median:"):
        assert gone not in exprs, gone
    assert panel(doc, "Node state")["type"] == "state-timeline"
    texts = {o["text"] for m in panel(doc, "Node state")["fieldConfig"]["defaults"]["mappings"]
             for o in m["options"].values()}
    assert texts == {"healthy", "degraded", "quarantined", "canary", "slow_start"}
    assert "probe" in panel(doc, "TTFT P50 / P99 (pool)")["description"]
    (transitions,) = [a for a in doc["annotations"]["list"] if a["name"] == "Controller transitions"]
    assert "grayguard_node_transitions_total" in transitions["expr"]
    assert "{{from_state}}" in transitions["titleFormat"] and "node" in transitions["tagKeys"].split(",")


def test_pool_overview_has_a_membership_and_leadership_row():
    """Nodes per pool from the registry, registry up and snapshot age, joins and removals, expiries held back by the
    cap, which replica leads (by id), pools led, leader changes; controller series follow rules.controller_job."""
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}], "rules": {"controller_job": "ctl"}})
    doc = docs(DashboardConfig.from_config(cfg))["grayguard-pool-overview.json"]
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows[-1] == "Membership and leadership"
    start = next(i for i, p in enumerate(doc["panels"]) if p.get("title") == "Membership and leadership")
    row = {p["title"]: p for p in doc["panels"][start + 1:]}
    exprs = {t: "\n".join(q["expr"] for q in p["targets"]) for t, p in row.items()}
    assert "grayguard_membership_nodes" in exprs["Nodes: registered vs in HAProxy"]
    assert "grayguard_pool_nodes" in exprs["Nodes: registered vs in HAProxy"]
    assert "grayguard_registry_up" in exprs["Registry"] and 'job="ctl"' in exprs["Registry"]
    assert "grayguard_registry_snapshot_age_seconds" in exprs["Snapshot age"]
    assert "sum by (action) (clamp_min(grayguard_membership_changes_total" in exprs["Joins and removals"]
    assert "grayguard_membership_expiries_held" in exprs["Expiries held back by the cap"]
    assert "grayguard_membership_expiry_cap" in exprs["Expiries held back by the cap"]
    assert exprs["Which replica leads"] == 'max by (id) (grayguard_controller_leader{job="ctl"})'
    assert row["Which replica leads"]["type"] == "state-timeline"
    texts = {o["text"] for m in row["Which replica leads"]["fieldConfig"]["defaults"]["mappings"]
             for o in m["options"].values()}
    assert texts == {"leads", "standby"}
    assert "grayguard_controller_led_pools" in exprs["Pools led per replica"]
    assert "grayguard_controller_leader_changes_total" in exprs["Leader changes"]
    assert exprs["Leaders"] == 'sum(grayguard_controller_leader{job="ctl"})'
    leaders = {o["text"] for m in row["Leaders"]["fieldConfig"]["defaults"]["mappings"] for o in m["options"].values()}
    assert leaders == {"NOBODY"}
    assert all("{{" not in p["description"] for p in row.values())


def test_gpu_health_covers_every_nvml_signal():
    doc = docs()["grayguard-gpu-health.json"]
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"pool", "instance", "gpu"} <= names
    exprs = "\n".join(e for _, e in expressions(doc))
    for series in ("sm_clock_hertz", "sm_clock_max_hertz", "memory_clock_hertz", "clock_event_reasons",
                   "temperature_celsius", "power_watts", "power_limit_watts", "pcie_link_generation",
                   "pcie_link_width", "pcie_replay_total", "ecc_errors", "remapped_rows", "xid_errors_total",
                   "utilization_ratio", "memory_used_bytes", "memory_total_bytes", "flags", "info"):
        assert f"grayguard_gpu_{series}" in exprs, series


def test_gpu_health_decodes_the_exporters_judgements_from_its_flags():
    """lost, row remap pending/failed and PCIe below max: bits of grayguard_gpu_flags (grayguard/vocab.py GPU_FLAGS),
    as the alerts read them (issue 34: one series a GPU in place of five)."""
    from grayguard.vocab import GPU_FLAGS

    bit = dict(GPU_FLAGS)
    doc = docs()["grayguard-gpu-health.json"]
    flags = 'grayguard_gpu_flags{pool=~"$pool", instance=~"$instance", gpu=~"$gpu"}'
    decode = lambda name: f"floor({flags} / {bit[name]}) % 2"  # noqa: E731
    assert [t["expr"] for t in panel(doc, "GPUs lost")["targets"]] == [f"sum({decode('lost')})"]
    assert [t["expr"] for t in panel(doc, "PCIe below max")["targets"]] == [f"sum({decode('pcie_below_max')})"]
    assert [t["expr"] for t in panel(doc, "Row remap pending / failed")["targets"]] == [
        f"sum({decode('row_remap_pending')})", f"sum({decode('row_remap_failure')})"]
    assert [t["expr"] for t in panel(doc, "Row remapping")["targets"]][1:] == [
        decode("row_remap_pending"), decode("row_remap_failure")]
    assert panel(doc, "GPU lost / NVML down")["targets"][0]["expr"] == decode("lost")
    # the PCIe maxima are labels of grayguard_gpu_info: the GPUs table shows them, the link panels point there
    assert "pcie_max_generation" in panel(doc, "PCIe link generation")["description"]
    assert "pcie_max_width" in panel(doc, "PCIe link width")["description"]


def test_gpu_health_decodes_each_clock_event_reason_from_nvmls_mask():
    from grayguard.exporters.gpumetrics import CLOCK_EVENT_REASONS

    doc = docs()["grayguard-gpu-health.json"]
    targets = panel(doc, "GPUs per clock-event reason")["targets"]
    mask = 'grayguard_gpu_clock_event_reasons{pool=~"$pool", instance=~"$instance", gpu=~"$gpu"}'
    assert [(t["legendFormat"], t["expr"]) for t in targets] == [
        (reason, f"sum(floor({mask} / {bit}) % 2)") for reason, bit in CLOCK_EVENT_REASONS]
    slowed = "(" + " + ".join(f"floor({mask} / {bit}) % 2" for bit in (8, 32, 64, 128)) + ") > bool 0"  # slowdowns
    (stat,) = panel(doc, "Slowed down")["targets"]
    assert stat["expr"] == f"sum(max by (pool, instance, gpu) ({slowed}))"
    (held,) = panel(doc, "Clocks held down")["targets"]  # 2 slowdown, else 1 at the power cap (0x4), else 0
    assert held["expr"] == f"max by (pool, instance, gpu) (2 * ({slowed}) > 0 or floor({mask} / 4) % 2)"


def test_config_knobs_reach_the_dashboards():
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}],
                        "thresholds": {"quarantine_score": 4.0},
                        "rules": {"control_window": "10s", "human_window": "1m", "controller_job": "ctl",
                                  "vllm_prefix": "vllm_"}})
    doc = docs(DashboardConfig.from_config(cfg))["grayguard-pool-overview.json"]
    steps = [s["value"] for s in panel(doc, "Peer score")["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 2.0, 4.0]
    exprs = "\n".join(e for _, e in expressions(doc))
    assert "rate10s" in exprs and "rate1m" in exprs and "rate30s" not in exprs and "rate5m" not in exprs
    assert 'job="ctl"' in exprs and "vllm_time_to_first_token_seconds_bucket" in exprs and "vllm:" not in exprs


def test_provisioning_points_grafana_at_the_dashboards():
    ds = yaml.safe_load((PROVISIONING / "datasource.yaml").read_text())
    (prom,) = ds["datasources"]
    assert ds["apiVersion"] == 1 and prom["type"] == "prometheus" and prom["url"].startswith("http")
    prov = yaml.safe_load((PROVISIONING / "dashboards.yaml").read_text())
    (provider,) = prov["providers"]
    assert prov["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]
    assert provider["folder"] == "grayguard"


def test_docs_list_every_dashboard():
    text = (REPO / "docs" / "dashboards.md").read_text()
    for name in BUILDERS:
        assert name in text
    assert "grafana-foundation-sdk" in text
