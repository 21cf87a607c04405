"""controller/membership.py, pure: which registered nodes serve, which leave, the expiry rules (the gateway's
agreement, the cap, the floor, a doubted view), the runtime-API lines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller import membership as mb
from grayguard.controller.haproxy import ADMF_FDRAIN, ADMF_FMAINT, CHK_ST_CONFIGURED, CHK_ST_ENABLED, ServerState
from grayguard.controller.policy import QUARANTINED, NodeState, Policy, max_ejected
from grayguard.registry import NodeRecord

BE = "vllm_chat"


def rec(node: str, port: int = 9000, state: str = "serving", host: str = "127.0.0.1") -> NodeRecord:
    return NodeRecord(pool="chat", node=node, endpoint=f"{host}:{port}", exporter=f"{host}:{port + 1000}",
                      model="m", ttl_s=5, state=state)


def srv(name: str, port: int = 9000, weight: int = 100, admin: int = 0, op: int = 2, agent: int | None = None,
        host: str = "127.0.0.1") -> ServerState:
    return ServerState(BE, name, f"{host}:{port}", weight, 100, admin, op, agent_state=agent)


def view(nodes=(), departed=(), fresh=True) -> mb.PoolView:
    return mb.PoolView({r.node: r for r in nodes}, {r.node: r for r in departed}, fresh)


POLICY = Policy(ThresholdsConfig(new_node_warmup_s=30), RecoveryConfig(slow_start_initial=0.1))


def settings_for(servers=None, ports=None) -> mb.AddSettings:
    return mb.add_settings(servers or {}, ports or {}, POLICY, now=100.0)


def decide(v, mem, present, now, share, up=(), fraction=1.0) -> mb.Decision:
    """mb.decide with every server DOWN in HAProxy (up: those UP) and no floor below max_ejected's own."""
    return mb.decide(v, mem, present, now, share, up=up, fraction=fraction)


# --- decide --------------------------------------------------------------------------------------------------------
def test_serving_registrations_are_wanted_and_a_graceful_leave_is_removed_at_once():
    v = view([rec("a"), rec("b", state="leaving")], [rec("c", state="leaving")])
    d = decide(v, mb.PoolMemory(), {"a", "b", "c"}, 10.0, 0.3)
    assert set(d.wanted) == {"a"}
    assert {n: r.cause for n, r in d.removing.items()} == {"b": mb.LEFT, "c": mb.LEFT}
    assert d.held == () and set(d.started) == {"b", "c"}


def test_an_expiry_within_the_cap_is_removed_the_rest_held_and_released_a_minute_later():
    nodes = [rec(f"n{i}", 9000 + i) for i in range(10)]
    present = {r.node for r in nodes}
    d = decide(view(nodes), mb.PoolMemory(), present, 0.0, 0.3)
    d = decide(view(nodes[3:], nodes[:3]), d.memory, present, 1.0, 0.3)  # three leases end: the cap, not more
    assert d.cap == 3 and len(d.removing) == 3 and d.held == () and not d.untrusted
    v = view(nodes[6:], nodes[:6])  # three more a second later
    d2 = decide(v, d.memory, present, 2.0, 0.3)
    assert set(d2.removing) == set(d.removing) and len(d2.held) == 3 and d2.started == ()
    d3 = decide(v, d2.memory, present, 59.0, 0.3)
    assert set(d3.removing) == set(d.removing) and d3.held == d2.held
    d4 = decide(v, d3.memory, present, 61.0, 0.3)
    assert len(d4.removing) == 6 and d4.held == ()


