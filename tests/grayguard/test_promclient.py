import math

import pytest
import requests
import responses

from grayguard.config import ConfigError, PrometheusConfig
from grayguard.promclient import PromError, PrometheusClient
from tests.support.ctl_helpers import PROM, make_controller, prom_answers, servers, vector


@responses.activate
def test_success_empty_and_nan():
    c = PrometheusClient(PrometheusConfig(url=PROM))
    responses.get(f"{PROM}/api/v1/query", json=vector({"a:1": 0.5, "b:1": "NaN", "c:1": "+Inf"}))
    got = {s.labels["instance"]: s.value for s in c.query("q")}
    assert got["a:1"] == 0.5 and math.isnan(got["b:1"]) and math.isinf(got["c:1"])
    responses.replace(responses.GET, f"{PROM}/api/v1/query",
                      json={"status": "success", "data": {"resultType": "vector", "result": []}})
    assert c.query("q") == []


@responses.activate
@pytest.mark.parametrize("kwargs, kind", [
    ({"status": 400, "json": {"status": "error", "error": "parse error"}}, "http_4xx"),
    ({"status": 503, "body": "overloaded"}, "http_5xx"),
    ({"body": requests.exceptions.ReadTimeout("slow")}, "timeout"),
    ({"body": requests.exceptions.ConnectionError("refused")}, "connect"),
    ({"body": "<html>proxy</html>"}, "bad_response"),
    ({"json": {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "x"]}]}}},
     "bad_response"),
])
def test_errors_are_classified(kwargs, kind):
    responses.get(f"{PROM}/api/v1/query", **kwargs)
    with pytest.raises(PromError) as e:
        PrometheusClient(PrometheusConfig(url=PROM)).query("q")
    assert e.value.kind == kind


@responses.activate
def test_auth_headers_from_environment():
    cfg = PrometheusConfig(url=PROM, bearer_token_env="TOK", headers_env={"X-Scope-OrgID": "TENANT"})
    responses.get(f"{PROM}/api/v1/query", json=vector({}))
    PrometheusClient(cfg, environ={"TOK": "s3cret", "TENANT": "team-a"}).query("q")
    h = responses.calls[0].request.headers
    assert h["Authorization"] == "Bearer s3cret" and h["X-Scope-OrgID"] == "team-a"
    with pytest.raises(ConfigError, match="prometheus.bearer_token_env"):
        PrometheusClient(cfg, environ={"TENANT": "x"})


@pytest.mark.parametrize("failure", [
    {"status": 404, "body": "not found"},
    {"status": 502, "body": "bad gateway"},
    {"body": requests.exceptions.ReadTimeout("slow")},
])
def test_prometheus_failures_change_no_weight(haproxy_factory, failure):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    ctl = make_controller([hap.endpoint])
    addrs = [f"127.0.0.1:{9100 + i}" for i in range(4)]
    with responses.RequestsMock() as rsps:  # first: a sick node gets its weight cut
        prom_answers(rsps, {a: (0.2 if a.endswith("9100") else 0.02) for a in addrs}, now=ctl.clock())
        r = ctl.tick()
        assert r.held is None and r.changes
    before = {s.name: (s.weight, s.admin_state) for s in ctl.haproxies[0].show_servers_state("vllm_chat")}
    assert before["node0"][0] < 100
    with responses.RequestsMock() as rsps:
        rsps.get(f"{PROM}/api/v1/query", **failure)
        r = ctl.tick()
    assert r.held and not r.changes
    after = {s.name: (s.weight, s.admin_state) for s in ctl.haproxies[0].show_servers_state("vllm_chat")}
    assert after == before
    assert ctl.metrics.registry.get_sample_value("grayguard_data_stale") == 1
    kind = "timeout" if "body" in failure and not isinstance(failure["body"], str) else (
        "http_5xx" if failure.get("status", 0) >= 500 else "http_4xx")
    assert ctl.metrics.registry.get_sample_value("grayguard_prometheus_errors_total", {"kind": kind}) == 1


def test_stale_data_holds(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    ctl = make_controller([hap.endpoint])
    with responses.RequestsMock() as rsps:
        prom_answers(rsps, {"127.0.0.1:9100": 0.2}, now=1000.0, age=150.0)  # the data is 150 s old
        r = ctl.tick()
    assert r.held and "old" in r.held and not r.changes


@responses.activate
def test_a_long_query_goes_as_a_post_form_and_a_short_one_as_a_get():
    """A sharded replica's queries name every pool it leads (controller/readscope.py): past LONG_PARAMS they go in
    the body of a POST, which Prometheus' API takes as well, not in a URL a proxy may refuse."""
    from urllib.parse import parse_qs

    from grayguard import promclient

    c = PrometheusClient(PrometheusConfig(url=PROM))
    long_q = "x and on(pool) (" + " or ".join(f'label_replace(vector(1), "pool", "p{i}", "", "")'
                                                for i in range(200)) + ")"
    assert len(long_q) > promclient.LONG_PARAMS
    responses.get(f"{PROM}/api/v1/query", json=vector({"a:1": 1.0}))
    responses.post(f"{PROM}/api/v1/query", json=vector({"b:1": 2.0}))
    assert [s.labels["instance"] for s in c.query("x")] == ["a:1"]
    assert [s.labels["instance"] for s in c.query(long_q, at=1000.0)] == ["b:1"]
    get, post = responses.calls
    assert get.request.method == "GET" and get.request.body is None
    assert post.request.method == "POST" and "?" not in post.request.url
    assert post.request.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert parse_qs(post.request.body) == {"query": [long_q], "time": ["1000.000"]}
