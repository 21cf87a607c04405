"""Issue 12, items 1-3 and 14: the controller never acts on data it must not trust and never leaves a node
silently unprotected; a node it forgets loses every series.

Real Prometheus for staleness and pool bleed: a target serves the recorded signal series with explicit
timestamps (honor_labels, honor_timestamps), as a lagging rule group or a remote-write backlog leaves them
in Prometheus: samples whose own time is 150 s old, still returned by an instant query (5 min lookback)
stamped with the evaluation time. Real HAProxy for addresses (srv_fqdn, IPv6) and membership.
"""

from __future__ import annotations

import logging
import time

import pytest
import responses
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from responses import matchers

from grayguard.config import PoolConfig, ServerConfig
from grayguard.controller import decide
from grayguard.controller.haproxy import RuntimeClient, ServerState, parse_servers_state
from grayguard.controller.policy import EJECTED, NodeInput, Policy, decide_pool
from grayguard.promclient import Sample
from tests.support.ctl_helpers import LAT_Q, PROM, RATE_Q, make_controller, prom_answers, servers, vector
from tests.support.stack import prometheus_config, require, serve_registry, start_prometheus, static_job

pytestmark = pytest.mark.e2e

LAG_S = 150.0  # "samples 150 s old"


class Recorded:
    """The recorded latency and rate series as a target: (labels, latency, lag seconds) rows, each sample
    stamped with its own time (now - lag); rate 5 req/s."""

    def __init__(self):
        self.rows: list[tuple[dict[str, str], float, float]] = []

    def collect(self):
        now = time.time()
        for name in (LAT_Q, RATE_Q):
            m = Metric(name, "recorded series (test)", "gauge")
            for labels, latency, lag in self.rows:
                m.add_sample(name, labels, latency if name == LAT_Q else 5.0, timestamp=now - lag)
            yield m


def rows(pool: str, port0: int, lat: dict[int, float], lag: dict[int, float] | None = None, **extra):
    return [({"pool": pool, "instance": f"127.0.0.1:{port0 + i}", **extra}, v, (lag or {}).get(i, 0.0))
            for i, v in lat.items()]


SLOW0 = {0: 0.2, 1: 0.02, 2: 0.02, 3: 0.02}  # node0 10x slower than its peers
EVEN = dict.fromkeys(range(4), 0.02)


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """One real Prometheus scraping every scenario's series (each scenario its pool and its ports)."""
    require("prometheus")
    rec = Recorded()
    rec.rows += rows("lag1", 9201, SLOW0, {0: LAG_S})  # node0's data is 150 s old (and slow)
    rec.rows += rows("lagall", 9211, SLOW0, dict.fromkeys(range(4), LAG_S))  # every node's data is old
    rec.rows += rows("skew", 9221, SLOW0)  # fresh
    rec.rows += rows("chat-us", 9231, {0: 0.2, 1: 0.02, 2: 0.02})  # a global view: two pools, same instances
    rec.rows += rows("chat-us", 9231, {3: 0.02}, replica="a") + rows("chat-us", 9231, {3: 0.5}, replica="b")
    rec.rows += rows("chat-eu", 9231, EVEN)
    rec.rows += rows("lone", 9241, {0: 0.04, 1: 0.02, 2: 0.02, 3: 0.02, 4: 0.02})  # node0 an L40S among H100s
    reg = CollectorRegistry()
    reg.register(rec)
    job = static_job("recorded", [])
    with serve_registry(reg) as target:
        job["static_configs"][0]["targets"] = [target.target]
        job["honor_labels"] = True  # the series' own pool and instance, as federation or remote write keep them
        with start_prometheus(prometheus_config([job], interval="1s"),
                              workdir=tmp_path_factory.mktemp("prom")) as p:
            p.wait_for(f"count({LAT_Q}) + count({RATE_Q})", lambda r: r and float(r[0]["value"][1]) == 2 * 26)
            yield p


def real_controller(hap, prom, pools, clock=None):
    return make_controller([hap.endpoint], clock=clock or time.time, extra={
        "prometheus": {"url": prom.url, "timeout_s": 5}, "pools": pools})


def weights(hap, backend):
    return {s.name: s.weight for s in RuntimeClient(hap.endpoint).show_servers_state(backend)}


