"""Decisions the controller must not undo or stall (issue 12, items 4, 7, 8 and 15), on real HAProxy.

4: a fresh controller (no state file, or a second replica) seeds the nodes it does not know from HAProxy
   and never readies a drained node or restores a cut weight on its first tick.
7: the ejection cap bounds what is out of rotation from any cause (MAINT, DOWN, drained); 0 means never.
8: MAINT on one HAProxy of a tier holds the node on that HAProxy only.
15: `grayguard replay` runs each pool's own Policy (its group_speed), as the live loop does.
"""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from grayguard.config import RecoveryConfig, ThresholdsConfig, load_config
from grayguard.controller import policy, replay
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.policy import (
    CANARY,
    HEALTHY,
    QUARANTINED,
    SLOW_START,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
    max_ejected,
)
from tests.support.ctl_helpers import LAT_Q, RATE_Q, FakeProm, make_controller, samples, servers

BE = "vllm_chat"


def addr(i: int) -> str:
    return f"127.0.0.1:{9100 + i}"


def tick(ctl, t: float, lat: dict[int, float]) -> None:
    """One tick at time t with these node latencies (a node left out has no series: drained or idle).

    Prometheus is a fake seam: the latency and rate queries answer fresh samples (timestamp() of a query: t).
    """
    values = {LAT_Q: {addr(i): v for i, v in lat.items()}, RATE_Q: {addr(i): 5.0 for i in lat}}

    def answer(q: str) -> list:
        inner = q.removeprefix("timestamp(").removesuffix(")")
        got = values.get(inner, {})
        return samples({k: t for k in got} if inner != q else got, t)
    ctl.prom = FakeProm(answer, [])
    ctl.tick()


def table(hap) -> dict[str, tuple[int, bool, bool]]:
    """server -> (weight, drained, in MAINT) as HAProxy has it."""
    return {s.name: (s.weight, s.drain, s.maint) for s in RuntimeClient(hap.endpoint).show_servers_state(BE)}


def out_of_rotation(hap) -> set[str]:
    # srv_op_state 0: stopped (DOWN by its health check, or in MAINT)
    return {s.name for s in RuntimeClient(hap.endpoint).show_servers_state(BE) if s.drain or s.maint or s.op_state == 0}


# ---- 4: a fresh controller seeds unknown nodes from HAProxy ------------------------------------------------
def test_a_fresh_controller_does_not_undo_another_controllers_drain_or_weight_cut(haproxy_factory):
    hap = haproxy_factory({BE: servers(10)})  # the cap: 3 out of rotation
    t = [1000.0]
    a = make_controller([hap.endpoint], clock=lambda: t[0])
    for _ in range(3):  # controller A quarantines node0 (10x slower than its peers)
        tick(a, t[0], {i: 0.2 if i == 0 else 0.02 for i in range(10)})
        t[0] += 5
    assert table(hap)["node0"] == (0, True, False)
    # what A would leave behind too: node1's weight cut (degraded), node2 at weight 0 without a drain
    RuntimeClient(hap.endpoint).execute([f"set server {BE}/node1 weight 40", f"set server {BE}/node2 weight 0"])

    b = make_controller([hap.endpoint], clock=lambda: t[0])  # restarted without its state file / a second replica
    live = {i: 0.02 for i in range(10) if i not in (0, 2)}  # node0 and node2 are out: no traffic, no series
    tick(b, t[0], live)
    got = table(hap)
    assert got["node0"] == (0, True, False), "the fresh controller's first tick readied a drained node"
    assert got["node2"] == (0, True, False), "a node at weight 0 must stay out"
    assert got["node1"][:2] == (40, False), "a weight cut must not come back to full weight at once"
    sb = b.states["chat"]
    assert sb["node0"].state == QUARANTINED and sb["node0"].cause == policy.SEEDED and "HAProxy" in sb["node0"].reason
    assert sb["node2"].state == QUARANTINED and sb["node1"].state == SLOW_START
    assert sb["node3"].state == HEALTHY and got["node3"] == (100, False, False)

    # the two controllers side by side (no lock in this test): node0 is never put back at full weight
    for _ in range(6):
        for ctl in (a, b):
            t[0] += 2.5
            tick(ctl, t[0], live)
            assert table(hap)["node0"] == (0, True, False)


