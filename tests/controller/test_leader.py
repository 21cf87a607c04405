"""Leader election (controller/leader.py) on an in-memory etcd and a test clock: who leads, fencing within the lease,
takeover within the lease + one tick, the guarded handover of states, sharding. The same on a real etcd and a
real HAProxy: test_leader_e2e.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.controller.haproxy import CLI_TIMEOUT_S
from grayguard.controller.leader import (
    CLOCK_MARGIN,
    SCOPE_ALL,
    Leadership,
    assign,
    leader_key,
    parse_replica,
    replica_key,
    replica_record,
    state_key,
)
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeState
from grayguard.controller.statefile import dump_states
from grayguard.vocab import State
from tests.support.ctl_helpers import LAT_Q, RATE_Q, FakeHaproxy, FakeProm, fake_controller, samples
from tests.support.fake_etcd import Client, FakeEtcd

TTL = 5
PREFIX = "/gg"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def world():
    clock = Clock()
    return clock, FakeEtcd(clock)


def replica(world, rid, pools=("chat",), shard=False, metrics=None):
    clock, etcd = world
    client = Client(etcd, clock.advance)
    return Leadership(client, rid, list(pools), TTL, prefix=PREFIX, shard=shard, metrics=metrics, clock=clock), client


# ---- the assignment (pure) -------------------------------------------------------------------------------
@given(st.sets(st.sampled_from([f"p{i}" for i in range(12)])), st.sets(st.sampled_from("abcdef"), min_size=1),
       st.dictionaries(st.sampled_from([f"p{i}" for i in range(12)]), st.sampled_from("abcdefgh")))
def test_assign_gives_every_scope_one_live_replica_balanced_and_keeps_holders_within_their_share(scopes, reps, holders):
    out = assign(scopes, reps, holders)
    assert set(out) == scopes and set(out.values()) <= reps
    counts = [sum(1 for r in out.values() if r == x) for x in reps]
    assert max(counts) - min(counts) <= 1
    fair = -(-len(scopes) // len(reps))  # ceil
    for s, h in holders.items():  # a live holder within its fair share keeps the scope
        share = sum(1 for x, y in holders.items() if y == h and x in scopes)
        if s in scopes and h in reps and share <= len(scopes) // len(reps):
            assert out[s] == h
    if out:
        assert assign(scopes, reps, out) == out  # balanced already: nothing moves
    assert max(counts) <= fair


@given(st.sets(st.sampled_from([f"p{i}" for i in range(8)]), min_size=1),
       st.dictionaries(st.sampled_from("abcd"), st.one_of(st.none(), st.frozensets(st.sampled_from(
           [f"p{i}" for i in range(8)]))), min_size=1),
       st.dictionaries(st.sampled_from([f"p{i}" for i in range(8)]), st.sampled_from("abcdef")))
def test_assign_gives_a_scope_only_to_a_replica_that_lists_it_and_all_alike_is_the_plain_assignment(scopes, serves,
                                                                                                   holders):
    out = assign(scopes, serves, holders, serves)
    for s in scopes:
        cands = [r for r, p in serves.items() if p is None or s in p]
        assert (out.get(s) in cands) if cands else s not in out
    same = dict.fromkeys(serves, frozenset(scopes))
    assert assign(scopes, serves, holders, same) == assign(scopes, serves, holders)


def test_a_replica_key_holds_its_id_and_pools_and_a_bare_id_of_an_earlier_version_lists_everything():
    assert parse_replica(replica_record("ctl-1:42", ["p2", "p1"])) == ("ctl-1:42", frozenset({"p1", "p2"}))
    assert parse_replica("ctl-1:42") == ("ctl-1:42", None)
    assert parse_replica("123") == ("123", None)  # a numeric id is JSON, but not a record
    assert parse_replica('{"id": "x", "pools": [1]}') == ('{"id": "x", "pools": [1]}', None)


def test_assign_with_no_replica_assigns_nothing():
    assert assign(["a"], [], {}) == {}


# ---- one leader ------------------------------------------------------------------------------------------
def test_exactly_one_of_two_leads_and_the_standby_is_ready(world):
    ma, mb = ControllerMetrics.create(), ControllerMetrics.create()
    a, _ = replica(world, "a", metrics=ma)
    b, _ = replica(world, "b", metrics=mb)
    ta, tb = a.begin_tick(), b.begin_tick()
    assert ta.led == {"chat"} and ta.handover == {"chat": None}
    assert tb.led == frozenset() and tb.ready and "a leads" in tb.why
    assert ma.registry.get_sample_value("grayguard_controller_leader", {"id": "a"}) == 1
    assert mb.registry.get_sample_value("grayguard_controller_leader", {"id": "b"}) == 0
    assert ma.registry.get_sample_value("grayguard_controller_leader_changes_total") == 1
    assert a.may_write("chat", 2.0) is None and b.may_write("chat", 2.0) is not None


def test_standby_takes_over_within_the_lease_and_one_tick_after_the_leader_dies(world):
    clock, etcd = world
    a, _ = replica(world, "a")
    b, _ = replica(world, "b")
    a.begin_tick()
    b.begin_tick()
    died, tick = clock(), 1.0  # a's last renewal was just now
    while not b.begin_tick().led:
        clock.advance(tick)
        assert clock() - died <= TTL + tick, "no takeover within lease_ttl_s + one tick"
    assert etcd.kv[leader_key(PREFIX, SCOPE_ALL)].value == "b"


# ---- fencing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("renew_takes_s", [0.0, 1.5])
def test_a_leader_cut_off_from_etcd_never_claims_past_its_lease_and_stops_at_the_first_sight_of_the_new_epoch(
        world, renew_takes_s):
    clock, etcd = world
    a, ca = replica(world, "a")
    b, _ = replica(world, "b")
    a.begin_tick()
    b.begin_tick()
    ca.delay_s = renew_takes_s  # a slow answer: the lease counts from when the renewal was sent
    sent = clock()
    a.renew()
    ca.delay_s = 0.0
    ca.cut = True  # a partition: a cannot reach etcd, b can
    mine = a.epoch(SCOPE_ALL)
    last_claim = None
    while not b.begin_tick().led:
        f = a.fence("chat")
        assert f.epoch == mine and a.may_write("chat", 2.0) is None  # it goes on steering where HAProxy has `mine`
        if clock() < f.claim_until:
            last_claim = clock()
        clock.advance(0.1)
    # a claim's epoch reaches HAProxy at most CLI_TIMEOUT_S after its read: before a's lease could end anywhere
    assert last_claim is not None and last_claim + CLI_TIMEOUT_S <= sent + TTL * (1 - CLOCK_MARGIN) + 1e-9
    assert etcd.kv[leader_key(PREFIX, SCOPE_ALL)].value == "b"  # etcd expired a's lease; b leads
    theirs = b.fence("chat")
    assert theirs.epoch != mine and clock() < theirs.claim_until  # b may claim at once
    assert a.status()["steering_without_registry"] and a.begin_tick().led == {"chat"}
    a.fence("chat").seen("unix:/h1", mine)  # HAProxy still has a's epoch: b has not claimed it yet
    assert a.begin_tick().led == {"chat"}
    a.fence("chat").seen("unix:/h1", theirs.epoch)  # b claimed it: a stops at once
    assert a.begin_tick().led == frozenset() and a.fence("chat").epoch is None


def test_a_standby_cannot_pass_a_fence_but_may_restore_a_restarted_haproxy(world):
    a, _ = replica(world, "a")
    b, _ = replica(world, "b")
    a.begin_tick()
    b.begin_tick()
    f = b.fence("chat")
    assert f.epoch is None and not f.restore and f.claim_until == float("-inf")
    assert b.fence("chat", restore=True).restore  # the snapshot's members, only where HAProxy has no epoch
    assert a.fence("chat").var == b.fence("chat").var  # one epoch per scope, whoever writes


def test_each_term_has_its_own_epoch(world):
    a, _ = replica(world, "a")
    a.begin_tick()
    first = a.epoch(SCOPE_ALL)
    assert 0 < first < 2 ** 63 and a.fence("chat").epoch == first
    a.close()  # resigned: the next term is another
    a.begin_tick()
    assert a.epoch(SCOPE_ALL) != first


def test_a_leader_whose_lease_survived_an_etcd_outage_steered_through_it_and_keeps_its_term(world):
    clock, etcd = world
    m = ControllerMetrics.create()
    a, _ = replica(world, "a", metrics=m)
    a.begin_tick()
    mine = a.epoch(SCOPE_ALL)
    assert a.publish("chat", {"n1": NodeState(state=State.QUARANTINED, since=5.0)}) is None
    etcd.down = True
    clock.advance(TTL)  # etcd is down: nobody can confirm anything, and nobody else can be elected
    assert a.begin_tick().led == {"chat"} and a.may_write("chat", 0.1) is None
    assert a.steering_unpublished("chat") and clock() >= a.fence("chat").claim_until  # it never claims now
    assert m.registry.get_sample_value("grayguard_controller_steering_without_registry", {"id": "a"}) == 1
    a.fence("chat").seen("unix:/h1", None)  # a restarted HAProxy has no epoch: a cannot steer it, but keeps the rest
    assert a.begin_tick().led == {"chat"}
    assert m.registry.get_sample_value("grayguard_controller_fence_refusals_total",
                                       {"endpoint": "unix:/h1", "seen": "no_epoch"}) == 1
    etcd.down = False
    etcd.leases = {k: (ttl, clock() + ttl) for k, (ttl, _) in etcd.leases.items()}  # a restarted etcd renews leases
    turn = a.begin_tick()
    assert turn.led == {"chat"} and a.epoch(SCOPE_ALL) == mine and not a.steering_unpublished("chat")
    assert m.registry.get_sample_value("grayguard_controller_steering_without_registry", {"id": "a"}) == 0


# ---- handover --------------------------------------------------------------------------------------------
def test_a_deposed_leader_cannot_publish_and_the_new_one_loads_the_last_published_states(world):
    clock, etcd = world
    a, ca = replica(world, "a")
    b, _ = replica(world, "b")
    a.begin_tick()
    drained = {"n1": NodeState(state=State.QUARANTINED, since=900.0, weight=0, cause="latency")}
    assert a.publish("chat", drained) is None
    ca.cut = True
    clock.advance(TTL + 0.1)
    turn = b.begin_tick()
    assert turn.led == {"chat"} and turn.handover["chat"] == drained
    ca.cut = False  # a comes back, still believing: its guarded put fails in etcd itself
    assert SCOPE_ALL in a._held  # it has not noticed yet
    assert a.publish("chat", {"n1": NodeState()}) is not None
    assert etcd.kv[state_key(PREFIX, "chat")].value == dump_states({"chat": drained})


def test_invalid_states_in_etcd_seed_every_node_from_haproxy(world):
    _, etcd = world
    etcd._put(state_key(PREFIX, "chat"), '{"version": 1, "pools": {"chat": {"n1": {"state": "zombie"}}}}', 0)
    a, _ = replica(world, "a")
    assert a.begin_tick().handover == {"chat": {}}


def test_a_pool_whose_states_cannot_be_read_is_not_led_until_they_are(world):
    clock, _ = world
    a, ca = replica(world, "a")
    orig = ca.get
    ca.get = lambda key: (_ for _ in ()).throw(__import__("grayguard.registry").registry.RegistryError("timeout", "x"))
    assert a.begin_tick().led == frozenset()
    ca.get = orig
    clock.advance(1)
    assert a.begin_tick().led == {"chat"}


def test_unchanged_states_are_not_put_again_every_tick(world):
    a, ca = replica(world, "a")
    a.begin_tick()
    states = {"n1": NodeState()}
    for _ in range(5):
        assert a.publish("chat", states) is None
    assert ca.calls.count("put_if_held") == 1


# ---- sharding --------------------------------------------------------------------------------------------
POOLS = ("p1", "p2", "p3", "p4", "p5")


def led_by(reps) -> dict[str, set[str]]:
    return {r.id: {p for p in POOLS if r.scope_of(p) in r._held} for r in reps}


def rounds(world, reps, n=3):
    for _ in range(n):
        for r in reps:
            r.begin_tick()
        world[0].advance(1.0)


def test_sharded_pools_are_spread_evenly_and_a_dead_replicas_pools_are_taken_over(world):
    reps = [replica(world, rid, POOLS, shard=True)[0] for rid in "abc"]
    rounds(world, reps)
    owners = led_by(reps)
    assert sorted(len(v) for v in owners.values()) == [1, 2, 2]
    assert set().union(*owners.values()) == set(POOLS) and sum(map(len, owners.values())) == len(POOLS)
    dead = max(reps, key=lambda r: len(led_by([r])[r.id]))
    live = [r for r in reps if r is not dead]
    for _ in range(int(TTL) + 3):  # the dead one renews nothing
        rounds(world, live, 1)
    owners = led_by(live)
    assert sorted(len(v) for v in owners.values()) == [2, 3] and set().union(*owners.values()) == set(POOLS)


def test_a_joining_replica_gets_its_share_by_handover(world):
    reps = [replica(world, rid, POOLS, shard=True)[0] for rid in "ab"]
    rounds(world, reps)
    assert sorted(len(v) for v in led_by(reps).values()) == [2, 3]
    reps.append(replica(world, "c", POOLS, shard=True)[0])
    rounds(world, reps, 4)
    owners = led_by(reps)
    assert sorted(len(v) for v in owners.values()) == [1, 2, 2]
    assert sum(map(len, owners.values())) == len(POOLS)  # never two leaders of one pool


def test_replicas_whose_pool_lists_differ_leave_no_pool_unled_and_do_not_flap(world):
    # a rolling config change: b already has p6, a does not yet. Each used to balance its own list: p5 stayed unled.
    _, etcd = world
    a = replica(world, "a", POOLS + ("p0",), shard=True)[0]
    b = replica(world, "b", POOLS + ("p0", "p6"), shard=True)[0]
    rounds(world, [a, b], 5)
    every = POOLS + ("p0", "p6")
    held = {p: [r.id for r in (a, b) if r.scope_of(p) in r._held] for p in every}
    assert all(len(v) == 1 for v in held.values()), held
    assert held["p6"] == ["b"]
    assert sorted(len(r._held) for r in (a, b)) == [3, 4]
    before = {p: etcd.kv.get(leader_key(PREFIX, p)) for p in every}
    rounds(world, [a, b], 5)
    assert {p: etcd.kv.get(leader_key(PREFIX, p)) for p in every} == before  # the same keys: no hand-over
    assert parse_replica(etcd.kv[replica_key(PREFIX, "b")].value)[1] == frozenset(every)


# ---- the controller's gate -------------------------------------------------------------------------------
def gated_controllers(world, lat: dict[int, float]):
    """controller(rid) -> (Controller over fake seams, its FakeHaproxy, its etcd client); events: every call."""
    clock, _ = world
    events: list = []
    srv = [(f"node{i}", f"127.0.0.1:{9100 + i}", 100) for i in range(4)]

    def prom_answer(q):
        inner = q.removeprefix("timestamp(").removesuffix(")")
        values = {f"127.0.0.1:{9100 + i}": v for i, v in lat.items()}
        got = {k: 5.0 for k in values} if inner == RATE_Q else values if inner == LAT_Q else {}
        return samples({k: clock() for k in got} if inner != q else got, clock())

    def controller(rid):
        hap = FakeHaproxy("unix:/h1", {"vllm_chat": srv}, events)
        c = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [hap], FakeProm(prom_answer, events),
                            clock=clock, extra={"rules": {"control_interval": "30s"}})
        c.leadership, client = replica(world, rid)
        publish = client.put_if_held
        client.put_if_held = lambda *a: events.append(("publish", rid)) or publish(*a)
        return c, hap, client
    return controller, events


def test_a_standby_controller_neither_reads_prometheus_nor_writes_haproxy_and_the_leader_publishes_first(world):
    _, etcd = world
    controller, events = gated_controllers(world, {0: 0.2, 1: 0.02, 2: 0.02, 3: 0.02})
    a, hap_a, _ = controller("a")
    b, hap_b, _ = controller("b")
    a.tick()  # a leads: node0 (10x its peers) is drained at once (one sample a 30 s window: one observation)
    seen = len(events)
    res = b.tick()
    assert res.standby and "a leads" in res.standby and len(events) == seen  # no query, no HAProxy call
    writes = [i for i, e in enumerate(events) if e[0] == "apply"]
    drain = next(i for i in writes if any("node0 state drain" in c for c in events[i][2]))
    assert ("publish", "a") in events[:drain]  # the drain was in etcd before HAProxy heard of it
    assert hap_b.table != hap_a.table  # b never wrote its HAProxy
    assert etcd.kv[state_key(PREFIX, "chat")].value.count('"quarantined"') == 1


def test_with_etcd_unreachable_the_leader_steers_on_and_puts_the_states_once_etcd_answers(world):
    clock, etcd = world
    lat = {0: 0.02, 1: 0.02, 2: 0.02, 3: 0.02}
    controller, events = gated_controllers(world, lat)
    a, hap, client = controller("a")
    a.tick()
    client.cut = True  # etcd unreachable (HAProxy's fencing epoch guards the write: test_outage_e2e.py)
    lat[0] = 0.2
    clock.advance(1.0)
    res = a.tick()
    assert res.decisions["chat"].nodes["node0"].state.state == State.QUARANTINED
    assert hap.table[("vllm_chat", "node0")].drain and not res.errors  # steered: the tick is a success
    assert '"quarantined"' not in etcd.kv[state_key(PREFIX, "chat")].value
    client.cut = False
    clock.advance(1.0)
    a.tick()
    assert '"quarantined"' in etcd.kv[state_key(PREFIX, "chat")].value


def test_a_new_leader_keeps_a_drain_its_predecessor_made_without_etcd(world):
    """a drains node0 while etcd cannot take the states; b takes over with the older states (node0 healthy) and
    must not ready node0: it is seeded from HAProxy (quarantined), as a drain it cannot explain."""
    clock, etcd = world
    lat = {0: 0.02, 1: 0.02, 2: 0.02, 3: 0.02}
    controller, events = gated_controllers(world, lat)
    a, hap_a, client_a = controller("a")
    b, hap_b, _ = controller("b")
    hap_b.table = hap_a.table  # one HAProxy
    a.tick()
    b.tick()
    client_a.cut = True
    lat[0] = 0.2
    clock.advance(1.0)
    a.tick()
    assert hap_a.table[("vllm_chat", "node0")].drain
    lat[0] = 0.02  # node0 looks fine again: only its state keeps it out
    while not b.tick().decisions:
        clock.advance(1.0)
        assert clock() < 1000 + 4 * TTL
    assert hap_a.table[("vllm_chat", "node0")].drain
    assert b.states["chat"]["node0"].state == State.QUARANTINED


@pytest.mark.parametrize("behind", [0.0, 3600.0])
def test_a_new_leader_whose_clock_is_behind_its_predecessors_does_not_freeze_its_timers(world, behind):
    """a drains node0 and dies; b, whose wall clock is an hour behind a's, takes over with a's states, whose times
    are an hour in b's future. Before on_this_clock, b held node0 drained for that hour (its minimum quarantine
    counted from a time b's clock had not reached), and the pool's noise learned nothing. Now b's timers run from
    its own now: node0 goes to its canaries within min_quarantine_s (20 s) of b's takeover, as with no skew."""
    clock, etcd = world
    lat = {0: 0.02, 1: 0.02, 2: 0.02, 3: 0.02}
    controller, _ = gated_controllers(world, lat)
    a, hap_a, _ = controller("a")
    a.tick()
    lat[0] = 0.2
    clock.advance(1.0)
    a.tick()
    assert '"quarantined"' in etcd.kv[state_key(PREFIX, "chat")].value  # published
    b, hap_b, _ = controller("b")
    b.clock = lambda: clock() - behind  # b's controller clock; the leases are etcd's (the shared clock)
    hap_b.table = hap_a.table  # one HAProxy
    lat[0] = 0.02  # node0 is fine again: its canaries will say so
    b.tick()  # a stops ticking: its lease runs out
    while not b.tick().decisions:
        clock.advance(1.0)
        assert clock() < 1000 + 4 * TTL
    took = b.clock()
    s = b.states["chat"]["node0"]
    assert s.state == State.QUARANTINED and s.since <= took
    assert all(x.since <= took and (x.window.noise.at is None or x.window.noise.at <= took)
               for x in b.states["chat"].values())
    while b.states["chat"]["node0"].state == State.QUARANTINED:
        clock.advance(1.0)
        b.tick()
        assert b.clock() - took <= 21.0, "node0's quarantine counted from a time b's clock has not reached"
