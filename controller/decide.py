"""The decide step of a tick, pure: plain observations of every pool in, decisions and next states out.

The shell (controller/loop.py) observes (HAProxy, Prometheus, canaries), calls `decide_tick`, then plans and
acts. Nothing here reads a socket, a clock or the Controller: `now` and every observation are parameters,
so a tick can be tested on hand-built observations.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from grayguard.config import PoolConfig
from grayguard.controller import canary
from grayguard.controller.haproxy import ServerState
from grayguard.controller.policy import NodeInput, NodeState, Policy, Pool, PoolDecision, decide_pools
from grayguard.controller.scoring import usable
from grayguard.promclient import Sample, finite
from grayguard.vocab import POOL_LABEL as POOL_LABEL  # re-exported: the controller's import

# the optional signals (signals.<name>_query); a failing or empty one is absent, never zero
OPTIONAL = ("probe_result", "probe_ttft", "probe_failures", "error_ratio", "kv_cache", "gpu_throttled",
            "pcie_degraded", "gpu_ecc", "gpu_xid", "peer_group", "live_itl", "live_ttft", "probe_ttft_median",
            "live_prefill_rate", "live_decode_batch")


@dataclass(frozen=True)
class CanaryRound:
    """One canary round as sent: the node, its reference peers, and each target's TTFT (None: failed)."""

    node: str
    peers: tuple[str, ...]
    ttft: Mapping[str, float | None]
    # when it was sent, on the tick's clock (a round runs off the tick and is decided on a later one: the node's
    # last_canary is this); None: this tick
    at: float | None = None
    # each peer's window latency (NodeState.ema) when it was sent; None: the previous states'
    emas: Mapping[str, float] | None = None


@dataclass(frozen=True)
class PoolObservation:
    """What the shell saw of one pool this tick."""

    servers: Mapping[str, ServerState]  # the tier's view of every HAProxy endpoint that answered (plan.tier_view)
    prev: Mapping[str, NodeState]  # the states after the previous tick
    canaries: Sequence[CanaryRound] = ()
    # pool_data of this tick's samples, servers, max age, when the shell has it already (it
    # checks every pool's data before the canaries); None: decide_tick computes it
    data: PoolData | None = None


@dataclass(frozen=True)
class Observation:
    """Everything one tick decides on; pools without an observation (no backend) are not decided."""

    now: float
    # "latency" and "rate"; "latency_timestamp" and "rate_timestamp" (optional): `timestamp()` of the same
    # queries, each sample's value the time of the data and its timestamp Prometheus' evaluation time
    samples: Mapping[str, Sequence[Sample]]
    optional: Mapping[str, Sequence[Sample]]  # OPTIONAL name -> samples; a missing name is absent
    pools: Mapping[str, PoolObservation]  # pool name -> observation
    max_age_s: float = math.inf  # stale_after_s: older data is no data


@dataclass(frozen=True)
class PoolOutcome:
    """One pool's decision, the states to keep until the next tick, and each canary's outcome."""

    decision: PoolDecision
    states: dict[str, NodeState]
    canaries: list[tuple[str, str]] = field(default_factory=list)  # (node, failed|measured|no_reference)


def series_keys(pool: PoolConfig, server: ServerState) -> tuple[str, ...]:
    """The values of the pool's series label that name this node: pools[].servers.<n>.series, else its
    hostname:port (a server configured by name, srv_fqdn) and its address ([v6]:port for IPv6)."""
    o = pool.servers.get(server.name)
    if o and o.series:
        return (o.series,)
    port = server.address.rpartition(":")[2]
    return (f"{server.fqdn}:{port}", server.address) if server.fqdn else (server.address,)


def series_key(pool: PoolConfig, server: ServerState) -> str:
    """The node's first series key (series_keys): the one its metrics are labelled with."""
    return series_keys(pool, server)[0]


NO_DATA_REASONS = ("conflict", "stale", "unmatched", "idle")  # why a node has no usable data (PoolData.without)


@dataclass(frozen=True)
class PoolData:
    """The pool's own latency and request-rate samples matched to its servers, and which nodes have no data."""

    latency: dict[str, float]  # node -> value: one series of the pool, fresh
    rate: dict[str, float]
    with_data: tuple[str, ...]  # nodes the controller can score (fresh latency, requests in the window)
    # node -> why it has no usable data: conflict (two series for its key), stale (older than stale_after_s,
    # or of unknown age), unmatched (no series of the pool names it), idle (no latency, or no requests in the window)
    without: dict[str, str]
    held: str | None = None  # why the pool holds every weight (not one node has fresh data), None: decide
    latency_at: dict[str, float] = field(default_factory=dict)  # node -> its latency sample's own timestamp


