"""Rendering the rules from the config: committed files up to date, names, overrides, baselines, runbook."""

import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import ConfigError, load_config, parse_config
from grayguard.rules import render
from grayguard.rules.render import (
    ALERTS,
    ALERTS_FILE,
    RECORDING_FILE,
    baseline_query,
    clean_baselines,
    derived_for,
    recording_rule_names,
    render_alerts,
    render_all,
    render_recording,
    signal_names,
    vllm_selector,
)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "rules"
EXAMPLE = REPO / "grayguard.example.yaml"
FLEET_ALERTS = {"GrayguardNoLeader"}  # about the controller replicas together: no pool, no instance


def cfg_with(**rules):
    return parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"},
                                   {"name": "batch", "backend": "vllm_batch"}], "rules": rules})


def alert_rules(text):
    return [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def test_committed_rules_are_the_render_of_the_example_config():
    cfg = load_config(EXAMPLE)
    for name, text in render_all(cfg).items():
        assert (RULES / name).read_text() == text, f"rules/{name} is stale: run grayguard rules render " \
                                                    "--config.file grayguard.example.yaml --out rules"


def test_committed_learned_fixture_is_current():
    cfg = load_config(RULES / "tests" / "grayguard-test.yaml")
    text = render_alerts(cfg, {"chat": 0.5, "batch": 2.0})
    assert (RULES / "tests" / "grayguard-alerts-learned.rules.yml").read_text() == text


def test_render_is_deterministic():
    cfg = load_config(EXAMPLE)
    assert render_all(cfg, {"chat": 0.3}) == render_all(cfg, {"chat": 0.3})


def test_default_signal_names_match_the_controller_queries():
    cfg = load_config(EXAMPLE)
    names = recording_rule_names(cfg)
    assert "instance:vllm_normalized_latency_seconds_per_token:rate30s" in names
    assert "instance:vllm_request_rate:rate30s" in names
    assert signal_names(cfg) == {"latency_query": cfg.signals.latency_query,
                                 "request_rate_query": cfg.signals.request_rate_query}


def test_window_suffix_follows_the_config():
    cfg = cfg_with(control_window="10s", human_window="2m")
    names = recording_rule_names(cfg)
    assert "instance:vllm_normalized_latency_seconds_per_token:rate10s" in names
    assert "instance:vllm_request_rate:rate10s" in names
    assert "pool:vllm_time_to_first_token_seconds:p99_rate2m" in names
    assert not any(n.endswith(("rate30s", "rate5m")) for n in names)
    text = render_recording(cfg)
    assert "[10s]" in text and "[2m]" in text and "[30s]" not in text
    assert signal_names(cfg)["latency_query"].endswith(":rate10s")


def test_equal_windows_give_one_group_without_duplicates():
    cfg = cfg_with(control_window="1m", human_window="1m")
    doc = yaml.safe_load(render_recording(cfg))
    assert [g["name"] for g in doc["groups"]] == ["grayguard-control"]
    names = recording_rule_names(cfg)
    assert len(names) == len(set(names))
    assert "pool:vllm_time_to_first_token_seconds:p99_rate1m" in names


def test_omega_and_interval_are_rendered():
    doc = yaml.safe_load(render_recording(cfg_with(omega=0.5, control_interval="2s")))
    control = doc["groups"][0]
    assert control["interval"] == "2s"
    expr = " ".join(control["rules"][0]["expr"].split())
    assert ("0.5 * ( sum by (pool, instance) (rate(grayguard_traffic_prompt_tokens_total[30s])) or "
            "sum by (pool, instance) (rate(vllm:request_prompt_tokens_sum[30s])) )") in expr
    assert "interval" not in yaml.safe_load(render_recording(cfg_with(control_interval=None)))["groups"][0]


def test_the_human_group_runs_every_minute_off_the_hot_path():
    groups = {g["name"]: g for g in yaml.safe_load(render_recording(cfg_with()))["groups"]}
    assert (groups["grayguard-control"]["interval"], groups["grayguard-human"]["interval"]) == ("5s", "1m")
    groups = {g["name"]: g for g in yaml.safe_load(render_recording(cfg_with(human_interval=None)))["groups"]}
    assert "interval" not in groups["grayguard-human"]  # null: Prometheus' global evaluation_interval


def test_ratios_are_guarded_against_no_traffic():
    for r in yaml.safe_load(render_recording(load_config(EXAMPLE)))["groups"][0]["rules"]:
        if r["record"].startswith("instance:") and "/" in r["expr"]:
            assert re.search(r"> 0\s*\)\s*$", r["expr"]), r["record"]


def test_series_label_of_a_pool_is_kept():
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b", "series_label": "hostname"}]})
    assert "sum by (pool, instance, hostname)" in render_recording(cfg)


def test_every_alert_is_complete():
    cfg = load_config(EXAMPLE)
    rules = alert_rules(render_alerts(cfg, {"chat": 0.4}))
    assert {r["alert"] for r in rules} == set(ALERTS)
    for r in rules:
        name = r["alert"]
        assert re.fullmatch(r"Grayguard[A-Z][A-Za-z]+", name)
        assert r["labels"]["severity"] == ALERTS[name][0] and r["labels"]["severity"] in ("page", "ticket")
        assert r["for"] == (ALERTS[name][1] or derived_for(cfg, name))
        ann = r["annotations"]
        assert "{{" not in ann["summary"], f"{name}: summary must be static"
        assert "{{ $labels.pool }}" in ann["description"] or name.startswith("GrayguardController") or \
            name in FLEET_ALERTS, name
        assert ann["runbook_url"] == f"https://github.com/grayguard/grayguard/blob/main/docs/runbook.md#{name.lower()}"


def test_issue_severities():
    pages = {n for n, (sev, _) in ALERTS.items() if sev == "page"}
    assert {"GrayguardNodeQuarantined", "GrayguardSafeguardEngaged", "GrayguardControllerDown",
            "GrayguardControllerStale", "GrayguardProbeFailing", "GrayguardProbeCudaError",
            "GrayguardGpuEccUncorrectable", "GrayguardGpuRowRemapFailure", "GrayguardGpuXidError"} <= pages
    assert ALERTS["GrayguardNodeDegraded"][0] == "ticket"
    assert ALERTS["GrayguardKvCacheSaturated"][0] == "ticket"


def test_runbook_has_a_section_per_alert():
    text = (REPO / "docs" / "runbook.md").read_text()
    anchors = {h.strip().lower() for h in re.findall(r"^## (.+)$", text, re.M)}
    assert set(n.lower() for n in ALERTS) <= anchors
    for name in ALERTS:
        section = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "**Meaning**" in section and "**Confirm**" in section and "**Act.**" in section, name


def test_overrides_and_job_names():
    cfg = cfg_with(alert_for={"GrayguardNodeQuarantined": "0s"}, alert_severity={"GrayguardTtftRegression": "page"},
                   controller_job="ctl", exporter_job="exp", runbook_url="https://wiki.example/runbook",
                   probe_failures=5, controller_stale_s=300)
    rules = {r["alert"]: r for r in alert_rules(render_alerts(cfg, {"chat": 1.0}))}
    assert rules["GrayguardNodeQuarantined"]["for"] == "0s"
    assert rules["GrayguardTtftRegression"]["labels"]["severity"] == "page"
    assert 'up{job="ctl"}' in rules["GrayguardControllerDown"]["expr"]
    assert 'up{job="exp"}' in rules["GrayguardExporterDown"]["expr"]
    assert ">= 5" in rules["GrayguardProbeFailing"]["expr"]
    assert "> 300" in rules["GrayguardControllerStale"]["expr"]
    assert rules["GrayguardNodeDegraded"]["annotations"]["runbook_url"] == \
        "https://wiki.example/runbook#grayguardnodedegraded"


@pytest.mark.parametrize("section", ["alert_for", "alert_severity"])
def test_unknown_alert_override_names_the_field(section):
    value = "1m" if section == "alert_for" else "page"
    cfg = cfg_with(**{section: {"GrayguardNoSuchAlert": value}})
    with pytest.raises(ConfigError) as e:
        render_alerts(cfg)
    assert e.value.path == f"rules.{section}.GrayguardNoSuchAlert"


@pytest.mark.parametrize("rules, path", [
    ({"alert_for": {"GrayguardNodeDegraded": "soon"}}, "rules.alert_for.GrayguardNodeDegraded"),
    ({"alert_severity": {"GrayguardNodeDegraded": "urgent"}}, "rules.alert_severity.GrayguardNodeDegraded"),
    ({"controller_job": 'a"b'}, "rules.controller_job"),
    ({"control_interval": "fast"}, "rules.control_interval"),
    ({"human_interval": "hourly"}, "rules.human_interval"),
    ({"runbook_url": "docs/runbook.md"}, "rules.runbook_url"),
    ({"load_gpu_utilization": 0}, "rules.load_gpu_utilization"),
    ({"probe_failures": 0}, "rules.probe_failures"),
    ({"reload_url": "localhost:9090"}, "rules.reload_url"),
    ({"vllm_prefix": "vllm-"}, "rules.vllm_prefix"),
])
def test_bad_rules_config_names_the_field(rules, path):
    with pytest.raises(ConfigError) as e:
        cfg_with(**rules)
    assert e.value.path == path


def test_regression_alerts_from_baselines():
    cfg = cfg_with()
    rules = [r for r in alert_rules(render_alerts(cfg, {"chat": 0.41234, "batch": 2.0, "unknown": 1.0,
                                                         "nan": math.nan}))
             if r["alert"] == "GrayguardTtftRegression"]
    assert [r["labels"]["pool"] for r in rules] == ["batch", "chat"]  # sorted, configured pools only
    assert rules[1]["expr"].strip() == 'pool:vllm_time_to_first_token_seconds:p99_rate5m{pool="chat"} > 2 * 0.41'
    assert "0.41 s" in rules[1]["annotations"]["description"]
    assert not [r for r in alert_rules(render_alerts(cfg)) if r["alert"] == "GrayguardTtftRegression"]


def test_clean_baselines_rounds_and_filters():
    cfg = cfg_with()
    assert clean_baselines(cfg, {"chat": 0.123456, "batch": 0.0}) == {"chat": 0.12}
    assert clean_baselines(cfg, {"chat": math.inf, "batch": -1}) == {}
    assert clean_baselines(cfg, {"chat": 0.4123}) == clean_baselines(cfg, {"chat": 0.4149})  # small drift: same


def test_baseline_query_uses_the_recorded_p99_and_window():
    assert baseline_query(cfg_with(baseline_window="7d")) == \
        "quantile_over_time(0.5, pool:vllm_time_to_first_token_seconds:p99_rate5m[7d])"


def test_file_names():
    assert set(render_all(cfg_with())) == {RECORDING_FILE, ALERTS_FILE}
    assert render.TEMPLATES.is_dir()


def test_vllm_selector_spellings():
    assert vllm_selector("vllm:", "num_requests_running") == "vllm:num_requests_running"
    assert vllm_selector("vllm_", "request_success_total", 'finished_reason="error"') == \
        'vllm_request_success_total{finished_reason="error"}'
    assert vllm_selector("any", "request_success_total", 'finished_reason="error"') == \
        '{__name__=~"vllm[:_]request_success_total", finished_reason="error"}'
    text = render_recording(cfg_with(vllm_prefix="vllm_"))
    assert "vllm_e2e_request_latency_seconds_sum[30s]" in text and "vllm:" not in text


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["chat", "batch", "other"]),
                       st.floats(allow_nan=True, allow_infinity=True) | st.floats(1e-4, 1e3)))
