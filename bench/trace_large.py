"""A large, realistic, seeded trace for the decision core (10,000 nodes in 500 pools at 1 s ticks), run closed-loop.

Every node has what the shipped defaults read each tick: the 30 s window's normalized latency with its rule
evaluation time (`latency_at`, new every 5 s), request rate, probe class, TTFT and failure streak, error ratio, KV
cache, GPU flags, the live fast path (ITL, TTFT, probe TTFT median, prefill rate, decode batch), a peer group in
some pools, and what HAProxy shows (weight, drain, DOWN, MAINT, agent, hanafail). Faults come and go on single
nodes (slowdowns of 1.25-10x with or without GPU evidence, hangs, CUDA errors, garbage probes, error ratios, KV
saturation, DOWN by the health check, MAINT, leaving and coming back, prefill-heavy tenants) and on whole pools
(overload, a bad rollout answering garbage, a pool-wide slowdown); nodes join. The loop is closed as the live
loop's is: canaries go to the nodes held in canary (controller.canary, controller.decide), and the planned writes
are applied to the simulated HAProxy, so quarantines, canaries, slow starts and recoveries happen.

Each pool draws from its own random stream (seed, pool), so a smaller trace is the first pools of a larger one.
`run` drives decide_pools + plan_backend over it; `digest` is the SHA-256 of one tick's canonical decisions.
"""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import hashlib
import json
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller import canary, decide
from grayguard.controller.haproxy import CHK_ST_CONFIGURED, CHK_ST_ENABLED, STATUS_AGENT_DOWN, ServerState
from grayguard.controller.plan import Change, plan_backend
from grayguard.controller.policy import NodeInput, NodeState, Policy, PoolDecision, decide_pools
from grayguard.reflexes import CHECK_STATUS_HANA
from grayguard.vocab import ProbeResult

FDRAIN, FMAINT = 0x08, 0x01  # srv_admin_state bits (controller/haproxy.py)
AGENT_ON = CHK_ST_CONFIGURED | CHK_ST_ENABLED
CHECK_L4 = 8  # a failed health check's srv_check_status (any but HANA)
GROUPS = {"h100": 1.0, "a100": 1.6, "l40": 2.3}  # peer group -> how much slower its hardware is
# single-node faults: (kind, share of faults, shortest and longest duration in seconds)
FAULTS = (("slow", 0.34, 20, 240), ("hang", 0.08, 20, 150), ("cuda", 0.06, 20, 200), ("garbage", 0.06, 20, 120),
          ("errors", 0.05, 20, 200), ("circuit", 0.05, 10, 120), ("kv", 0.10, 10, 60), ("down", 0.08, 10, 90),
          ("maint", 0.04, 30, 200), ("leave", 0.07, 20, 450), ("prefill", 0.07, 30, 200))
SILENT = ("hang", "cuda", "down")  # no token comes out of these nodes
EVIDENCE = (None, None, "throttle", "pcie", "ecc", "xid")  # a slowdown's GPU evidence, drawn evenly


@dataclass(frozen=True)
class TraceParams:
    """What the trace is; a fixture records these with the digests."""

    seed: int = 20261201
    pools: int = 500
    pool_size: int = 20
    ticks: int = 1000
    start: float = 1_000_000.0
    tick_s: float = 1.0
    rule_interval_s: float = 5.0  # the recording rules' evaluation interval: latency_at moves this often
    fault_per_node_s: float = 1 / 3000  # single-node faults started per node per second
    pool_event_per_s: float = 1 / 1500  # pool-wide events started per pool per second
    join_per_pool_s: float = 1 / 3000  # new nodes joining per pool per second
    # the policy's knobs as (field, value) pairs; empty: the shipped defaults. A recorded trace pins every one, so
    # that tuning a default later changes no recorded decision (only a change to the decision code does)
    thresholds: tuple[tuple[str, object], ...] = ()
    recovery: tuple[tuple[str, object], ...] = ()

    def pinned(self) -> TraceParams:
        """These parameters with every knob of the policy spelled out (the shipped defaults where unset)."""
        return dataclasses.replace(self, thresholds=tuple(sorted(dataclasses.asdict(self.policy().thresholds).items())),
                                   recovery=tuple(sorted(dataclasses.asdict(self.policy().recovery).items())))

    def policy(self, group_speed: dict[str, float] | None = None) -> Policy:
        known = {f.name for f in dataclasses.fields(ThresholdsConfig)}  # a field since removed pins nothing
        return Policy(ThresholdsConfig(**{k: v for k, v in self.thresholds if k in known}),
                      RecoveryConfig(**dict(self.recovery)),
                      group_speed or {})


