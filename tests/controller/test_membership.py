"""controller/membership.py, pure: which registered nodes serve, which leave, the expiry cap, the runtime-API lines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import membership as mb
from controller.haproxy import ADMF_FDRAIN, ADMF_FMAINT, CHK_ST_CONFIGURED, CHK_ST_ENABLED, ServerState
from controller.policy import Policy
from grayguard.config import RecoveryConfig, ThresholdsConfig
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


# --- decide --------------------------------------------------------------------------------------------------------
def test_serving_registrations_are_wanted_and_a_graceful_leave_is_removed_at_once():
    v = view([rec("a"), rec("b", state="leaving")], [rec("c", state="leaving")])
    d = mb.decide(v, mb.PoolMemory(), {"a", "b", "c"}, 10.0, 0.3)
    assert set(d.wanted) == {"a"}
    assert {n: r.cause for n, r in d.removing.items()} == {"b": mb.LEFT, "c": mb.LEFT}
    assert d.held == () and set(d.started) == {"b", "c"}


def test_an_expiry_within_the_cap_is_removed_the_rest_held_and_released_a_minute_later():
    nodes = [rec(f"n{i}", 9000 + i) for i in range(10)]
    present = {r.node for r in nodes}
    v = view([], nodes)  # every lease ended at once
    d = mb.decide(v, mb.PoolMemory(), present, 0.0, 0.3)
    assert d.cap == 3 and len(d.removing) == 3 and len(d.held) == 7
    d2 = mb.decide(v, d.memory, present, 59.0, 0.3)
    assert set(d2.removing) == set(d.removing) and d2.held == d.held and d2.started == ()
    d3 = mb.decide(v, d2.memory, present, 60.0, 0.3)
    assert len(d3.removing) == 6 and len(d3.held) == 4


def test_a_lone_crash_in_a_small_pool_is_removed_and_share_0_never_removes_an_expiry():
    v = view([rec("a")], [rec("b")])
    assert set(mb.decide(v, mb.PoolMemory(), {"a", "b"}, 0.0, 0.3).removing) == {"b"}
    d = mb.decide(v, mb.PoolMemory(), {"a", "b"}, 0.0, 0.0)
    assert d.removing == {} and d.held == ("b",)


def test_a_frozen_view_begins_no_removal_but_finishes_those_begun():
    v = view([rec("a", state="leaving")], [rec("b"), rec("c")], fresh=False)
    mem = mb.PoolMemory(removing={"c": mb.Removal(mb.EXPIRED, 0.0)}, expiries=(0.0,))
    d = mb.decide(v, mem, {"a", "b", "c"}, 5.0, 0.7)
    assert set(d.removing) == {"c"} and d.started == ()
    assert d.held == ()  # b waits for a fresh view: within the cap (2 a minute, c was 1), it is not held by it
    d = mb.decide(replace(v, fresh=True), d.memory, {"a", "b", "c"}, 6.0, 0.7)
    assert d.started == ("a", "b")


def test_a_node_registered_again_cancels_its_removal_and_a_deleted_server_ends_it():
    mem = mb.PoolMemory(removing={"a": mb.Removal(mb.EXPIRED, 0.0), "b": mb.Removal(mb.LEFT, 0.0)})
    d = mb.decide(view([rec("a")], [rec("b", state="leaving")]), mem, {"a"}, 1.0, 0.3)
    assert d.cancelled == ("a",) and d.removing == {} and set(d.wanted) == {"a"}


def test_servers_the_registry_never_named_are_left_alone():
    d = mb.decide(view([rec("a")]), mb.PoolMemory(), {"a", "static1"}, 0.0, 0.3)
    assert d.removing == {} and d.held == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 9)), min_size=1, max_size=40),
       st.floats(0.0, 1.0), st.integers(1, 12))
def test_expiries_never_remove_more_than_the_cap_in_any_minute(events, share, n):
    """Random expiries and re-registrations over time: within any 60 s window the removals begun by expiry stay
    within the cap of the largest pool seen in it."""
    nodes = {f"n{i}": rec(f"n{i}", 9000 + i) for i in range(n)}
    alive, gone = set(nodes), set()
    mem, t, begun, caps = mb.PoolMemory(), 0.0, [], []
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
        d = mb.decide(v, mem, set(nodes), t, share)
        mem = d.memory
        begun += [(t, x) for x in d.started if d.removing[x].cause == mb.EXPIRED]
        caps.append(mb.expiry_cap(share, n))
    for t0, _ in begun:
        in_window = [x for t1, x in begun if t0 <= t1 < t0 + mb.EXPIRY_WINDOW_S]
        assert len(in_window) <= max(caps)


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
    d = mb.decide(view([rec("a", 9001)]), mb.PoolMemory(), set(), 100.0, 0.3)
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
    d = mb.decide(view([rec("a", 9001)]), mb.PoolMemory(), set(), 100.0, 0.3)
    changes, _ = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
    assert "agent" not in " ".join(lines(changes))
    own = replace(rec("a", 9001))
    object.__setattr__(own, "agent", "0.0.0.0:7001")  # a future record field: the node's agent address
    d = mb.decide(view([own]), mb.PoolMemory(), set(), 100.0, 0.3)
    changes, _ = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
    assert "agent-addr 127.0.0.1 agent-port 7001" in lines(changes)[0]


def test_base_weight_is_the_backends_most_common_initial_weight():
    servers = {"s1": replace(srv("s1"), initial_weight=50), "s2": replace(srv("s2"), initial_weight=50),
               "s3": srv("s3")}
    add = settings_for(servers)
    assert (add.base_weight, add.warm_weight) == (50, 5)
    assert settings_for().base_weight == mb.DEFAULT_WEIGHT


def test_a_leaving_server_is_drained_then_deleted_once_its_connections_are_gone():
    d = mb.decide(view([], [rec("a")]), mb.PoolMemory(), {"a"}, 0.0, 0.3)
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
    d = mb.decide(view([rec("a", 9005), rec("b")]), mem, {"a", "b"}, 1.0, 0.3)
    servers = {"a": srv("a", 9005, admin=ADMF_FDRAIN), "b": srv("b", 9000, host="127.0.0.9")}
    changes, _ = mb.plan_endpoint("chat", BE, d, servers, {}, settings_for())
    assert lines(changes) == [f"set server {BE}/a state ready", f"set server {BE}/b addr 127.0.0.1 port 9000"]


def test_a_converged_pool_plans_nothing():
    d = mb.decide(view([rec("a"), rec("b", 9001)]), mb.PoolMemory(), {"a", "b"}, 0.0, 0.3)
    servers = {"a": srv("a"), "b": srv("b", 9001), "static": srv("static", 9100)}
    assert mb.plan_endpoint("chat", BE, d, servers, {}, settings_for()) == ([], {})


@pytest.mark.parametrize("endpoint, ok", [("10.0.0.1:8000", ("10.0.0.1", 8000)), ("[::1]:8000", ("::1", 8000)),
                                          ("[0:0::1]:80", ("::1", 80)), ("vllm-1.internal:8000", None)])
def test_only_ip_endpoints_are_added(endpoint, ok):
    if ok is None:
        with pytest.raises(mb.BadEndpoint):
            mb.server_address(endpoint)
        r = replace(rec("a"), endpoint=endpoint)
        d = mb.decide(view([r]), mb.PoolMemory(), set(), 0.0, 0.3)
        changes, bad = mb.plan_endpoint("chat", BE, d, {}, {}, settings_for())
        assert changes == [] and "not an IP address" in bad["a"]
    else:
        assert mb.server_address(endpoint) == ok


def test_an_ipv6_server_is_matched_by_its_address():
    d = mb.decide(view([replace(rec("a"), endpoint="[::1]:8000")]), mb.PoolMemory(), {"a"}, 0.0, 0.3)
    servers = {"a": ServerState(BE, "a", "[::1]:8000", 100, 100, 0, 2)}
    assert mb.plan_endpoint("chat", BE, d, servers, {}, settings_for()) == ([], {})


def test_rendering_refuses_an_unsafe_name():
    from controller.haproxy import UnsafeNameError
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
