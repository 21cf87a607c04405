"""The desired-state document as a versioned interface (issue 36): what a real leader publishes validates against
grayguard/schemas/desired.v1.json (and documents every field); load() reads a document without a version as version 1
and ignores fields it does not know; another major version is refused with DesiredVersionError, and the actuator then
leaves that pool's HAProxy as it is, counts it under reason="version" and applies the other pools."""

from __future__ import annotations

import json
import logging

import pytest

from grayguard.controller import desired as dd
from grayguard.controller.actuator import Actuator, ActuatorMetrics
from grayguard.controller.haproxy import DRAIN_MASK
from tests.controller.test_status_schema import leader_world, validate
from tests.support.ctl_helpers import FakeHaproxy
from tests.support.fake_etcd import Client

PREFIX = "/gg"  # tests/controller/test_leader.py's, which leader_world uses
KEY = dd.desired_key(PREFIX, "chat")


def published() -> tuple[str, object]:
    """The desired document a real leader (haproxy.writer: actuators) put in etcd after draining node0; the etcd."""
    ctl, _, etcd, _ = leader_world(extra={"haproxy": {"endpoints": ["unix:/h1"], "writer": "actuators"},
                                          "registry": {"url": "http://etcd.test:2379"}})
    res = ctl.tick()
    assert not res.errors, res.errors
    return etcd.kv[KEY].value, etcd


def test_a_real_leaders_document_validates_and_carries_version_1():
    text, _ = published()
    doc = json.loads(text)
    assert doc["version"] == 1 and doc["servers"]["node0"] == {"weight": 0, "drain": True, "state": "quarantined"}
    assert validate(doc, "desired") == []
    assert dd.dump(dd.load(text)) == text  # and this release reads what it writes


def test_from_decision_validates_too():
    from tests.deploy.test_actuator import BE, _decision  # a decision with a held node and an agent released
    doc = json.loads(dd.dump(dd.from_decision("chat", BE, _decision())))
    assert validate(doc, "desired") == [] and doc["agent_off"] == ["node1"]


def test_a_document_without_a_version_reads_as_version_1():
    text, _ = published()
    doc = json.loads(text)
    del doc["version"]
    assert dd.load(json.dumps(doc)) == dd.load(text)
    assert validate(doc, "desired") == []


def test_fields_it_does_not_know_are_ignored():
    text, _ = published()
    doc = json.loads(text)
    doc["priority"] = 3
    doc["servers"]["node0"]["zone"] = "b"
    assert dd.load(json.dumps(doc)) == dd.load(text)


@pytest.mark.parametrize("version", [2, 0, "1", True, None, 1.0])
def test_another_major_version_is_refused_and_classified(version):
    doc = json.loads(published()[0]) | {"version": version}
    with pytest.raises(dd.DesiredVersionError, match=r"^version: desired-state document version .* not supported"):
        dd.load(json.dumps(doc))
    if version != 1.0:  # (JSON Schema counts 1.0 as the integer 1; the loader, as a Go or Rust reader, does not)
        assert validate(doc, "desired") != []


class Registry:
    """The actuator's registry seam over the leader's in-memory etcd."""

    url = "http://etcd.test:2379"

    def __init__(self, etcd):
        self.client = Client(etcd)

    def get_prefix(self, prefix):
        return self.client.get_prefix(prefix)


def test_the_actuator_leaves_haproxy_as_it_is_for_a_newer_major_and_counts_it(caplog):
    text, etcd = published()
    v2 = json.loads(text) | {"version": 2, "servers": {"node1": {"weight": 7, "drain": True, "state": "healthy"}}}
    etcd.kv[KEY] = type(etcd.kv[KEY])(KEY, json.dumps(v2), etcd.rev + 1, etcd.rev + 1, 0)
    embed = dd.Desired("embed", "vllm_embed", {"e0": dd.DesiredServer(40, False, "degraded")})
    etcd.kv[dd.desired_key(PREFIX, "embed")] = type(etcd.kv[KEY])(dd.desired_key(PREFIX, "embed"), dd.dump(embed),
                                                                   etcd.rev + 2, etcd.rev + 2, 0)
    events: list = []
    hap = FakeHaproxy("unix:/gw", {"vllm_chat": [(f"node{i}", f"127.0.0.1:{9100 + i}", 100) for i in range(4)],
                                   "vllm_embed": [("e0", "127.0.0.1:9200", 100)]}, events)
    before = dict(hap.table)
    metrics = ActuatorMetrics()
    act = Actuator(Registry(etcd), hap, PREFIX, metrics=metrics)
    with caplog.at_level(logging.WARNING, "grayguard.actuator"):
        res = act.round()
        act.round()  # said once
    assert res.error is None and res.pools == ("embed",)  # the other pool is applied
    assert hap.table[("vllm_embed", "e0")].weight == 40
    assert {k: v for k, v in hap.table.items() if k[0] == "vllm_chat"} == \
        {k: v for k, v in before.items() if k[0] == "vllm_chat"}  # chat's servers untouched: nothing lost
    assert not hap.table[("vllm_chat", "node1")].admin_state & DRAIN_MASK
    get = metrics.registry.get_sample_value
    assert get("grayguard_actuator_invalid_documents_total", {"reason": "version"}) == 2  # each round counts it
    assert get("grayguard_actuator_invalid_documents_total", {"reason": "invalid"}) == 0
    said = [r.getMessage() for r in caplog.records if KEY in r.getMessage()]
    assert len(said) == 1 and "version 2 is not supported" in said[0] and "left as it was" in said[0]
    assert json.loads(etcd.kv[KEY].value)["version"] == 2  # the document itself is left for a newer actuator


def test_an_invalid_document_is_counted_apart_from_a_version():
    text, etcd = published()
    etcd.kv[KEY] = type(etcd.kv[KEY])(KEY, text.replace('"weight":0', '"weight":999'), etcd.rev + 1, etcd.rev + 1, 0)
    metrics = ActuatorMetrics()
    Actuator(Registry(etcd), FakeHaproxy("unix:/gw", {}, []), PREFIX, metrics=metrics).round()
    get = metrics.registry.get_sample_value
    assert (get("grayguard_actuator_invalid_documents_total", {"reason": "invalid"}),
            get("grayguard_actuator_invalid_documents_total", {"reason": "version"})) == (1, 0)
