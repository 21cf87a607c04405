"""The controller's count of the canary requests it sends, which the recording rules take out of request rates."""

from __future__ import annotations

from grayguard.controller.metrics import ControllerMetrics


def test_a_canary_counts_once_under_each_series_key_of_its_node():
    m = ControllerMetrics.create()
    m.canary_sent("chat", "node3", ("gpu3.example:8000", "10.0.0.3:8000"))
    m.canary_sent("chat", "node3", ("gpu3.example:8000", "10.0.0.3:8000"))
    m.canary_sent("chat", "node1", ("10.0.0.1:8000",))  # a reference peer
    got = m.registry.get_sample_value
    assert got("grayguard_canary_requests_total", {"pool": "chat", "node": "node3", "instance": "10.0.0.3:8000"}) == 2
    assert got("grayguard_canary_requests_total",
               {"pool": "chat", "node": "node3", "instance": "gpu3.example:8000"}) == 2
    assert got("grayguard_canary_requests_total", {"pool": "chat", "node": "node1", "instance": "10.0.0.1:8000"}) == 1


def test_a_forgotten_node_takes_its_canary_counts_along():
    m = ControllerMetrics.create()
    m.canary_sent("chat", "node3", ("10.0.0.3:8000",))
    m.canary_sent("chat", "node1", ("10.0.0.1:8000",))
    m.forget_node("chat", "node3")
    got = m.registry.get_sample_value
    node3 = {"pool": "chat", "node": "node3", "instance": "10.0.0.3:8000"}
    assert got("grayguard_canary_requests_total", node3) is None
    assert got("grayguard_canary_requests_total", {"pool": "chat", "node": "node1", "instance": "10.0.0.1:8000"}) == 1
