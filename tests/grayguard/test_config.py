import subprocess
import sys

import pytest
import yaml

from grayguard.config import ConfigError, load_config, parse_config


def base():
    return {"pools": [{"name": "chat", "backend": "vllm_chat"}]}


def test_example_config_loads():
    cfg = load_config("grayguard.example.yaml")
    assert cfg.pools[0].backend == "vllm_chat"
    assert cfg.thresholds.quarantine_score == 3.5
    assert cfg.thresholds.max_ejected_fraction == 0.3 and cfg.recovery.canary_interval_s == 10


@pytest.mark.parametrize("mutate, path, problem", [
    (lambda d: d["pools"][0].update(backend="vllm;shutdown"), "pools[0].backend", "inject"),
    (lambda d: d["pools"][0].pop("backend"), "pools[0].backend", "required"),
    (lambda d: d.update(thresholds={"live_drift": 0.5}), "thresholds.live_drift", ">= 1"),
    (lambda d: d.update(thresholds={"quarantine_score": 1.0}), "thresholds.quarantine_score", ">="),
    (lambda d: d.update(thresholds={"probe_ok_to_clear": "three"}), "thresholds.probe_ok_to_clear", "integer"),
    (lambda d: d.update(tresholds={}), "tresholds", "unknown field"),
    (lambda d: d.update(haproxy={"endpoints": ["nohost"]}), "haproxy.endpoints[0]", "host:port"),
    (lambda d: d.update(prometheus={"url": "localhost:9090"}), "prometheus.url", "http://"),
    (lambda d: d["pools"].append({"name": "chat", "backend": "b2"}), "pools[1].name", "duplicate"),
    (lambda d: d["pools"][0].update(servers={"n 1": {}}), "pools[0].servers.n 1", "server names"),
    (lambda d: d.update(rules={"control_window": "30 seconds"}), "rules.control_window", "duration"),
    (lambda d: d.update(pools=[]), "pools", "at least one"),
])
def test_bad_fields_are_named(mutate, path, problem):
    d = base()
    mutate(d)
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.path == path
    assert problem in str(e.value)


def test_a_removed_field_loads_with_a_warning_that_names_it(caplog):
    """A config written for the last release (thresholds.live_prefill_gate, which the load model replaced) still
    loads: the field is dropped with a warning naming it and what replaced it, not an error that stops the
    controller on upgrade; a misspelled field is still an error."""
    d = base()
    d["thresholds"] = {"live_prefill_gate": 1.5, "quarantine_score": 4.5}
    with caplog.at_level("WARNING", logger="grayguard.config"):
        cfg = parse_config(d)
    assert cfg.thresholds.quarantine_score == 4.5 and not hasattr(cfg.thresholds, "live_prefill_gate")
    assert any("thresholds.live_prefill_gate was removed" in r.getMessage() and "load model" in r.getMessage()
               for r in caplog.records)
    d["thresholds"] = {"live_prefill_gates": 1.5}
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.path == "thresholds.live_prefill_gates"


def test_cli_exits_2_naming_the_field(tmp_path):
    d = base()
    d["thresholds"] = {"max_ejected_fraction": 3}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(d))
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(f), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert "thresholds.max_ejected_fraction" in p.stderr
    f.write_text("pools: [")
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(f), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "not valid YAML" in p.stderr
    ok = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file",
                         "grayguard.example.yaml", "--check"], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout


def test_example_shows_the_defaults(caplog):
    """Every default, and no field a release removed: the example is what a new install copies (a removed field would
    load with a warning, ignored, and the example would still show a knob that does nothing)."""
    import dataclasses

    import yaml

    from grayguard.config import RecoveryConfig, SignalsConfig, ThresholdsConfig
    cfg = load_config("grayguard.example.yaml")
    assert "was removed" not in caplog.text
    with open("grayguard.example.yaml") as f:
        shown = set(yaml.safe_load(f)["thresholds"])
    assert shown == {f.name for f in dataclasses.fields(ThresholdsConfig)}
    assert cfg.thresholds == ThresholdsConfig()
    assert cfg.recovery == RecoveryConfig()
    assert cfg.signals == SignalsConfig()


def test_duration_seconds():
    from grayguard.config import duration_seconds
    assert duration_seconds("10s") == 10 and duration_seconds("1m30s") == 90 and duration_seconds("500ms") == 0.5


def _removed_thresholds() -> list[str]:
    from grayguard.config import REMOVED_FIELDS
    return sorted(k.removeprefix("thresholds.") for k in REMOVED_FIELDS if k.startswith("thresholds."))


@pytest.mark.parametrize("field", _removed_thresholds())
def test_a_field_a_release_removed_loads_with_a_warning_that_says_what_replaced_it(field, caplog):
    """A config written for an older release still loads for one release: the field is ignored, and the log says
    why (the live ITL's fields, then the 30 s window's, went to one sequential test, issue 33), not a silent
    difference."""
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}], "thresholds": {field: 2, "live_cut_ratio": 1.6}})
    assert cfg.thresholds.live_cut_ratio == 1.6 and not hasattr(cfg.thresholds, field)
    assert f"thresholds.{field} was removed" in caplog.text


def test_a_live_cut_ratio_at_or_below_the_allowance_is_refused():
    """At the allowance every tick would be evidence enough to cut: refused, naming the field."""
    with pytest.raises(ConfigError, match=r"thresholds\.live_cut_ratio: must be > thresholds\.live_drift"):
        parse_config({"pools": [{"name": "chat", "backend": "b"}],
                      "thresholds": {"live_cut_ratio": 1.1, "live_drift": 1.1}})


def test_every_removed_field_is_listed_for_upgrades():
    """docs/operations.md ("Upgrade") lists every field a release took out, with what took its place: the warning a
    config that still sets one gets is the same text, so an operator can read it before the upgrade."""
    from pathlib import Path

    from grayguard.config import REMOVED_FIELDS
    doc = Path("docs/operations.md").read_text()
    for field, why in REMOVED_FIELDS.items():
        assert f"| `{field}` | {why.removesuffix('; ignored')} |" in doc, field
