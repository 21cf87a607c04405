"""The policies the benchmark compares, each a detector on top of an HAProxy balancing algorithm.

A detector sees what its real counterpart sees (per-request outcomes for Envoy, per-tick observations for
the latency-based ones) and sets per-server weights: 0..256, or drained. Names: `roundrobin`, `leastconn`
(no detector: the status quo), `seeds`, `envoy`, `envoy-one` (always_eject_one_host), `haproxy` (leastconn
with HAProxy's reflexes of grayguard.reflexes, no controller), `grayguard` (the controller behind the same
reflexes), `oracle` (the reference floor: behind the same reflexes, drains each faulty node exactly while its
fault lasts); the detectors run on leastconn unless the name says `@roundrobin`, e.g. `grayguard@roundrobin`.
The peers users pick instead of grayguard, other gateways with no controller and no HAProxy reflexes (PEERS;
their balancers are bench.peers'): `linkerd` (Peak-EWMA with power of two choices), `envoy-lr` (Envoy's
LEAST_REQUEST at its defaults, without outlier detection: Envoy configures none by default) and `epp` (the Gateway
API Inference Extension's endpoint picker: least queue, then least KV cache, from vLLM's gauges every 50 ms).
"""

from __future__ import annotations

import math
import statistics
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from grayguard.bench.node import NodeObs, node_input
from grayguard.bench.spec import NodeSpec, Scenario
from grayguard.config import ConfigError, ThresholdsConfig
from grayguard.controller import canary
from grayguard.controller.policy import (
    EJECTED,
    NodeState,
    Policy,
    decide_pool,
    is_cut,
    live_samples,
    window_samples,
)
from grayguard.reflexes import DEFAULT as REFLEXES
from grayguard.reflexes import Reflexes
from grayguard.vocab import Detector as DetectorName


@dataclass(frozen=True)
class Assign:
    """A detector's instruction for one server."""

    weight: int
    drained: bool = False
    state: str = "healthy"
    agent: bool = True  # the server's agent check is enabled (the controller disables it past the cap)
    cut: bool = False  # in rotation and held below its state's weight by a finding (policy.is_cut), as a warm-up can be


class Detector:
    """No detection: weights stay at their base (plain roundrobin / leastconn)."""

    interval_s: float | None = None  # how often tick() runs; None: never
    reflexes: Reflexes | None = None  # HAProxy's request-path reflexes in front of it; None: none (bench.lb.Gateway)

    def __init__(self, nodes: Sequence[NodeSpec], scn: Scenario) -> None:
        self.nodes = list(nodes)
        self.names = [n.name for n in nodes]
        self.spec = {n.name: n for n in nodes}

    def on_result(self, node: str, ok: bool, now: float) -> dict[str, Assign]:
        """A client-visible request outcome (an answer, an HTTP error, a timeout)."""
        return {}

    def on_fault(self, node: str, now: float, clear: bool) -> dict[str, Assign]:
        """A scheduled fault starts (or ends) on node: only a reference that knows the schedule may look."""
        return {}

    def canaries(self, now: float) -> list[tuple[str, list[str]]]:
        """Canary rounds due now: (drained node, [node, peer, peer]) for the engine to send."""
        return []

    def tick(self, now: float, obs: Mapping[str, NodeObs], canary_ttft: Mapping[str, float | None]
             ) -> dict[str, Assign]:
        """Periodic decision; canary_ttft holds the TTFT of each canary target (None: failed)."""
        return {}