def _ident(labels: Mapping[str, str]) -> frozenset:
    """A series' identity in its timestamp() query: its labels but the metric name (timestamp() drops it).
    A tick builds one per timestamp sample and matched node: a copy and frozenset(items()) run in C, where a
    generator over the labels would not."""
    if "__name__" in labels:
        labels = dict(labels)
        del labels["__name__"]
    return frozenset(labels.items())


class _Conflict:
    """Two or more series for one node (own_series, _node_series): which one is its own would be a guess."""

    def __repr__(self) -> str:
        return "CONFLICT"


CONFLICT = _Conflict()


def own_series(pool: PoolConfig, samples: Sequence[Sample]) -> dict[str, Sample | _Conflict]:
    """The pool's own sample of each series key, CONFLICT for a key with two or more: a series labelled with
    another pool is never this pool's (a global view shares `instance` values across pools); one without a
    `pool` label is matched by key alone. One sample per key, not a list: every query of every pool comes
    through here, and a node takes a key's sample only when it is the only one."""
    out: dict[str, Sample | _Conflict] = {}
    label, name = pool.series_label, pool.name
    for s in samples:
        labels = s.labels
        key = labels.get(label)
        if key is not None and labels.get(POOL_LABEL, name) == name:
            out[key] = CONFLICT if key in out else s
    return out


def by_pool(samples: Mapping[str, Sequence[Sample]]) -> dict[str, dict[str | None, list[Sample]]]:
    """Each query's samples grouped by their `pool` label (None: no pool label), once per tick: a pool then looks
    at its own series and the unlabelled ones, not at the whole fleet's (pools x nodes, quadratic, at scale)."""
    out: dict[str, dict[str | None, list[Sample]]] = {}
    for name, seq in samples.items():
        groups: defaultdict[str | None, list[Sample]] = defaultdict(list)  # every sample of the tick: no setdefault
        for s in seq:
            groups[s.labels.get(POOL_LABEL)].append(s)
        out[name] = dict(groups)  # plain: looking up a pool without series must not add it
    return out


def pool_samples(grouped: Mapping[str, Mapping[str | None, list[Sample]]], pool: str) -> dict[str, list[Sample]]:
    """What own_series could take for `pool` from each query (by_pool's groups): its series and the unlabelled ones.
    pool_data, signal_maps and node_inputs give the same answers on these as on the whole answers."""
    return {name: [*g.get(pool, ()), *g.get(None, ())] for name, g in grouped.items()}


def _node_series(by_key: Mapping[str, Sample | _Conflict], keys: Sequence[str]) -> Sample | _Conflict | None:
    """A node's one sample by its series keys (distinct, _keys; by_key: own_series): None if it has none,
    CONFLICT if two (two series for one key, or one for each of two keys)."""
    if len(keys) == 1:
        return by_key.get(keys[0])
    got = [by_key[k] for k in keys if k in by_key]
    return got[0] if len(got) == 1 else CONFLICT if got else None


def _one_each(by_key: Mapping[str, Sample | _Conflict], keys: Mapping[str, tuple[str, ...]]) -> dict[str, Sample]:
    """Node -> its one sample (by_key: own_series), in server order; a node with none or a conflict has none."""
    out = {}
    for n, ks in keys.items():
        s = by_key.get(ks[0]) if len(ks) == 1 else _node_series(by_key, ks)  # one key (most nodes): no call
        if s is not None and s is not CONFLICT:
            out[n] = s
    return out


def _keys(pool: PoolConfig, servers: Mapping[str, ServerState]) -> dict[str, tuple[str, ...]]:
    """Each server's distinct series keys, once per pool and tick (not once per signal)."""
    out = {}
    for n, srv in servers.items():
        keys = series_keys(pool, srv)
        out[n] = keys if len(keys) == 1 else tuple(dict.fromkeys(keys))  # one key: most servers, nothing to dedupe
    return out


