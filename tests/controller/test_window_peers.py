"""The 30 s window's peers are the nodes that carry their full share of traffic (policy._window_scores). A node held
below its weight (warming up after a join or a restart, ramping back from a drain, cut) serves fewer requests and its
window is faster for it: half a pool scaled out at once made the old half's full windows look 1.6x their peers' and
cut healthy nodes for up to 25 s (docs/benchmarks.md, "twenty-third round")."""

from __future__ import annotations

from dataclasses import replace

from grayguard.controller.policy import (
    CANARY,
    DEGRADED,
    HEALTHY,
    SLOW_START,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
)
from tests.support.ctl_helpers import seasoned

OLD, NEW = [f"n{i}" for i in range(4)], [f"n{i}" for i in range(4, 8)]


def _scaled_out(now: float) -> dict[str, NodeState]:
    """Four nodes serving for a minute, four joined 10 s ago and warming up at a tenth of their weight."""
    joined = {n: replace(seasoned(since=now - 10), state=SLOW_START, ramp_start=now + 20) for n in NEW}
    return {**{n: seasoned(since=0.0) for n in OLD}, **joined}


def _windows(old: float, new: float) -> dict[str, NodeInput]:
    return {n: NodeInput(base_weight=100, latency=old if n in OLD else new, request_rate=5.0 if n in OLD else 0.5)
            for n in OLD + NEW}


def test_the_full_windows_of_a_pool_scaled_out_by_half_are_not_outliers():
    pol, now = Policy(), 100.0
    states = _scaled_out(now)
    for k in range(6):  # one new sample a tick: the window's test sees each
        d = decide_pool(states, _windows(0.022, 0.012), pol, now + k)
        states = {n: x.state for n, x in d.nodes.items()}
        assert all(d.nodes[n].state.state == HEALTHY and d.nodes[n].weight == 100 for n in OLD), \
            {n: d.nodes[n].state.reason for n in OLD}
        # the joiners are compared with the nodes that carry their share: faster, so nothing to say
        assert all(d.nodes[n].state.ratio is not None and d.nodes[n].state.ratio < 1 for n in NEW)


def test_a_slow_joiner_is_still_scored_and_cut_against_the_full_share_nodes():
    pol, now = Policy(), 100.0
    states = _scaled_out(now)
    windows = {**_windows(0.022, 0.012), "n4": NodeInput(base_weight=100, latency=0.066, request_rate=0.5)}
    d = decide_pool(states, windows, pol, now)
    n4 = d.nodes["n4"]
    assert n4.state.state == SLOW_START and 2.9 < n4.state.ratio < 3.1  # 3x the full-share nodes' 0.022
    # cut below its warm-up share: four warm-ups of eight hold back more than the cap of two nodes' worth, so the
    # ramps move on to half (policy.warm_floor), and the slow one is cut below the others
    others = {d.nodes[n].weight for n in NEW if n != "n4"}
    assert others == {50} and n4.weight < 50 * 0.5 and "latency 3.00x peer median" in n4.state.reason


def test_a_cut_node_is_no_peer_of_the_others():
    """A cut node (its weight lower, its window the one that is slow) no longer sets its peers' median: of five, n0
    cut at 4x and n1 a little slow, n2's peers are n1 and the two like it (median 0.02), not n0 too (0.025)."""
    pol, now = Policy(), 100.0
    states = {f"n{i}": seasoned(since=0.0) for i in range(5)}
    states["n0"] = replace(states["n0"], state=DEGRADED, factors=())
    windows = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0) for i in range(5)}
    windows["n0"] = replace(windows["n0"], latency=0.08)
    windows["n1"] = replace(windows["n1"], latency=0.03)
    d = decide_pool(states, windows, pol, now)
    assert d.nodes["n2"].peer_median == 0.02
    assert abs(d.nodes["n0"].state.ratio - 4.0) < 1e-9 and d.nodes["n0"].weight < 100  # against 0.02, its peers'


def test_with_too_few_full_share_nodes_every_node_is_a_peer():
    """A pool where fewer than three nodes carry their full share (a 4-node pool with two joiners) compares every node
    with every other, as before: the full-share ones alone are too few to say what a node's window should be."""
    pol, now = Policy(), 100.0
    states = {"a": seasoned(since=0.0), "b": seasoned(since=0.0),
              "c": replace(seasoned(since=90.0), state=SLOW_START, ramp_start=120.0),
              "d": replace(seasoned(since=90.0), state=SLOW_START, ramp_start=120.0)}
    windows = {n: NodeInput(base_weight=100, latency=0.02, request_rate=5.0) for n in "abcd"}
    d = decide_pool(states, windows, pol, now)
    assert all(d.nodes[n].state.ratio == 1.0 for n in "abcd")
    assert d.nodes["a"].peer_median == 0.02


def test_a_garbage_window_of_a_node_held_below_its_weight_is_no_value():
    """A warming node of a small peer group reporting a window a float cannot hold apart from its peers' (1e-300 s in a
    group whose speed is set by 1e300 s): the quotient is no value, not a math domain error that stops the tick."""
    pol, now = Policy(group_speed={"big": 1e300}), 100.0
    states = {**{f"n{i}": seasoned(since=0.0) for i in range(4)},
              "w": replace(seasoned(since=90.0), state=SLOW_START, ramp_start=120.0)}
    windows = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0) for i in range(4)}
    windows["w"] = NodeInput(base_weight=100, latency=1e-300, request_rate=0.5, peer_group="big")
    d = decide_pool(states, windows, pol, now)
    assert d.nodes["w"].state.state == SLOW_START and "w" in d.uncompared


def test_a_canary_a_float_cannot_hold_apart_from_its_peers_is_no_good_canary():
    """The same quotient for a drained node's canary (1e-300 s in a group whose speed is 1e300): a bad canary, not a
    math domain error that stops the tick."""
    pol, now = Policy(group_speed={"big": 1e300}), 100.0
    states = {**{f"n{i}": seasoned(since=0.0) for i in range(4)},
              "c": replace(seasoned(since=0.0), state=CANARY, cause="latency")}
    windows = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0) for i in range(4)}
    windows["c"] = NodeInput(base_weight=100, canary=1e-300, canary_at=now, peer_group="big")
    c = decide_pool(states, windows, pol, now).nodes["c"].state
    assert c.state == CANARY and c.canary_ok == 0 and "canary bad (no value)" in c.reason