@dataclass
class Fault:
    kind: str
    until: float
    k: float = 1.0  # slowdown
    evidence: str | None = None


@dataclass
class SimNode:
    """One node's truth and what its exporter and HAProxy remember (mutable: the simulator's, not the policy's)."""

    name: str
    group: str | None
    speed: float  # its hardware's slowness (1.0: the pool's reference)
    base: int  # HAProxy initial weight
    started: float  # process start (a fresh node answers `starting` for a few seconds)
    fault: Fault | None = None
    window: deque = field(default_factory=lambda: deque(maxlen=30))  # 30 s of slowdowns (the window's rate)
    latency: float | None = None
    latency_at: float | None = None
    probes: deque = field(default_factory=lambda: deque(maxlen=5))  # last answered probe TTFTs
    probe_ttft: float | None = None
    failures: int = 0
    hanafail: int = 0
    hana_until: float = -math.inf
    weight: int = 0
    admin: int = 0
    agent: int = AGENT_ON


class PoolSim:
    """One pool of the trace: its nodes, its faults, its own random stream."""

    def __init__(self, p: int, params: TraceParams):
        self.name, self.params = f"pool{p:03d}", params
        self.rnd = random.Random(f"{params.seed}:{p}")
        self.mixed = p % 4 == 1  # two peer groups (a100 a third of the pool)
        self.small_group = p % 8 == 5  # plus a lone pair of l40s: scored against the pool, speed-normalized
        self.old_exporter = p % 7 == 3  # no probe failure count, no GPU flags (absent, not zero)
        self.offset = self.rnd.uniform(0, params.rule_interval_s)
        self.policy = params.policy(group_speed={"a100": 1.6} if p % 8 == 1 else {})
        self.nodes: dict[str, SimNode] = {}
        self.absent: dict[str, float] = {}  # node -> back at
        self.load, self.event, self.event_until = 1.0, "", -math.inf
        for i in range(params.pool_size):
            self._add(f"n{i:02d}", i, params.start - 3600.0)
        self.joined = params.pool_size

    def _add(self, name: str, i: int, started: float) -> None:
        n = self.params.pool_size
        group = ("l40" if self.small_group and i >= n - 2 else "a100" if self.mixed and i % 3 == 2
                 else "h100" if self.mixed or self.small_group else None)
        speed = GROUPS[group or "h100"] * math.exp(self.rnd.gauss(0, 0.03))
        base = 50 if i % 10 == 7 else 100
        self.nodes[name] = SimNode(name, group, speed, base, started, weight=base)

    def step(self, now: float) -> None:
        """Advance the truth to `now`: faults end and start, nodes leave, come back and join, pool events."""
        r, dt = self.rnd, self.params.tick_s
        self.load = min(1.6, max(0.7, self.load * math.exp(r.gauss(0, 0.005))))  # the pool's traffic drifts
        if now >= self.event_until:
            self.event = ""
        if not self.event and r.random() < self.params.pool_event_per_s * dt:
            self.event, self.event_until = r.choice(("overload", "rollout", "slow")), now + r.uniform(30, 90)
            if self.event == "rollout":
                for s in r.sample(sorted(self.nodes), len(self.nodes) // 2):
                    self.nodes[s].fault = Fault("garbage", self.event_until)
        for name, back in list(self.absent.items()):
            if now >= back:
                del self.absent[name]
                node = self.nodes[name]
                node.fault, node.started, node.weight, node.admin, node.agent = None, now, node.base, 0, AGENT_ON
                node.window.clear()
                node.probes.clear()
                node.latency = node.latency_at = node.probe_ttft = None
        if r.random() < self.params.join_per_pool_s * dt:
            self._add(f"n{self.joined:02d}", self.joined, now)
            self.joined += 1
        for node in self.nodes.values():
            if node.fault is not None and now >= node.fault.until:
                node.fault = None
            if node.fault is None and node.name not in self.absent and r.random() < self.params.fault_per_node_s * dt:
                node.fault = self._draw_fault(now)
                if node.fault.kind == "leave":
                    self.absent[node.name] = node.fault.until
            if node.fault is not None and node.fault.kind in ("errors", "circuit") and r.random() < 0.1:
                node.hanafail += 1  # HAProxy's error-limit fired: DOWN (HANA) until its next health check
                node.hana_until = now + 2.0

    def _draw_fault(self, now: float) -> Fault:
        r = self.rnd
        kind, _, lo, hi = r.choices(FAULTS, weights=[f[1] for f in FAULTS])[0]
        k = math.exp(r.uniform(math.log(1.25), math.log(10.0))) if kind == "slow" else 1.0
        return Fault(kind, now + r.uniform(lo, hi), k, r.choice(EVIDENCE) if kind == "slow" else None)

    def observe(self, now: float) -> tuple[dict[str, NodeInput], dict[str, ServerState]]:
        """What the controller reads this tick: every present node's input and HAProxy server state."""
        inputs, servers = {}, {}
        evaluated = math.floor((now - self.offset) / self.params.rule_interval_s) * self.params.rule_interval_s
        for name, node in self.nodes.items():
            if name not in self.absent:
                inputs[name], servers[name] = self._observe(node, now, evaluated + self.offset)
        return inputs, servers

    def slowdown(self, node: SimNode) -> float:
        f = node.fault
        k = f.k if f is not None and f.kind == "slow" else 1.0
        return k * (2.0 if self.event == "slow" else 1.0) * (1.5 if self.event == "overload" else 1.0)

    def _observe(self, node: SimNode, now: float, evaluated: float) -> tuple[NodeInput, ServerState]:
        r, f = self.rnd, node.fault
        kind = f.kind if f is not None else ""
        silent = kind in SILENT
        starting = now - node.started < 4.0
        drained, maint = bool(node.admin & FDRAIN), kind == "maint"
        share = 0.0 if drained or maint or kind == "down" else node.weight / node.base if node.base else 0.0
        slow = self.slowdown(node) * node.speed * self.load
        node.window.append(slow if not silent else math.nan)
        # the 30 s window, as the rules evaluated it last: the finished requests' mean slowdown
        rate = 5.0 * share * math.exp(r.gauss(0, 0.1)) if not silent else 0.0
        if node.latency_at != evaluated:
            done = [x for x in node.window if x == x]
            node.latency_at = evaluated
            node.latency = (0.02 * sum(done) / len(done) * math.exp(r.gauss(0, 0.05))
                            if done and rate > 0.05 else None)
        prefill = 3.0 if kind == "prefill" else 1.0
        batch = 16.0 * share * prefill ** 0.5 * (1 + 0.4 * (min(slow, 10) - 1)) * math.exp(r.gauss(0, 0.1))
        live = share > 0 and not silent and not starting and r.random() > 0.01
        itl = 0.015 * slow * (1 + 0.015 * max(0.0, batch - 1)) * math.exp(r.gauss(0, 0.08)) if live else None
        result, ttft = self._probe(node, now, kind, slow * (2.5 if kind == "prefill" else 1.0), starting)
        agent_down = node.agent == AGENT_ON and (kind in ("cuda", "garbage") or (kind == "hang" and node.failures >= 2))
        hana = now < node.hana_until
        down = kind == "down" or hana or agent_down
        ev = f.evidence if f is not None and kind == "slow" else None
        gpu = None if self.old_exporter else False
        inp = NodeInput(
            node.base, latency=node.latency if r.random() > 0.002 else math.nan,
            latency_at=node.latency_at, request_rate=rate,
            peer_group=node.group, hold=maint, probe_result=result, probe_ttft=ttft,
            probe_failures=None if self.old_exporter else node.failures,
            error_ratio=(r.uniform(0.6, 0.95) if kind in ("circuit", "cuda") else r.uniform(0.02, 0.1)
                         if kind == "errors" else 0.002 * r.random()) if rate > 0 else None,
            live_itl=itl, live_ttft=0.08 * slow * math.exp(r.gauss(0, 0.15)) if live else None,
            probe_ttft_median=sorted(node.probes)[len(node.probes) // 2] if node.probes else None,
            live_prefill_rate=2000.0 * share * prefill * math.exp(r.gauss(0, 0.1)) if live else None,
            live_decode_batch=batch if live else None,
            kv_cache_usage=r.uniform(0.955, 0.99) if kind == "kv" else 0.3 + 0.4 * share * r.random(),
            gpu_throttled=True if ev == "throttle" else gpu, pcie_degraded=True if ev == "pcie" else gpu,
            gpu_ecc_uncorrectable=True if ev == "ecc" else gpu, gpu_xid=True if ev == "xid" else gpu,
            down=down and not maint, gateway_marked_down=hana and not maint, gateway_errors=node.hanafail,
            agent_down=agent_down and not hana and not maint, agent_off=node.agent == CHK_ST_CONFIGURED,
            agent_why=(f"{kind}: agent says down" if agent_down and not hana and not maint else None),
            haproxy_weight=node.weight, haproxy_drain=drained)
        status = ("MAINT" if maint else "DOWN" if hana or kind == "down" else STATUS_AGENT_DOWN if agent_down else "UP")
        srv = ServerState(self.name, node.name, f"10.0.0.{node.name[1:]}:8000", node.weight, node.base,
                          node.admin | (FMAINT if maint else 0), 0 if down or maint else 2,
                          check_status=CHECK_STATUS_HANA if hana else CHECK_L4 if kind == "down" else None,
                          hanafail=node.hanafail, agent_state=node.agent, status=status)
        return inp, srv

    def _probe(self, node: SimNode, now: float, kind: str, slow: float, starting: bool) -> tuple[str, float | None]:
        """The exporter's last probe: its class and the TTFT of the last answered one."""
        r = self.rnd
        if starting:
            result = ProbeResult.STARTING
        elif kind in ("hang", "cuda", "garbage", "down"):
            result = {"hang": ProbeResult.TIMEOUT, "cuda": ProbeResult.CUDA_ERROR, "garbage": ProbeResult.BAD_RESPONSE,
                      "down": ProbeResult.CONNECT_ERROR}[kind]
        elif self.event == "overload" and r.random() < 0.3:
            result = ProbeResult.TIMEOUT
        else:
            spike = 4.0 if r.random() < 0.02 else 1.0
            queue = 6.0 if self.event == "overload" else 1.0  # a saturated pool's probes wait
            node.probe_ttft = 0.05 * slow * spike * queue * math.exp(r.gauss(0, 0.2))
            node.probes.append(node.probe_ttft)
            result = ProbeResult.SLOW if node.probe_ttft > 0.5 else ProbeResult.OK
        node.failures = 0 if result in (ProbeResult.OK, ProbeResult.SLOW, ProbeResult.STARTING) else node.failures + 1
        return result, node.probe_ttft

    def canary_ttft(self, name: str) -> float | None:
        """A 1-token canary straight to the node: its TTFT, None when it fails."""
        node = self.nodes.get(name)
        if node is None or name in self.absent or (node.fault and node.fault.kind in SILENT + ("garbage",)):
            return None
        return 0.05 * self.slowdown(node) * node.speed * self.load * math.exp(self.rnd.gauss(0, 0.15))

    def canaries(self, servers: dict[str, ServerState], prev: dict[str, NodeState], now: float) -> dict[str, float]:
        """The live loop's canary rounds due now (controller.canary) and their estimates (controller.decide)."""
        groups = {n: self.nodes[n].group for n in servers}
        rounds = canary.canary_rounds(sorted(servers), prev, groups, now, self.policy.recovery)
        got = [decide.CanaryRound(n, tuple(t[1:]), {m: self.canary_ttft(m) for m in t}) for n, t in rounds]
        return decide.canary_estimates(got, prev)[0]

    def apply(self, changes: list[Change]) -> None:
        """HAProxy takes the planned writes."""
        for c in changes:
            node, v = self.nodes[c.node], c.command.value
            if c.command.kind == "weight":
                node.weight = int(v)
            elif c.command.kind == "state":
                node.admin = node.admin | FDRAIN if v == "drain" else node.admin & ~FDRAIN
            else:
                node.agent = AGENT_ON if v == "enable" else CHK_ST_CONFIGURED


@dataclass
class Tick:
    """One tick of the trace as decided: the inputs, the decisions and the plans of every pool."""

    k: int
    now: float
    inputs: dict[str, dict[str, NodeInput]]
    servers: dict[str, dict[str, ServerState]]
    decisions: dict[str, PoolDecision]
    plans: dict[str, list[Change]]
    states: dict[str, dict[str, NodeState]]  # what the controller keeps until the next tick, by pool
    started: float  # time.perf_counter() when the decisions began
    seconds: float  # decide_pools + plan_backend over every pool, this tick (wall clock)
    cpu_seconds: float  # the same, this thread's CPU time (steadier on a shared machine)


def run(params: TraceParams, profile: cProfile.Profile | None = None, pools: Iterable[int] | None = None
        ) -> Iterator[Tick]:
    """Drive decide_pools + plan_backend over the trace, closed-loop, as the live loop does; yield every tick.
    profile: enabled around the decision code only (not the trace's own work). pools: only these pools of the trace
    (each pool is the same whatever else runs: the trace can be split across processes)."""
    sims = [PoolSim(p, params) for p in (range(params.pools) if pools is None else pools)]
    states: dict[str, dict[str, NodeState]] = {s.name: {} for s in sims}
    for k in range(params.ticks):
        now = params.start + k * params.tick_s
        inputs, servers = {}, {}
        for s in sims:
            s.step(now)
            inp, servers[s.name] = s.observe(now)
            est = s.canaries(servers[s.name], states[s.name], now)
            inputs[s.name] = {n: dataclasses.replace(i, canary=est[n]) if n in est else i for n, i in inp.items()}
        decisions, plans = {}, {}
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        for s, d in zip(sims, decide_pools([(states[s.name], inputs[s.name], s.policy) for s in sims], now),
                        strict=True):
            decisions[s.name] = d
            plans[s.name] = plan_backend(s.name, s.name, d.nodes, servers[s.name], d.agent_off)
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if profile is not None:
            profile.disable()
        for s in sims:
            d = decisions[s.name]
            states[s.name] = {**d.retained, **{n: nd.state for n, nd in d.nodes.items()}}
            s.apply(plans[s.name])
        yield Tick(k, now, inputs, servers, decisions, plans, states, t0, seconds, cpu)


# fields added to the decision after the digests were recorded, left out while empty: a decision that has nothing in
# them is written as before, so the recorded digests still say whether the decisions are the same
LATER_FIELDS = frozenset({("NodeDecision", "shadow"), ("SignalMemory", "probe_at"), ("SignalMemory", "probe_seen"),
                          ("SignalMemory", "probe_waited_share"), ("SignalMemory", "probe_failed_share"),
                          ("SignalMemory", "probe_excused"), ("NodeState", "unreachable")})


def _written(o, name: str) -> bool:
    return (type(o).__name__, name) not in LATER_FIELDS or bool(getattr(o, name))


def _plain(x):
    """A decision as plain JSON values (dataclasses by field, sets sorted, dict keys as they are)."""
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x) if _written(x, f.name)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, frozenset | set):
        return sorted(x)
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, str):
        return str(x)  # a StrEnum as its plain value
    return x