def pool_data(pool: PoolConfig, servers: Mapping[str, ServerState], samples: Mapping[str, Sequence[Sample]],
              max_age_s: float = math.inf, keys: Mapping[str, tuple[str, ...]] | None = None) -> PoolData:
    """Match the pool's latency and rate series to its servers; drop what cannot be trusted.

    A node with two series for its key has no data (which one is its own is a guess); a series older than
    max_age_s (its age: Prometheus' evaluation time minus the data's own timestamp, both Prometheus' clock)
    is no data; a pool where not one node has a fresh series holds.
    keys: _keys(pool, servers), if the caller has them.
    """
    vals: dict[str, dict[str, float]] = {"latency": {}, "rate": {}}
    without: dict[str, str] = {}
    latency_at: dict[str, float] = {}
    keys = keys if keys is not None else _keys(pool, servers)
    for name in ("latency", "rate"):
        by_key = own_series(pool, samples.get(name, ()))
        ts = samples.get(f"{name}_timestamp")
        # each series' timestamp() sample (its value the data's time, its timestamp the evaluation's), by identity;
        # of two with one identity the last counts
        stamped = None if ts is None else {_ident(s.labels): s for s in ts}
        for n in servers:
            got = _node_series(by_key, keys[n])
            if got is CONFLICT:
                without[n] = "conflict"
            elif got is not None and without.get(n) != "conflict":
                if stamped is None:  # no timestamp() answer at all: the age is not checked
                    age, at = 0.0, None
                else:
                    t = stamped.get(_ident(got.labels))
                    age, at = (None, None) if t is None else (t.timestamp - t.value, t.value)
                if age is None or not age <= max_age_s:  # unknown (or NaN) age is not trusted either
                    without[n] = "stale"
                else:
                    vals[name][n] = got.value
                    if name == "latency" and at is not None and math.isfinite(at):
                        latency_at[n] = at
    with_data = []
    for n in servers:
        if n in without:
            vals["latency"].pop(n, None)
            vals["rate"].pop(n, None)
        elif n not in vals["latency"] and n not in vals["rate"]:
            without[n] = "unmatched"
        elif usable(vals["latency"].get(n)) and vals["rate"].get(n, math.inf) > 0:
            with_data.append(n)
        else:
            without[n] = "idle"
    fresh = set(vals["latency"]) | set(vals["rate"])
    held = None
    if servers and not fresh:
        what = {"stale": f"stale: data older than {max_age_s:g}s or of unknown age", "conflict": "conflict: two "
                "series for one node", "unmatched": "unmatched: no series of the pool names the server"}
        counts = {r: sum(1 for v in without.values() if v == r) for r in what}
        held = "no node has fresh data (" + "; ".join(f"{c} {what[r]}" for r, c in counts.items() if c) + ")"
    latency_at = {n: a for n, a in latency_at.items() if n in vals["latency"]}
    return PoolData(vals["latency"], vals["rate"], tuple(with_data), dict(sorted(without.items())), held, latency_at)


def canary_groups(pool: PoolConfig, servers: Mapping[str, ServerState]) -> dict[str, str | None]:
    """Configured peer group of each server (reference canaries stay within it)."""
    return {n: (pool.servers[n].peer_group if n in pool.servers else None) for n in servers}


def canary_estimates(rounds: Sequence[CanaryRound], prev: Mapping[str, NodeState]
                     ) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Latency estimates (normalized-latency units) of the canaried nodes, and each round's outcome."""
    est: dict[str, float] = {}
    outcomes = []
    for r in rounds:
        node_ttft = r.ttft.get(r.node)
        emas = [r.emas[m] for m in r.peers] if r.emas is not None else [prev[m].ema for m in r.peers]
        e = canary.canary_estimate(node_ttft, [r.ttft.get(m) for m in r.peers], emas)  # type: ignore[arg-type]
        if e is not None:
            est[r.node] = e
        outcomes.append((r.node, "failed" if node_ttft is None else "measured" if e is not None else "no_reference"))
    return est, outcomes


def signal_maps(pool: PoolConfig, servers: Mapping[str, ServerState], optional: Mapping[str, Sequence[Sample]],
                keys: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, dict]:
    """Node -> value for every optional signal (probe_result and peer_group map to label values), from the
    pool's own series; a node with two series for one signal has none (absent, never a guess). probe_at: the send
    time of the probe probe_result shows, where its value is one (the shipped query's; 1: unknown).
    keys: _keys(pool, servers), if the caller has them."""
    out: dict[str, dict] = {}
    keys = keys if keys is not None else _keys(pool, servers)
    for name in OPTIONAL:
        samples = optional.get(name, ())
        if name == "probe_result":  # 1, or the time the probe shown was sent (the shipped query: its identity)
            samples = [s for s in samples if 1 <= s.value < math.inf]
        if name == "peer_group" and not pool.peer_group_label:
            samples = ()
        one = _one_each(own_series(pool, samples), keys) if samples else {}  # an absent signal: nothing to match
        if name == "probe_result":
            out[name] = {n: s.labels.get("result") for n, s in one.items()}
            out["probe_at"] = {n: s.value for n, s in one.items() if s.value > 1}
        elif name == "peer_group":
            out[name] = {n: s.labels.get(pool.peer_group_label or "") for n, s in one.items()}
        else:
            out[name] = {n: s.value for n, s in one.items()}
    return out


