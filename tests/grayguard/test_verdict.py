"""The verdict for another router (issue 36, docs/api.md): a real /status, served by the controller's HTTP server after
a leader drained node0, turned into Envoy's EDS ClusterLoadAssignment by grayguard.verdict.cluster_load_assignment:
weights as grayguard wants them (Envoy's at-least-1 rule kept), the drained node listed as DRAINING, a node grayguard
does not report at the router's default weight (absent is not zero)."""

from __future__ import annotations

import json

from grayguard.verdict import cluster_load_assignment, load_status
from tests.controller.test_status_schema import ADDR, leader_world, real_status, served_status

UINT32_MAX = 4294967295


def lb_endpoints(cla: dict) -> dict[str, dict]:
    """hostname -> LbEndpoint, after checking the v3 JSON shape Envoy takes."""
    assert set(cla) == {"cluster_name", "endpoints"} and len(cla["endpoints"]) == 1
    out = {}
    for e in cla["endpoints"][0]["lb_endpoints"]:
        assert set(e) <= {"endpoint", "load_balancing_weight", "health_status"}
        sa = e["endpoint"]["address"]["socket_address"]
        assert isinstance(sa["address"], str) and isinstance(sa["port_value"], int)
        w = e["load_balancing_weight"]
        assert type(w) is int and 1 <= w <= 256  # Envoy: at least 1; grayguard's weights stop at HAProxy's 256
        assert e.get("health_status", "HEALTHY") in ("HEALTHY", "DRAINING")
        out[e["endpoint"]["hostname"]] = e
    assert sum(e["load_balancing_weight"] for e in out.values()) <= UINT32_MAX  # Envoy's limit for a locality
    return out


def test_a_real_status_becomes_envoy_weights_with_the_drained_node_draining():
    status = load_status(json.dumps(real_status()))
    cla = cluster_load_assignment(status, "chat", ADDR, "vllm_chat")
    got = lb_endpoints(cla)
    assert cla["cluster_name"] == "vllm_chat" and sorted(got) == sorted(ADDR)
    assert got["node0"]["health_status"] == "DRAINING" and got["node0"]["load_balancing_weight"] == 1
    assert {n: (e["load_balancing_weight"], "health_status" in e) for n, e in got.items() if n != "node0"} == \
        {"node1": (100, False), "node2": (100, False), "node3": (100, False)}
    assert got["node1"]["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9101}
    json.dumps(cla)  # plain JSON


def test_a_node_grayguard_does_not_report_keeps_the_routers_default_weight():
    status = load_status(real_status())
    got = lb_endpoints(cluster_load_assignment(status, "chat", {**ADDR, "node9": ("10.0.0.9", 8000)}, "c",
                                               default_weight=50))
    assert got["node9"]["load_balancing_weight"] == 50 and "health_status" not in got["node9"]
    ctl, *_ = leader_world()  # before the controller's first tick it reports no node: every one at the default
    before = load_status(served_status(ctl)[0])
    assert {n: e["load_balancing_weight"] for n, e in
            lb_endpoints(cluster_load_assignment(before, "chat", ADDR, "c")).items()} == dict.fromkeys(ADDR, 100)
    unknown_pool = cluster_load_assignment(status, "embed", ADDR, "c")
    assert {e["load_balancing_weight"] for e in lb_endpoints(unknown_pool).values()} == {100}


def test_a_cut_weight_passes_through_and_a_weight_0_in_rotation_is_draining():
    doc = real_status()
    nodes = {n["node"]: n for n in doc["pools"][0]["nodes"]}
    nodes["node1"].update(state="degraded", weight=35)
    nodes["node2"].update(weight=0)  # KV cache full: in rotation at weight 0 (HAProxy sends it nothing new)
    nodes["node3"].update(state="a_state_added_in_1_1", weight=60)  # a newer minor's state: judged by its weight
    got = lb_endpoints(cluster_load_assignment(load_status(doc), "chat", ADDR, "c"))
    assert (got["node1"]["load_balancing_weight"], "health_status" in got["node1"]) == (35, False)
    assert (got["node2"]["load_balancing_weight"], got["node2"]["health_status"]) == (1, "DRAINING")
    assert (got["node3"]["load_balancing_weight"], "health_status" in got["node3"]) == (60, False)