def gauge(ctl, name, **labels):
    return ctl.metrics.registry.get_sample_value(name, labels)


# ---- 1: staleness is the age of the data itself, per node -----------------------------------------------------
def test_a_node_no_peer_group_can_compare_is_counted_and_named_once_real_prometheus(prom, haproxy_factory, caplog):
    """A peer group of one (an L40S among H100s, no group_speed for it): no comparison scores its latency, so a slow
    one goes unseen, and nothing said so (GrayguardPoolUnprotected counts nodes with data: 5 here). Now
    grayguard_pool_nodes_uncompared counts it (GrayguardNodesUncompared) and one warning names it; with a speed
    for its group it is compared with the pool at that speed, and counted no more."""
    hap = haproxy_factory({"vllm_lone": servers(5, base_port=9241)})
    groups = {"node0": {"peer_group": "l40s"}, **{f"node{i}": {"peer_group": "h100"} for i in range(1, 5)}}
    ctl = real_controller(hap, prom, [{"name": "lone", "backend": "vllm_lone", "servers": groups}])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert ctl.tick().held is None
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="lone") == 5
    assert gauge(ctl, "grayguard_pool_nodes_uncompared", pool="lone") == 1
    said = [r.getMessage() for r in caplog.records if "no peers to compare" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("pool=lone: ") and said[0].endswith(": node0"), said
    sped = real_controller(hap, prom, [{"name": "lone", "backend": "vllm_lone", "servers": groups,
                                        "group_speed": {"l40s": 2.0}}])
    for _ in range(3):
        assert sped.tick().held is None
    assert gauge(sped, "grayguard_pool_nodes_uncompared", pool="lone") == 0
    assert weights(hap, "vllm_lone") == {f"node{i}": 100 for i in range(5)}  # twice as slow as it should be: fine


def test_a_node_whose_data_is_150s_old_has_no_data_real_prometheus(prom, haproxy_factory):
    hap = haproxy_factory({"vllm_lag1": servers(4, base_port=9201)})
    ctl = real_controller(hap, prom, [{"name": "lag1", "backend": "vllm_lag1"}])
    for _ in range(3):
        r = ctl.tick()
        assert r.held is None and not r.errors
    # node0's old (slow) sample is not acted on; the others are compared as usual
    assert ctl.states["lag1"]["node0"].state == "healthy" and ctl.states["lag1"]["node0"].ema is None
    assert weights(hap, "vllm_lag1") == dict.fromkeys(("node0", "node1", "node2", "node3"), 100)
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="lag1") == 3
    assert gauge(ctl, "grayguard_pool_nodes_without_data", pool="lag1", reason="stale") == 1


def test_a_pool_whose_data_is_all_old_holds_real_prometheus(prom, haproxy_factory, caplog):
    hap = haproxy_factory({"vllm_lagall": servers(4, base_port=9211)})
    ctl = real_controller(hap, prom, [{"name": "lagall", "backend": "vllm_lagall"}])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            r = ctl.tick()
            assert r.held and "older than 60s" in r.held and "4 stale" in r.held
    assert r.decisions == {} and r.changes == []
    assert weights(hap, "vllm_lagall") == dict.fromkeys(("node0", "node1", "node2", "node3"), 100)
    assert gauge(ctl, "grayguard_last_successful_tick_timestamp_seconds") == 0  # never a success
    assert gauge(ctl, "grayguard_data_stale") == 1
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="lagall") == 0
    assert gauge(ctl, "grayguard_pool_nodes_without_data", pool="lagall", reason="stale") == 4
    assert gauge(ctl, "grayguard_prometheus_errors_total", kind="stale") == 3
    assert caplog.text.count("older than stale_after_s") == 1  # the stale nodes are named once, not every tick


def test_controller_clock_skew_does_not_matter_real_prometheus(prom, haproxy_factory):
    """The controller's clock 2 minutes ahead of Prometheus' (or behind): fresh data is fresh."""
    for skew in (120.0, -120.0):
        hap = haproxy_factory({"vllm_skew": servers(4, base_port=9221)})
        ctl = real_controller(hap, prom, [{"name": "skew", "backend": "vllm_skew"}],
                              clock=lambda skew=skew: time.time() + skew)
        r = ctl.tick()
        assert r.held is None, r.held
        assert ctl.states["skew"]["node0"].state == "degraded" and weights(hap, "vllm_skew")["node0"] < 100
        assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="skew") == 4
        hap.stop()