def node_inputs(pool: PoolConfig, servers: Mapping[str, ServerState], samples: Mapping[str, Sequence[Sample]],
                optional: Mapping[str, Sequence[Sample]], canaries: Mapping[str, float],
                data: PoolData | None = None, keys: Mapping[str, tuple[str, ...]] | None = None,
                canary_at: Mapping[str, float] | None = None) -> dict[str, NodeInput]:
    """The policy's input for every server of the pool, matched to the pool's own samples by series key.
    keys: _keys(pool, servers), if the caller has them; canary_at: when each canary was sent (absent: now)."""
    keys = keys if keys is not None else _keys(pool, servers)
    canary_at = canary_at or {}
    data = data or pool_data(pool, servers, samples, keys=keys)
    lat, rate = data.latency, data.rate  # by node
    sig = signal_maps(pool, servers, optional, keys)  # by node
    inputs = {}
    for n, s in servers.items():
        key = n  # every map above is by node name (pool_data and signal_maps match series keys)
        o = pool.servers.get(n)
        inputs[n] = NodeInput(
            base_weight=s.initial_weight, latency=lat.get(key), latency_at=data.latency_at.get(key),
            request_rate=rate.get(key),
            peer_group=(o.peer_group if o and o.peer_group else sig["peer_group"].get(key)),
            canary=canaries.get(n), canary_at=canary_at.get(n), hold=s.maint, down=s.down,
            gateway_marked_down=s.marked_down_for_errors,
            gateway_errors=s.hanafail, agent_down=s.agent_down, agent_off=s.agent_off,
            agent_why=s.agent_text if s.agent_down else None,
            haproxy_weight=s.weight, haproxy_drain=s.drain,
            probe_result=sig["probe_result"].get(key), probe_ttft=finite(sig["probe_ttft"].get(key)),
            probe_failures=_int(sig["probe_failures"].get(key)), probe_at=sig["probe_at"].get(key),
            error_ratio=finite(sig["error_ratio"].get(key)), kv_cache_usage=finite(sig["kv_cache"].get(key)),
            gpu_throttled=_flag(sig["gpu_throttled"].get(key)), pcie_degraded=_flag(sig["pcie_degraded"].get(key)),
            gpu_ecc_uncorrectable=_flag(sig["gpu_ecc"].get(key)), gpu_xid=_flag(sig["gpu_xid"].get(key)),
            live_itl=finite(sig["live_itl"].get(key)), live_ttft=finite(sig["live_ttft"].get(key)),
            probe_ttft_median=finite(sig["probe_ttft_median"].get(key)),
            live_prefill_rate=finite(sig["live_prefill_rate"].get(key)),
            live_decode_batch=finite(sig["live_decode_batch"].get(key)))
    return inputs


def decide_tick(obs: Observation, pools: Sequence[PoolConfig], policies: Mapping[str, Policy]
                ) -> dict[str, PoolOutcome]:
    """Every observed pool's decision, in config order (decided together: policy.decide_pools)."""
    asked: list[tuple[str, list[tuple[str, str]], Pool]] = []  # (pool, its canaries' outcomes, what it decides on)
    samples, optional = by_pool(obs.samples), by_pool(obs.optional)
    for pool in pools:
        po = obs.pools.get(pool.name)
        if po is None:
            continue
        own = pool_samples(samples, pool.name)
        keys = _keys(pool, po.servers)  # once for pool_data and node_inputs
        data = po.data or pool_data(pool, po.servers, own, obs.max_age_s, keys)
        if data.held:  # no fresh data at all: hold every weight of the pool (the shell logs and counts it)
            continue
        est, outcomes = canary_estimates(po.canaries, po.prev)
        at = {r.node: r.at for r in po.canaries if r.at is not None}
        inputs = node_inputs(pool, po.servers, own, pool_samples(optional, pool.name), est, data, keys, at)
        asked.append((pool.name, outcomes, (po.prev, inputs, policies[pool.name])))
    decided = decide_pools([a[2] for a in asked], obs.now)
    return {name: PoolOutcome(d, {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}, outcomes)
            for (name, outcomes, _), d in zip(asked, decided, strict=True)}


def _flag(v: float | None) -> bool | None:
    return None if v is None or v != v else v > 0


def _int(v: float | None) -> int | None:
    return None if v is None or not math.isfinite(v) else int(v)
