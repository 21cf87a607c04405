"""Issue 35: a config is checked whole. Every problem is reported at once, one a line under the file's name; a key
given twice, signals of another window than rules.control_window and PromQL promtool cannot parse are problems too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grayguard.cli import main
from grayguard.config import ConfigError, Problems, SignalsConfig, check_signal_windows, load_config, parse_config
from grayguard.promqlcheck import check_queries, parse_problems
from tests.support.stack import require

# Five independent mistakes, each of a different kind: a section given twice, a typo, a wrong type, a value out of
# range (in the block that counts), the signals' window against rules.control_window.
FIVE = """\
prometheus:
  url: http://prom:9090
  timeout_s: fast
pools:
  - name: chat
    backend: vllm_chat
thresholds:
  quarantine_score: 4
rules:
  control_window: 45s
signals:
  latency_query: instance:vllm_normalized_latency_seconds_per_token:rate30s
thresholds:
  max_ejected_fraction: 3
tick_intervall_s: 1
"""
FIVE_PATHS = ["thresholds", "tick_intervall_s", "prometheus.timeout_s", "thresholds.max_ejected_fraction",
              "signals.latency_query"]


def write(tmp_path, text: str, name: str = "grayguard.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def test_five_mistakes_are_five_errors(tmp_path):
    f = write(tmp_path, FIVE)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert [p for p, _ in e.value.errors] == FIVE_PATHS
    assert str(e.value).splitlines() == [f"{p}: {q}" for p, q in e.value.errors]
    assert e.value.source == str(f)


@pytest.mark.parametrize("argv", [["controller", "--config.file", "{f}", "--check"],
                                  ["config", "check", "--config.file", "{f}", "--no-promql"]])
def test_check_prints_five_errors_under_the_file_and_exits_2(tmp_path, argv):
    f = write(tmp_path, FIVE)
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", *(a.format(f=f) for a in argv)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    report = p.stderr[p.stderr.index(f"grayguard: config error in {f}:"):].splitlines()
    assert len(report) == 6, p.stderr  # the heading and one line a problem
    assert [line.partition(": ")[0].strip() for line in report[1:]] == FIVE_PATHS
    assert "Traceback" not in p.stderr


def test_the_report_is_one_line_a_problem():
    e = ConfigError(errors=[("a.b", "must be > 0"), ("c", "unknown field")], source="g.yaml")
    assert e.report() == "grayguard: config error in g.yaml:\n  a.b: must be > 0\n  c: unknown field"
    assert (e.path, e.problem) == ("a.b", "must be > 0")
    assert ConfigError("x", "bad").report() == "grayguard: config error: x: bad"  # no file: the one line it was


@pytest.mark.parametrize("text, path, lines", [
    ("thresholds: {}\npools: []\nthresholds: {}\n", "thresholds", (1, 3)),
    ("pools:\n  - name: a\n    backend: b\n    name: c\n", "pools[0].name", (2, 4)),
    ("pools: [{name: a, backend: b}]\nrules:\n  alert_for:\n    GrayguardX: 1m\n    GrayguardX: 2m\n",
     "rules.alert_for.GrayguardX", (4, 5)),
])
def test_a_key_given_twice_is_named_with_both_lines(tmp_path, text, path, lines):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert (path, f"given twice (lines {lines[0]} and {lines[1]}): YAML would keep the second silently; merge them "
                  "into one") in e.value.errors


def test_a_merge_key_may_be_overridden(tmp_path):
    """YAML's `<<` merge is meant to be overridden: no duplicate."""
    text = "pools: [{name: a, backend: b}]\nprometheus:\n  <<: {timeout_s: 3, url: 'http://p:1'}\n  timeout_s: 4\n"
    cfg = load_config(write(tmp_path, text))
    assert (cfg.prometheus.timeout_s, cfg.prometheus.url) == (4, "http://p:1")


def test_a_yaml_error_names_the_file_and_line(tmp_path):
    f = write(tmp_path, "pools:\n  - name: a\n    backend: [b\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f} is not valid YAML: ") and "line 4" in str(e.value)
    assert "<unicode string>" not in str(e.value)


def test_type_and_range_errors_of_several_sections_come_together():
    with pytest.raises(ConfigError) as e:
        parse_config({"pools": [{"name": "a b"}, {"name": "c", "backend": "d", "discovery": "dns"}],
                      "haproxy": {"endpoints": ["h:1", 5, "nohost"]}, "recovery": {"canary_successes": 0},
                      "registry": {"lease_ttl_s": 2.5, "timeout_s": 3}})
    assert [p for p, _ in e.value.errors] == [
        "pools[0].backend",  # required: missing
        "haproxy.endpoints[1]",  # a number; the others still checked, at their own index
        "registry.lease_ttl_s",  # not an integer: timeout_s is not compared with it
        "haproxy.endpoints[2]", "recovery.canary_successes", "pools[0].name", "pools[1].discovery"]


def test_a_field_is_reported_once_and_what_depends_on_it_not_at_all():
    with pytest.raises(ConfigError) as e:
        parse_config({"pools": [{"name": "a", "backend": "b"}], "thresholds": {"live_drift": float("nan")}})
    # not also "must be a finite number", nor live_cut_ratio "must be > thresholds.live_drift"
    assert e.value.errors == (("thresholds.live_drift", "must be >= 1 (a multiple of the peer median)"),)


def test_sections_still_raise_on_their_own_with_every_problem():
    from grayguard.config import RecoveryConfig
    with pytest.raises(ConfigError) as e:
        RecoveryConfig(canary_successes=0, canary_timeout_s=0).validate("recovery")
    assert [p for p, _ in e.value.errors] == ["recovery.canary_successes", "recovery.canary_timeout_s"]


