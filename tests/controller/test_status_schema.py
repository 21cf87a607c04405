"""/status as a stable, versioned interface (issue 36): the shipped schemas are the generated ones and valid draft
2020-12; a real leader's tick, served by the controller's own HTTP server, gives a /status that carries version 1,
validates against grayguard/schemas/status.v1.json and holds no field the schema does not document; the document is
strict JSON; a reader takes a document without a version as version 1, ignores fields it does not know, and refuses
another major version."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import urllib.request
from pathlib import Path

import msgspec
import pytest

from grayguard import verdict
from grayguard.cli import main
from grayguard.controller.httpserver import serve, status_document
from grayguard.verdict import VERSION, VersionError, json_schema, load_status, render, schema_file
from tests.controller.test_leader import Clock, replica
from tests.support.ctl_helpers import LAT_Q, RATE_Q, FakeHaproxy, FakeProm, fake_controller, samples
from tests.support.fake_etcd import FakeEtcd

jsonschema = pytest.importorskip("jsonschema")  # a test dependency (pyproject's test extra)

NAMES = ("status", "desired")
ADDR = {f"node{i}": ("127.0.0.1", 9100 + i) for i in range(4)}


def strict(schema: dict) -> dict:
    """The schema with additionalProperties: false on every object it defines: a document that validates against it
    has no field the schema leaves undocumented (the shipped schema lets a newer minor add fields)."""
    s = copy.deepcopy(schema)
    for d in s["$defs"].values():
        if d.get("type") == "object" and "properties" in d:
            d["additionalProperties"] = False
    return s


def validate(doc: dict, name: str) -> list[str]:
    """Every problem of doc against the shipped schema and against its strict form."""
    shipped = json.loads(schema_file(name).read_text())
    return [f"{e.json_path}: {e.message}" for schema in (shipped, strict(shipped))
            for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def leader_world(clock: Clock | None = None, extra: dict | None = None):
    """A leading controller over fake seams (its HAProxy, its Prometheus, an in-memory etcd): node0 is 10x slower
    than its peers (extra: config sections to add, e.g. a detector in shadow mode)."""
    clock = clock or Clock()
    etcd = FakeEtcd(clock)
    events: list = []
    lat = {"127.0.0.1:9100": 0.2} | {f"127.0.0.1:{9100 + i}": 0.02 for i in (1, 2, 3)}

    def prom(q):
        inner = q.removeprefix("timestamp(").removesuffix(")")
        got = {k: 5.0 for k in lat} if inner == RATE_Q else lat if inner == LAT_Q else {}
        return samples({k: clock() for k in got} if inner != q else got, clock())

    hap = FakeHaproxy("unix:/h1", {"vllm_chat": [(n, f"{a}:{p}", 100) for n, (a, p) in ADDR.items()]}, events)
    ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [hap], FakeProm(prom, events), clock=clock,
                          extra={"rules": {"control_interval": "30s"}, **(extra or {})})
    ctl.leadership, client = replica((clock, etcd), "a")
    return ctl, hap, etcd, client


def served_status(ctl) -> tuple[dict, str]:
    """GET /status from the controller's own HTTP server: the document and its text."""
    srv = serve("127.0.0.1:0", ctl.metrics.registry, ctl.status)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.server_address[1]}/status", timeout=5) as r:
            assert r.headers["Content-Type"] == "application/json"
            text = r.read().decode()
    finally:
        srv.shutdown()
    return json.loads(text), text


