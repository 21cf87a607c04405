"""`grayguard rules render|check` through the real dispatcher."""

from pathlib import Path

import responses

from grayguard.cli import main
from grayguard.rules.render import ALERTS_FILE, RECORDING_FILE
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "grayguard.example.yaml"


def test_render_writes_then_reports_unchanged(tmp_path, capsys):
    out = tmp_path / "rules"
    assert main(["rules", "render", "--config.file", str(EXAMPLE), "--out", str(out)]) == 0
    assert (out / RECORDING_FILE).read_text() == (REPO / "rules" / RECORDING_FILE).read_text()
    assert (out / ALERTS_FILE).read_text() == (REPO / "rules" / ALERTS_FILE).read_text()
    assert capsys.readouterr().out.count("written") == 2
    assert main(["rules", "render", "--config.file", str(EXAMPLE), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("unchanged") == 2


def test_bad_config_names_the_field_and_exits_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("pools: [{name: chat, backend: b}]\nrules:\n  omega: 7\n")
    assert main(["rules", "render", "--config.file", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "rules.omega" in err and "config error" in err
    assert not (tmp_path / "o").exists()


def test_unknown_override_exits_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("pools: [{name: chat, backend: b}]\nrules:\n  alert_for: {GrayguardNope: 1m}\n")
    assert main(["rules", "render", "--config.file", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "rules.alert_for.GrayguardNope" in capsys.readouterr().err


def test_signals_mismatch_is_warned(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    # a query that is no series of these rules (a window of its own is a config error: grayguard.config)
    cfg.write_text("pools: [{name: chat, backend: b}]\nsignals:\n  latency_query: my_latency_seconds\n")
    assert main(["rules", "render", "--config.file", str(cfg), "--out", str(tmp_path / "o")]) == 0
    assert "signals.latency_query" in capsys.readouterr().err


@responses.activate
def test_render_with_prometheus_baselines(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pools: [{name: chat, backend: b}]\nprometheus: {url: 'http://prom.test:9090'}\n")
    responses.get("http://prom.test:9090/api/v1/query", json={"status": "success", "data": {
        "resultType": "vector", "result": [{"metric": {"pool": "chat"}, "value": [1, "0.61"]}]}})
    assert main(["rules", "render", "--config.file", str(cfg), "--out", str(tmp_path), "--prometheus-baselines"]) == 0
    assert '{pool="chat"} > 2 * 0.61' in (tmp_path / ALERTS_FILE).read_text()


@responses.activate
def test_unreachable_prometheus_exits_1(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pools: [{name: chat, backend: b}]\nprometheus: {url: 'http://prom.test:9090'}\n")
    responses.get("http://prom.test:9090/api/v1/query", status=502)
    assert main(["rules", "render", "--config.file", str(cfg), "--out", str(tmp_path), "--prometheus-baselines"]) == 1
    assert "cannot learn baselines" in capsys.readouterr().err


def test_check_passes_on_the_repo(capsys):
    require("promtool")
    assert main(["rules", "check"]) == 0
    out = capsys.readouterr().out
    assert "rules check: OK" in out and "recording.test.yml" in out


def test_check_fails_on_a_broken_dir(tmp_path, capsys):
    require("promtool")
    broken = "groups:\n  - name: g\n    rules:\n      - record: a\n        expr: 'rate(x'\n"
    (tmp_path / "x.rules.yml").write_text(broken)
    assert main(["rules", "check", "--dir", str(tmp_path)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_check_without_promtool_says_how_to_install(capsys):
    assert main(["rules", "check", "--promtool", "no-such-promtool"]) == 1
    assert "apt-get install prometheus" in capsys.readouterr().err


def test_no_action_exits_2(capsys):
    assert main(["rules"]) == 2
