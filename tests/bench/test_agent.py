"""The benchmark's model of HAProxy's agent check (the exporter's verdict) and the oracle reference policy.

The agent settings come from grayguard.reflexes (agent_inter_s), the probe's from the Scenario (1 s +-20 %, 2 s
deadline); these tests read them from there.
"""

from __future__ import annotations

import dataclasses

import pytest

from grayguard.bench.engine import GARBAGE, Run, run_family
from grayguard.bench.lb import Gateway
from grayguard.bench.metrics import summarize
from grayguard.bench.node import NodeObs, ProbeLog, node_input
from grayguard.bench.policies import Assign, Grayguard, make_policy
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario
from grayguard.controller.policy import decide_pool
from grayguard.reflexes import DEFAULT as RX

FAULT_AT = 30.0


def scenario(*faults: str, nodes: int = 4, util: float = 0.4, until: float | None = None, **kw) -> Scenario:
    specs = tuple(NodeSpec(f"node{i}") for i in range(nodes))
    fs = tuple(FaultSpec(f"node{i}", f, FAULT_AT, until_s=until) for i, f in enumerate(faults))
    base = dict(name="agent/" + "+".join(faults or ("none",)), nodes=specs, load=LoadSpec(utilization=util),
                faults=fs, duration_s=70.0, control_start_s=20.0, seed=3)
    return Scenario(**{**base, **kw})


def agent_downs(res, k: int | None = None) -> list[float]:
    return [t for t, j, down, why in res.gateway if down and why == "agent" and (k is None or j == k)]


def latest_first_probe(scn: Scenario) -> float:
    """The latest a probe can start after the fault: one probe interval (+20 %)."""
    return scn.probe_interval_s * 1.2


# -- the verdict and the gateway alone ----------------------------------------------------------------------
@pytest.mark.parametrize("result,hung,down", [
    ("ok", False, False), ("slow", False, False), ("connect_error", False, False), ("http_error", False, False),
    ("timeout", False, False),  # timed out while vLLM kept making tokens: load, not a hang
    ("timeout", True, True), ("bad_response", False, True), ("cuda_error", False, True)])
def test_the_exporters_verdict_is_its_last_probe(result, hung, down):
    log = ProbeLog()
    assert not log.agent_down  # no probe yet: up
    log.finish(1.0, "bad_response", None)
    log.finish(2.0, result, 0.05 if result in ("ok", "slow") else None, hung=hung)
    assert log.agent_down is down  # one strike, and only the last probe counts


def test_agent_down_marks_a_server_out_at_once_and_up_brings_it_back():
    gw = Gateway(RX, 2)
    gw.agent(0, 1.0, True)
    assert gw.out == [True, False] and not gw.down[0]  # DOWN (agent), not by its health check
    gw.agent(0, 2.0, True)  # no new event while it stays down
    gw.agent(0, 3.0, False)
    assert gw.out == [False, False]
    assert gw.events == [(1.0, 0, True, "agent"), (3.0, 0, False, "agent up")]


def test_up_from_the_agent_does_not_override_a_failed_health_check():
    gw = Gateway(RX, 1)
    for j in range(RX.check_fall):
        gw.check(0, float(j), False)
    gw.agent(0, 5.0, True)
    gw.agent(0, 6.0, False)
    assert gw.out[0] and gw.down[0]


def test_a_disabled_agent_is_ignored_and_the_server_follows_its_health_check():
    gw = Gateway(RX, 1)
    gw.agent(0, 1.0, True)
    gw.set_agent(0, False, 2.0)
    assert not gw.out[0] and not gw.agent_down[0]
    gw.agent(0, 3.0, True)
    assert not gw.out[0]
    gw.set_agent(0, True, 4.0)
    assert not gw.out[0]  # re-enabled: the next agent answer decides
    gw.agent(0, 5.0, True)
    assert gw.out[0]
    assert [e[3] for e in gw.events] == ["agent", "agent disabled", "agent"]


# -- in the engine --------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["haproxy", "grayguard"])
def test_a_garbage_node_is_agent_down_within_a_probe_and_an_agent_interval(policy):
    scn = scenario("garbage")
    res = Run(scn, policy).execute()
    downs = agent_downs(res, 0)
    assert downs and FAULT_AT < downs[0] <= FAULT_AT + latest_first_probe(scn) + 0.5 + RX.agent_inter_s
    assert agent_downs(res) == downs  # no other node
    first_bad = min(t + e for t, e, s in zip(res.t, res.e2e, res.status, strict=True) if s == GARBAGE)
    late = [t for t, k, s in zip(res.t, res.node, res.status, strict=True) if k == 0 and t > downs[0] + 1e-9]
    assert late == []  # out of rotation from then on: it gets nothing more
    m = summarize(res)
    assert m["agent_downs"] == 1 and m["false_agent_downs"] == 0
    assert m["t_agent_down_s"] == pytest.approx(downs[0] - FAULT_AT)
    assert m["t_garbage_to_out_s"] == pytest.approx(max(0.0, downs[0] - first_bad))


