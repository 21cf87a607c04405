"""The decide step of a tick, pure: plain observations of every pool in, decisions and next states out.

The shell (controller/loop.py) observes (HAProxy, Prometheus, canaries), calls `decide_tick`, then plans and
acts. Nothing here reads a socket, a clock or the Controller: `now` and every observation are parameters,
so a tick can be tested on hand-built observations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controller import canary
from controller.haproxy import ServerState
from controller.policy import NodeInput, NodeState, Policy, PoolDecision, decide_pool
from grayguard.config import PoolConfig
from grayguard.promclient import Sample, finite

# the optional signals (signals.<name>_query); a failing or empty one is absent, never zero
OPTIONAL = ("probe_result", "probe_ttft", "probe_failures", "error_ratio", "kv_cache", "gpu_throttled",
            "pcie_degraded", "gpu_ecc", "gpu_xid", "peer_group")


@dataclass(frozen=True)
class CanaryRound:
    """One canary round as sent: the node, its reference peers, and each target's TTFT (None: failed)."""

    node: str
    peers: tuple[str, ...]
    ttft: Mapping[str, float | None]


@dataclass(frozen=True)
class PoolObservation:
    """What the shell saw of one pool this tick."""

    servers: Mapping[str, ServerState]  # the first HAProxy endpoint that answered: server -> state
    prev: Mapping[str, NodeState]  # the states after the previous tick
    canaries: Sequence[CanaryRound] = ()


@dataclass(frozen=True)
class Observation:
    """Everything one tick decides on; pools without an observation (no backend) are not decided."""

    now: float
    samples: Mapping[str, Sequence[Sample]]  # "latency" and "rate"
    optional: Mapping[str, Sequence[Sample]]  # OPTIONAL name -> samples; a missing name is absent
    pools: Mapping[str, PoolObservation]  # pool name -> observation


@dataclass(frozen=True)
class PoolOutcome:
    """One pool's decision, the states to keep until the next tick, and each canary's outcome."""

    decision: PoolDecision
    states: dict[str, NodeState]
    canaries: list[tuple[str, str]] = field(default_factory=list)  # (node, failed|measured|no_reference)


def series_key(pool: PoolConfig, server: ServerState) -> str:
    """The node's value of the pool's series label in Prometheus (pools[].servers.<n>.series, or its address)."""
    o = pool.servers.get(server.name)
    return o.series if o and o.series else server.address


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
        e = canary.canary_estimate(node_ttft, [r.ttft.get(m) for m in r.peers],
                                   [prev[m].ema for m in r.peers])  # type: ignore[misc]
        if e is not None:
            est[r.node] = e
        outcomes.append((r.node, "failed" if node_ttft is None else "measured" if e is not None else "no_reference"))
    return est, outcomes


def signal_maps(pool: PoolConfig, optional: Mapping[str, Sequence[Sample]]) -> dict[str, dict]:
    """Series key -> value for every optional signal (probe_result and peer_group map to label values)."""
    out: dict[str, dict] = {}
    for name in OPTIONAL:
        samples = optional.get(name, [])
        if name == "probe_result":
            out[name] = {s.labels.get(pool.series_label): s.labels.get("result") for s in samples if s.value == 1}
        elif name == "peer_group":
            lbl = pool.peer_group_label
            out[name] = {s.labels.get(pool.series_label): s.labels.get(lbl) for s in samples} if lbl else {}
        else:
            out[name] = {s.labels.get(pool.series_label): s.value for s in samples}
    return out


def node_inputs(pool: PoolConfig, servers: Mapping[str, ServerState], samples: Mapping[str, Sequence[Sample]],
                optional: Mapping[str, Sequence[Sample]], canaries: Mapping[str, float]) -> dict[str, NodeInput]:
    """The policy's input for every server of the pool, matched to the samples by series key."""
    lat = {s.labels.get(pool.series_label): s.value for s in samples["latency"]}
    rate = {s.labels.get(pool.series_label): s.value for s in samples["rate"]}
    sig = signal_maps(pool, optional)
    inputs = {}
    for n, s in servers.items():
        key = series_key(pool, s)
        o = pool.servers.get(n)
        inputs[n] = NodeInput(
            base_weight=s.initial_weight, latency=lat.get(key), request_rate=rate.get(key),
            peer_group=(o.peer_group if o and o.peer_group else sig["peer_group"].get(key)),
            canary=canaries.get(n), hold=s.maint,
            probe_result=sig["probe_result"].get(key), probe_ttft=finite(sig["probe_ttft"].get(key)),
            probe_failures=_int(sig["probe_failures"].get(key)),
            error_ratio=finite(sig["error_ratio"].get(key)), kv_cache_usage=finite(sig["kv_cache"].get(key)),
            gpu_throttled=_flag(sig["gpu_throttled"].get(key)), pcie_degraded=_flag(sig["pcie_degraded"].get(key)),
            gpu_ecc_uncorrectable=_flag(sig["gpu_ecc"].get(key)), gpu_xid=_flag(sig["gpu_xid"].get(key)))
    return inputs


def decide_tick(obs: Observation, pools: Sequence[PoolConfig], policies: Mapping[str, Policy]
                ) -> dict[str, PoolOutcome]:
    """Every observed pool's decision, in config order."""
    out = {}
    for pool in pools:
        po = obs.pools.get(pool.name)
        if po is None:
            continue
        est, outcomes = canary_estimates(po.canaries, po.prev)
        inputs = node_inputs(pool, po.servers, obs.samples, obs.optional, est)
        d = decide_pool(po.prev, inputs, policies[pool.name], obs.now)
        out[pool.name] = PoolOutcome(d, {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}, outcomes)
    return out


def _flag(v: float | None) -> bool | None:
    return None if v is None or v != v else v > 0


def _int(v: float | None) -> int | None:
    return None if v is None or not math.isfinite(v) else int(v)