# ---- 2: only the pool's own series; two series for one node is no data ----------------------------------------
def test_pools_sharing_instances_do_not_bleed_and_a_doubled_node_has_no_data_real_prometheus(prom, haproxy_factory):
    """chat-us and chat-eu share `instance` values (a global view): the slow US node0 must not touch EU node0.
    US node3 has two series (replicas a and b, 0.02 and 0.5): no data, counted, whatever their order."""
    hap = haproxy_factory({"vllm_us": servers(4, base_port=9231), "vllm_eu": servers(4, base_port=9231)})
    ctl = real_controller(hap, prom, [{"name": "chat-us", "backend": "vllm_us"},
                                      {"name": "chat-eu", "backend": "vllm_eu"}])
    for _ in range(3):
        r = ctl.tick()
        assert r.held is None and not r.errors
    assert ctl.states["chat-us"]["node0"].state in ("degraded", "quarantined")
    assert weights(hap, "vllm_us")["node0"] < 100
    assert {n: s.state for n, s in ctl.states["chat-eu"].items()} == dict.fromkeys(
        ("node0", "node1", "node2", "node3"), "healthy")
    assert weights(hap, "vllm_eu") == dict.fromkeys(("node0", "node1", "node2", "node3"), 100)
    assert ctl.states["chat-us"]["node3"].ema is None and ctl.states["chat-us"]["node3"].state == "healthy"
    assert gauge(ctl, "grayguard_pool_nodes_without_data", pool="chat-us", reason="conflict") == 1
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="chat-us") == 3
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="chat-eu") == 4


def test_pool_data_is_pure_and_order_free():
    pool = PoolConfig(name="us", backend="b")
    srv = {f"n{i}": ServerState("b", f"n{i}", f"10.0.0.{i}:8000", 100, 100, 0, 2) for i in range(5)}

    def s(i, v, pool="us", **extra):
        return Sample({"__name__": LAT_Q, "pool": pool, "instance": f"10.0.0.{i}:8000", **extra}, v, 1000.0)
    lat = [s(0, 0.02), s(0, 0.9, pool="eu"), s(1, 0.02, replica="a"), s(1, 0.03, replica="b"),
           Sample({"instance": "10.0.0.2:8000"}, 0.02, 1000.0), s(3, 0.02), s(4, 0.02)]
    rate = [Sample(x.labels, 5.0 if "10.0.0.4" not in x.labels["instance"] else 0.0, 1000.0) for x in lat]
    ts = [Sample({k: v for k, v in x.labels.items() if k != "__name__"}, 1000.0 - (200 if "10.0.0.3" in
                                                                                  x.labels["instance"] else 1),
                 1000.0) for x in lat]
    for order in (1, -1):
        got = decide.pool_data(pool, srv, {"latency": lat[::order], "rate": rate[::order],
                                           "latency_timestamp": ts[::order], "rate_timestamp": ts[::order]},
                               max_age_s=60)
        assert got.latency == {"n0": 0.02, "n2": 0.02, "n4": 0.02}  # the EU series of n0 is not the US pool's
        assert got.with_data == ("n0", "n2")  # n2: no pool label, matched by key alone
        assert got.without == {"n1": "conflict", "n3": "stale", "n4": "idle"} and got.held is None
    # a series of unknown age (its timestamp() missing) is not trusted
    got = decide.pool_data(pool, srv, {"latency": lat, "rate": rate, "latency_timestamp": [], "rate_timestamp": []},
                           max_age_s=60)
    assert got.held and got.with_data == ()
    # a NaN timestamp() (a garbage answer) is an unknown age, not fresh data
    nan_ts = [Sample(x.labels, float("nan"), x.timestamp) for x in ts]
    got = decide.pool_data(pool, srv, {"latency": lat, "rate": rate, "latency_timestamp": nan_ts,
                                       "rate_timestamp": nan_ts}, max_age_s=60)
    assert got.held and got.with_data == ()


# ---- 3: hostname and IPv6 servers match; nobody silently unprotected ------------------------------------------
HAP_FQDN = [("node0", "localhost:9300", 100), ("node1", "::1:9301", 100),
            ("node2", "127.0.0.1:9302", 100), ("node3", "127.0.0.1:9303", 100)]
