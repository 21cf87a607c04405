"""Every check of every section, with its exact message: the field path is the contract with operators."""

import copy

import pytest

from grayguard.config import ConfigError, PoolConfig, ThresholdsConfig, load_config, parse_config

BASE = {"pools": [{"name": "chat", "backend": "vllm_chat"}]}


def with_override(where: str, override: dict) -> dict:
    """BASE with override merged into a section ("thresholds"), the top level (""), pool 0 or a new pool."""
    d = copy.deepcopy(BASE)
    if where == "":
        d.update(override)
    elif where == "pool0":
        d["pools"][0].update(override)
    elif where == "pools+":
        d["pools"].append(override)
    else:
        d[where] = override
    return d


@pytest.mark.parametrize("where, override, message", [
    ("prometheus", {"url": "localhost:9090"},
     "prometheus.url: must start with http:// or https://, got 'localhost:9090'"),
    ("prometheus", {"timeout_s": 0},
     "prometheus.timeout_s: must be > 0"),
    ("prometheus", {"verify_tls": "yes"},
     "prometheus.verify_tls: expected true or false, got 'yes'"),
    ("prometheus", {"headers": {"X": 1}},
     "prometheus.headers.X: expected a string, got 1"),
    ("haproxy", {"endpoints": []},
     "haproxy.endpoints: at least one endpoint is needed"),
    ("haproxy", {"endpoints": ["unix:/s", "h:x"]},
     "haproxy.endpoints[1]: expected unix:/path, /path or host:port, got 'h:x'"),
    ("haproxy", {"endpoints": "h:1"},
     "haproxy.endpoints: expected a list, got str"),
    ("haproxy", {"timeout_s": "2 s"},
     "haproxy.timeout_s: expected a number of seconds or a duration such as 5s, 1m or 500ms, got '2 s'"),
    ("registry", {"lease_ttl_s": "2500ms"},
     "registry.lease_ttl_s: must be whole seconds, got '2500ms'"),
    ("signals", {"latency_query": 5},
     "signals.latency_query: expected a string, got 5"),
    ("signals", {"latncy_query": "x"},
     "signals.latncy_query: unknown field (known: error_ratio_query, gpu_ecc_query, gpu_throttled_query, "
     "gpu_xid_query, hardware_every_s, kv_cache_query, latency_query, live_decode_batch_query, live_itl_query, "
     "live_prefill_rate_query, "
     "live_ttft_query, "
     "pcie_degraded_query, peer_group_query, probe_failures_query, probe_result_query, probe_ttft_median_query, "
     "probe_ttft_query, request_rate_query)"),
    ("thresholds", {"quarantine_score": 1.5},
     "thresholds.quarantine_score: must be >= 2 (the score, in noise widths, from which a cut's weight falls)"),
    ("thresholds", {"min_spread": 0},
     "thresholds.min_spread: must be > 0"),
    ("thresholds", {"window_noise_cv": -0.5},
     "thresholds.window_noise_cv: must be >= 0 (0: not counted)"),
    ("thresholds", {"max_ejected_fraction": 1.5},
     "thresholds.max_ejected_fraction: must be in [0, 1]"),
    ("thresholds", {"cut_factor": 0},
     "thresholds.cut_factor: must be in (0, 1]"),
    ("thresholds", {"cut_factor": 1.1},
     "thresholds.cut_factor: must be in (0, 1]"),
    ("thresholds", {"probe_consecutive": 0},
     "thresholds.probe_consecutive: must be >= 1"),
    ("thresholds", {"probe_ok_to_clear": 0},
     "thresholds.probe_ok_to_clear: must be >= 1"),
    ("thresholds", {"kv_outlier_ratio": 0.5},
     "thresholds.kv_outlier_ratio: must be > 1 (times the peers' usage), or 0 (off)"),
    ("thresholds", {"circuit_error_ratio": 0.01},
     "thresholds.circuit_error_ratio: must be in (thresholds.error_ratio, 1]"),
    ("thresholds", {"error_ratio": 0},
     "thresholds.circuit_error_ratio: must be in (thresholds.error_ratio, 1]"),
    ("thresholds", {"kv_drained": 0.95},
     "thresholds.kv_drained: must be in (0, thresholds.kv_saturated)"),
    ("thresholds", {"kv_saturated": 1.5},
     "thresholds.kv_drained: must be in (0, thresholds.kv_saturated)"),
    ("thresholds", {"new_node_warmup_s": -1},
     "thresholds.new_node_warmup_s: must be >= 0"),
    ("thresholds", {"forget_after_s": -1},
     "thresholds.forget_after_s: must be >= 0"),
    ("thresholds", {"live_drift": float("nan")},
     "thresholds.live_drift: must be >= 1 (a multiple of the peer median)"),
    ("recovery", {"min_quarantine_s": -1},
     "recovery.min_quarantine_s: must be >= 0"),
    ("recovery", {"canary_interval_s": 0},
     "recovery.canary_interval_s: must be > 0"),
    ("recovery", {"canary_successes": 0},
     "recovery.canary_successes: must be >= 1"),
    ("recovery", {"canary_timeout_s": 0},
     "recovery.canary_timeout_s: must be > 0"),
    ("recovery", {"slow_start_initial": 0},
     "recovery.slow_start_initial: must be in (0, 1]"),
    ("recovery", {"slow_start_step_per_min": 0},
     "recovery.slow_start_step_per_min: must be > 0"),
    ("recovery", {"canary_model": 3},
     "recovery.canary_model: expected a string, got 3"),
    ("rules", {"omega": 0},
     "rules.omega: must be in (0, 1]"),
    ("rules", {"human_window": "5 m"},
     "rules.human_window: must be a Prometheus duration such as 30s, 5m or 1d"),
    ("rules", {"baseline_window": ""},
     "rules.baseline_window: must be a Prometheus duration such as 30s, 5m or 1d"),
    ("rules", {"regression_factor": 1},
     "rules.regression_factor: must be > 1"),
    ("rules", {"kv_saturation_ratio": 0},
     "rules.kv_saturation_ratio: must be in (0, 1]"),
    ("rules", {"rerender_interval_s": -1},
     "rules.rerender_interval_s: must be >= 0"),
    ("rules", {"exporter_job": "a b"},
     "rules.exporter_job: must be a non-empty job name without quotes, backslashes or spaces"),
    ("rules", {"controller_stale_s": 0},
     "rules.controller_stale_s: must be > 0"),
    ("rules", {"alert_for": {"NodeDegraded": "1m"}},
     "rules.alert_for.NodeDegraded: not an alert name"),
    ("rules", {"alert_severity": {"GrayguardNodeDegraded": "urgent"}},
     "rules.alert_severity.GrayguardNodeDegraded: must be page or ticket, got 'urgent'"),
    ("rules", {"alert_severity": {"Node": "page"}},
     "rules.alert_severity.Node: not an alert name"),
    ("rules", {"alert_for": {"GrayguardNodeDegraded": "soon"}},
     "rules.alert_for.GrayguardNodeDegraded: must be a duration such as 0s or 10m"),
    ("rules", {"vllm_prefix": "vllm-"},
     "rules.vllm_prefix: must be 'vllm:', 'vllm_' or 'any', got 'vllm-'"),
    ("rules", {"reload_url": "localhost"},
     "rules.reload_url: must start with http:// or https://, or be null"),
    ("", {"tick_interval_s": 0},
     "tick_interval_s: must be at least 0.05 (s), got 0: each tick queries Prometheus and HAProxy, and the fast path "
     "they read moves once a second (1 shipped)"),
    ("", {"tick_interval_s": 1e-9},
     "tick_interval_s: must be at least 0.05 (s), got 1e-09: each tick queries Prometheus and HAProxy, and the fast "
     "path they read moves once a second (1 shipped)"),
    ("", {"tick_interval_s": 1e9},
     "tick_interval_s: must be at most 60 (s), got 1e+09: a slower tick leaves a gray failure in rotation for "
     "minutes, and the stall limit of /healthz grows with it (1 shipped)"),
    ("rules", {"control_window": "1s"},
     "rules.control_window: must be at least 10s, got 1s: the rate() behind the controller's signals needs two of the "
     "engine's scrapes in the window (every 5 s in rules/prometheus.example.yml; 30s shipped)"),
    ("rules", {"control_window": "9999ms"},
     "rules.control_window: must be at least 10s, got 9999ms: the rate() behind the controller's signals needs two of "
     "the engine's scrapes in the window (every 5 s in rules/prometheus.example.yml; 30s shipped)"),
    ("", {"stale_after_s": -1},
     "stale_after_s: must be > 0"),
    ("", {"listen_address": "9300"},
     "listen_address: expected host:port, got '9300'"),
    ("", {"state_file": 1},
     "state_file: expected a string, got 1"),
    ("", {"listen_address": ":9300"},
     "listen_address: expected host:port, got ':9300'"),
    ("pool0", {"name": "chat room"},
     "pools[0].name: 'chat room' may only hold letters, digits, '-', '_', '.' and ':'"),
    ("pool0", {"series_label": "0bad"},
     "pools[0].series_label: '0bad' is not a Prometheus label name"),
    ("pool0", {"peer_group_label": "gpu-model"},
     "pools[0].peer_group_label: 'gpu-model' is not a Prometheus label name"),
    ("pool0", {"group_speed": {"h100": 0}},
     "pools[0].group_speed.h100: must be > 0 (latency relative to the pool)"),
    ("pool0", {"servers": {"n1": {"serie": "x"}}},
     "pools[0].servers.n1.serie: unknown field (known: address, canary_url, peer_group, series, weight)"),
    ("pool0", {"servers": {"n1": None, "n2": []}},
     "pools[0].servers.n2: expected a mapping, got list"),
    ("pools+", {"name": "two", "backend": "vllm_chat"},
     "pools[1].backend: backend 'vllm_chat' is already driven by another pool"),
])
def test_each_check_names_its_field(where, override, message):
    with pytest.raises(ConfigError) as e:
        parse_config(with_override(where, override))
    assert str(e.value) == message
    assert e.value.path == message.partition(": ")[0]


def test_sections_validate_themselves_under_the_path_given():
    with pytest.raises(ConfigError) as e:
        ThresholdsConfig(probe_ok_to_clear=0).validate("thresholds")
    assert str(e.value) == "thresholds.probe_ok_to_clear: must be >= 1"
    with pytest.raises(ConfigError) as e:
        PoolConfig(name="chat", backend="vllm chat").validate("pools[3]")
    assert e.value.path == "pools[3].backend"
    ThresholdsConfig().validate("thresholds")  # the defaults are valid
    parse_config(BASE).validate()


def test_type_errors_come_before_range_errors():
    # The whole document is read into dataclasses before any section checks its values.
    d = with_override("thresholds", {"probe_ok_to_clear": "three"})
    d["pools"][0]["name"] = "chat room"
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.path == "thresholds.probe_ok_to_clear"


def test_sections_are_checked_in_document_order():
    d = with_override("rules", {"omega": 0})
    d["prometheus"] = {"timeout_s": 0}
    d["tick_interval_s"] = 0
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.path == "prometheus.timeout_s"


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