def test_a_lone_crash_is_removed_but_share_0_and_the_floor_of_a_small_pool_never_remove_an_expiry():
    v = view([rec("a"), rec("c"), rec("d")], [rec("b")])
    assert set(decide(v, mb.PoolMemory(), {"a", "b", "c", "d"}, 0.0, 0.3, fraction=0.3).removing) == {"b"}
    d = decide(v, mb.PoolMemory(), {"a", "b", "c", "d"}, 0.0, 0.0)
    assert d.removing == {} and d.held == ("b",)
    # two nodes: max_ejected leaves both (as the policy never drains one of two): the dead one stays, DOWN
    d = decide(view([rec("a")], [rec("b")]), mb.PoolMemory(), {"a", "b"}, 0.0, 0.3, fraction=0.3)
    assert d.removing == {} and d.held == ("b",) and d.floor == 2


def test_a_frozen_view_begins_no_removal_but_finishes_those_begun():
    v = view([rec("a", state="leaving"), rec("d"), rec("e"), rec("f")], [rec("b"), rec("c")], fresh=False)
    mem = mb.PoolMemory(removing={"c": mb.Removal(mb.EXPIRED, 0.0)}, expiries=((0.0, "c"),))
    present = {"a", "b", "c", "d", "e", "f"}
    d = decide(v, mem, present, 5.0, 0.7, fraction=0.7)
    assert set(d.removing) == {"c"} and d.started == ()
    assert d.held == ()  # b waits for a fresh view: within the cap (4 a minute, c was 1), it is not held by it
    d = decide(replace(v, fresh=True), d.memory, present, 6.0, 0.7, fraction=0.7)
    assert d.started == ("a", "b")


def test_a_node_registered_again_cancels_its_removal_and_a_deleted_server_ends_it():
    mem = mb.PoolMemory(removing={"a": mb.Removal(mb.EXPIRED, 0.0), "b": mb.Removal(mb.LEFT, 0.0)})
    d = decide(view([rec("a")], [rec("b", state="leaving")]), mem, {"a"}, 1.0, 0.3)
    assert d.cancelled == ("a",) and d.removing == {} and set(d.wanted) == {"a"}


def test_servers_the_registry_never_named_are_left_alone():
    d = decide(view([rec("a")]), mb.PoolMemory(), {"a", "static1"}, 0.0, 0.3)
    assert d.removing == {} and d.held == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 9)), min_size=1, max_size=40),
       st.floats(0.0, 1.0), st.integers(1, 12))
def test_expiries_never_remove_more_than_the_cap_in_any_minute(events, share, n):
    """Random expiries and re-registrations over time: within any 60 s window the removals begun by expiry stay
    within the cap of the largest pool seen in it."""
    nodes = {f"n{i}": rec(f"n{i}", 9000 + i) for i in range(n)}
    alive, gone = set(nodes), set()
    mem, t, begun, caps = mb.PoolMemory(), 0.0, [], []  # every server DOWN: nothing but the cap limits removals
    for dt, k in events:
        t += dt * 5.0
        name = f"n{k % n}"
        if name in alive:
            alive.discard(name)
            gone.add(name)
        else:
            alive.add(name)
            gone.discard(name)
        v = view([nodes[x] for x in alive], [nodes[x] for x in gone])
        d = decide(v, mem, set(nodes), t, share)
        mem = d.memory
        begun += [(t, x) for x in d.started if d.removing[x].cause == mb.EXPIRED]
        caps.append(mb.expiry_cap(share, n))
    for t0, _ in begun:
        in_window = [x for t1, x in begun if t0 <= t1 < t0 + mb.EXPIRY_WINDOW_S]
        assert len(in_window) <= max(caps)


def test_an_expired_node_haproxy_has_up_is_kept_and_flagged_and_removed_once_haproxy_has_it_down():
    """A partition of the exporters from etcd, a crashed exporter: the lease ends, vLLM still serves."""
    nodes = [rec(f"n{i}", 9000 + i) for i in range(6)]
    present = {r.node for r in nodes}
    v = view(nodes[1:], nodes[:1])
    d = decide(v, mb.PoolMemory(), present, 0.0, 1.0, up=present)
    assert d.removing == {} and d.kept == ("n0",) and d.held == ()
    d = decide(v, d.memory, present, 1.0, 1.0, up=present - {"n0"})  # its checks fail now: the usual rules
    assert d.started == ("n0",) and d.kept == ()


