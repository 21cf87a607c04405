"""promtool and amtool on the committed rules, their unit tests and the Alertmanager example."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from grayguard.config import load_config, parse_config
from grayguard.rules.render import ALERTS, recording_rule_names, render_all
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "rules"
RULE_FILES = sorted(RULES.glob("*.rules.yml")) + sorted(RULES.glob("tests/*.rules.yml"))
TEST_FILES = sorted(RULES.glob("tests/*.test.yml"))
AM_EXAMPLE = RULES / "alertmanager.example.yml"


def run(argv, cwd=None):
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def promtool():
    require("promtool")
    return shutil.which("promtool")


@pytest.fixture(scope="module")
def amtool():
    require("amtool")
    return shutil.which("amtool")


def test_rule_files_exist():
    names = {p.name for p in RULE_FILES}
    assert {"grayguard-recording.rules.yml", "grayguard-alerts.rules.yml"} <= names
    assert {p.name for p in TEST_FILES} >= {"recording.test.yml", "alerts.test.yml", "regression.test.yml",
                                            "links.test.yml"}


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(promtool, path):
    res = run([promtool, "check", "rules", "--lint-fatal", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(promtool, path):
    # Test files name their rule files relative to themselves.
    res = run([promtool, "test", "rules", path.name], cwd=path.parent)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("rules", [
    {"control_window": "10s", "human_window": "2m", "omega": 0.5, "control_interval": None},
    {"control_window": "1m", "human_window": "1m"},
    {"alert_for": {"GrayguardNodeQuarantined": "0s"}, "controller_job": "ctl", "exporter_job": "exp"},
])
def test_promtool_accepts_other_configs(promtool, tmp_path, rules):
    cfg = parse_config({"pools": [{"name": "a", "backend": "a"}, {"name": "b", "backend": "b"}], "rules": rules})
    paths = []
    for name, text in render_all(cfg, {"a": 0.25, "b": 3.0}).items():
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    res = run([promtool, "check", "rules", "--lint-fatal", *paths])
    assert res.returncode == 0, res.stdout + res.stderr


def _tests(path):
    return yaml.safe_load(path.read_text())["tests"]


def test_every_recording_rule_has_an_expr_test():
    exprs = [t["expr"] for f in TEST_FILES for g in _tests(f) for t in g.get("promql_expr_test", [])]
    missing = [n for n in recording_rule_names(load_config(REPO / "grayguard.example.yaml"))
               if not any(n in e for e in exprs)]
    assert not missing, f"recording rules without a promql_expr_test: {missing}"


def test_every_alert_has_a_firing_and_a_silent_case_around_for():
    cases = {}
    for f in TEST_FILES:
        for g in _tests(f):
            for t in g.get("alert_rule_test", []):
                cases.setdefault(t["alertname"], []).append((t["eval_time"], bool(t.get("exp_alerts"))))
    for name in ALERTS:
        got = cases.get(name, [])
        assert any(firing for _, firing in got), f"{name}: no firing case"
        assert any(not firing for _, firing in got), f"{name}: no silent case"


def test_promtool_test_catches_a_broken_rule(promtool, tmp_path):
    """The unit tests are not vacuous: a rule without the no-traffic guard fails them."""
    rec = (RULES / "grayguard-recording.rules.yml").read_text().replace("            > 0\n", "            >= 0\n")
    (tmp_path / "grayguard-recording.rules.yml").write_text(rec)
    (tmp_path / "tests").mkdir()
    shutil.copy(RULES / "tests" / "recording.test.yml", tmp_path / "tests")
    res = run([promtool, "test", "rules", "recording.test.yml"], cwd=tmp_path / "tests")
    assert res.returncode != 0
    assert "NaN" in res.stdout + res.stderr


def test_the_links_test_catches_a_lost_join(promtool, tmp_path):
    """links.test.yml is not vacuous: alerts that find a node by grayguard_node_info's own instance only (as if the
    controller were always scraped with honor_labels) lose node1, whose info Prometheus stored as exported_instance."""
    learned = (RULES / "tests" / "grayguard-alerts-learned.rules.yml").read_text()
    cut = learned.replace(" or grayguard_node_info{pool=%[1]q, exported_instance=%[2]q}", "")
    assert cut != learned
    shutil.copy(RULES / "grayguard-recording.rules.yml", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "grayguard-alerts-learned.rules.yml").write_text(cut)
    shutil.copy(RULES / "tests" / "links.test.yml", tmp_path / "tests")
    res = run([promtool, "test", "rules", "links.test.yml"], cwd=tmp_path / "tests")
    assert res.returncode != 0
    assert "GrayguardProbeFailing" in res.stdout + res.stderr


def test_promtool_check_prometheus_example(promtool):
    res = run([promtool, "check", "config", str(RULES / "prometheus.example.yml")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_amtool_check_config(amtool):
    res = run([amtool, "check-config", str(AM_EXAMPLE)])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("labels, receiver", [
    (["severity=page", "pool=chat", "alertname=GrayguardNodeQuarantined"], "page"),
    (["severity=ticket", "pool=chat", "alertname=GrayguardNodeDegraded"], "ticket"),
    (["alertname=SomethingElse"], "ticket"),
])
def test_alertmanager_routes_by_severity(amtool, labels, receiver):
    res = run([amtool, "config", "routes", "test", f"--config.file={AM_EXAMPLE}", *labels])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == [receiver]


def test_alertmanager_example_groups_by_pool_and_inhibits_per_pool():
    cfg = yaml.safe_load(AM_EXAMPLE.read_text())
    assert cfg["route"]["group_by"] == ["pool"]
    rule = cfg["inhibit_rules"][0]
    assert rule["source_matchers"] == ['alertname="GrayguardSafeguardEngaged"']
    assert "GrayguardNodeQuarantined" in rule["target_matchers"][0]
    assert rule["equal"] == ["pool"]


@pytest.mark.parametrize("prefix, input_sep", [("vllm_", "_"), ("any", ":"), ("any", "_")])
def test_recording_unit_tests_pass_under_other_vllm_naming(promtool, tmp_path, prefix, input_sep):
    """rules.vllm_prefix: the same hand-computed numbers when Prometheus stores vllm_ names (OpenMetrics
    scrape with ':' escaped) or when the rules match both spellings."""
    data = yaml.safe_load((REPO / "grayguard.example.yaml").read_text())
    data["rules"]["vllm_prefix"] = prefix
    rec = render_all(parse_config(data))["grayguard-recording.rules.yml"]
    assert ("vllm:" in rec) is False
    (tmp_path / "grayguard-recording.rules.yml").write_text(rec)
    (tmp_path / "tests").mkdir()
    # the input series and the queries people run instead of a recording (they read vLLM's names as stored)
    test = (RULES / "tests" / "recording.test.yml").read_text().replace("vllm:", f"vllm{input_sep}")
    (tmp_path / "tests" / "recording.test.yml").write_text(test)
    res = run([promtool, "test", "rules", "recording.test.yml"], cwd=tmp_path / "tests")
    assert res.returncode == 0, res.stdout + res.stderr