def test_baselines_property(baselines):
    """Any Prometheus answer gives valid rules: configured pools only, finite positive thresholds, one
    regression rule per learned pool, and re-rounding changes nothing (no churn between re-renders)."""
    cfg = cfg_with()
    clean = clean_baselines(cfg, baselines)
    assert set(clean) <= {"chat", "batch"}
    assert all(math.isfinite(v) and v > 0 for v in clean.values())
    assert clean_baselines(cfg, clean) == clean
    rules = [r for r in alert_rules(render_alerts(cfg, baselines)) if r["alert"] == "GrayguardTtftRegression"]
    assert sorted(r["labels"]["pool"] for r in rules) == sorted(clean)
    for r in rules:
        threshold = r["expr"].rsplit(">", 1)[1]
        assert "nan" not in threshold.lower() and "inf" not in threshold.lower()


def test_no_leader_waits_the_lease_and_a_tick_and_checks_absence_only_with_a_registry():
    """A hand-over takes at most registry.lease_ttl_s + one tick: the page waits that long (whole seconds). Absent
    leader series mean "no election" without a registry, so only a config with registry.url alerts on them."""
    def no_leader(doc):
        cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}], **doc})
        return next(r for r in alert_rules(render_alerts(cfg)) if r["alert"] == "GrayguardNoLeader")

    plain = no_leader({})
    assert plain["for"] == "6s" and plain["labels"]["severity"] == "page"
    assert plain["expr"].strip() == 'sum(grayguard_controller_leader{job="grayguard-controller"}) == 0'
    reg = no_leader({"registry": {"url": "http://etcd:2379", "lease_ttl_s": 10}, "tick_interval_s": 2.5,
                     "rules": {"controller_job": "ctl"}})
    assert reg["for"] == "13s"  # 10 + 2.5, rounded up
    assert 'absent(grayguard_controller_leader{job="ctl"})' in reg["expr"]
    assert 'count(up{job="ctl"} == 1) > 0' in reg["expr"]
    assert no_leader({"rules": {"alert_for": {"GrayguardNoLeader": "1m"}}})["for"] == "1m"


def test_committed_engines_alerts_fixture_is_current():
    """rules/tests/engines-alerts.test.yml runs the alerts of the engines config: the GPU alerts' "under load" with
    each engine's running requests (the recorded instance:vllm_num_requests_running:sum is gone, issue 34)."""
    cfg = load_config(RULES / "tests" / "grayguard-engines-test.yaml")
    assert (RULES / "tests" / "grayguard-engines-alerts.rules.yml").read_text() == render_alerts(cfg)
