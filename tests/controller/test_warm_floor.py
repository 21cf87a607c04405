"""The pool's cap bounds the weight it holds back, warm-ups included (policy.warm_floor): a joining or restarted node
holds a tenth of its weight for 30 s, then gains a fifth a minute, and two such nodes of four beside a drained one
left one node at full weight (P99 TTFT 1.8-5.9x leastconn's; docs/benchmarks.md, "twenty-fourth round"). Where the
pool would hold back more than `max_ejected_fraction` of its nodes' worth, the warm-ups' ramps move on first."""

from __future__ import annotations

import math
from dataclasses import replace

from grayguard.controller.policy import (
    HEALTHY,
    QUARANTINED,
    SLOW_START,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
    warm_floor,
    warming,
)
from grayguard.controller.signals import SignalMemory
from grayguard.controller.statefile import dump_states, load_states
from grayguard.vocab import ProbeResult
from tests.support.ctl_helpers import seasoned

NOW = 100.0


def _warming(now: float = NOW) -> NodeState:
    """Back from a restart 5 s ago: at slow_start_initial until its 30 s warm-up ends."""
    return replace(seasoned(since=now - 5), state=SLOW_START, ramp_start=now + 25)


def _inputs(names: str, **kw) -> dict[str, NodeInput]:
    return {n: NodeInput(base_weight=100, latency=0.02, request_rate=5.0, **kw.get(n, {})) for n in names}


