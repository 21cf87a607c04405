"""One canary estimator: controller/canary.py's, called by the live loop and by the benchmark alike."""

from __future__ import annotations

import math

import pytest

from grayguard.bench.policies import Grayguard
from grayguard.bench.spec import NodeSpec, Scenario
from grayguard.config import RecoveryConfig
from grayguard.controller import canary
from grayguard.controller.policy import NodeState
from tests.support.ctl_helpers import FakeHaproxy, FakeProm, fake_controller, samples, tick_settled

NAMES = [f"node{i}" for i in range(5)]


# -- the estimate ------------------------------------------------------------------------------------------
def test_estimate_is_the_peers_median_ema_scaled_by_the_ttft_ratio():
    assert canary.canary_estimate(0.3, [0.05, 0.15], [0.01, 0.02]) == pytest.approx(0.015 * 0.3 / 0.1)
    assert canary.canary_estimate(0.2, [0.1], [0.02]) == pytest.approx(0.04)
    assert canary.canary_estimate(0.3, [0.1, 0.2, 0.9], [0.01, 0.02, 0.5]) == pytest.approx(0.02 * 0.3 / 0.2)


def test_a_failed_canary_is_infinitely_slow_whatever_the_peers_say():
    assert canary.canary_estimate(None, [0.1, 0.1], [0.02, 0.02]) == math.inf
    assert canary.canary_estimate(None, [], []) == math.inf


@pytest.mark.parametrize("peer_ttfts,peer_emas", [([], []), ([None, None], [0.02, 0.02]), ([0.0, None], [0.1, 0.1])])
def test_no_usable_reference_is_no_estimate(peer_ttfts, peer_emas):
    assert canary.canary_estimate(0.1, peer_ttfts, peer_emas) is None


def test_a_failed_reference_leaves_the_ttft_median_but_not_the_ema_median():
    # the loop's formula: the scale is the EMA median of every chosen peer, the reference only the answers
    assert canary.canary_estimate(0.2, [0.1, None], [0.01, 0.03]) == pytest.approx(0.02 * 0.2 / 0.1)


# -- the peers ---------------------------------------------------------------------------------------------
def prev(**over):
    base = {"node0": NodeState(state="canary", since=0.0),
            "node1": NodeState(ema=0.02, score=0.5), "node2": NodeState(ema=0.02, score=None),
            "node3": NodeState(ema=0.02, score=-1.0), "node4": NodeState(ema=0.02, score=0.5)}
    return {**base, **over}


def test_peers_are_the_two_lowest_scores_then_names_whatever_the_order():
    assert canary.canary_peers("node0", NAMES, prev(), {}) == ["node3", "node2"]  # -1, then None counts as 0
    assert canary.canary_peers("node0", list(reversed(NAMES)), prev(), {}) == ["node3", "node2"]
    assert canary.canary_peers("node0", NAMES, prev(), {}, limit=4) == ["node3", "node2", "node1", "node4"]


def test_peers_stay_in_the_peer_group():
    groups = {"node0": "a100", "node1": "a100", "node2": "h100", "node3": "h100", "node4": "a100"}
    assert canary.canary_peers("node0", NAMES, prev(), groups) == ["node1", "node4"]
    assert canary.canary_peers("node0", NAMES, prev(), {"node0": "a100"}) == []  # unknown group != a100


def test_drained_unmeasured_unknown_and_absent_nodes_are_no_peers():
    p = prev(node1=NodeState(state="quarantined", ema=0.02), node2=NodeState(state="canary", ema=0.02),
             node3=NodeState(ema=None))
    assert canary.canary_peers("node0", NAMES, p, {}) == ["node4"]
    assert canary.canary_peers("node0", NAMES, {k: v for k, v in prev().items() if k != "node3"}, {}) \
        == ["node2", "node1"]  # no state: not a peer
    assert canary.canary_peers("node0", ["node0", "node1"], prev(), {}) == ["node1"]  # only candidates
    assert canary.canary_peers("node0", NAMES, prev(node3=NodeState(state="slow_start", ema=0.02, score=-1.0)),
                               {})[0] == "node3"  # slow start is in rotation


def test_rounds_are_the_due_nodes_in_the_candidates_order():
    p = prev(node4=NodeState(state="canary", since=0.0, last_canary=95.0))
    r = RecoveryConfig(canary_interval_s=10.0)
    assert canary.canary_rounds(NAMES, p, {}, 100.0, r) == [("node0", ["node0", "node3", "node2"])]
    assert canary.canary_rounds(NAMES[::-1], p, {}, 105.0, r) == [("node4", ["node4", "node3", "node2"]),
                                                                 ("node0", ["node0", "node3", "node2"])]


# -- one implementation: the benchmark and the live loop call the same functions ------------------------------
STATES = {"node0": NodeState(state="canary", since=0.0),
          "node1": NodeState(ema=0.010, score=0.1), "node2": NodeState(ema=0.020, score=0.2),
          "node3": NodeState(ema=0.5, score=3.0)}
TTFT = {"node0": 0.3, "node1": 0.05, "node2": 0.15, "node3": 0.2}


@pytest.fixture
def spies(monkeypatch):
    """Wrap controller.canary's functions; every call is recorded as (function, args)."""
    calls: list = []
    for name in ("canary_rounds", "canary_estimate"):
        real = getattr(canary, name)

        def spy(*a, _real=real, _name=name, **kw):
            out = _real(*a, **kw)
            calls.append((_name, a, out))
            return out
        monkeypatch.setattr(canary, name, spy)
    return calls


def test_the_benchmark_uses_the_shared_functions(spies):
    nodes = [NodeSpec(n) for n in ("node0", "node1", "node2", "node3")]
    g = Grayguard(nodes, Scenario(name="t", nodes=tuple(nodes)))
    g.states = dict(STATES)
    est = g.canary_estimates(100.0, TTFT)
    assert [c[0] for c in spies] == ["canary_rounds", "canary_estimate"]
    assert spies[-1][1] == (0.3, [0.05, 0.15], [0.010, 0.020])
    assert est == {"node0": spies[-1][2]} and est["node0"] == pytest.approx(0.015 * 0.3 / 0.1)


def test_the_live_loop_uses_the_shared_functions(spies):
    now = 1000.0
    events: list = []
    addr = {f"node{i}": f"10.0.0.{i}:8000" for i in range(4)}
    hap = FakeHaproxy("127.0.0.1:9999", {"vllm_chat": [(n, a, 100) for n, a in addr.items()]}, events)
    lat = {a: 0.02 for n, a in addr.items() if n != "node0"}
    prom = FakeProm(lambda q: samples(lat if "latency" in q else dict.fromkeys(lat, 5.0), now), events)
    by_url = {f"http://{a}": TTFT[n] for n, a in addr.items()}
    ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [hap], prom, canary=by_url.__getitem__,
                          clock=lambda: now)
    ctl.states["chat"] = dict(STATES)
    tick_settled(ctl)  # the round starts, off the tick
    ctl.tick()  # and is decided on the next one (which starts no other for node0)
    assert [c[0] for c in spies] == ["canary_rounds", "canary_rounds", "canary_estimate"]
    # the same call as the benchmark's: the peers' EMAs are those of when the round was sent
    assert spies[-1][1] == (0.3, [0.05, 0.15], [0.010, 0.020])
    assert ctl.metrics.registry.get_sample_value("grayguard_canaries_total",
                                                 {"pool": "chat", "node": "node0", "result": "measured"}) == 1