def test_the_floor_keeps_what_max_ejected_leaves_whatever_the_cap():
    nodes = [rec(f"n{i}", 9000 + i) for i in range(4)]
    present = {r.node for r in nodes}
    d = decide(view(nodes[2:], nodes[:2]), mb.PoolMemory(), present, 0.0, 1.0, fraction=0.3)
    assert d.cap == 4 and d.started == ("n0",) and d.held == ("n1",) and d.floor == 3
    # n0 is deleted: the window still counts it, so the pool is 4 for the floor, not 3
    d = decide(view(nodes[2:], nodes[:2]), d.memory, present - {"n0"}, 10.0, 1.0, fraction=0.3)
    assert d.started == () and d.held == ("n1",)


def test_removals_recorded_elsewhere_count_in_the_window():
    """A restarted controller, or the replica a pool was handed over to, reads the window from etcd."""
    nodes = [rec(f"n{i}", 9000 + i) for i in range(10)]
    present = {r.node for r in nodes} - {"x1", "x2"}
    mem = mb.remembered(mb.PoolMemory(), [(0.0, "x1"), (5.0, "x2")])  # two removals, deleted since
    d = decide(view(nodes[1:], nodes[:1]), mem, present, 10.0, 0.3, fraction=0.3)
    assert d.cap == 3 and d.started == ("n0",)
    d = decide(view(nodes[2:], nodes[:2]), d.memory, present, 11.0, 0.3, fraction=0.3)
    assert d.started == () and d.held == ("n1",)  # 3 in the window
    assert mb.remembered(d.memory, [(0.0, "x1")]) is d.memory


def test_a_mass_loss_is_not_trusted_for_a_minute_or_until_the_nodes_register_again():
    """An etcd freeze past the TTL ends every lease; its re-list shows no registration until the exporters
    register again: no tick in that gap removes anything, even a server HAProxy has DOWN."""
    nodes = [rec(f"n{i}", 9000 + i) for i in range(10)]
    present = {r.node for r in nodes}
    d = decide(view(nodes), mb.PoolMemory(), present, 0.0, 0.3)
    d = decide(view([], nodes), d.memory, present, 1.0, 0.3)
    assert d.untrusted and d.removing == {} and len(d.held) == 10 and d.memory.untrusted_since == 1.0
    d2 = decide(view(nodes[1:], nodes[:1]), d.memory, present, 2.0, 0.3)  # nine registered again
    assert not d2.untrusted and d2.started == ("n0",)
    d3 = decide(view([], nodes), d.memory, present, 60.5, 0.3)  # none did, for a minute: the rules decide
    assert d3.untrusted and d3.started == ()
    d3 = decide(view([], nodes), d3.memory, present, 61.0, 0.3)
    assert not d3.untrusted and len(d3.started) == 3


def test_a_view_with_no_registration_left_is_not_trusted_even_within_the_cap():
    nodes = [rec(f"n{i}", 9000 + i) for i in range(3)]
    present = {r.node for r in nodes}
    d = decide(view(nodes), mb.PoolMemory(), present, 0.0, 1.0)
    d = decide(view([], nodes), d.memory, present, 1.0, 1.0)
    assert d.cap == 3 and d.untrusted and d.started == ()
    d = decide(view([], nodes), mb.PoolMemory(), present, 1.0, 1.0)  # a restart into such a view, too
    assert d.untrusted and d.started == ()


