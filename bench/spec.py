"""What one benchmark scenario is: nodes, faults, load, control knobs; and its seeded arrival sequence.

Pure data and pure functions: the same Scenario gives the same arrivals (times, sizes, pinned node) on
every run, so every policy sees identical traffic, and the fault-free twin of a scenario (its healthy
baseline) sees it too.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from grayguard.sim.faults import ScheduledFault
from grayguard.sim.loadgen import LengthDist
from grayguard.sim.model import SPEED_CLASSES
from grayguard.sim.traces import TraceLoad, TracePlan, mix_tokens, plan_trace

# Requests per second one h100-class node serves at saturation with the default request mix
# (docs/simulator.md, measured in virtual time); slower classes scale by their speed multiplier.
H100_CAPACITY_RPS = 11.0


@dataclass(frozen=True)
class NodeSpec:
    """One backend server."""

    name: str
    speed_class: str = "h100"  # sim.model.SPEED_CLASSES key
    peer_group: str | None = None  # passed to the controller as NodeInput.peer_group
    base_weight: int = 100  # the server's configured HAProxy weight
    backend: str = "vllm"  # "vllm": sim.model.Engine; "fixed": a constant service time (Linkerd replica)
    fixed_latency_s: float = 0.01  # service time of a "fixed" backend

    @property
    def speed(self) -> float:
        return SPEED_CLASSES[self.speed_class]

    @property
    def capacity_rps(self) -> float:
        """Nominal saturation rate with the default mix (relative capacity for 'capacity kept')."""
        return H100_CAPACITY_RPS / self.speed


# A scheduled fault: (node, fault, at_s, until_s, params), validated against the sim.faults catalogue.
FaultSpec = ScheduledFault


@dataclass(frozen=True)
class PinnedLoad:
    """Extra Poisson traffic pinned to one node (sticky sessions / stick tables bypass the balancer)."""

    node: str
    start_s: float
    end_s: float
    rate: float
    prompt: LengthDist
    completion: LengthDist


@dataclass(frozen=True)
class TracePin:
    """A trace's hottest tenant (sim.traces.TracePlan.hottest) pinned to one node over [start_s, end_s).

    Unlike PinnedLoad it adds no traffic: the tenant's own requests, drawn from the trace, bypass the balancer.
    max_rate caps the tenant's size (every k-th of its requests is pinned, the rest stay balanced): a decile of a
    32-node pool's traffic is more than one node serves, and the same tenant should not grow with the pool.
    """

    node: str
    start_s: float = 0.0
    end_s: float = math.inf
    max_rate: float | None = None  # req/s


@dataclass(frozen=True)
class Absence:
    """A node out of the pool (not in HAProxy's backend) over [from_s, until_s); it joins (again) at until_s.

    While absent it gets no requests, no probes and no checks, and the controller does not see it. Its
    requests in flight when it leaves run to completion (a graceful restart: the server is removed first).
    It joins cold: every step is slowed by warmup_k, decaying to 1 with time constant warmup_tau_s (empty
    caches, first-call compilation); with from_s > 0 vLLM restarted, so its counters and the exporter start over.
    """

    node: str
    from_s: float
    until_s: float
    warmup_k: float = 1.0
    warmup_tau_s: float = 10.0

    def warmup(self, t: float) -> float:
        """The cold-start step-time multiplier at t (1 before the join)."""
        if t < self.until_s or self.warmup_k <= 1.0:
            return 1.0
        return 1.0 + (self.warmup_k - 1.0) * math.exp(-(t - self.until_s) / self.warmup_tau_s)


@dataclass(frozen=True)
class LoadSpec:
    """Open-loop Poisson arrivals; the mean rate is `rate`, or `utilization` of the pool's capacity.

    With `trace`, a production trace's window replaces the Poisson stream and its lengths (shape, surges, prompt
    and completion are then unused): compressed to `rate` req/s, or to `utilization` of the pool's capacity in
    tokens/s (Scenario.capacity_tps: prompt + output tokens, the trace's requests being larger than the default
    mix's), or played at trace.speedup when that is set (utilization and rate None).
    """

    utilization: float | None = 0.4
    rate: float | None = None  # total req/s; wins over utilization
    shape: str = "steady"  # steady | bursty (square wave: burst_factor for burst_s every burst_period_s)
    burst_period_s: float = 30.0
    burst_s: float = 10.0
    burst_factor: float = 1.6
    lull_factor: float = 0.7  # (1.6*10 + 0.7*20) / 30 = 1.0: the mean rate is unchanged
    surges: tuple[tuple[float, float, float], ...] = ()  # (start_s, end_s, factor): whole-pool surges
    prompt: LengthDist = field(default_factory=lambda: LengthDist(200, 1.0, 8, 4000))
    completion: LengthDist = field(default_factory=lambda: LengthDist(100, 1.0, 4, 1024))
    pinned: tuple[PinnedLoad, ...] = ()
    timeout_s: float = 30.0  # client deadline per request, from its arrival
    trace: TraceLoad | None = None  # sim.traces: the file, window, format, speed-up and the model's context
    trace_pin: TracePin | None = None  # the trace's hottest tenant on one node

    def factor(self, t: float) -> float:
        """Rate multiplier at time t."""
        f = 1.0
        if self.shape == "bursty":
            f = self.burst_factor if (t % self.burst_period_s) < self.burst_s else self.lull_factor
        for start, end, k in self.surges:
            if start <= t < end:
                f *= k
        return f

    def max_factor(self) -> float:
        f = max(self.burst_factor, self.lull_factor) if self.shape == "bursty" else 1.0
        return f * math.prod(max(1.0, k) for _, _, k in self.surges)


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario; `policies` are compared on its identical traffic."""

    name: str
    nodes: tuple[NodeSpec, ...]
    load: LoadSpec = field(default_factory=LoadSpec)
    faults: tuple[FaultSpec, ...] = ()
    duration_s: float = 150.0  # arrivals stop here; answers are awaited up to the client timeout
    seed: int = 1
    group: str = "fault"  # fault | benign | double | linkerd | sensitivity (how the report reads it)
    tick_s: float = 1.0  # control tick (grayguard.example.yaml tick_interval_s)
    control_start_s: float = 0.0  # first control tick (0: one tick after start); traffic starts at 0
    window_s: float = 30.0  # rate window of the normalized-latency recording rule
    omega: float = 0.25  # prompt-token weight in normalized latency
    signal_lag_s: float = 5.0  # age of the rate-window data the controller reads (scrape + rule evaluation)
    rule_eval_s: float = 5.0  # Prometheus' evaluation interval of the control rules: the 30 s window moves in steps
    gauge_lag_s: float = 2.5  # age of scraped gauges (probe results, KV usage): half a 5 s scrape interval
    probes: bool = True  # the exporter's 1-token micro-probe runs against every node (a little load)
    probe_interval_s: float = 1.0  # exporter ProbeConfig defaults: every 1 s +-20 %, 2 s deadline,
    probe_deadline_s: float = 2.0  # slower than 0.3 s is `slow`
    probe_slow_s: float = 0.3
    live_window_s: float = 5.0  # the exporter's fast path: ITL / TTFT means over its last 5 s of /metrics readings
    fast_scrape_s: float = 1.0  # Prometheus scrapes the exporter's fast endpoint this often (per-node phase)
    full_scrape_s: float = 5.0  # ...and its full page (the GPU evidence) this often (per-node phase)
    hardware_every_s: float = 5.0  # the controller reads each GPU signal once in this (signals.hardware_every_s)
    drift: float = 0.0  # amplitude of a slow sinusoidal speed drift per node (0.02 = +-2 %)
    drift_period_s: float = 120.0
    # (start_s, end_s, k): every node's step time x k together (a shared dependency, a hot datacenter); benign
    slowdown_all: tuple[tuple[float, float, float], ...] = ()
    absent: tuple[Absence, ...] = ()  # nodes out of the pool for an interval (a restart, a late join); benign
    measure_from_s: float | None = None  # start of the measurement window (default: first fault, or 30 s)
    measure_to_s: float | None = None  # end (default: duration_s)
    policies: tuple[str, ...] = ()  # empty: the suite's default list
    # the exporters' GPU tells each fault's story (thermal: throttled, pcie: link down); False: the real fleet on
    # CPUs, whose fake GPU stays healthy whatever the fault (no GPU evidence)
    gpu_evidence: bool = True
    # the exporter's fast path reads the engine's live ITL, live TTFT, prompt tokens/s and decode batch (vLLM, SGLang);
    # False: an engine whose /metrics has none of them (Triton without histogram latencies, docs/engines.md), whose
    # nodes the probes and the 30 s window judge alone
    live_signals: bool = True
    tags: tuple[tuple[str, object], ...] = ()  # report columns: fault, size, mix, load, slowdown

    @property
    def tag(self) -> dict[str, object]:
        return dict(self.tags)

    @property
    def rate(self) -> float:
        """Mean total arrival rate (req/s) of the balanced traffic."""
        if self.load.trace is not None:
            return trace_plan(self).meta["mean_rate"] or 0.0
        if self.load.rate is not None:
            return self.load.rate
        return (self.load.utilization or 0.0) * sum(n.capacity_rps for n in self.nodes)

    @property
    def capacity_tps(self) -> float:
        """The pool's nominal capacity in tokens/s: capacity_rps x the mean prompt + completion of the default mix."""
        return sum(n.capacity_rps for n in self.nodes) * DEFAULT_MIX_TOKENS

    @property
    def window(self) -> tuple[float, float]:
        """The measurement window [from, to): the fault phase, or the event of a benign scenario."""
        start = self.measure_from_s
        if start is None:
            start = min((f.at_s for f in self.faults), default=30.0)
        end = self.measure_to_s if self.measure_to_s is not None else self.duration_s
        return start, end

    def pool_slowdown(self, t: float) -> float:
        """The whole pool's step-time multiplier at t (slowdown_all)."""
        k = 1.0
        for start, end, f in self.slowdown_all:
            if start <= t < end:
                k *= f
        return k

    def joins(self, node: str) -> list[float]:
        """When `node` joins the pool after an absence."""
        return [a.until_s for a in self.absent if a.node == node]

    @property
    def faulty(self) -> frozenset[str]:
        return frozenset(f.node for f in self.faults)

    def healthy_twin(self) -> Scenario:
        """The same scenario without its faults (same seed, nodes and traffic): the baseline."""
        return replace(self, name=self.name + "~healthy", faults=(), tags=())

    def traffic_key(self) -> str:
        """Identity of the fault-free run: scenarios with equal keys share one healthy baseline."""
        d = asdict(self.healthy_twin())
        for k in ("name", "group", "policies", "tags", "measure_from_s", "measure_to_s"):
            d.pop(k)
        return json.dumps(d, sort_keys=True, default=str)


@dataclass(frozen=True)
class Arrivals:
    """The arrival sequence: parallel lists, in time order. pin = node index, or -1 (balanced)."""

    t: list[float]
    prompt: list[int]
    gen: list[int]
    pin: list[int]

    def __len__(self) -> int:
        return len(self.t)


def _poisson(rate_at, max_rate: float, start: float, end: float, seed: int):
    """Arrival times of a Poisson process with rate rate_at(t) <= max_rate (thinning), seeded."""
    gap, keep = random.Random(seed), random.Random(seed + 7919)
    t = start
    while max_rate > 0:
        t += gap.expovariate(max_rate)
        if t >= end:
            return
        if keep.random() * max_rate < rate_at(t):
            yield t


# Tokens per request of the mix H100_CAPACITY_RPS was measured with (prompt 200, completion 100, both CV 1): ~424.
DEFAULT_MIX_TOKENS = mix_tokens(LoadSpec().prompt, LoadSpec().completion)


@lru_cache(maxsize=32)
def _plan(load: TraceLoad, run_s: float, capacity_tps: float) -> TracePlan:
    return plan_trace(load, run_s, capacity_tps=capacity_tps)


def trace_plan(s: Scenario) -> TracePlan:
    """The scenario's trace arrivals (cached: every policy's run replays the same plan)."""
    load = s.load
    tl = load.trace
    if tl.speedup is None:
        tl = replace(tl, rate=load.rate, utilization=None if load.rate is not None else load.utilization)
    return _plan(tl, s.duration_s, s.capacity_tps)


def trace_sources(scenarios: list[Scenario]) -> list[dict]:
    """The traces the scenarios replay, for a report's metadata: file, format, attribution, which scenarios."""
    out: dict[str, dict] = {}
    for s in scenarios:
        if s.load.trace is not None:
            m = trace_plan(s).meta
            out.setdefault(m["file"], {"file": m["file"], "format": m["format"], "attribution": m["attribution"],
                                       "scenarios": []})["scenarios"].append(s.name)
    return list(out.values())


def _pinned(plan: TracePlan, pin: TracePin, run_s: float) -> list[bool]:
    """Which of the plan's requests go to the pinned node: the hottest tenant's in the pin window, thinned evenly
    to pin.max_rate."""
    hot = [h and pin.start_s <= t < pin.end_s for h, t in zip(plan.hottest(), plan.t, strict=True)]
    n = sum(hot)
    if pin.max_rate is None or n == 0:
        return hot
    keep = min(n, pin.max_rate * (min(pin.end_s, run_s) - pin.start_s))
    out, j = [], 0
    for h in hot:
        out.append(h and math.floor((j + 1) * keep / n) > math.floor(j * keep / n))
        j += h
    return out


def make_arrivals(s: Scenario) -> Arrivals:
    """The scenario's arrivals: the balanced stream (Poisson, or a trace) plus any pinned streams, merged by time."""
    load = s.load
    rows: list[tuple[float, int, int, int]] = []
    index = {n.name: i for i, n in enumerate(s.nodes)}
    if load.trace is not None:
        plan = trace_plan(s)
        pin = load.trace_pin
        pinned = _pinned(plan, pin, s.duration_s) if pin is not None else [False] * len(plan)
        for t, p, o, h in zip(plan.t, plan.prompt, plan.output, pinned, strict=True):
            rows.append((t, p, o, index[pin.node] if h else -1))
    else:
        base = s.rate
        sizes = random.Random(s.seed + 1)  # own stream: sizes do not shift when the rate changes
        for t in _poisson(lambda t: base * load.factor(t), base * load.max_factor(), 0.0, s.duration_s, s.seed):
            rows.append((t, load.prompt.sample(sizes), load.completion.sample(sizes), -1))
    for j, p in enumerate(load.pinned):
        rng = random.Random(s.seed * 1000 + 17 * (j + 1))
        for t in _poisson(lambda _t, r=p.rate: r, p.rate, p.start_s, min(p.end_s, s.duration_s), s.seed + 31 * (j + 1)):
            rows.append((t, p.prompt.sample(rng), p.completion.sample(rng), index[p.node]))
    rows.sort(key=lambda r: (r[0], r[3]))
    return Arrivals([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