def test_seeding_rules():
    t, r = ThresholdsConfig(), RecoveryConfig(slow_start_initial=0.1, slow_start_step_per_min=0.2)
    now = 500.0
    assert policy.seed(NodeInput(100), False, t, r, now) == NodeState(since=now)  # unknown to HAProxy too: as before
    assert policy.seed(NodeInput(100, haproxy_weight=100), False, t, r, now).state == HEALTHY
    for i in (NodeInput(100, haproxy_weight=100, haproxy_drain=True), NodeInput(100, haproxy_weight=0)):
        for joined in (False, True):
            s = policy.seed(i, joined, t, r, now)
            assert (s.state, s.cause, s.since) == (QUARANTINED, policy.SEEDED, now)
    assert policy.seed(NodeInput(0, haproxy_weight=0), False, t, r, now).state == HEALTHY  # weight 0 is its base
    cut = policy.seed(NodeInput(100, haproxy_weight=50), False, t, r, now)
    d = decide_pool({}, {"a": NodeInput(100, haproxy_weight=50)}, Policy(t, r), now)
    assert cut.state == SLOW_START and d.nodes["a"].weight == 50  # slow start at HAProxy's share, then ramps
    assert decide_pool({"a": d.nodes["a"].state}, {"a": NodeInput(100)}, Policy(t, r), now + 60).nodes["a"].weight == 70
    low = decide_pool({}, {"a": NodeInput(100, haproxy_weight=3)}, Policy(t, r), now)
    assert low.nodes["a"].weight == 10  # below slow_start_initial: slow start from its start
    joined = policy.seed(NodeInput(100, haproxy_weight=100), True, t, r, now)
    assert joined.state == SLOW_START and joined.ramp_start == now + t.new_node_warmup_s  # warm-up as before


def test_a_seeded_node_comes_back_through_canaries_as_usual():
    pol = Policy(ThresholdsConfig(), RecoveryConfig(min_quarantine_s=20, canary_interval_s=10, canary_successes=2))
    lat = {f"n{i}": NodeInput(100, 0.02, haproxy_weight=100) for i in range(1, 4)}
    prev, now, seen = {}, 1000.0, []
    for k in range(12):
        i0 = NodeInput(100, None, haproxy_weight=0, haproxy_drain=True, canary=0.02 if k >= 5 else None)
        d = decide_pool(prev, {"n0": i0, **lat}, pol, now)
        seen.append(d.nodes["n0"].state.state)
        prev = {n: nd.state for n, nd in d.nodes.items()}
        now += 5
    assert seen[0] == QUARANTINED and CANARY in seen and seen[-1] == SLOW_START
    assert seen.index(CANARY) == 4  # min_quarantine_s after the seeding tick


# ---- 7: the cap bounds what is out of rotation from any cause ----------------------------------------------
@pytest.mark.parametrize("how", ["state maint", "health down"])
def test_the_cap_counts_servers_already_out_of_rotation(haproxy_factory, how):
    hap = haproxy_factory({BE: servers(10)})
    RuntimeClient(hap.endpoint).execute([f"set server {BE}/node{i} {how}" for i in range(3)])
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    for _ in range(5):  # nodes 3-5 are 10x slower; nodes 0-2 take no traffic
        tick(ctl, t[0], {i: (0.2 if i in (3, 4, 5) else 0.02) for i in range(3, 10)})
        t[0] += 5
    d = ctl.last_decisions["chat"]
    assert d.max_ejected == 3
    assert out_of_rotation(hap) == {"node0", "node1", "node2"}, "the cap must count MAINT/DOWN servers"
    assert d.safeguard and d.out_of_rotation == 3
    assert "3 in MAINT or DOWN" in ctl.states["chat"]["node3"].reason


def test_servers_leaving_rotation_release_drained_nodes_within_the_cap():
    pol = Policy(ThresholdsConfig(), RecoveryConfig())
    prev = {f"n{i}": NodeState(state=QUARANTINED, since=0.0) for i in range(3)}
    inputs = {f"n{i}": NodeInput(100, hold=3 <= i < 5) for i in range(10)}  # two went to MAINT
    d = decide_pool(prev, inputs, pol, 1.0)
    states = [d.nodes[f"n{i}"].state.state for i in range(3)]
    assert states.count(QUARANTINED) == 1 and states.count(SLOW_START) == 2 and d.out_of_rotation == 3


def test_max_ejected_fraction_0_never_drains(haproxy_factory):
    hap = haproxy_factory({BE: servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], extra={
        "thresholds": {"max_ejected_fraction": 0}})
    for _ in range(6):
        tick(ctl, t[0], {0: 0.4, 1: 0.02, 2: 0.02, 3: 0.02})
        t[0] += 5
        assert not out_of_rotation(hap), "max_ejected_fraction: 0 drained a node"
    s = ctl.states["chat"]["node0"]
    assert s.state == "degraded" and table(hap)["node0"][0] < 100 and "safeguard cap of 0" in s.reason
    assert max_ejected(10, 0.0) == 0 and max_ejected(3, 0.0) == 0


