"""The controller's own tick at scale (bench/ticklocal.py): a real HAProxy and the real Controller, with Prometheus'
answers served by bench/answers.py. Checks what is served and the measurement's structure, never its speed."""

from __future__ import annotations

import argparse
import json
import math
import urllib.parse

import pytest

from grayguard.bench import answers, promtarget
from grayguard.bench.controller import add_arguments
from grayguard.bench.ticklocal import format_local, main, measure
from grayguard.config import parse_config
from grayguard.controller import readscope
from grayguard.httpserve import Request
from grayguard.promclient import _vector
from tests.support.stack import require

CFG = parse_config({"prometheus": {"url": "http://127.0.0.1:9"}, "haproxy": {"endpoints": ["127.0.0.1:9"]},
                    "state_file": None, "pools": [{"name": "pool0", "backend": "pool0"}]})


def served(routes, promql: str):
    status, _, body = routes["GET /api/v1/query"](Request("GET", "/api/v1/query",
                                                          urllib.parse.urlencode({"query": promql}), None))
    assert status == 200
    doc = json.loads(body)
    assert doc["status"] == "success" and doc["data"]["resultType"] == "vector"
    return _vector(doc["data"]["result"])  # as the controller's client parses it


def test_every_query_of_the_shipped_config_is_answered_for_every_node():
    nodes = promtarget.fleet(40)
    routes = answers.routes(CFG, nodes)
    asked = answers.queries(CFG)
    wanted = {f.removesuffix("_query") for f in vars(CFG.signals) if f.endswith("_query") and getattr(CFG.signals, f)}
    assert {s.removesuffix("_timestamp") for s in asked.values()} == wanted - {"peer_group", "request_rate"} | {"rate"}
    for promql, signal in asked.items():
        got = served(routes, promql)
        assert [(s.labels["pool"], s.labels["instance"]) for s in got] == [(n.pool, n.instance) for n in nodes]
        assert all(math.isfinite(s.value) and s.timestamp > 0 for s in got)
        if signal.endswith("_timestamp"):  # the data's time: the control group's last evaluation, not in the future
            assert all(s.timestamp - 5.0 <= s.value <= s.timestamp for s in got)
    lat = {s.labels["instance"]: s.value for s in served(routes, CFG.signals.latency_query)}
    slow = [n for n in nodes if n.slow > 1]
    assert slow and all(lat[n.instance] > 3 * lat[nodes[1].instance] for n in slow)
    assert all(s.labels["__name__"] == CFG.signals.latency_query for s in served(routes, CFG.signals.latency_query))
    assert served(routes, "up") == []  # a query the config does not ask: an empty answer


def test_a_sharded_replicas_scoped_queries_are_answered_with_its_pools_series_by_get_or_post():
    cfg = parse_config({"prometheus": {"url": "http://127.0.0.1:9"}, "haproxy": {"endpoints": ["127.0.0.1:9"]},
                        "state_file": None, "pools": [{"name": f"pool{i}", "backend": f"pool{i}"} for i in range(3)]})
    nodes = promtarget.fleet(60)
    led = answers.led_pools([p.name for p in cfg.pools], 0.67)
    assert led == ["pool0", "pool1"] and answers.led_pools(["a", "b"], 1.0) == ["a", "b"]
    routes = answers.routes(cfg, nodes, led=led)
    q = readscope.scoped(cfg.signals.latency_query, led)
    want = [(n.pool, n.instance) for n in nodes if n.pool in led]
    assert [(s.labels["pool"], s.labels["instance"]) for s in served(routes, q)] == want
    assert {s.labels["__name__"] for s in served(routes, q)} == {cfg.signals.latency_query}  # `and` keeps the name
    status, _, body = routes["POST /api/v1/query"](Request("POST", "/api/v1/query", "", None,
                                                           urllib.parse.urlencode({"query": q}).encode()))
    assert status == 200 and len(_vector(json.loads(body)["data"]["result"])) == len(want)
    assert served(routes, cfg.signals.latency_query) == []  # the replica never asks unscoped: not answered


def test_the_controllers_own_tick_as_a_replica_leading_part_of_the_pools():
    require("haproxy")
    r = measure(60, 2, lead_share=0.34)  # pool0 of 3 (n0 of pool0 4x slow)
    assert r.led == 1 and r.first is not None and r.first.decided == 1 and r.first.commands >= 1
    assert all(t.held is None and t.decided == 1 for t in r.ticks)
    assert "a replica leading 1 of them (its queries scoped)" in "\n".join(format_local(r))


def test_the_controllers_own_tick_on_real_haproxy():
    require("haproxy")
    r = measure(60, 3)  # 3 pools of 20, n0 of pool0 4x slow
    assert len(r.ticks) == 3 and r.first is not None
    assert r.first.decided == 3 and r.first.commands >= 1  # the slow node is drained on the first tick
    for t in r.ticks:
        assert t.held is None and t.decided == 3
        assert {"haproxy_read", "prometheus", "pool_data", "decide", "export"} <= set(t.seconds)
    text = "\n".join(format_local(r))
    assert "whole tick (Controller.tick)" in text and "verdict:" in text and "controller memory: tick 1" in text


def test_bench_controller_local_tick_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert not a.no_local_tick and a.local_tick_nodes == "1000,10000" and a.local_tick_ticks == 30
    a = p.parse_args(["--no-local-tick", "--local-tick-nodes", "60", "--local-tick-ticks", "3"])
    assert a.no_local_tick and a.local_tick_nodes == "60" and a.local_tick_ticks == 3


def test_ticklocal_refuses_a_share_of_no_pools(capsys):
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit) as e:
            main(["--nodes", "60", "--lead-share", bad])
        assert e.value.code == 2 and "--lead-share" in capsys.readouterr().err