# ---- the signals' window -------------------------------------------------------------------------------------------

def test_signals_left_unset_follow_the_control_window():
    cfg = parse_config({"pools": [{"name": "a", "backend": "b"}], "rules": {"control_window": "45s"},
                        "signals": {"request_rate_query": "sum by (instance) (rate(my_requests_total[45s]))"}})
    assert cfg.signals.latency_query == "instance:vllm_normalized_latency_seconds_per_token:rate45s"
    assert cfg.signals.error_ratio_query == "instance:vllm_request_errors:ratio_rate45s"
    assert cfg.signals.request_rate_query == "sum by (instance) (rate(my_requests_total[45s]))"  # as given
    assert cfg.signals.kv_cache_query == SignalsConfig().kv_cache_query  # no window in it
    assert parse_config({"pools": [{"name": "a", "backend": "b"}]}).signals == SignalsConfig()  # the defaults


@pytest.mark.parametrize("field, query", [
    ("latency_query", "instance:vllm_normalized_latency_seconds_per_token:rate30s"),
    ("error_ratio_query", "max by (instance) (instance:vllm_request_errors:ratio_rate1m) > 0"),
])
def test_a_signal_of_another_window_names_both_fields(field, query):
    with pytest.raises(ConfigError) as e:
        parse_config({"pools": [{"name": "a", "backend": "b"}], "rules": {"control_window": "45s"},
                      "signals": {field: query}})
    assert e.value.path == f"signals.{field}" and "rules.control_window is 45s" in e.value.problem


def test_a_bad_control_window_is_reported_once():
    with pytest.raises(ConfigError) as e:
        parse_config({"pools": [{"name": "a", "backend": "b"}], "rules": {"control_window": "45 s"}})
    assert [p for p, _ in e.value.errors] == ["rules.control_window"]


def test_raw_promql_windows_are_not_recorded_series():
    from grayguard.config import Config, PoolConfig
    cfg = Config(pools=(PoolConfig("a", "b"),),
                 signals=SignalsConfig(latency_query="avg by (instance) (rate(x_sum[1m]) / rate(x_count[1m]))"))
    pr = Problems()
    check_signal_windows(cfg, pr)
    assert pr.items == []


# ---- PromQL --------------------------------------------------------------------------------------------------------

def test_promtool_output_maps_to_fields():
    out = ('x.yml: 5:11: group "grayguard-config-check", rule 1, "grayguard_config_check:latency_query": could not '
           'parse expression: 1:14: parse error: unclosed left parenthesis\n')
    assert parse_problems(out) == {"latency_query": "could not parse expression: 1:14: parse error: unclosed left "
                                                    "parenthesis"}


def test_without_promtool_the_queries_are_not_checked_and_it_says_so(caplog):
    cfg = parse_config({"pools": [{"name": "a", "backend": "b"}], "signals": {"latency_query": "max by ((("}})
    pr = Problems()
    assert check_queries(cfg, pr, which=lambda _name: None) is False
    assert pr.items == [] and "PromQL was not checked" in caplog.text


def test_promtool_names_each_query_it_cannot_parse(tmp_path):
    require("promtool")  # `make test` installs it: a missing one is a broken set-up, not a pass
    f = write(tmp_path, "pools: [{name: a, backend: b}]\nsignals:\n  latency_query: 'max by (pool (x)'\n"
                        "  gpu_xid_query: 'increase(x[5m]'\n  probe_ttft_query: ''\n")
    assert load_config(f).signals.probe_ttft_query == ""  # without promql: not parsed
    with pytest.raises(ConfigError) as e:
        load_config(f, promql=True)
    assert [p for p, _ in e.value.errors] == ["signals.latency_query", "signals.gpu_xid_query"]
    assert all(q.startswith("not valid PromQL (promtool): ") for _, q in e.value.errors)
    assert load_config("grayguard.example.yaml", promql=True).signals == SignalsConfig()


def test_config_check_command(tmp_path, capsys):
    assert main(["config", "check", "--config.file", "grayguard.example.yaml"]) == 0
    assert "grayguard.example.yaml: OK" in capsys.readouterr().out
    f = write(tmp_path, "pools: [{name: a, backend: b}]\nstale_after_s: 0\n")
    assert main(["config", "check", "--config.file", str(f)]) == 2
    assert capsys.readouterr().err == f"grayguard: config error in {f}:\n  stale_after_s: must be > 0\n"


def test_check_names_every_problem_of_the_environment_too(tmp_path, monkeypatch):
    """What the file alone cannot show (an environment variable it names, a file it names, the state file's folder)
    is reported the same way: every problem at once, under the file's name, exit 2."""
    monkeypatch.delenv("GRAYGUARD_TEST_UNSET_TOKEN", raising=False)
    (tmp_path / "afile").write_text("x")
    f = write(tmp_path, f"""\
prometheus:
  bearer_token_env: GRAYGUARD_TEST_UNSET_TOKEN
  ca_file: {tmp_path / "missing-ca.pem"}
pools:
  - name: chat
    backend: vllm_chat
state_file: {tmp_path / "afile" / "state.json"}
""")
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(f), "--check"],
                       capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                       if k != "GRAYGUARD_TEST_UNSET_TOKEN"})
    assert p.returncode == 2, p.stderr
    report = p.stderr[p.stderr.index(f"grayguard: config error in {f}:"):].splitlines()
    assert [line.partition(": ")[0].strip() for line in report[1:]] == [
        "prometheus.bearer_token_env", "prometheus.ca_file", "state_file"], p.stderr