KEYS = ["localhost:9300", "[::1]:9301", "127.0.0.1:9302", "127.0.0.1:9303"]


def test_show_servers_state_gives_fqdn_and_a_bracketed_ipv6_address(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": HAP_FQDN})
    got = {s.name: (s.address, s.fqdn) for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}
    assert got == {"node0": ("127.0.0.1:9300", "localhost"), "node1": ("[::1]:9301", None),
                   "node2": ("127.0.0.1:9302", None), "node3": ("127.0.0.1:9303", None)}
    pool = PoolConfig(name="chat", backend="vllm_chat", servers={"node3": ServerConfig(series="gpu-3")})
    states = {s.name: s for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}
    assert decide.series_keys(pool, states["node0"]) == ("localhost:9300", "127.0.0.1:9300")
    assert decide.series_keys(pool, states["node1"]) == ("[::1]:9301",)
    assert decide.series_keys(pool, states["node3"]) == ("gpu-3",)
    old = "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight " \
          "srv_port\n2 b 1 s1 10.0.0.1 2 0 100 100 8000\n"  # a reply without srv_fqdn
    assert parse_servers_state(old)[0].fqdn is None


@pytest.mark.parametrize("slow", [0, 1])
def test_fqdn_and_ipv6_servers_are_scored(haproxy_factory, slow):
    hap = haproxy_factory({"vllm_chat": HAP_FQDN})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    for _ in range(2):
        with responses.RequestsMock() as rsps:
            prom_answers(rsps, {k: 0.2 if i == slow else 0.02 for i, k in enumerate(KEYS)}, now=t[0])
            r = ctl.tick()
        t[0] += 5
        assert not r.errors
    assert ctl.states["chat"][f"node{slow}"].state == "quarantined"
    assert weights(hap, "vllm_chat")[f"node{slow}"] == 0
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="chat") == 4


def test_every_unmatched_server_is_named_once_and_counted(haproxy_factory, caplog):
    hap = haproxy_factory({"vllm_chat": HAP_FQDN})
    ctl = make_controller([hap.endpoint], clock=lambda: 1000.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with responses.RequestsMock() as rsps:
                prom_answers(rsps, {"127.0.0.1:9302": 0.02, "127.0.0.1:9303": 0.02, "gpu-9:8000": 0.02}, now=1000.0)
                ctl.tick()
    warnings = [r.getMessage() for r in caplog.records if "not protected" in r.getMessage()]
    assert len(warnings) == 1
    assert "node0 (localhost:9300, 127.0.0.1:9300)" in warnings[0] and "node1 ([::1]:9301)" in warnings[0]
    assert "node2" not in warnings[0]
    assert gauge(ctl, "grayguard_pool_nodes_without_data", pool="chat", reason="unmatched") == 2
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="chat") == 2


def test_an_empty_result_holds_and_last_success_stays(haproxy_factory, caplog):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    with responses.RequestsMock() as rsps:
        prom_answers(rsps, {f"127.0.0.1:{9100 + i}": 0.02 for i in range(4)}, now=t[0])
        ctl.tick()
    assert gauge(ctl, "grayguard_last_successful_tick_timestamp_seconds") == 1000.0
    with caplog.at_level(logging.WARNING):
        for _ in range(5):  # many ticks of empty vectors
            t[0] += 5
            with responses.RequestsMock() as rsps:
                prom_answers(rsps, {}, now=t[0])
                r = ctl.tick()
            assert r.held and "4 unmatched" in r.held
    assert gauge(ctl, "grayguard_last_successful_tick_timestamp_seconds") == 1000.0
    assert gauge(ctl, "grayguard_pool_nodes_with_data", pool="chat") == 0
    assert sum("not protected" in r.getMessage() for r in caplog.records) == 1