class Seeds(Detector):
    """The seeds' algorithm: population Z-score (node included) over the EMA of normalized latency.

    weight = base * 2^-(Z-2) above Z 2.0; weight 0 above Z 3.5 within a cap of floor(30 % of the pool);
    back to base when Z < 2. A zeroed node gets no traffic, so its EMA freezes: it returns only if the
    pool's statistics move, which is how the algorithm was written.
    """

    def __init__(self, nodes: Sequence[NodeSpec], scn: Scenario, alpha: float = 0.2, degrade: float = 2.0,
                 quarantine: float = 3.5, cap: float = 0.3) -> None:
        super().__init__(nodes, scn)
        self.interval_s = scn.tick_s
        self.alpha, self.degrade, self.quarantine, self.cap = alpha, degrade, quarantine, cap
        self.ema: dict[str, float] = {}
        self.zeroed: set[str] = set()

    def tick(self, now, obs, canary_ttft):
        for n in self.names:
            o = obs.get(n)
            if o is not None and o.latency is not None and o.latency > 0 and n not in self.zeroed:
                prev = self.ema.get(n)  # the seeds' exponential moving average
                self.ema[n] = o.latency if prev is None else self.alpha * o.latency + (1.0 - self.alpha) * prev
        vals = list(self.ema.values())
        if len(vals) < 2:
            return {}
        mean, std = statistics.fmean(vals), statistics.pstdev(vals)
        z = {n: (v - mean) / std if std > 0 else 0.0 for n, v in self.ema.items()}
        out: dict[str, Assign] = {}
        cap = math.floor(self.cap * len(self.names) + 1e-9)
        for n, zn in z.items():
            if zn < self.degrade:
                self.zeroed.discard(n)
        for _zn, n in sorted(((zn, n) for n, zn in z.items() if zn > self.quarantine), reverse=True):
            if n not in self.zeroed and len(self.zeroed) < cap:
                self.zeroed.add(n)
        for n, zn in z.items():
            base = self.spec[n].base_weight
            if n in self.zeroed:
                out[n] = Assign(0, False, "quarantined")
            elif zn > self.degrade:
                out[n] = Assign(max(1, round(base * 2.0 ** -(zn - self.degrade))), False, "degraded")
            else:
                out[n] = Assign(base, False, "healthy")
        return out


class Envoy(Detector):
    """Envoy outlier detection with its defaults (consecutive_5xx and success-rate ejection).

    Failures are 5xx answers and timeouts (Envoy maps local-origin timeouts to 5xx by default). Ejection is
    allowed while (ejected + 1) / hosts <= max_ejection_percent (Envoy >= 1.27); with the default 10 % a
    pool below 10 hosts therefore ejects nobody unless always_eject_one_host is set.
    """

    def __init__(self, nodes: Sequence[NodeSpec], scn: Scenario, consecutive_5xx: int = 5, interval_s: float = 10.0,
                 base_ejection_s: float = 30.0, max_ejection_s: float = 300.0, max_ejection_percent: float = 10.0,
                 sr_minimum_hosts: int = 5, sr_request_volume: int = 100, sr_stdev_factor: float = 1.9,
                 always_eject_one_host: bool = False) -> None:
        super().__init__(nodes, scn)
        self.interval_s = interval_s
        self.c5xx, self.base_s, self.max_s = consecutive_5xx, base_ejection_s, max_ejection_s
        self.max_pct, self.sr_hosts, self.sr_volume = max_ejection_percent, sr_minimum_hosts, sr_request_volume
        self.sr_factor, self.always_one = sr_stdev_factor, always_eject_one_host
        self.consecutive = dict.fromkeys(self.names, 0)
        self.ok = dict.fromkeys(self.names, 0)
        self.total = dict.fromkeys(self.names, 0)
        self.ejected_at: dict[str, float] = {}
        self.multiplier = dict.fromkeys(self.names, 0)

    def _eject(self, n: str, now: float) -> dict[str, Assign]:
        active = len(self.ejected_at)
        if n in self.ejected_at:
            return {}
        if 100.0 * (active + 1) / len(self.names) > self.max_pct and not (self.always_one and active == 0):
            return {}
        self.ejected_at[n] = now
        self.multiplier[n] += 1
        return {n: Assign(0, True, "quarantined")}

    def on_result(self, node, ok, now):
        self.total[node] += 1
        if ok:
            self.ok[node] += 1
            self.consecutive[node] = 0
            return {}
        self.consecutive[node] += 1
        if self.consecutive[node] >= self.c5xx:
            self.consecutive[node] = 0
            return self._eject(node, now)
        return {}

    def tick(self, now, obs, canary_ttft):
        out: dict[str, Assign] = {}
        for n, at in list(self.ejected_at.items()):
            if now - at >= min(self.max_s, self.base_s * self.multiplier[n]) - 1e-9:
                del self.ejected_at[n]
                out[n] = Assign(self.spec[n].base_weight, False, "healthy")
        for n in self.names:  # a host that stayed in rotation a whole interval earns back one multiplier
            if n not in self.ejected_at and n not in out and self.multiplier[n] > 0:
                self.multiplier[n] -= 1
        rates = {n: self.ok[n] / self.total[n] for n in self.names
                 if self.total[n] >= self.sr_volume and n not in self.ejected_at}
        if len(rates) >= self.sr_hosts:
            mean, std = statistics.fmean(rates.values()), statistics.pstdev(rates.values())
            for n, sr in sorted(rates.items(), key=lambda kv: kv[1]):
                if sr < mean - self.sr_factor * std:
                    out.update(self._eject(n, now))
        self.ok = dict.fromkeys(self.names, 0)
        self.total = dict.fromkeys(self.names, 0)
        return out