def test_withhold_takes_back_only_the_expiry_removals_begun_this_tick():
    nodes = [rec(f"n{i}", 9000 + i) for i in range(10)]
    present = {r.node for r in nodes}
    mem = mb.PoolMemory(removing={"n9": mb.Removal(mb.EXPIRED, 0.0)}, expiries=((0.0, "n9"),))
    v = view(nodes[2:9] + [rec("n1", 9001, state="leaving")], [nodes[0], nodes[9]])
    d = decide(v, mem, present, 5.0, 0.3)
    assert set(d.started) == {"n0", "n1"}
    w = mb.withhold(d, ["n0", "n1", "n9"])
    assert set(w.removing) == {"n1", "n9"} and w.started == ("n1",) and w.held == ("n0",)
    assert w.memory.expiries == ((0.0, "n9"),) and set(w.memory.removing) == {"n1", "n9"}
    assert mb.withhold(w, ["n0"]) is w


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 11), st.booleans()), min_size=1, max_size=40),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 12))
def test_expiry_removals_never_take_the_pool_below_its_floor(events, share, fraction, n):
    """Servers DOWN and leases ending (or coming back) at random; a removed server is deleted at the next tick.
    Whenever an expiry removal begins, the servers left keep what max_ejected leaves of them and of the expiry
    removals of the last minute, as this test counts them itself."""
    nodes = {f"n{i}": rec(f"n{i}", 9000 + i) for i in range(n)}
    alive, present = set(nodes), set(nodes)
    mem, t, removed = mb.PoolMemory(), 0.0, []  # (when, node) of each expiry removal begun
    for dt, k, flip in events:
        t += dt
        name = f"n{k % n}"
        if flip and name in alive:
            alive.discard(name)
        elif flip:
            alive.add(name)
            present.add(name)  # registered again: added again
        v = view([nodes[x] for x in sorted(alive)], [nodes[x] for x in sorted(set(nodes) - alive)])
        d = mb.decide(v, mem, present, t, share, up=(), fraction=fraction)
        mem = d.memory
        begun = [(t, x) for x in d.started if d.removing[x].cause == mb.EXPIRED]
        removed += begun
        present -= set(d.removing)  # deleted by the next tick
        if not begun:
            continue
        out = {x for t1, x in removed if t - t1 < mb.EXPIRY_WINDOW_S} | {
            x for x, rm in d.removing.items() if rm.cause == mb.EXPIRED}
        pool = len(present | out)
        assert len(out) <= max_ejected(pool, fraction), (t, sorted(out), pool)


# --- joining ---------------------------------------------------------------------------------------------------------
def test_a_joining_node_is_hidden_until_haproxy_has_it_up_or_it_waited_too_long():
    mem = mb.PoolMemory(joining={"a": 0.0, "b": 0.0})
    views = [{"a": srv("a", op=0), "b": srv("b")}]
    left = mb.joined(mem, views, 1.0)
    assert set(left.joining) == {"a"} and mb.hidden(left) == {"a"}
    assert mb.joined(left, views, mb.JOIN_TIMEOUT_S).joining == {}


# --- planning --------------------------------------------------------------------------------------------------------
def lines(changes):
    return [c.command.render() for c in changes]


def test_a_new_node_is_added_with_the_reflexes_checks_enabled_at_the_warm_up_weight_and_made_ready():
    d = decide(view([rec("a", 9001)]), mb.PoolMemory(), set(), 100.0, 0.3)
    add = settings_for({"s": srv("s", 9000, agent=CHK_ST_CONFIGURED | CHK_ST_ENABLED)}, {"s": 9401})
    changes, bad = mb.plan_endpoint("chat", BE, d, {"s": srv("s", 9000)}, {}, add)
    assert bad == {}
    assert lines(changes) == [
        f"add server {BE}/a 127.0.0.1:9001 weight 100 check inter 2s downinter 10s fall 3 rise 2 observe layer7 "
        "error-limit 5 on-error mark-down agent-check agent-addr 127.0.0.1 agent-port 9401 agent-inter 500ms",
        f"set server {BE}/a weight 10",  # slow_start_initial 10 % of 100, as policy.warm_up holds it
        f"enable health {BE}/a",
        f"enable agent {BE}/a",
        f"set server {BE}/a state ready"]
    assert [c.action for c in changes] == ["add", "", "", "", ""]


