"""The slow-probe run a node needs is the one its peers would not have by chance (issue 33's sampling noise of the
probe): in a pool where a fifth of the probes wait behind long prompts, two slow probes in a row on one node are
common luck; in a quiet pool they are not.

Found on the default suite's trace_busy/n32 (the Azure trace at 70 % of 32 nodes): every false cut there was
`probe slow (370 ms vs peers 35 ms)`, on nodes whose peers had slow probes at about the same share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.controller.policy import NodeInput, Policy, decide_pool, peer_slow_shares
from grayguard.controller.signals import PROBE_RUN_CHANCE, probe_run_needed
from grayguard.vocab import State


@pytest.mark.parametrize("share, nodes, needed", [
    (None, 4, 2), (0.0, 32, 2), (0.05, 4, 2), (0.1, 4, 3), (1 / 3, 4, 6), (0.5, 4, 9), (0.03, 32, 3), (0.1, 32, 4),
    (0.1, 1, 2), (0.2, 1, 3)])
def test_the_run_needed_grows_with_the_peers_share_of_slow_probes_and_the_pools_size(share, nodes, needed):
    assert probe_run_needed(share, 2, nodes) == needed


@given(st.floats(0.001, 0.999), st.integers(1, 5), st.integers(1, 1000))
def test_one_of_the_pools_healthy_nodes_has_the_run_needed_by_chance_at_most_rarely(share, least, nodes):
    k = probe_run_needed(share, least, nodes)
    chance = PROBE_RUN_CHANCE / nodes
    assert k >= least and (share ** k <= chance * (1 + 1e-9) or k == least)
    if k > least:  # and not one more than needed
        assert share ** (k - 1) > chance


def test_a_pool_whose_every_peer_is_slow_gives_no_run_as_evidence():
    assert probe_run_needed(1.0, 2) > 10 ** 6


def _inputs(results: dict[str, str]) -> dict[str, NodeInput]:
    return {n: NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result=r,
                         probe_ttft=0.4 if r == "slow" else 0.03) for n, r in results.items()}


def test_each_nodes_share_leaves_the_node_out():
    ins = _inputs({"a": "slow", "b": "ok", "c": "slow", "d": "ok", "e": "timeout"})
    sh = peer_slow_shares(ins, sorted(ins))
    assert sh == {"a": 2 / 4, "b": 3 / 4, "c": 2 / 4, "d": 3 / 4, "e": 2 / 4}
    assert peer_slow_shares(_inputs({"a": "slow", "b": "ok"}), ["a", "b"]) == {}  # one peer: no share


def _run(slow_nodes_per_tick, ticks=10, n=10):
    """A 10-node pool: node n0 slow on every tick, and `slow_nodes_per_tick` other nodes slow on each tick, in turn
    (a loaded pool whose probes queue behind long prompts here and there)."""
    prev, states = {}, []
    for k in range(ticks):
        others = {f"n{1 + (k * slow_nodes_per_tick + j) % (n - 1)}" for j in range(slow_nodes_per_tick)}
        res = {f"n{i}": ("slow" if i == 0 or f"n{i}" in others else "ok") for i in range(n)}
        d = decide_pool(prev, _inputs(res), Policy(), 1000.0 + k)
        prev = {m: nd.state for m, nd in d.nodes.items()}
        states.append(prev["n0"].state)
    return states


def test_a_node_slow_among_quiet_peers_is_cut_on_its_second_slow_probe():
    assert _run(0)[:2] == [State.HEALTHY, State.DEGRADED]


def test_a_node_slow_among_peers_slow_a_third_of_the_time_is_cut_later_but_cut():
    states = _run(3)  # 3 of its 9 peers slow each tick: share 1/3, in a pool of 10: 7 in a row needed
    assert probe_run_needed(3 / 9, 2, 10) == 7
    assert states[:6] == [State.HEALTHY] * 6 and states[6] == State.DEGRADED
