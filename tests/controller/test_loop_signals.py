"""The live loop reads the optional signals from Prometheus and acts on them (real HAProxy)."""

import responses
from responses import matchers

from grayguard.config import SignalsConfig
from grayguard.controller.haproxy import RuntimeClient
from tests.support.ctl_helpers import PROM, make_controller, prom_answers, servers, vector

ADDRS = [f"127.0.0.1:{9100 + i}" for i in range(4)]
SIG = SignalsConfig()


def answer(rsps, query, body):
    rsps.get(f"{PROM}/api/v1/query", json=body, match=[matchers.query_param_matcher({"query": query})])


def probe_results(results, now):
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"instance": a, "pool": "chat", "result": r}, "value": [now, "1"]} for a, r in results.items()]}}


def test_cuda_probe_quarantines_and_a_failing_optional_query_is_counted_not_held(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], extra={"signals": {
        "probe_result_query": SIG.probe_result_query, "kv_cache_query": SIG.kv_cache_query}})
    with responses.RequestsMock() as rsps:
        prom_answers(rsps, {a: 0.02 for a in ADDRS}, now=t[0])
        answer(rsps, SIG.probe_result_query,
               probe_results({a: ("cuda_error" if a == ADDRS[1] else "ok") for a in ADDRS}, t[0]))
        rsps.get(f"{PROM}/api/v1/query", status=500, body="boom",
                 match=[matchers.query_param_matcher({"query": SIG.kv_cache_query})])
        r = ctl.tick()
    assert r.held is None
    assert ctl.states["chat"]["node1"].state == "quarantined"
    assert "CUDA" in ctl.states["chat"]["node1"].reason and ctl.states["chat"]["node1"].cause == "probe"
    w = {s.name: (s.weight, s.drain) for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}
    assert w["node1"] == (0, True) and w["node0"] == (100, False)
    assert ctl.metrics.registry.get_sample_value("grayguard_prometheus_errors_total", {"kind": "http_5xx"}) == 1


def test_kv_saturation_sets_weight_zero_without_drain(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], extra={"signals": {
        "kv_cache_query": SIG.kv_cache_query}})
    with responses.RequestsMock() as rsps:
        prom_answers(rsps, {a: 0.02 for a in ADDRS}, now=t[0])
        answer(rsps, SIG.kv_cache_query, vector({a: (0.99 if a == ADDRS[2] else 0.4) for a in ADDRS}, t[0]))
        ctl.tick()
    w = {s.name: (s.weight, s.drain) for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}
    assert w["node2"] == (0, False) and ctl.states["chat"]["node2"].state == "healthy"
    assert ctl.metrics.registry.get_sample_value("grayguard_node_weight_factor",
                                                 {"pool": "chat", "node": "node2", "signal": "kv_cache"}) == 0
    assert "KV cache 99% full" in ctl.status()["pools"][0]["nodes"][2]["reason"]


def test_peer_groups_from_the_gpu_model_label(haproxy_factory):
    """Two H100s and two A100s 1.6x slower: grouped by the exporter's GPU model, nobody is cut."""
    hap = haproxy_factory({"vllm_chat": servers(5)})
    addrs = [f"127.0.0.1:{9100 + i}" for i in range(5)]
    model = {a: ("NVIDIA H100 80GB HBM3" if i < 3 else "NVIDIA A100-SXM4-80GB") for i, a in enumerate(addrs)}
    t = [1000.0]

    def run(extra_pool):
        ctl = make_controller([hap.endpoint], clock=lambda: t[0], extra={
            "signals": {"peer_group_query": SIG.peer_group_query},
            "pools": [{"name": "chat", "backend": "vllm_chat", **extra_pool}]})
        seen = set()
        for _ in range(10):  # a fresh controller is careful until it has learned the pool's noise (scoring.Noise)
            t[0] += 1.0
            with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
                prom_answers(rsps, {a: 0.02 * (1.6 if "A100" in model[a] else 1.0) for a in addrs}, now=t[0])
                answer(rsps, SIG.peer_group_query, {"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {"instance": a, "pool": "chat", "name": m}, "value": [t[0], "1"]}
                    for a, m in model.items()]}})
                ctl.tick()
            seen |= {s.state for s in ctl.states["chat"].values()}
        return seen

    assert run({"peer_group_label": "name"}) == {"healthy"}
    assert run({}) != {"healthy"}  # without groups the A100s would look sick