class Grayguard(Detector):
    """grayguard's controller: decide_pool with the given Policy (default Policy()), the loop's canaries."""

    def __init__(self, nodes: Sequence[NodeSpec], scn: Scenario, policy: Policy | None = None) -> None:
        super().__init__(nodes, scn)
        self.interval_s = scn.tick_s
        self.policy = policy or scenario_policy(scn)
        self.states: dict[str, NodeState] = {}
        # what the engine was last told per node (it starts at base weight, in rotation, agent enabled)
        self.last = {n.name: Assign(n.base_weight) for n in nodes}

    def canaries(self, now):
        groups = {n.name: n.peer_group for n in self.nodes}
        present = [n for n in self.names if n not in self.states or self.states[n].gone_since is None]
        return canary.canary_rounds(present, self.states, groups, now, self.policy.recovery)

    def canary_estimates(self, now: float, canary_ttft: Mapping[str, float | None]) -> dict[str, float]:
        """The live loop's estimate (controller.canary.canary_estimate) for every round due now."""
        out = {}
        for n, targets in self.canaries(now):
            peers = targets[1:]
            est = canary.canary_estimate(canary_ttft.get(n), [canary_ttft.get(m) for m in peers],
                                         [self.states[m].ema for m in peers])  # type: ignore[misc]
            if est is not None:
                out[n] = est
        return out

    def tick(self, now, obs, canary_ttft):
        est = self.canary_estimates(now, canary_ttft) if canary_ttft else {}
        # the pool is what HAProxy shows: a node absent from it (obs has none) is not an input, as in the live loop
        inputs = {n: node_input(self.spec[n], obs[n], est.get(n)) for n in self.names if n in obs}
        d = decide_pool(self.states, inputs, self.policy, now)
        # as controller/decide.py: the states of nodes gone from HAProxy are kept (forget_after_s) for their return
        self.states = {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}
        off = d.agent_off
        out = {}
        for n, nd in d.nodes.items():
            agent = n not in off  # level-triggered: every node's agent is enabled unless the decision says off
            if nd.weight is not None:
                out[n] = self.last[n] = Assign(nd.weight, nd.drain or nd.state.state in EJECTED, nd.state.state, agent,
                                               is_cut(nd.state))
            elif self.last[n].agent != agent:  # weight held: keep the last assignment, write only the agent
                out[n] = self.last[n] = replace(self.last[n], agent=agent)
        return out


class Oracle(Detector):
    """The floor no detector can beat: knows the fault schedule, drains each faulty node exactly at its fault's
    start (weight 0, drained) and puts it back at its end, nothing else. What the lost capacity alone costs."""

    def on_fault(self, node, now, clear):
        if clear:
            return {node: Assign(self.spec[node].base_weight, False, "healthy")}
        return {node: Assign(0, True, "quarantined")}