@pytest.mark.parametrize("policy", ["haproxy", "grayguard", "oracle"])
def test_no_fault_no_agent_mark_down(policy):
    res = Run(scenario(), policy).execute()
    assert agent_downs(res) == []
    assert summarize(res)["false_agent_downs"] == 0


def test_a_hung_node_goes_agent_down_after_the_probe_deadline():
    scn = scenario("hang")
    res = Run(scn, "haproxy").execute()
    downs = agent_downs(res, 0)
    assert downs and FAULT_AT + scn.probe_deadline_s <= downs[0]
    assert downs[0] <= FAULT_AT + latest_first_probe(scn) + scn.probe_deadline_s + RX.agent_inter_s
    assert agent_downs(res) == downs
    # its probes keep timing out without a token: it stays out for the rest of the run
    assert not [e for e in res.gateway if e[1] == 0 and not e[2]]


def test_an_overloaded_node_that_still_makes_tokens_is_not_agent_down():
    scn = scenario(util=2.5, duration_s=50.0)  # far past capacity: probes wait in long queues
    run = Run(scn, "haproxy")
    timeouts = []
    for node in run.nodes:  # record every probe the exporter finishes
        finish = node.probes.finish

        def spy(t, result, ttft, hung=False, sent=None, _finish=finish):
            timeouts.append((result, hung))
            _finish(t, result, ttft, hung, sent)
        node.probes.finish = spy
    res = run.execute()
    assert sum(1 for r, _h in timeouts if r == "timeout") > 20
    assert not any(h for _r, h in timeouts)
    assert agent_downs(res) == []


def test_assign_agent_false_makes_the_gateway_ignore_the_agent():
    scn = scenario("garbage")
    run = Run(scn, "haproxy")
    run.apply({"node0": Assign(100, agent=False)}, 0.0)  # what `disable agent` from the controller does
    res = run.execute()
    assert agent_downs(res) == []
    assert summarize(res)["garbage"] > 50  # HAProxy cannot see garbage: it keeps sending it traffic


def test_only_the_policies_behind_the_reflexes_run_agent_checks():
    scn = scenario("garbage")
    for name in ("leastconn", "seeds", "envoy"):
        run = Run(scn, name)
        assert run.agent_due == [] and agent_downs(run.execute()) == []
    for name in ("haproxy", "grayguard", "oracle"):
        assert len(Run(scn, name).agent_due) == len(scn.nodes)


def test_grayguard_sees_the_agent_and_disables_the_agents_its_decision_releases():
    scn = scenario("garbage", "garbage")
    g = Grayguard(scn.nodes, scn)
    obs = {n.name: NodeObs(latency=0.01, request_rate=5.0, probe_result="ok", probe_failures=0)
           for n in scn.nodes}
    for n in ("node0", "node1"):  # both marked DOWN (agent) by HAProxy: more than a 4-node pool's cap
        obs[n] = dataclasses.replace(obs[n], down=True, agent_down=True, probe_result="bad_response",
                                     probe_failures=1)
    inputs = {n.name: node_input(n, obs[n.name]) for n in scn.nodes}
    assert all(inputs[n].agent_down for n in ("node0", "node1"))  # NodeObs reaches NodeInput
    expected = decide_pool({}, inputs, g.policy, 100.0).agent_off
    out = g.tick(100.0, obs, {})
    assert {n for n, a in out.items() if not a.agent} == expected
    healthy = {n: dataclasses.replace(o, down=False, agent_down=False, agent_off=n in expected, probe_result="ok")
               for n, o in obs.items()}
    out = g.tick(105.0, healthy, {})
    assert all(a.agent for a in {**g.last, **out}.values())  # level-triggered: re-armed once the probe is healthy


def test_grayguard_quarantines_an_agent_down_garbage_node_through_the_engine():
    res = Run(scenario("garbage"), "grayguard").execute()
    drained = [t for t, k, _w, d, _s in res.timeline if k == 0 and d]
    assert drained and drained[0] - FAULT_AT <= 2 * scenario().tick_s


# -- the oracle -------------------------------------------------------------------------------------------
def test_the_oracle_drains_each_faulty_node_exactly_while_its_fault_lasts():
    scn = scenario("thermal", until=50.0)
    assert make_policy("oracle", scn.nodes, scn)[0].reflexes is RX
    res = Run(scn, "oracle").execute()
    assert res.timeline[len(scn.nodes):] == [(FAULT_AT, 0, 0, True, "quarantined"), (50.0, 0, 100, False, "healthy")]
    assert not [t for t, k in zip(res.t, res.node, strict=True) if k == 0 and FAULT_AT <= t < 50.0]
    m = summarize(res)
    assert m["t_quarantine_s"] == 0.0 and m["false_quarantines"] == 0 and m["false_cuts"] == 0


def test_the_oracle_knows_the_fault_of_a_branch_too():
    scns = [scenario("garbage"), dataclasses.replace(scenario("hang"), name="agent/hang")]
    for s, r in zip(scns, run_family(scns, "oracle"), strict=True):
        assert (FAULT_AT, 0, 0, True, "quarantined") in r.timeline, s.name
        assert summarize(r)["garbage"] == 0
