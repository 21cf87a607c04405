"""The benchmark's model of HAProxy's reflexes (bench.lb.Gateway) and what it does in the engine.

The settings come from grayguard.reflexes (the one definition); these tests read them from there.
"""

from __future__ import annotations

from dataclasses import replace

from grayguard.bench.engine import ERROR, NO_SERVER, OK, Run
from grayguard.bench.lb import Gateway
from grayguard.bench.policies import Assign, make_policy
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario
from grayguard.reflexes import DEFAULT as RX


def scenario(fault: str, nodes: int = 4, every: bool = False, **kw) -> Scenario:
    specs = tuple(NodeSpec(f"node{i}") for i in range(nodes))
    targets = [n.name for n in specs] if every else ["node0"]
    base = dict(name=f"{fault}/n{nodes}", nodes=specs, load=LoadSpec(utilization=0.4), duration_s=80.0,
                control_start_s=20.0, seed=3, faults=tuple(FaultSpec(t, fault, 30.0) for t in targets))
    return Scenario(**{**base, **kw})


def in_window(res, status=None):
    lo, hi = res.scenario.window
    return [i for i, t in enumerate(res.t) if lo <= t < hi and (status is None or res.status[i] == status)]


# -- the gateway alone ----------------------------------------------------------------------------------
def test_error_limit_consecutive_errors_mark_a_server_down_and_an_answer_resets_the_count():
    gw = Gateway(RX, 2)
    for _ in range(RX.error_limit - 1):
        gw.failed(0, 1.0)
    gw.answered(0)
    for _ in range(RX.error_limit - 1):
        gw.failed(0, 2.0)
    assert not gw.down[0]
    gw.failed(0, 3.0)
    assert gw.down[0] and not gw.down[1]
    assert gw.events == [(3.0, 0, True, "error-limit")]


def test_health_checks_bring_a_server_back_after_rise_and_take_it_out_after_fall():
    gw = Gateway(RX, 1)
    for _ in range(RX.error_limit):
        gw.failed(0, 0.0)
    for j in range(RX.check_rise - 1):
        gw.check(0, 1.0 + j, True)
    assert gw.down[0]
    gw.check(0, 9.0, True)
    assert not gw.down[0]  # /health says 200: back in rotation, whatever it answers to requests
    for j in range(RX.check_fall - 1):
        gw.check(0, 10.0 + j, False)
    gw.check(0, 19.0, True)  # a good check breaks the run
    for j in range(RX.check_fall):
        assert not gw.down[0]
        gw.check(0, 20.0 + j, False)
    assert gw.down[0] and gw.events[-1][3] == "check fall"


def test_retry_budget_counts_failures_against_requests_over_the_window():
    gw = Gateway(RX, 2)
    for j in range(100):
        gw.request(j * 0.01)
    for _ in range(3 * int(RX.retry_budget * 100)):
        gw.failed(1, 1.0)  # failed attempts that were retried (and served) are no failed responses
    assert gw.budget_ok(1.0)
    for _ in range(int(RX.retry_budget * 100)):
        gw.response_failed(1.0)
    assert gw.budget_ok(1.0)
    gw.response_failed(1.0)
    assert not gw.budget_ok(1.0)
    assert gw.budget_ok(1.0 + RX.budget_window_s + 1)  # the window slid past them all


# -- in the engine --------------------------------------------------------------------------------------
def test_only_haproxy_and_grayguard_have_the_reflexes_and_they_are_the_shipped_ones():
    scn = scenario("cuda_error")
    for name in ("roundrobin", "leastconn", "seeds", "envoy"):
        assert make_policy(name, scn.nodes, scn)[0].reflexes is None
    for name in ("haproxy", "grayguard", "grayguard@roundrobin", "oracle"):
        assert make_policy(name, scn.nodes, scn)[0].reflexes is RX


def test_a_node_answering_500_costs_clients_nothing_behind_the_reflexes():
    scn = scenario("cuda_error")
    bare = Run(scn, "leastconn").execute()
    assert len(in_window(bare, ERROR)) > 100  # the black hole: the failing node has the fewest connections
    for policy in ("haproxy", "grayguard"):
        res = Run(scn, policy).execute()
        assert in_window(res, ERROR) == [] and in_window(res, NO_SERVER) == []
        retried = [i for i in in_window(res) if res.retried[i]]
        assert retried and all(res.node[i] != 0 and res.status[i] == OK for i in retried)  # redispatched
        assert max(res.retried) <= RX.retries


