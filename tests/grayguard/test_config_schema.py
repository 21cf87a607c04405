"""The config's JSON Schema (issue 35): shipped as generated, valid draft 2020-12, true to every shipped config, and
it refuses what the loader refuses, field by field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from grayguard.cli import main
from grayguard.config import ConfigError, parse_config
from grayguard.configschema import CONSTRAINTS, SCHEMA_FILE, json_schema, render

jsonschema = pytest.importorskip("jsonschema")  # a test dependency (pyproject's test extra)

ROOT = Path(__file__).resolve().parents[2]
# every grayguard config the repository ships or tests with
SHIPPED = ["grayguard.example.yaml", "deploy/kubernetes/base/controller/grayguard.yaml",
           "rules/tests/grayguard-test.yaml", *sorted(str(p.relative_to(ROOT)) for p in
                                                     (ROOT / "tests/fixtures/vllm/runs").glob("*/grayguard.yaml"))]
BASE = {"pools": [{"name": "chat", "backend": "vllm_chat"}]}


@pytest.fixture(scope="module")
def validator():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_shipped_schema_is_the_generated_one():
    assert SCHEMA_FILE.read_text() == render(), "regenerate: grayguard config schema --out grayguard/config.schema.json"


def test_the_command_prints_it(capsys):
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_config_is_valid(validator, path):
    doc = yaml.safe_load((ROOT / path).read_text())
    assert [e.message for e in validator.iter_errors(doc)] == []
    # and the loader agrees (a recorded run's config names the series of its day, read by no query again)
    parse_config(doc, series="tests/fixtures/vllm/runs/" not in path)


# The mistakes an editor can show as they are typed: each refused by the schema and by the loader, at the same field.
MISTAKES = [
    ({"tick_intervall_s": 1}, "tick_intervall_s"),  # a typo
    ({"prometheus": {"timeout_s": "fast"}}, "prometheus.timeout_s"),  # a wrong type
    ({"thresholds": {"max_ejected_fraction": 3}}, "thresholds.max_ejected_fraction"),  # out of range
    ({"pools": [{"name": "chat", "backend": "vllm;shutdown"}]}, "pools[0].backend"),  # a name HAProxy cannot take
    ({"rules": {"control_window": "30 seconds"}}, "rules.control_window"),  # not a Prometheus duration
    ({"haproxy": {"writer": "both"}}, "haproxy.writer"),  # not one of the choices
    ({"thresholds": {"quarantine_scor": 3}}, "thresholds.quarantine_scor"),  # a typo a level down
    ({"pools": [{"name": "chat"}]}, "pools[0].backend"),  # a required field missing
]


@pytest.mark.parametrize("change, path", MISTAKES, ids=[m[1] for m in MISTAKES])
def test_each_mistake_is_refused_by_both(validator, change, path):
    doc = {**copy.deepcopy(BASE), **change}
    assert list(validator.iter_errors(doc)), f"the schema accepts {change}"
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert path in [p for p, _ in e.value.errors]


def test_five_mistakes_in_one_file_are_five_errors_for_both(validator, tmp_path):
    """The issue's acceptance on a file an editor can judge: five independent mistakes (a typo, a wrong type, out of
    range, a name HAProxy cannot take, a value outside the choices), five schema errors at those fields, and
    `--check` prints five lines and exits 2 (the loader-only mistakes, a duplicate block and the signals' window:
    tests/grayguard/test_config_all_errors.py)."""
    doc = copy.deepcopy(BASE)
    for change, _ in (MISTAKES[0], MISTAKES[1], MISTAKES[2], MISTAKES[3], MISTAKES[5]):
        for key, value in change.items():
            doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    paths = {"tick_intervall_s", "prometheus.timeout_s", "thresholds.max_ejected_fraction", "pools[0].backend",
             "haproxy.writer"}

    def where(err) -> str:  # a schema error's field (the deepest of a nullable section's), as the loader spells it
        err = max([err, *err.context], key=lambda x: len(x.absolute_path))
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path).lstrip(".")
    errors = list(validator.iter_errors(doc))
    found = {where(e) for e in errors} | {m for e in errors if e.validator == "additionalProperties"
                                          for m in paths if m in e.message}
    assert paths <= found and len(errors) == 5, [(where(e), e.message) for e in errors]
    f = tmp_path / "five.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert main(["controller", "--config.file", str(f), "--check"]) == 2
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert {p for p, _ in e.value.errors} == paths


def test_seconds_are_durations_or_numbers_for_both(validator):
    """One unit convention (docs/configuration.md, "Units"): every duration may be written as Prometheus writes
    one; a `_s` field takes a number of seconds too, as it always did."""
    doc = {**copy.deepcopy(BASE), "prometheus": {"timeout_s": "1m30s"}, "recovery": {"min_quarantine_s": "500ms"},
           "registry": {"lease_ttl_s": "10s"}, "tick_interval_s": 2}
    assert list(validator.iter_errors(doc)) == []
    cfg = parse_config(doc)
    assert (cfg.prometheus.timeout_s, cfg.recovery.min_quarantine_s, cfg.registry.lease_ttl_s,
            cfg.tick_interval_s) == (90.0, 0.5, 10, 2.0)
    assert isinstance(cfg.registry.lease_ttl_s, int)
    for bad in ("90 seconds", "1.5s", "-5s"):
        wrong = {**copy.deepcopy(BASE), "prometheus": {"timeout_s": bad}}
        assert list(validator.iter_errors(wrong)), bad
        with pytest.raises(ConfigError, match="prometheus.timeout_s"):
            parse_config(wrong)


def test_removed_fields_are_accepted_as_deprecated(validator):
    doc = {**BASE, "thresholds": {"min_peers": 3}}
    assert list(validator.iter_errors(doc)) == []
    assert json_schema()["$defs"]["ThresholdsConfig"]["properties"]["min_peers"]["deprecated"] is True


def test_null_sections_and_servers_are_empty_ones(validator):
    doc = {**BASE, "thresholds": None}
    doc["pools"] = [{"name": "chat", "backend": "vllm_chat", "servers": {"n1": None}}]
    assert list(validator.iter_errors(doc)) == []
    parse_config(doc)


# ---- each bound of the schema is one of the loader's ---------------------------------------------------------------

WHERE = {"Config": "", "PrometheusConfig": "prometheus", "HaproxyConfig": "haproxy", "PoolConfig": "pools[0]",
         "ServerConfig": "pools[0].servers.n1", "SignalsConfig": "signals", "ThresholdsConfig": "thresholds",
         "RecoveryConfig": "recovery", "RulesConfig": "rules", "RegistryConfig": "registry"}


def place(defn: str, field: str, value) -> dict:
    doc = copy.deepcopy(BASE)
    if defn == "Config":
        doc[field] = value
    elif defn == "PoolConfig":
        doc["pools"][0][field] = value
    elif defn == "ServerConfig":
        doc["pools"][0]["servers"] = {"n1": {field: value}}
    else:
        doc[WHERE[defn]] = {field: value}
    return doc


def violations():
    """(definition, field, a value just past one of its bounds, or a string no pattern or choice takes)."""
    out = []
    for defn, fields in CONSTRAINTS.items():
        for field, kw in fields.items():
            branch = next((b for b in kw.get("anyOf", []) if b.get("type") != "null"), kw)
            if "minimum" in branch:
                out.append((defn, field, branch["minimum"] - 0.5))
            if "exclusiveMinimum" in branch:
                out.append((defn, field, branch["exclusiveMinimum"]))
            if "maximum" in branch:
                out.append((defn, field, branch["maximum"] + 0.5))
            if "exclusiveMaximum" in branch:
                out.append((defn, field, branch["exclusiveMaximum"]))
            if "pattern" in branch or "enum" in branch:
                out.append((defn, field, "no such; value"))
            if "minItems" in branch:
                out.append((defn, field, []))
            if "items" in branch and "pattern" in branch["items"]:
                out.append((defn, field, ["no such; value"]))
            if "propertyNames" in branch:
                out.append((defn, field, {"no such; name": {} if defn == "PoolConfig" else "1m"}))
            if kw.get("anyOf") and kw["anyOf"][0].get("const") == 0:  # kv_outlier_ratio: 0 or > 1
                out.append((defn, field, 0.5))
    return out


@pytest.mark.parametrize("defn, field, value", violations(), ids=lambda v: str(v))
def test_what_the_schema_refuses_the_loader_refuses(validator, defn, field, value):
    doc = place(defn, field, value)
    if isinstance(value, float) and field in ("probe_consecutive", "probe_ok_to_clear", "canary_successes",
                                              "probe_failures", "lease_ttl_s"):
        doc = place(defn, field, int(value - 0.5))  # an integer field: the integer below the bound
    assert list(validator.iter_errors(doc)), f"the schema accepts {defn}.{field}={value!r}"
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    name = f"{WHERE[defn]}.{field}" if WHERE[defn] else field
    assert name in str(e.value)