def canonical(tick: Tick, pools: list[str] | None = None) -> dict:
    """Every pool's decision and plan this tick as plain values (floats exact: json writes their repr)."""
    names = pools if pools is not None else sorted(tick.decisions)
    return {p: {"decision": _plain(tick.decisions[p]), "plan": [c.describe() for c in tick.plans[p]]} for p in names}


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def _fields(o):
    """json's fallback, one level at a time (the encoder recurses): a dataclass as its fields, a set sorted."""
    names = _field_names(type(o))
    if names is not None:
        return {n: getattr(o, n) for n in names if _written(o, n)}
    if isinstance(o, frozenset | set):
        return sorted(o)
    raise TypeError(f"{type(o).__name__} is not JSON")


def pool_digests(tick: Tick) -> dict[str, str]:
    """Each pool's SHA-256 of its canonical decision and plan (the text dumps(canonical(tick)[pool]) writes, made
    faster by letting json's encoder walk the dataclasses itself)."""
    return {p: hashlib.sha256(json.dumps({"decision": tick.decisions[p], "plan": [c.describe() for c in plan]},
                                         default=_fields, sort_keys=True, separators=(",", ":"),
                                         allow_nan=True).encode()).hexdigest()
            for p, plan in tick.plans.items()}


def combine(pools: Mapping[str, str]) -> str:
    """One tick's digest: the SHA-256 of its pools' digests in pool order."""
    return hashlib.sha256("".join(pools[p] for p in sorted(pools)).encode()).hexdigest()


def digest(tick: Tick) -> str:
    """SHA-256 of every pool's canonical decision and plan this tick (combine over pool_digests)."""
    return combine(pool_digests(tick))