def test_health_checks_put_a_500_node_back_unless_the_controller_drained_it():
    scn = scenario("cuda_error")
    run = Run(scn, "haproxy")
    run.apply({"node0": Assign(100, agent=False)}, 0.0)  # without the agent check (tests/bench/test_agent.py)
    alone = run.execute()
    downs = [e for e in alone.gateway if e[2]]
    rises = [e for e in alone.gateway if not e[2]]
    assert len(downs) >= 5 and len(rises) >= 4  # /health is 200: it comes back and fails again, all run long
    assert {e[3] for e in downs} == {"error-limit"} and {e[3] for e in rises} == {"check rise"}
    gg = Run(scn, "grayguard").execute()
    drained = min(t for t, k, _w, d, _s in gg.timeline if k == 0 and d)
    # the first probe that sees the CUDA error (agent, or its gauge scraped) and the next tick
    assert drained - 30.0 <= 1.2 * scn.probe_interval_s + scn.gauge_lag_s + scn.tick_s + 1e-9
    assert [e for e in gg.gateway if e[2] and e[0] > drained] == []  # drained: no more traffic, no more errors


def test_the_agent_keeps_a_500_node_out_after_its_health_check_puts_it_back():
    scn = scenario("cuda_error")
    res = Run(scn, "haproxy").execute()
    agent = [t for t, k, down, why in res.gateway if k == 0 and down and why == "agent"]
    assert agent and agent[0] < 30.0 + 1.2 * scn.probe_interval_s + RX.agent_inter_s  # its probe got a 500
    assert [e for e in res.gateway if e[0] > agent[0] and e[3] == "error-limit"] == []  # it gets nothing more
    assert [t for t, k in zip(res.t, res.node, strict=True) if k == 0 and t > agent[0]] == []


def test_a_refusing_node_is_marked_down_and_its_requests_are_retried_elsewhere():
    scn = scenario("refused")
    res = Run(scn, "haproxy").execute()
    assert in_window(res, ERROR) == []
    assert [e[3] for e in res.gateway][:1] == ["error-limit"]
    assert not any(not e[2] for e in res.gateway)  # its /health refuses too: never back while the fault lasts
    assert sum(res.retried) == RX.error_limit  # the requests that met it before it was marked down


def test_a_whole_pool_failing_does_not_multiply_the_load():
    scn = scenario("cuda_error", every=True)
    no_agents = {n.name: Assign(100, agent=False) for n in scn.nodes}  # the budget alone (agents: test_agent.py)
    run = Run(scn, "haproxy")
    run.apply(no_agents, 0.0)
    res = run.execute()
    n = len(in_window(res))
    retried = sum(1 for i in in_window(res) if res.retried[i])
    assert retried <= 0.10 * n
    # the same without a budget: every failed request is retried on every server left
    free = Run(scn, "haproxy")
    free.gw = Gateway(replace(RX, retry_budget=1e9), len(free.nodes))
    free.res.gateway = free.gw.events
    free.apply(no_agents, 0.0)
    res_free = free.execute()
    assert sum(1 for i in in_window(res_free) if res_free.retried[i]) > 2 * retried


def test_the_controller_sees_an_error_limit_mark_down_until_the_next_check_overwrites_it():
    gw = Gateway(RX, 1)
    for _ in range(RX.error_limit):
        gw.failed(0, 0.0)
    assert gw.down[0] and gw.hana[0]
    assert gw.next_check_in(0) == RX.check_downinter_s  # down, no good check yet
    gw.check(0, 1.0, True)
    assert gw.down[0] and not gw.hana[0]  # still down (rise not reached), the verdict is the check's now
    assert gw.next_check_in(0) == RX.check_inter_s  # on its way up: no fastinter configured, so inter


def test_grayguard_quarantines_a_500_node_on_haproxys_mark_down_and_keeps_it_out():
    scn = scenario("cuda_error")
    run = Run(scn, "grayguard")
    res = run.execute()
    obs_down = [t for t, _k, down, why in res.gateway if down and why == "error-limit"]
    assert obs_down and obs_down[0] < 31.0  # HAProxy reacts within a few requests of the fault
    assert run.detector.states["node0"].state in ("quarantined", "canary")