def test_no_agent_check_where_none_is_known_to_answer():
    """A dynamic server's agent starts DOWN: without a port the backend's servers use, or the record's own agent
    address, a new server gets the health check only."""
    d = decide(view([rec("a", 9001)]), mb.PoolMemory(), set(), 100.0, 0.3)
    changes, _ = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
    assert "agent" not in " ".join(lines(changes))
    own = replace(rec("a", 9001))
    object.__setattr__(own, "agent", "0.0.0.0:7001")  # a future record field: the node's agent address
    d = decide(view([own]), mb.PoolMemory(), set(), 100.0, 0.3)
    changes, _ = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
    assert "agent-addr 127.0.0.1 agent-port 7001" in lines(changes)[0]


def test_base_weight_is_the_backends_most_common_initial_weight():
    servers = {"s1": replace(srv("s1"), initial_weight=50), "s2": replace(srv("s2"), initial_weight=50),
               "s3": srv("s3")}
    add = settings_for(servers)
    assert (add.base_weight, add.warm_weight) == (50, 5)
    assert settings_for().base_weight == mb.DEFAULT_WEIGHT


def test_a_leaving_server_is_drained_then_deleted_once_its_connections_are_gone():
    d = decide(view([], [rec("a", state="leaving")]), mb.PoolMemory(), {"a"}, 0.0, 0.3)
    agent = CHK_ST_CONFIGURED | CHK_ST_ENABLED
    busy, _ = mb.plan_endpoint("chat", BE, d, {"a": srv("a", agent=agent)}, {"a": 3}, settings_for())
    assert lines(busy) == [f"set server {BE}/a state drain"]
    waiting, _ = mb.plan_endpoint("chat", BE, d, {"a": srv("a", admin=ADMF_FDRAIN, agent=agent)}, {"a": 1},
                                  settings_for())
    assert waiting == []
    idle, _ = mb.plan_endpoint("chat", BE, d, {"a": srv("a", admin=ADMF_FDRAIN, agent=agent)}, {"a": 0},
                               settings_for())
    assert lines(idle) == [f"disable agent {BE}/a", f"set server {BE}/a state maint", f"del server {BE}/a"]
    retry, _ = mb.plan_endpoint("chat", BE, d, {"a": srv("a", admin=ADMF_FMAINT, agent=CHK_ST_CONFIGURED)},
                                {"a": 0}, settings_for())
    assert lines(retry) == [f"del server {BE}/a"]
    unknown, _ = mb.plan_endpoint("chat", BE, d, {"a": srv("a", admin=ADMF_FDRAIN)}, {}, settings_for())
    assert unknown == []  # no session count: not deleted this tick


def test_a_cancelled_removal_returns_the_server_and_a_moved_node_gets_its_new_address():
    mem = mb.PoolMemory(removing={"a": mb.Removal(mb.EXPIRED, 0.0)})
    d = decide(view([rec("a", 9005), rec("b")]), mem, {"a", "b"}, 1.0, 0.3)
    servers = {"a": srv("a", 9005, admin=ADMF_FDRAIN), "b": srv("b", 9000, host="127.0.0.9")}
    changes, _ = mb.plan_endpoint("chat", BE, d, servers, {}, settings_for())
    assert lines(changes) == [f"set server {BE}/a state ready", f"set server {BE}/b addr 127.0.0.1 port 9000"]