def test_an_idle_pool_is_decided_and_not_held(haproxy_factory):
    """No latency (no finished request) and a request rate of 0: idle, not missing; the tick is a success."""
    hap = haproxy_factory({"vllm_chat": servers(4)})
    ctl = make_controller([hap.endpoint], clock=lambda: 1000.0)
    addrs = [f"127.0.0.1:{9100 + i}" for i in range(4)]
    answers = {LAT_Q: vector({}, 1000.0), f"timestamp({LAT_Q})": vector({}, 1000.0),
               RATE_Q: vector(dict.fromkeys(addrs, 0.0), 1000.0),
               f"timestamp({RATE_Q})": vector(dict.fromkeys(addrs, 1000.0), 1000.0)}
    with responses.RequestsMock() as rsps:
        for q, body in answers.items():
            rsps.get(f"{PROM}/api/v1/query", json=body, match=[matchers.query_param_matcher({"query": q})])
        r = ctl.tick()
    assert r.held is None and not r.errors and r.decisions
    assert gauge(ctl, "grayguard_pool_nodes_without_data", pool="chat", reason="idle") == 4
    assert gauge(ctl, "grayguard_last_successful_tick_timestamp_seconds") == 1000.0


# ---- 14: a node the controller forgets loses every series ----------------------------------------------------
def test_a_forgotten_node_loses_every_series(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    addrs = [f"127.0.0.1:{9100 + i}" for i in range(4)]

    def tick(lat):
        with responses.RequestsMock() as rsps:
            prom_answers(rsps, lat, now=t[0])
            ctl.tick()
        t[0] += 5
    for _ in range(2):
        tick({a: 0.2 if i == 0 else 0.02 for i, a in enumerate(addrs)})
    assert ctl.states["chat"]["node0"].state == "quarantined"
    assert gauge(ctl, "grayguard_node_state", pool="chat", node="node0", state="quarantined") == 1
    # node0 leaves HAProxy (decommissioned while drained)
    hap.cfg.write_text(hap.cfg.read_text().replace("  server node0 127.0.0.1:9100 weight 100\n", ""))
    hap.restart()
    tick(dict(zip(addrs[1:], [0.02] * 3, strict=True)))
    assert gauge(ctl, "grayguard_node_state", pool="chat", node="node0", state="quarantined") == 1  # kept a while
    t[0] += ctl.cfg.thresholds.forget_after_s
    tick(dict(zip(addrs[1:], [0.02] * 3, strict=True)))
    assert "node0" not in ctl.states["chat"]
    left = [s for fam in ctl.metrics.registry.collect() for s in fam.samples if s.labels.get("node") == "node0"]
    assert left == []
    assert gauge(ctl, "grayguard_node_state", pool="chat", node="node1", state="healthy") == 1


@pytest.mark.parametrize("behind", [3600.0, 45.0])
def test_a_prometheus_whose_clock_is_behind_the_last_one_does_not_blind_the_window(behind):
    """Prometheus fails over to a replica whose clock is behind the first's (or is stepped back): every window
    sample's own time is then before the last one counted. Counted as seen before, the window detector was blind
    for the length of the step (a node 3x slow from 100 s, an hour behind: never cut in 300 s). A sample earlier
    than the last by more than the window is another clock's, and new; an HA pair's samples a few seconds apart,
    read in turns, are not counted twice."""
    prev, cut_at = {}, None
    for k in range(160):
        t = 1000.0 + k
        ahead = behind if k < 60 else 0.0  # the first Prometheus until 60 s, then the one behind it
        inputs = {n: NodeInput(100, 0.06 if (n == "a" and k >= 100) else 0.02, request_rate=5.0,
                               latency_at=float(int(t // 5) * 5) + ahead) for n in "abcdef"}
        d = decide_pool(prev, inputs, Policy(), t)
        prev = {n: x.state for n, x in d.nodes.items()}
        if cut_at is None and (prev["a"].factors or prev["a"].state in EJECTED):
            cut_at = k
    assert cut_at is not None and cut_at <= 106  # the next sample (every 5 s) after the slowdown

    # an HA pair read in turns, 3 s apart: each sample counted once, as from one Prometheus
    prev, counted = {}, 0
    for k in range(60):
        at = float(int((1000.0 + k) // 5) * 5) + (3.0 if k % 2 else 0.0)
        d = decide_pool(prev, {n: NodeInput(100, 0.02, request_rate=5.0, latency_at=at) for n in "abcdef"},
                        Policy(), 1000.0 + k)
        counted += d.nodes["a"].state.latency_seen_at != prev.get("a", d.nodes["a"].state).latency_seen_at
        prev = {n: x.state for n, x in d.nodes.items()}
    assert counted <= 2 * 12 + 1  # the newer of the pair's two samples each 5 s, and its twin 3 s later at most