def test_two_warming_nodes_and_a_drained_one_of_four_do_not_leave_one_node_carrying_the_pool():
    states = {"a": _warming(), "b": _warming(), "c": replace(seasoned(since=NOW - 5), state=QUARANTINED,
                                                               cause="latency"), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd"), Policy(), NOW)
    # the cap of a 4-node pool is one node: the drained one is it, so the warm-ups hold back nothing
    assert [d.nodes[n].weight for n in "abcd"] == [100, 100, 0, 100]
    assert "warm-ups give way first" in d.nodes["a"].state.reason
    later = decide_pool({n: x.state for n, x in d.nodes.items()}, _inputs("abcd"), Policy(), NOW + 1)
    assert later.nodes["a"].state.state == HEALTHY and later.nodes["a"].weight == 100


def test_warm_ups_share_the_cap_and_never_ramp_back_down():
    states = {"a": _warming(), "b": _warming(), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd"), Policy(), NOW)
    assert [d.nodes[n].weight for n in "ab"] == [50, 50]  # 0.5 + 0.5 held back: the cap of one node
    st = {n: x.state for n, x in d.nodes.items()}
    weights = []
    for k in range(1, 12):  # five seconds a tick: the ramp goes on from half, a fifth a minute
        d = decide_pool(st, _inputs("abcd"), Policy(), NOW + 5 * k)
        st = {n: x.state for n, x in d.nodes.items()}
        weights.append(d.nodes["a"].weight)
    # from half on, a fifth a minute: 55 s later 0.5 + 0.2 x 55 / 60 of the weight (rounded up, as a slow start is)
    assert weights == sorted(weights) and weights[0] >= 50 and weights[-1] == math.ceil(100 * (0.5 + 0.2 * 55 / 60))


def test_a_node_ramping_back_from_a_drain_does_not_give_way():
    """Evidence was against it: its canaries passed, but its ramp is the caution it earned. A warm-up beside it gives
    way instead."""
    back = replace(seasoned(since=NOW), state=SLOW_START, ramp_start=None)  # canaries passed just now
    states = {"a": back, "b": _warming(), "c": replace(seasoned(since=NOW - 5), state=QUARANTINED,
                                                         cause="latency"), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd"), Policy(), NOW)
    assert d.nodes["a"].weight == 10 and d.nodes["b"].weight == 100


def test_a_server_down_in_haproxy_counts_as_held_back():
    states = {"a": _warming(), "b": seasoned(since=0.0), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    inputs = _inputs("abcd", c={"down": True})
    assert warm_floor(states, inputs, sorted(inputs), 1, NOW, Policy(), set()) == 1.0
    assert decide_pool(states, inputs, Policy(), NOW).nodes["a"].weight == 100


def test_within_the_cap_and_in_a_pool_without_one_the_warm_up_is_as_configured():
    eight = {**{f"n{i}": seasoned(since=0.0) for i in range(7)}, "w": _warming()}
    d = decide_pool(eight, _inputs([*eight]), Policy(), NOW)
    assert d.nodes["w"].weight == 10  # 0.9 of a node held back, within a cap of two
    two = {"a": _warming(), "b": seasoned(since=0.0)}
    assert decide_pool(two, _inputs("ab"), Policy(), NOW).nodes["a"].weight == 10  # below 3 nodes: no cap
    zero = Policy()
    zero = replace(zero, thresholds=replace(zero.thresholds, max_ejected_fraction=0.0))
    four = {"a": _warming(), "b": _warming(), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    assert decide_pool(four, _inputs("abcd"), zero, NOW).nodes["a"].weight == 10


def test_a_fresh_controller_does_not_raise_a_weight_it_found_cut():
    """A controller without its state file finds a node at half its weight: why is not known (a drain's ramp back, a
    cut), so it is no warm-up and does not give way, even in a pool over its cap (trust rule 4: a fresh controller
    never restores a cut weight)."""
    inputs = {"a": NodeInput(100, 0.02, request_rate=5.0, haproxy_weight=50),
              "b": NodeInput(100, 0.02, request_rate=5.0, haproxy_weight=100, haproxy_drain=True),
              "c": NodeInput(100, 0.02, request_rate=5.0, haproxy_weight=100),
              "d": NodeInput(100, 0.02, request_rate=5.0, haproxy_weight=100)}
    d = decide_pool({}, inputs, Policy(), NOW)
    assert d.nodes["b"].state.state == QUARANTINED and d.nodes["a"].weight == 50


def test_a_joiner_does_not_overtake_nodes_ramping_for_another_reason():
    """A fresh controller found three registered nodes at their warm-up weight (why is not known: no warm-ups, they
    ramp from there) when a fourth joined: their ramps are caution as the joiner's own, not capacity the pool lost, so
    the joiner gave way to 100 % while they sat at 15 % (tests/controller/test_registry_membership.py). It does not."""
    found = {n: replace(seasoned(since=NOW - 20), state=SLOW_START, ramp_start=None) for n in "abc"}
    d = decide_pool({**found, "d": _warming()}, _inputs("abcd"), Policy(), NOW)
    assert d.nodes["d"].weight == 10 and "give way" not in d.nodes["d"].state.reason
    # a cut of one of them is held on evidence: what it holds below its ramp counts, and the joiner makes up for it
    cut = replace(found["a"], factors=(("live", 0.01, "live ITL 9x peer median"),))
    share = 0.1 + 0.2 * 20 / 60  # a's ramp, from its `since` 20 s ago
    floor = warm_floor({**found, "a": cut, "d": _warming()}, _inputs("abcd"), list("abcd"), 1, NOW, Policy(), set())
    assert math.isclose(floor, share * 0.99, abs_tol=1 / 4096)  # 1 - floor + share x 0.99 = the cap of one node
    drained = replace(seasoned(since=NOW - 5), state=QUARANTINED, cause="latency")
    d = decide_pool({**found, "a": drained, "d": _warming()}, _inputs("abcd"), Policy(), NOW)
    assert d.nodes["d"].weight == 100  # a drained node is capacity lost: the cap's one node, so d holds back nothing


# -- a restart in place: drained while unreachable, back as a warm-up (policy.back_in) --------------------------------
def _canary_passing(**kw) -> NodeState:
    """A drained node whose next good canary is its last one (canary_successes 3)."""
    return replace(seasoned(since=NOW - 40), state="canary", cause="gateway", canary_ok=2, last_canary=NOW - 10, **kw)


def test_a_node_drained_while_unreachable_comes_back_as_a_warm_up_that_gives_way():
    """Restarted in place, its server refused connections: HAProxy's error limit or the probes drained it, canaries
    brought it back. Its drain said nothing of its speed, so its ramp gives way where the pool holds back more than its
    cap, as a warm-up's does; a 4-node pool with two such nodes and a third slowed and drained had the fourth carry the
    pool, and cut it for 25-40 s (docs/benchmarks.md, "twenty-sixth round")."""
    gone = SignalMemory(probe_seen=ProbeResult.CONNECT_ERROR, probe_at=NOW - 41)
    states = {"a": _canary_passing(signals=gone), "b": replace(seasoned(since=NOW - 5), state=QUARANTINED,
                                                                cause="latency"),
              "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    inputs = _inputs("abcd", a={"canary": 0.02})
    d = decide_pool(states, inputs, Policy(), NOW)
    a = d.nodes["a"].state
    assert a.state == SLOW_START and warming(a) and not a.unreachable
    assert d.nodes["a"].weight == 100  # b drained is the cap's one node: a holds nothing back
    # drained on evidence (its probes answered before the gateway's reflex; no connect_error seen): a ramp back
    d = decide_pool({**states, "a": _canary_passing()}, inputs, Policy(), NOW)
    assert not warming(d.nodes["a"].state) and d.nodes["a"].weight == 10


def test_a_drained_node_whose_probes_find_no_server_is_marked_unreachable():
    """The drain may come before any probe sees the server gone (HAProxy's error limit fires on the first refused
    connections): the probes of the drained node say it, and the node remembers (persisted in the state file)."""
    states = {"a": _canary_passing(), "b": seasoned(since=0.0), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd", a={"probe_result": ProbeResult.CONNECT_ERROR}), Policy(), NOW)
    assert d.nodes["a"].state.unreachable and d.nodes["a"].state.state == "canary"
    d2 = decide_pool({n: x.state for n, x in d.nodes.items()}, _inputs("abcd", a={"canary": 0.02}), Policy(),
                     NOW + 10)
    assert warming(d2.nodes["a"].state) and not d2.nodes["a"].state.unreachable
    assert load_states(dump_states({"p": {"a": d.nodes["a"].state}}))["p"]["a"].unreachable


def test_a_node_released_by_the_cap_ramps_from_now():
    """A node drained while it warmed up kept its warm-up's ramp start; released by the cap a minute later, its ramp
    counted from then and it went straight to a full share. It starts at slow_start_initial."""
    old = replace(seasoned(since=NOW - 60), state=QUARANTINED, cause="latency", ramp_start=NOW - 300)
    states = {"a": old, "b": replace(old, since=NOW - 50), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd"), Policy(), NOW)  # two drained, a cap of one: the older goes back
    released = [n for n in "ab" if d.nodes[n].state.state == SLOW_START]
    assert len(released) == 1 and d.nodes[released[0]].weight == 10
    assert d.nodes[released[0]].state.ramp_start is None


def test_an_unreachable_node_the_cap_releases_while_it_does_not_answer_is_no_warm_up():
    """Released over the cap with no good canary and no answered probe, its server may still be gone: it ramps back
    at a tenth, not as a warm-up that the cap could raise to its full weight. With a good canary, or its last probe
    answered, it answers again: a warm-up (the restart_in_place runs: HAProxy's error limit marked the next server
    DOWN, and the pool over its cap released the first before its canaries began)."""
    gone = replace(seasoned(since=NOW - 60), state=QUARANTINED, cause="probe", unreachable=True)
    states = {"a": gone, "b": replace(gone, since=NOW - 50), "c": seasoned(since=0.0), "d": seasoned(since=0.0)}
    d = decide_pool(states, _inputs("abcd"), Policy(), NOW)  # two drained, a cap of one: the older goes back
    a = d.nodes["a"].state
    assert a.state == SLOW_START and not warming(a) and d.nodes["a"].weight == 10 and "released" in a.reason
    answered = replace(gone, state="canary", canary_ok=1, last_canary=NOW - 5)
    d = decide_pool({**states, "a": answered}, _inputs("abcd"), Policy(), NOW)
    assert warming(d.nodes["a"].state) and not d.nodes["a"].state.unreachable
    d = decide_pool(states, _inputs("abcd", a={"probe_result": ProbeResult.OK}), Policy(), NOW)
    assert warming(d.nodes["a"].state) and d.nodes["a"].state.state == SLOW_START