# ---- 8: MAINT holds a node per HAProxy endpoint -------------------------------------------------------------
@pytest.mark.parametrize("maint_on", [0, 1])
def test_maint_on_one_haproxy_holds_the_node_only_there(haproxy_factory, maint_on):
    haps = [haproxy_factory({BE: servers(4)}), haproxy_factory({BE: servers(4)})]
    RuntimeClient(haps[maint_on].endpoint).execute([f"set server {BE}/node0 state maint"])
    t = [1000.0]
    ctl = make_controller([h.endpoint for h in haps], clock=lambda: t[0])
    for _ in range(3):  # node0 still takes traffic through the other HAProxy, 10x slower than its peers
        tick(ctl, t[0], {0: 0.2, 1: 0.02, 2: 0.02, 3: 0.02})
        t[0] += 5
    other = haps[1 - maint_on]
    assert table(other)["node0"] == (0, True, False), "the node must be drained where it is not in MAINT"
    assert table(haps[maint_on])["node0"] == (100, False, True), "the MAINT server must be left alone"
    assert ctl.states["chat"]["node0"].state == QUARANTINED
    assert not any(ep == haps[maint_on].endpoint and c.node == "node0" for ep, c in ctl.tick().changes)


def test_maint_on_every_haproxy_holds_the_node(haproxy_factory):
    haps = [haproxy_factory({BE: servers(4)}), haproxy_factory({BE: servers(4)})]
    for h in haps:
        RuntimeClient(h.endpoint).execute([f"set server {BE}/node0 state maint"])
    t = [1000.0]
    ctl = make_controller([h.endpoint for h in haps], clock=lambda: t[0])
    for _ in range(3):
        tick(ctl, t[0], {0: 0.2, 1: 0.02, 2: 0.02, 3: 0.02})
        t[0] += 5
    assert all(table(h)["node0"] == (100, False, True) for h in haps)
    d = ctl.last_decisions["chat"].nodes["node0"]
    assert d.weight is None and "MAINT" in d.state.reason


# ---- 15: replay runs each pool's own Policy ------------------------------------------------------------------
def mixed_trace(path) -> None:
    """Three H100 nodes and one A100 (configured 2x slower than the pool) that turns 5x slower than that."""
    lines = ["t,pool,node,normalized_latency,peer_group"]
    for k in range(30):
        for i in range(3):
            lines.append(f"{k * 5},chat,h{i},{0.02 * (1 + 0.01 * ((k + i) % 3))},h100")
        lines.append(f"{k * 5},chat,a0,{0.04 * (5.0 if k >= 5 else 1.0)},a100")
    path.write_text("\n".join(lines) + "\n")


def replay_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    return p.parse_args(argv)


def test_replay_uses_the_pools_group_speed(tmp_path):
    with open("grayguard.example.yaml") as f:
        doc = yaml.safe_load(f)
    doc["pools"] = [{"name": "chat", "backend": BE, "group_speed": {"a100": 2.0, "h100": 1.0}}]
    cfg_path = tmp_path / "g.yaml"
    cfg_path.write_text(yaml.safe_dump(doc))
    mixed_trace(tmp_path / "t.csv")
    args = replay_args("--config.file", str(cfg_path), "--trace", str(tmp_path / "t.csv"),
                       "--out", str(tmp_path / "o.jsonl"))
    assert replay.run(args) == 0
    recs = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    a0 = [r for r in recs if r["node"] == "a0"]
    assert a0[3]["state"] == HEALTHY and a0[3]["score"] is not None  # scored against the pool at its speed
    assert QUARANTINED in {r["state"] for r in a0}, "replay ignored pools[].group_speed"
    # the same Policy objects as the live loop builds
    cfg = load_config(str(cfg_path))
    live = make_controller(["unix:/nonexistent"], extra={"pools": doc["pools"], "thresholds": doc["thresholds"],
                                                         "rules": doc["rules"]})
    assert policy.pool_policies(cfg) == live.policies
    assert policy.pool_policies(cfg)["chat"].group_speed == {"a100": 2.0, "h100": 1.0}


def test_replay_says_when_a_pool_of_the_trace_is_not_configured(tmp_path, capsys):
    mixed_trace(tmp_path / "t.csv")
    args = replay_args("--config.file", "grayguard.example.yaml", "--trace", str(tmp_path / "t.csv"), "--out",
                       str(tmp_path / "o.jsonl"))
    text = (tmp_path / "t.csv").read_text().replace(",chat,", ",other,")
    (tmp_path / "t.csv").write_text(text)
    assert replay.run(args) == 0
    assert "pool 'other' of the trace is not in grayguard.example.yaml" in capsys.readouterr().err
    assert (tmp_path / "o.jsonl").read_text()