DETECTORS = {
    "roundrobin": (Detector, "roundrobin", {}),
    "leastconn": (Detector, "leastconn", {}),
    "seeds": (Seeds, "leastconn", {}),
    "envoy": (Envoy, "leastconn", {}),
    "envoy-one": (Envoy, "leastconn", {"always_eject_one_host": True}),
    "haproxy": (Detector, "leastconn", {}),
    "grayguard": (Grayguard, "leastconn", {}),
    "oracle": (Oracle, "leastconn", {}),
    "linkerd": (Detector, "peak_ewma", {}),
    "envoy-lr": (Detector, "least_request", {}),
    "epp": (Detector, "epp", {}),
}
# The peers: another gateway's balancer, nothing on top. Linkerd's failure accrual and retries are opt-in (off);
# Envoy has no outlier detection, health check or retry policy unless configured; the endpoint picker follows
# Kubernetes' readiness (bench.peers.EndpointPicker) and Envoy in front of it retries nothing by default.
PEERS = frozenset({"linkerd", "envoy-lr", "epp"})
# Policies behind HAProxy's reflexes as shipped (grayguard.reflexes, the agent check included): grayguard's
# gateway, that gateway without a controller, and the oracle reference behind it. roundrobin / leastconn / seeds
# are the status quo without them; Envoy has its own outlier detection (its defaults) and no retry policy
# (Envoy's default).
WITH_REFLEXES = frozenset({"haproxy", "grayguard", "oracle"})


def grayguard_variant(spec: str, scn: Scenario) -> Policy:
    """grayguard's Policy with the overrides a policy name carries after `~`: `grayguard~live_batch_slope=0`
    (a numeric thresholds field: an ablation, or a knob tried on some seeds) and `grayguard~shadow=live+probe`
    (detectors in shadow mode). ValueError names what is wrong."""
    types = typing.get_type_hints(ThresholdsConfig)
    over: dict[str, float | int] = {}
    shadow: set[str] = set()
    for part in spec.split("~"):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"grayguard variant {part!r}: expected name=value")
        if key == "shadow":
            names = set(value.split("+"))
            unknown = names - {d.value for d in DetectorName}
            if unknown:
                raise ValueError(f"grayguard variant shadow: unknown detector(s) {', '.join(sorted(unknown))} "
                                 f"(known: {', '.join(d.value for d in DetectorName)})")
            shadow |= names
        elif types.get(key) in (int, float):
            try:
                over[key] = types[key](value)
            except ValueError:
                raise ValueError(f"grayguard variant {part!r}: not a number for {key}") from None
        else:
            raise ValueError(f"grayguard variant: {key!r} is no numeric thresholds field")
    t = replace(ThresholdsConfig(), **over)
    try:
        t.validate("thresholds")
    except ConfigError as e:
        raise ValueError(f"grayguard variant: {e}") from None
    return scenario_policy(scn, t, frozenset(shadow))


def scenario_policy(scn: Scenario, t: ThresholdsConfig | None = None, shadow: frozenset[str] = frozenset()) -> Policy:
    """grayguard's Policy for a scenario's control window, rule evaluation and tick (as config_policy builds it from
    rules.control_window, control_interval and tick_interval_s), with these thresholds (default: the shipped ones)."""
    return Policy(t or ThresholdsConfig(), window_s=scn.window_s,
                  window_samples=window_samples(scn.window_s, scn.rule_eval_s), live_samples=live_samples(scn.tick_s),
                  shadow=shadow)


def make_policy(name: str, nodes: Sequence[NodeSpec], scn: Scenario) -> tuple[Detector, str]:
    """(detector, balancer name) for a policy name like `grayguard`, `envoy@roundrobin` or a grayguard variant
    `grayguard~knob=value` (grayguard_variant)."""
    base, _, balancer = name.partition("@")
    base, tilde, variant = base.partition("~")
    if tilde and base != "grayguard":
        raise ValueError(f"policy {name!r}: only grayguard takes ~overrides")
    if base not in DETECTORS:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(DETECTORS)} (optionally @roundrobin)")
    cls, default_lb, kw = DETECTORS[base]
    if balancer and (base in ("roundrobin", "leastconn", "haproxy") or base in PEERS):
        raise ValueError(f"policy {name!r}: {base} is itself a balancer")
    if balancer not in ("", "roundrobin", "leastconn"):
        raise ValueError(f"policy {name!r}: unknown balancer {balancer!r}")
    if tilde:
        kw = {**kw, "policy": grayguard_variant(variant, scn)}
    det = cls(nodes, scn, **kw)
    if base in WITH_REFLEXES:
        det.reflexes = REFLEXES
    return det, balancer or default_lb
