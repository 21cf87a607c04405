"""One active controller among several replicas: leader election on etcd leases, fencing, and the handover of
the node states (docs/architecture.md, "Leader election").

Leading a scope ("all", or one pool with registry.shard_pools) means holding the key <prefix>/leader/<scope>,
created with compare-and-create on this replica's own lease of registry.lease_ttl_s. The lease is renewed at the
start of every tick and by the run loop's keeper job (every third of the lease, so a long tick does not lose it);
a standby campaigns every tick. Fencing: every HAProxy batch is fenced by the scope's epoch kept in HAProxy
(controller/haproxy.py, Fence), read in the batch's own connection. A leader sets its epoch there ("claims" it)
only while the lease it last confirmed (from the monotonic time the renewal was *sent*, less CLOCK_MARGIN) outlasts
the claim; etcd can only expire the lease later than that, and no other replica can create the key before it does.
A leader that cannot renew (etcd unreachable) keeps its scopes and steers every HAProxy whose epoch is still its
own: another replica leads only through etcd, and sets its own epoch before its first write. Handover: before its
HAProxy writes the
leader puts the pool's states (the state file's JSON) to <prefix>/state/<pool> in a transaction guarded by its
leader key, so etcd never lags what HAProxy was told; a new leader loads them before its first tick.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from grayguard.controller.desired import desired_key
from grayguard.controller.haproxy import CLI_TIMEOUT_S, Fence, epoch_var
from grayguard.controller.leader_store import ElectionStore
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeState
from grayguard.controller.statefile import StateError, dump_states, load_states
from grayguard.registry import RegistryError

log = logging.getLogger("grayguard.leader")

SCOPE_ALL = "all"
CLOCK_MARGIN = 0.1  # share of a confirmed lease never counted on (clock rates differ by ppm: ample)
REPUBLISH_TICKS = 60  # unchanged states are published again this often (a key deleted by hand comes back)
CLAIM_MARGIN_S = 0.5  # a claim ends at most CLI_TIMEOUT_S after its epoch read; this much more is kept in hand


def leader_key(prefix: str, scope: str) -> str:
    return f"{prefix}/leader/{scope}"


def state_key(prefix: str, pool: str) -> str:
    return f"{prefix}/state/{pool}"


def replica_key(prefix: str, replica: str) -> str:
    return f"{prefix}/replicas/{replica}"


def replica_record(replica: str, scopes: Iterable[str]) -> str:
    """The value of a sharded replica's key: its id and the pools it lists (its config's)."""
    return json.dumps({"id": replica, "pools": sorted(scopes)}, separators=(",", ":"))


def parse_replica(value: str) -> tuple[str, frozenset[str] | None]:
    """(id, the pools it lists) from a replica key's value. Pools None: the value is a bare id (a replica of an
    earlier version), taken to list the same pools as the reader."""
    try:
        d = json.loads(value)
    except ValueError:
        return value, None
    if isinstance(d, dict) and isinstance(d.get("id"), str) and isinstance(d.get("pools"), list) \
            and all(isinstance(p, str) for p in d["pools"]):
        return d["id"], frozenset(d["pools"])
    return value, None


def assign(scopes: Iterable[str], replicas: Iterable[str], holders: Mapping[str, str],
           serves: Mapping[str, frozenset[str] | None] | None = None) -> dict[str, str]:
    """Each scope to one of the live replicas that list it (serves: replica -> its scopes; None or missing: every
    scope), balanced among the replicas that list the same scopes, moving as few as possible. Replicas whose pool
    lists differ (a rolling change of the config) still agree: each scope is decided among its own candidates,
    from what every candidate reads alike. Pure."""
    groups: dict[tuple[str, ...], list[str]] = {}
    reps = sorted(set(replicas))
    for s in sorted(set(scopes)):
        cands = tuple(r for r in reps if serves is None or serves.get(r) is None or s in serves[r])
        groups.setdefault(cands, []).append(s)
    out: dict[str, str] = {}
    for cands, group in groups.items():
        out.update(_balanced(group, cands, holders))
    return out


def _balanced(scopes: Iterable[str], replicas: Iterable[str], holders: Mapping[str, str]) -> dict[str, str]:
    """Each scope to one of the replicas, balanced (counts differ by at most one), moving as few as possible:
    a live holder keeps its scopes up to its fair share; the others go to the least loaded (then by id)."""
    scopes, reps = sorted(set(scopes)), sorted(set(replicas))
    if not reps:
        return {}
    base, extra = divmod(len(scopes), len(reps))
    count = dict.fromkeys(reps, 0)
    out: dict[str, str] = {}
    surplus = []
    for s in scopes:
        h = holders.get(s)
        if h in count and count[h] < base:
            out[s] = h
            count[h] += 1
        elif h in count:
            surplus.append(s)
    for s in surplus:  # a holder past its share keeps one more while the division leaves some over
        h = holders[s]
        if extra > 0 and count[h] == base:
            out[s] = h
            count[h] += 1
            extra -= 1
    for s in scopes:
        if s not in out:
            r = min(reps, key=lambda r: (count[r], r))
            out[s] = r
            count[r] += 1
    return out


@dataclass(frozen=True)
class Turn:
    """What this replica may do this tick."""

    led: frozenset[str]  # the pools it leads
    handover: dict[str, dict[str, NodeState] | None] = field(default_factory=dict)  # pools just taken: their
    # states from etcd ({}: unreadable, seed every node from HAProxy; None: never published, keep what it has)
    why: str = ""  # when it leads nothing: who does, or why it cannot tell
    ready: bool = False  # it reached the registry this tick and every scope has a leader (a standby ready to lead)


class Leadership:
    """This replica's side of the election for every scope; every etcd call goes through one lock."""

    def __init__(self, store: ElectionStore, replica_id: str, pools: Sequence[str], ttl_s: int, *, prefix: str,
                 shard: bool = False, metrics: ControllerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.id, self.pools, self.ttl, self.prefix = store, replica_id, tuple(pools), ttl_s, prefix
        self.shard, self.metrics, self.clock = shard, metrics, clock
        self.scopes = tuple(self.pools) if shard else (SCOPE_ALL,)
        self._io = threading.Lock()
        self._lease: int | None = None
        self._confirmed = -math.inf  # monotonic time the last renewal etcd answered was sent
        self._held: dict[str, int] = {}  # scope -> create_revision of this replica's leader key (replaced, not mutated)
        self._leaders: dict[str, str] = {}  # scope -> holder, as last read
        self._pending: set[str] = set()  # pools taken over whose states are not loaded yet
        self._published: dict[str, tuple[str, int]] = {}  # pool -> (text in etcd, ticks since it was put)
        self._error: str | None = None  # the registry trouble last logged (once per kind, until it clears)
        self._unconfirmed = False  # it leads with a lease it cannot confirm: it steers on HAProxy's epoch alone
        self._said: set[str] = set()  # "<op>: <kind>" of the registry errors logged since it last answered
        self._export()

    # ---- what the tick asks --------------------------------------------------------------------
    def begin_tick(self) -> Turn:
        """Renew the lease, campaign (and hand over past a fair share when sharded), load the states of pools just
        taken over; the pools this replica leads now."""
        with self._io:
            reached = self._renew() and self._campaign()
            self._check_fence()
            handover = self._load_pending()
            led = frozenset(p for p in self.pools if self.scope_of(p) in self._held) - self._pending
            ready = reached and all(s in self._leaders for s in self.scopes)
        self._export()
        return Turn(led, handover, "" if led else self._standby_why(), ready)

    def may_write(self, pool: str, budget_s: float) -> str | None:
        """None when this replica may send pool's HAProxy batches now: it leads it (each batch is then fenced in
        HAProxy: fence()); else why not. A lease confirmed for less than budget_s is renewed first, unless the
        registry did not answer the last call (the tick and the keeper job retry: no batch waits on it)."""
        if self.scope_of(pool) in self._held and self._error is None and self.valid_for() < budget_s:
            self.renew()
        if self.scope_of(pool) not in self._held:
            return f"replica {self.id} does not lead {self.scope_of(pool)} any more"
        return None

    def fence(self, pool: str, restore: bool = False) -> Fence:
        """What a batch of pool's needs of HAProxy's epoch: this replica's epoch if it leads the pool, the right to
        claim it while the confirmed lease outlasts a claim; restore: the batch may go where HAProxy has no epoch
        (membership put back after a restart). Not leading: only a restore can pass."""
        scope = self.scope_of(pool)
        var = epoch_var(self.prefix, scope)
        if scope not in self._held:
            return Fence(var, None, restore=restore)
        mine = self.epoch(scope)
        return Fence(var, mine, claim_until=self._claim_until(), restore=restore,
                     seen=lambda endpoint, gateway: self._gateway_seen(scope, mine, endpoint, gateway))

    def epoch(self, scope: str) -> int:
        """This replica's fencing epoch for a scope it leads: unique to its term (lease, the leader key's create
        revision, its id), so a term of an earlier etcd history (its data lost) never passes for this one."""
        text = f"{self._lease}:{self._held[scope]}:{self.id}"
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)  # 60 bits: an HAProxy sint

    def steering_unpublished(self, pool: str) -> bool:
        """Whether pool's HAProxy may be written although its states could not be put in etcd: it leads pool and
        etcd did not answer (the states go in once it does; a successor reseeds drains from HAProxy)."""
        return self.scope_of(pool) in self._held and self._error is not None

    def _claim_until(self) -> float:
        """Until when an epoch read may be followed by a claim: the claim reaches HAProxy at most CLI_TIMEOUT_S after
        its read (or HAProxy closes the connection unread), before the confirmed lease can end."""
        return self._confirmed + self.ttl * (1 - CLOCK_MARGIN) - CLI_TIMEOUT_S - CLAIM_MARGIN_S

    def publish(self, pool: str, states: Mapping[str, NodeState], desired: str | None = None) -> str | None:
        """Put pool's states in etcd, guarded by this replica's leader key (skipped when etcd has them already);
        None when etcd has them, else why not (then HAProxy must not be written for pool this tick). desired: the
        pool's desired HAProxy state for the actuators (controller/desired.py), put in the same transaction."""
        scope = self.scope_of(pool)
        try:
            text = dump_states({pool: dict(states)})
        except ValueError as e:
            return f"states not serializable: {e}"
        puts = {state_key(self.prefix, pool): text}
        if desired is not None:
            puts[desired_key(self.prefix, pool)] = desired
            text += "\0" + desired  # what was put, compared as one
        with self._io:
            rev = self._held.get(scope)
            if rev is None:
                return f"replica {self.id} does not lead {scope}"
            last = self._published.get(pool)
            if last is not None and last[0] == text and last[1] < REPUBLISH_TICKS:
                self._published[pool] = (text, last[1] + 1)
                return None
            if self._error is not None:  # this tick's renewal did not answer: no second wait on etcd in the tick
                return f"the states could not be put in etcd (it did not answer: {self._error})"
            try:
                ok = self.store.put_if_held(leader_key(self.prefix, scope), rev, puts)
            except RegistryError as e:
                self._registry_error("publish", e)
                return f"the states could not be put in etcd ({e.kind}): HAProxy is written only once they are"
            if not ok:
                self._lose({scope}, f"the leader key {leader_key(self.prefix, scope)} is not this replica's any more")
                return f"replica {self.id} does not lead {scope} any more"
            self._published[pool] = (text, 0)
        return None

    def renew(self) -> None:
        """Keep the lease alive (the keeper job calls this between ticks)."""
        with self._io:
            self._renew()
            self._check_fence()

    def valid_for(self) -> float:
        """Seconds the lease is still certainly alive (<= 0: it may have expired)."""
        return self._confirmed + self.ttl * (1 - CLOCK_MARGIN) - self.clock()

    def scope_of(self, pool: str) -> str:
        return pool if self.shard else SCOPE_ALL

    def close(self) -> None:
        """Resign: revoke the lease, so the keys go at once and a standby leads at its next tick."""
        with self._io:
            if self._lease is None:
                return
            try:
                self.store.revoke(self._lease)
                log.info("replica %s resigned (lease revoked)", self.id)
            except RegistryError as e:
                log.warning("replica %s: could not revoke its lease (%s); it expires within %ds", self.id, e, self.ttl)
            self._lease = None
            self._lose(set(self._held), "resigned")

    def status(self) -> dict:
        """For /status."""
        return {"id": self.id, "leads": sorted(self._held), "leaders": dict(sorted(self._leaders.items())),
                "lease_valid_for_s": round(max(self.valid_for(), 0.0), 3) if self._held else None,
                "steering_without_registry": bool(self._held) and self.valid_for() <= 0,
                "epochs": {s: self.epoch(s) for s in sorted(self._held)},
                "shard_pools": self.shard}

    # ---- the election --------------------------------------------------------------------------
    def _renew(self) -> bool:
        """Grant or renew the lease; True when etcd confirmed it now."""
        sent = self.clock()
        try:
            if self._lease is None:
                self._lease = self.store.grant(self.ttl)  # (sharded: _campaign registers the replica on it)
            elif self.store.keep_alive(self._lease) <= 0:
                self._lose(set(self._held), f"lost the lease: it expired on etcd (not renewed within {self.ttl}s)")
                self._lease = None
                return self._renew()  # a new lease, to campaign with at once
        except RegistryError as e:
            self._registry_error("lease", e)
            return False
        self._confirmed = sent
        self._registry_ok()
        return True

    def _check_fence(self) -> None:
        """A leader whose lease may have ended keeps its scopes on HAProxy's epoch alone (said once each way)."""
        unconfirmed = bool(self._held) and self.valid_for() <= 0
        if unconfirmed and not self._unconfirmed:
            age = self.clock() - self._confirmed
            log.warning("replica %s: the lease was not confirmed for %.1fs (%s): it steers %s only where HAProxy still "
                        "has its epoch (nobody else was elected since), and sets it nowhere", self.id, age,
                        self._error or "no answer", ", ".join(sorted(self._held)))
        elif self._unconfirmed and not unconfirmed and self._held:
            log.warning("replica %s: the lease is confirmed again: it leads %s as before", self.id,
                        ", ".join(sorted(self._held)))
        self._unconfirmed = unconfirmed
        self._export()

    def _gateway_seen(self, scope: str, mine: int, endpoint: str, gateway: int | None) -> None:
        """A fenced read: another epoch in HAProxy while this replica's lease may have ended means another replica
        was elected and claimed it (or HAProxy restarted: no epoch); the first loses the scope at once."""
        if gateway == mine or self.clock() < self._claim_until():
            return  # its own, or the lease is confirmed: a claim sets it
        if self.valid_for() > 0:
            return  # confirmed, for too short a claim: the next renewal gives one
        if self.metrics is not None:
            self.metrics.fence_refusals.labels(endpoint, "no_epoch" if gateway is None else "other_epoch").inc()
        if gateway is not None and scope in self._held and self._held_epoch(scope) == mine:
            with self._io:
                self._lose({scope}, f"HAProxy {endpoint} has epoch {gateway}, not this replica's {mine}: another "
                           "replica was elected and claimed it")

    def _campaign(self) -> bool:
        """Read who leads, campaign for what is this replica's to lead, hand over the rest; True when etcd answered."""
        try:
            entries, _ = self.store.get_prefix(leader_key(self.prefix, ""))
            replicas = {self.id}
            serves: dict[str, frozenset[str] | None] = {}
            if self.shard:
                present, _ = self.store.get_prefix(replica_key(self.prefix, ""))
                if replica_key(self.prefix, self.id) not in present:
                    self.store.put(replica_key(self.prefix, self.id), replica_record(self.id, self.scopes),
                                   lease=self._lease or 0)
                for e in present.values():
                    rid, listed = parse_replica(e.value)
                    replicas.add(rid)
                    serves[rid] = listed
                serves[self.id] = frozenset(self.scopes)
        except RegistryError as e:
            self._registry_error("read", e)
            return False
        view = {k.rsplit("/", 1)[1]: e for k, e in entries.items() if k.rsplit("/", 1)[1] in self.scopes}
        for scope, rev in sorted(self._held.items()):
            e = view.get(scope)
            if e is None or e.create_revision != rev:
                self._lose({scope}, "its leader key was deleted" if e is None else f"{e.value} holds the key now")
        for scope, e in sorted(view.items()):
            if e.lease == self._lease and scope not in self._held:  # still ours: etcd came back with the lease
                self._gain(scope, e.create_revision, "its key survived while etcd was unreachable")
        prev = dict(self._leaders)
        self._leaders = {s: e.value for s, e in view.items()}
        if self.shard:  # every scope any replica lists: replicas whose lists differ compute the same assignment
            owner = assign(set(self.scopes).union(*(p for p in serves.values() if p is not None)), replicas,
                           self._leaders, serves)
        else:
            owner = dict.fromkeys(self.scopes, self.id)
        for scope in self.scopes:
            if owner.get(scope) != self.id or scope in self._held or scope in view:
                continue
            try:
                c = self.store.campaign(leader_key(self.prefix, scope), self.id, self._lease or 0)
            except RegistryError as e:
                self._registry_error("campaign", e)
                return False
            if c.won:
                was = prev.get(scope)
                self._gain(scope, c.revision, f"took over from {was} (its key expired or was released)" if was
                           else "no replica led it")
            elif c.holder is not None:
                self._leaders[scope] = c.holder.value
        for scope, rev in sorted(self._held.items()):  # sharded: past the fair share, hand over to the assignee
            if owner.get(scope, self.id) != self.id:
                try:
                    if self.store.delete_if_held(leader_key(self.prefix, scope), rev):
                        self._lose({scope}, f"handed over to {owner[scope]} (balanced assignment)")
                except RegistryError as e:
                    self._registry_error("resign", e)
        return True

    def _load_pending(self) -> dict[str, dict[str, NodeState] | None]:
        out: dict[str, dict[str, NodeState] | None] = {}
        for pool in sorted(self._pending):
            try:
                entry = self.store.get(state_key(self.prefix, pool))
            except RegistryError as e:  # stays pending: the pool is not led until its states are known
                self._registry_error("load", e)
                continue
            self._pending.discard(pool)
            if entry is None:
                log.info("pool=%s: no states in etcd: starting from this replica's own (state file), the rest seeded "
                         "from HAProxy", pool)
                out[pool] = None
                continue
            try:
                out[pool] = load_states(entry.value).get(pool, {})
                log.info("pool=%s: %d node states loaded from etcd (revision %d)", pool, len(out[pool] or {}),
                         entry.mod_revision)
            except StateError as e:
                log.warning("pool=%s: the states in etcd are not valid (%s): every node is seeded from HAProxy",
                            pool, e)
                out[pool] = {}
        return out

    def _gain(self, scope: str, rev: int, why: str) -> None:
        self._held = {**self._held, scope: rev}
        self._pending |= {p for p in self.pools if self.scope_of(p) == scope}
        self._leaders[scope] = self.id
        log.warning("replica %s leads %s: %s", self.id, scope, why)
        self._changed()

    def _lose(self, scopes: set[str], why: str) -> None:
        scopes &= set(self._held)
        if not scopes:
            return
        self._held = {s: r for s, r in self._held.items() if s not in scopes}
        for p in self.pools:
            if self.scope_of(p) in scopes:
                self._pending.discard(p)
                self._published.pop(p, None)
        log.warning("replica %s stops leading %s: %s", self.id, ", ".join(sorted(scopes)), why)
        self._changed()

    def _held_epoch(self, scope: str) -> int | None:
        return self.epoch(scope) if scope in self._held else None

    def _changed(self) -> None:
        if self.metrics is not None:
            self.metrics.leader_changes.inc()
        self._export()

    def _export(self) -> None:
        if self.metrics is not None:
            self.metrics.controller_leader.labels(self.id).set(1 if self._held else 0)
            self.metrics.led_pools.labels(self.id).set(sum(1 for p in self.pools if self.scope_of(p) in self._held))
            self.metrics.steering_without_registry.labels(self.id).set(
                1 if self._held and self.valid_for() <= 0 else 0)

    def _standby_why(self) -> str:
        if self._lease is None or self._error:
            return f"replica {self.id} cannot reach the registry ({self._error or 'no lease'})"
        others = sorted({h for h in self._leaders.values() if h != self.id})
        return f"replica {self.id} stands by ({', '.join(others) or 'nobody'} leads)"

    def _registry_error(self, op: str, e: RegistryError) -> None:
        if self.metrics is not None:
            self.metrics.registry_errors.labels(op, e.kind).inc()
        text = f"{op}: {e}"
        if f"{op}: {e.kind}" not in self._said:  # once per operation and kind until the registry answers again
            self._said.add(f"{op}: {e.kind}")
            log.warning("replica %s: registry %s", self.id, text)
        self._error = text

    def _registry_ok(self) -> None:
        if self._error is not None:
            log.info("replica %s: registry answers again", self.id)
            self._error = None
            self._said.clear()