def real_status() -> dict:
    """/status after a leader's tick that drained node0."""
    ctl, *_ = leader_world()
    ctl.tick()
    return served_status(ctl)[0]


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_schema_is_the_generated_one_and_valid(name):
    assert schema_file(name).read_text() == render(name), f"regenerate: grayguard api schema {name} --out " \
                                                         f"grayguard/schemas/{name}.v1.json"
    jsonschema.Draft202012Validator.check_schema(json_schema(name))
    assert json_schema(name)["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("name", NAMES)
def test_the_command_prints_it(name, capsys):
    assert main(["api", "schema", name]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(schema_file(name).read_text())


SHADOW = {"detectors": {"latency": {"enforce": False}}}


def test_a_real_ticks_status_validates_and_documents_every_field():
    ctl, *_ = leader_world()
    before, _ = served_status(ctl)  # before the first tick: nulls where nothing was decided yet
    assert before["version"] == VERSION and before["last_tick"] is None
    assert validate(before, "status") == []
    ctl.tick()
    doc, text = served_status(ctl)
    assert doc["version"] == 1 and text.lstrip().startswith('{\n "version": 1,')  # first, where a reader looks
    assert validate(doc, "status") == []
    nodes = {n["node"]: n for n in doc["pools"][0]["nodes"]}
    assert (nodes["node0"]["state"], nodes["node0"]["weight"], nodes["node0"]["drain_cause"]) == \
        ("quarantined", 0, "latency")
    assert nodes["node1"]["state"] == "healthy" and nodes["node1"]["weight"] == 100
    assert doc["leadership"]["leads"] == ["all"]  # the leadership block is covered too
    got = load_status(text)
    assert got.pools[0].nodes[0].node == "node0" and got.leadership.id == "a"


def test_a_shadowed_detectors_findings_validate_too():
    ctl, *_ = leader_world(extra=SHADOW)  # the latency detector reports node0 and changes nothing
    ctl.tick()
    doc, _ = served_status(ctl)
    assert validate(doc, "status") == []
    node0 = doc["pools"][0]["nodes"][0]
    assert node0["state"] == "healthy" and [f["detector"] for f in node0["shadow"]] == ["latency"]
    assert isinstance(node0["shadow"][0]["factor"], float)


def test_a_drained_node_its_probes_found_no_server_says_so():
    """`unreachable`: it comes back as a warm-up once it answers (policy.back_in); every other node says false."""
    ctl, *_ = leader_world()
    ctl.tick()
    pool = next(iter(ctl.states))
    ctl.states[pool]["node0"] = dataclasses.replace(ctl.states[pool]["node0"], unreachable=True)
    doc, text = served_status(ctl)
    assert validate(doc, "status") == []
    nodes = {n["node"]: n for n in doc["pools"][0]["nodes"]}
    assert nodes["node0"]["unreachable"] is True and nodes["node1"]["unreachable"] is False
    assert load_status(text).pools[0].nodes[0].unreachable is True


def test_the_strict_schema_notices_an_undocumented_field():
    doc = real_status()
    doc["pools"][0]["nodes"][0]["new_field"] = 1
    problems = validate(doc, "status")
    assert len(problems) == 1 and "new_field" in problems[0]  # the shipped schema allows it; the strict one does not


def test_status_is_strict_json_a_non_finite_number_is_null():
    doc = {"last_tick": 1.0, "dry_run": False, "pools": [{"pool": "chat", "backend": "b", "ejected": 0,
           "max_ejected": 1, "safeguard_engaged": False, "nodes": [
               {"node": "n", "state": "healthy", "since": 0.0, "weight": 100, "score": math.nan,
                "ratio_to_peers": math.inf, "latency_ema": None, "peer_median": -math.inf, "reason": "",
                "factors": {"latency": math.nan}, "drain_cause": None, "gone_since": None, "shadow": []}]}]}

    def no_constants(c):
        raise AssertionError(f"not JSON: {c}")
    served = json.loads(status_document(doc), parse_constant=no_constants)
    node = served["pools"][0]["nodes"][0]
    assert (node["score"], node["ratio_to_peers"], node["peer_median"], node["factors"]) == \
        (None, None, None, {"latency": None})
    assert served["version"] == 1 and served["pools"][0]["max_ejected"] == 1


def test_a_status_without_a_version_reads_as_version_1():
    doc = real_status()
    del doc["version"]  # as the previous release served it
    assert validate(doc, "status") == []
    assert load_status(doc).version == 1


def test_a_reader_ignores_fields_it_does_not_know():
    doc = real_status()
    doc["added_in_1_1"] = {"x": 1}
    doc["pools"][0]["nodes"][0]["added_too"] = "y"
    got = load_status(json.dumps(doc))
    assert got.pools[0].nodes[0].state == "quarantined"


@pytest.mark.parametrize("version", [2, 0, "1", True, None])
def test_a_reader_refuses_another_major_version(version):
    doc = real_status() | {"version": version}
    with pytest.raises(VersionError, match=r"^version: /status version .* is not supported") as e:
        load_status(doc)
    assert e.value.got == version
    assert validate(doc, "status") != []  # the schema of version 1 refuses it too


def test_a_malformed_status_is_refused_with_the_field_named():
    doc = real_status()
    doc["pools"][0]["nodes"][0]["weight"] = "heavy"
    with pytest.raises(ValueError, match=r"pools\[0\]\.nodes\[0\]\.weight"):
        load_status(doc)


def test_docs_api_names_every_field_of_both_documents():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    named = set(re.findall(r"`\.?([a-z_]+)(?:\[\])?`", doc))  # `field`, `.field`, `field[]`
    # `pools[].field`, `servers.<name>.field`
    named |= set(re.findall(r"`[a-z_]+(?:\[\]|\.<name>)?\.([a-z_]+)(?:\[\])?`", doc))
    for struct in (verdict.Status, verdict.PoolStatus, verdict.NodeStatus, verdict.ShadowFinding, verdict.Leadership,
                   verdict.Desired, verdict.DesiredServer):
        missing = {f.name for f in msgspec.structs.fields(struct)} - named
        assert not missing, f"docs/api.md does not name {struct.__name__}'s {sorted(missing)}"