def test_a_node_the_policy_holds_out_comes_back_drained_at_weight_0_and_a_healthy_one_as_before():
    """HAProxy restarted (its dynamic servers gone): a quarantined node is added drained, its policy state kept."""
    d = decide(view([rec("a", 9001), rec("b", 9002)]), mb.PoolMemory(), set(), 100.0, 0.3)
    states = {"a": NodeState(state=QUARANTINED, since=50.0, reason="latency outlier"), "b": NodeState()}
    changes, _ = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for(), states)
    assert lines(changes) == [
        f"add server {BE}/a 127.0.0.1:9001 weight 100 check inter 2s downinter 10s fall 3 rise 2 observe layer7 "
        "error-limit 5 on-error mark-down",
        f"set server {BE}/a weight 0",
        f"enable health {BE}/a",
        f"set server {BE}/a state drain",  # out of MAINT (its checks run), never ready
        f"add server {BE}/b 127.0.0.1:9002 weight 100 check inter 2s downinter 10s fall 3 rise 2 observe layer7 "
        "error-limit 5 on-error mark-down",
        f"set server {BE}/b weight 10",
        f"enable health {BE}/b",
        f"set server {BE}/b state ready"]
    assert "quarantined by the policy (latency outlier)" in changes[0].reason


def test_a_cancelled_removal_of_a_node_the_policy_holds_out_leaves_it_drained():
    mem = mb.PoolMemory(removing={"a": mb.Removal(mb.EXPIRED, 0.0), "b": mb.Removal(mb.EXPIRED, 0.0)})
    d = decide(view([rec("a"), rec("b", 9001)]), mem, {"a", "b"}, 1.0, 0.3)
    states = {"a": NodeState(state=QUARANTINED), "b": NodeState(state=QUARANTINED)}
    servers = {"a": srv("a", admin=ADMF_FMAINT), "b": srv("b", 9001, admin=ADMF_FDRAIN)}
    changes, _ = mb.plan_endpoint("chat", BE, d, servers, {}, settings_for(), states)
    assert lines(changes) == [f"set server {BE}/a state drain"]


def test_a_converged_pool_plans_nothing():
    d = decide(view([rec("a"), rec("b", 9001)]), mb.PoolMemory(), {"a", "b"}, 0.0, 0.3)
    servers = {"a": srv("a"), "b": srv("b", 9001), "static": srv("static", 9100)}
    assert mb.plan_endpoint("chat", BE, d, servers, {}, settings_for()) == ([], {})


@pytest.mark.parametrize("endpoint, ok", [("10.0.0.1:8000", ("10.0.0.1", 8000)), ("[::1]:8000", ("::1", 8000)),
                                          ("[0:0::1]:80", ("::1", 80)), ("vllm-1.internal:8000", None)])
def test_only_ip_endpoints_are_added(endpoint, ok):
    if ok is None:
        with pytest.raises(mb.BadEndpoint):
            mb.server_address(endpoint)
        r = replace(rec("a"), endpoint=endpoint)
        d = decide(view([r]), mb.PoolMemory(), set(), 0.0, 0.3)
        changes, bad = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
        assert changes == [] and "not an IP address" in bad["a"]
    else:
        assert mb.server_address(endpoint) == ok


def test_an_ipv6_server_is_matched_by_its_address():
    d = decide(view([replace(rec("a"), endpoint="[::1]:8000")]), mb.PoolMemory(), {"a"}, 0.0, 0.3)
    servers = {"a": ServerState(BE, "a", "[::1]:8000", 100, 100, 0, 2)}
    assert mb.plan_endpoint("chat", BE, d, servers, {}, settings_for()) == ([], {})


def test_rendering_refuses_an_unsafe_name():
    from grayguard.controller.haproxy import UnsafeNameError
    with pytest.raises(UnsafeNameError):
        mb.MemberCommand(BE, "a;shutdown", "del").render()


def test_an_agent_address_is_an_ip_never_a_name_haproxy_would_resolve():
    r = replace(rec("a", 9001), exporter="exporter-a.internal:9400")
    add = settings_for({"s": srv("s", agent=CHK_ST_CONFIGURED)}, {"s": 9401})
    assert add.agent(r) == ("127.0.0.1", 9401)  # the node's own address
    object.__setattr__(r, "agent", "10.1.2.3:7001")
    assert add.agent(r) == ("10.1.2.3", 7001)
    object.__setattr__(r, "agent", "[::]:7001")
    assert add.agent(r) == ("127.0.0.1", 7001)
