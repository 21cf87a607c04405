"""One simulated backend in virtual time, and what the controller can observe about it.

`VirtualNode` wraps the latency model (`sim.model.EngineModel`, or a constant-service-time backend for the Linkerd
replica) with its fault state and the per-node record the recording rules are computed from.
`observe()` is the single place that turns a node into per-tick observations; `node_input()` maps them
onto the controller's NodeInput, passing every optional signal NodeInput declares (probe results, error
ratio, KV usage, GPU flags, the exporter's live signals) as soon as the controller grows those fields.
`LiveSignals` models the exporter's fast path: vLLM's ITL and TTFT histograms read at every probe start,
differenced over the last few seconds, and scraped by Prometheus every `fast_scrape_s`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from grayguard.bench.spec import NodeSpec, Scenario
from grayguard.controller.policy import NodeInput
from grayguard.sim.faults import THERMAL_FAULTS, FaultState
from grayguard.sim.model import EngineModel, Finished, FirstToken, ModelParams, RequestStats, Slowdown, Stallable
from grayguard.vocab import PROBE_AGENT_DOWN


class FixedBackend(Stallable):
    """A plain HTTP server with a constant service time and unbounded concurrency (EngineModel's interface).

    Unlike vLLM it does not notice a client hanging up: an aborted request still completes and is
    recorded server-side, as a simple Go or Java server would.
    """

    def __init__(self, latency_s: float, slowdown) -> None:
        self.latency_s = latency_s
        self.slowdown = slowdown
        self._heap: list[tuple[float, int, object, float, int, int]] = []
        self._n = 0

    def submit(self, req_id, prompt_tokens: int, max_tokens: int, now: float) -> None:
        self._n += 1
        done = now + self.latency_s * self.slowdown(now).decode
        heapq.heappush(self._heap, (done, self._n, req_id, now, prompt_tokens, max_tokens))

    def advance(self, now: float) -> list:
        out: list = []
        if self._stalled_at is not None:
            now = min(now, self._stalled_at)
        heap = self._heap
        while heap and heap[0][0] <= now:
            t, _, rid, arrival, p, g = heapq.heappop(heap)
            out.append(FirstToken(rid, t))
            out.append(Finished(rid, t, 0, RequestStats(arrival, arrival, t, t, p, g, 0)))
        return out

    def next_event_time(self) -> float:
        if self._stalled_at is not None or not self._heap:
            return math.inf
        return self._heap[0][0]

    def abort(self, req_id) -> bool:
        return False  # the server finishes the work anyway

    def _thaw(self, since: float, now: float) -> None:
        shift = now - since
        self._heap = [(max(t, since) + shift, *rest) for t, *rest in self._heap]
        heapq.heapify(self._heap)

    def kv_usage(self) -> float:
        return 0.0

    @property
    def num_running(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class NodeObs:
    """What the controller's data sources show for one node at one tick (None: no sample).

    Field names match NodeInput's optional signals, so node_input() can pass them by name.
    """

    latency: float | None  # normalized latency over the window; None when nothing finished
    request_rate: float  # finished requests per second over the window
    error_ratio: float | None = None  # errored / (finished + errored) requests over the window
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc at the scrape
    gpu_throttled: bool | None = None  # thermal clock-event reasons under load (thermal, slow_recovery)
    pcie_degraded: bool | None = None  # PCIe link below its maximum under load (pcie)
    gpu_xid: bool | None = None  # an XID in the last 5 minutes (cuda_error emits one when it starts)
    probe_result: str | None = None  # the exporter's last probe class
    probe_ttft: float | None = None  # TTFT of its last answered probe
    probe_failures: int | None = None  # its consecutive failed probes
    probe_at: float | None = None  # when the probe shown was sent (its identity: counted once)
    # the exporter's fast path (LiveSignals), as Prometheus last scraped it: seconds, None: no data
    live_itl: float | None = None  # mean ITL of the tokens vLLM produced over the exporter's last live window
    live_ttft: float | None = None  # mean TTFT of the first tokens vLLM produced over that window (probes left out)
    probe_ttft_median: float | None = None  # median TTFT of the last answered probes (3 to 5 of them)
    live_prefill_rate: float | None = None  # prompt tokens prefilled per second over the live window
    live_decode_batch: float | None = None  # mean sequences decoding over the live window: delta(ITL sum) / span
    latency_at: float | None = None  # the rule evaluation the latency (and rate, errors) come from
    # HAProxy's `show stat` for the server, read at the tick (no scrape): None without a balancer model
    gateway_sessions: int | None = None  # scur: client requests on the server now
    gateway_started: int | None = None  # stot: cumulative requests sent to the server (failed attempts included)
    down: bool = False  # HAProxy has it DOWN (error-limit, its health check, or its agent): read from the runtime API
    gateway_marked_down: bool = False  # DOWN by error-limit, and no health check has overwritten that yet
    agent_down: bool = False  # DOWN (agent): the exporter answered HAProxy's agent check "down"
    agent_off: bool = False  # its agent check is disabled (the controller released it)


PROBE, CANARY, REAL = range(3)  # what a finished request is (VirtualNode.finished)
AGENT_DOWN_RESULTS = PROBE_AGENT_DOWN  # one strike: neither is load (the exporter's agent, grayguard.vocab)


PROBE_MEDIAN_OF = 5  # the exporter's probe TTFT median: over its last 5 answered probes,
PROBE_MEDIAN_MIN = 3  # at least 3 of them, ended within the last 2 live windows


class ProbeLog:
    """The exporter's micro-probe state for one node over time, as its gauges would be scraped."""

    def __init__(self, slow_s: float = math.inf) -> None:
        self.slow_s = slow_s  # the exporter's slow threshold: a probe waiting longer is exported slow while it waits
        # (time, result, last ttft, failures, when that probe was sent)
        self.history: deque[tuple[float, str, float | None, int, float]] = deque()
        self.waiting: list[float] = []  # when each probe still waiting for its answer was sent (oldest first)
        self.answered: deque[tuple[float, float]] = deque(maxlen=PROBE_MEDIAN_OF)  # (end, ttft) of ok / slow probes
        self.failures = 0
        self.last_ttft: float | None = None
        self.agent_down = False  # the exporter's agent verdict after its last probe (exporters/agent.py)

    def start(self, t: float) -> None:
        """A probe was sent at t and waits for its first token."""
        self.waiting.append(t)

    def finish(self, t: float, result: str, ttft: float | None, hung: bool = False, sent: float | None = None) -> None:
        """One probe ended at t with result (ok, slow, timeout, cuda_error, bad_response, connect_error).

        hung: a timeout during which vLLM made no token progress while it had requests (a hang, not load).
        sent: when it was sent (default t: it failed at once).
        """
        sent = t if sent is None else sent
        if sent in self.waiting:
            self.waiting.remove(sent)
        if result in ("ok", "slow"):
            self.failures = 0
            self.last_ttft = ttft
            if ttft is not None:
                self.answered.append((t, ttft))
        else:
            self.failures += 1
        self.agent_down = result in AGENT_DOWN_RESULTS or (result == "timeout" and hung)
        self.history.append((t, result, self.last_ttft, self.failures, sent))

    def ttft_median(self, t: float, horizon_s: float) -> float | None:
        """Median TTFT of the last answered probes that ended in (t - horizon_s, t]; None with fewer than 3."""
        recent = sorted(ttft for end, ttft in self.answered if t - horizon_s < end <= t)
        n = len(recent)
        if n < PROBE_MEDIAN_MIN:
            return None
        return recent[n // 2] if n % 2 else (recent[n // 2 - 1] + recent[n // 2]) / 2

    def at(self, t: float) -> tuple[str, float | None, int, float] | None:
        """The gauges as of time t (None before the first probe ended), with when the probe shown was sent (its
        identity); ticks move forward.

        As the exporter shows them (exporters/prober.py: Prober.exported): when the last probe answered and the next
        one has waited longer than the slow threshold at t, `slow` with the time waited as its TTFT, and its send time.
        """
        h = self.history
        while len(h) > 1 and h[1][0] <= t:
            h.popleft()
        if not h or h[0][0] > t:
            return None
        result, ttft, failures, shown = h[0][1], h[0][2], h[0][3], h[0][4]
        if result in ("ok", "slow"):
            # the probe waiting at t: one that ended after t (the next entry), else the one still waiting now
            sent = h[1][4] if len(h) > 1 else self.waiting[0] if self.waiting else None
            if sent is not None and sent <= t and t - sent > self.slow_s:
                return "slow", t - sent, failures, sent
        return result, ttft, failures, shown


def last_scrape(now: float, phase: float, every_s: float) -> float | None:
    """The last scrape at or before now of a target scraped every every_s from phase (None before the first)."""
    if now < phase:
        return None
    return phase + math.floor((now - phase) / every_s) * every_s


GPU_SIGNALS = ("gpu_throttled", "pcie_degraded", "gpu_xid")  # the hardware signals the simulator gives, in
# GpuFlags' order (no ECC fault, no peer-group label)


class GpuFlags:
    """The exporter's GPU evidence for one node (throttled, PCIe below its maximum, a recent XID), as the controller
    reads it.

    The exporter judges its GPUs from NVML when Prometheus scrapes its full page, every `scrape_s` from a per-node
    phase; the controller reads each hardware signal once in signals.hardware_every_s, on a schedule of its own
    (controller.ticker.next_read; bench.engine keeps it), and so sees the flags of the node's last scrape before its
    last read. The flags are noted at every tick (the simulator's resolution: a scrape sees the flags of the last
    tick at or before it); reads may go back up to keep_s.
    """

    def __init__(self, scrape_s: float, phase: float, keep_s: float) -> None:
        self.scrape_s = scrape_s
        self.phase = phase  # first scrape, in [0, scrape_s)
        self.keep_s = keep_s
        self.noted: deque[tuple[float, tuple[bool, bool, bool]]] = deque()

    def note(self, t: float, flags: tuple[bool, bool, bool]) -> None:
        """The flags the exporter would compute at t (ticks move forward)."""
        n = self.noted
        n.append((t, flags))
        while len(n) > 1 and n[1][0] <= t - self.keep_s:
            n.popleft()

    def at(self, read_at: float) -> tuple[bool, bool, bool] | None:
        """The flags a read at read_at sees: those of the node's last scrape at or before it (None before the first
        scrape, or before the first tick noted)."""
        s = last_scrape(read_at, self.phase, self.scrape_s)
        if s is None:
            return None
        for t, flags in reversed(self.noted):
            if t <= s + 1e-9:
                return flags
        return None


class LiveSignals:
    """The exporter's fast path for one node, and what Prometheus scraped of it.

    At every probe start the exporter reads vLLM's cumulative ITL and TTFT histograms (sum, count) and computes
    mean = delta(sum) / delta(count) between that reading and the newest one at least `window_s` old (else the
    oldest one at least window_s / 2 old; else no value); no token in between is no data, not zero. Prometheus
    scrapes the exporter every `scrape_s` from a per-node phase; the controller reads the latest scrape, so at
    tick t it sees the exporter's last computation before the node's last scrape before t. Amortized O(1).
    """

    def __init__(self, window_s: float, scrape_s: float, phase: float) -> None:
        self.window_s = window_s
        self.scrape_s = scrape_s
        self.phase = phase  # first scrape, in [0, scrape_s)
        # (t, itl sum, count, ttft sum, count, prompt tokens)
        self.readings: deque[tuple[float, float, int, float, int, int]] = deque()
        # (t, itl, ttft, probe median, prompt tokens/s, decode batch, KV-cache usage)
        self.computed: deque[tuple[float, float | None, float | None, float | None, float | None, float | None,
                                   float | None]] = deque()

    def read(self, t: float, itl_sum: float, itl_count: int, ttft_sum: float, ttft_count: int,
             probe_median: float | None, prompt_total: int = 0, kv_usage: float | None = None) -> None:
        """One reading of vLLM's /metrics at t, and the exporter's computation from it (the KV-cache usage is the
        reading's own gauge)."""
        r = self.readings
        r.append((t, itl_sum, itl_count, ttft_sum, ttft_count, prompt_total))
        old = t - self.window_s
        while len(r) > 1 and r[1][0] <= old:  # keep the newest reading at least a window old as the base
            r.popleft()
        itl = ttft = prefill = batch = None
        base = r[0]
        if t - base[0] >= self.window_s / 2:
            dn = itl_count - base[2]
            itl = (itl_sum - base[1]) / dn if dn else None
            dn = ttft_count - base[4]
            ttft = (ttft_sum - base[3]) / dn if dn else None
            prefill = (prompt_total - base[5]) / (t - base[0])
            batch = (itl_sum - base[1]) / (t - base[0]) if itl is not None else None
        self.computed.append((t, itl, ttft, probe_median, prefill, batch, kv_usage))

    def last_scrape(self, now: float) -> float | None:
        """The node's last scrape at or before now (None before the first)."""
        return last_scrape(now, self.phase, self.scrape_s)

    def at(self, now: float) -> tuple[float | None, float | None, float | None, float | None, float | None,
                                      float | None]:
        """(live ITL, live TTFT, probe TTFT median, prompt tokens/s, decode batch, KV-cache usage) as the controller
        reads them at now (ticks move forward)."""
        s = self.last_scrape(now)
        c = self.computed
        if s is None:
            return None, None, None, None, None, None
        while len(c) > 1 and c[1][0] <= s:
            c.popleft()
        if not c or c[0][0] > s:
            return None, None, None, None, None, None
        return c[0][1:]


class VirtualNode:
    """A backend: its engine, fault, and the record of finished and failed requests."""

    def __init__(self, spec: NodeSpec, index: int, scn: Scenario, params: ModelParams | None = None) -> None:
        self.spec = spec
        self.index = index
        self.faults = FaultState()
        self.drift = scn.drift
        self.drift_w = 2 * math.pi / scn.drift_period_s
        self.drift_phase = 2 * math.pi * index / max(1, len(scn.nodes))
        self.pool_slow = scn.pool_slowdown if scn.slowdown_all else None  # benign: the whole pool slower together
        self.cold = [a for a in scn.absent if a.node == spec.name and a.warmup_k > 1.0]  # warm-ups after a join
        seed = scn.seed * 7_919 + index
        if spec.backend == "fixed":
            self.engine = FixedBackend(spec.fixed_latency_s, self.slowdown)
        else:
            self.engine = EngineModel(params, speed=spec.speed, seed=seed, slowdown=self.slowdown)
        self.rng = random.Random(seed ^ 0x9E3779B9)  # draws for cuda_error / garbage rates
        # (time, e2e, prompt, generated, kind) of what vLLM finished; kind REAL, CANARY (the recording rules keep it in
        # the latency, subtract the controller's count from the rate) or PROBE (the exporter's traffic counters leave
        # it out of both; vLLM's request_success_total, the error ratio's denominator, still counts it)
        self.finished: deque[tuple[float, float, int, int, int]] = deque()
        self.errors: deque[float] = deque()  # times of requests that ended in an error (CUDA)
        self.probes = ProbeLog(scn.probe_slow_s)
        self.xid_at: float | None = None  # when a cuda_error fault emitted its XID
        self.last_token = -math.inf  # when the engine last produced a token (the agent's hang evidence)
        # vLLM's cumulative ITL and TTFT histograms (sum, count), what the exporter's fast path reads
        self.itl_sum = self.ttft_sum = 0.0
        self.itl_count = self.ttft_count = 0
        self.prompt_total = 0  # vLLM's prompt_tokens_total
        phase = random.Random(seed ^ 0x5C4A9E).uniform(0.0, scn.fast_scrape_s)  # its own stream: nothing else moves
        self.live = LiveSignals(scn.live_window_s, scn.fast_scrape_s, phase)
        phase = random.Random(seed ^ 0x6A09E6).uniform(0.0, scn.full_scrape_s)  # likewise
        self.gpu = GpuFlags(scn.full_scrape_s, phase, scn.hardware_every_s + scn.full_scrape_s + scn.tick_s)

    def slowdown(self, now: float) -> Slowdown:
        sd = self.faults.slowdown(now)
        k = 1.0
        if self.drift:
            k = 1.0 + self.drift * math.sin(self.drift_w * now + self.drift_phase)
        if self.pool_slow is not None:
            k *= self.pool_slow(now)
        for a in self.cold:
            k *= a.warmup(now)
        if k != 1.0:
            sd = Slowdown(sd.prefill * k, sd.decode * k, sd.kv_fraction)
        return sd

    def restart(self) -> None:
        """vLLM restarted: its counters start from zero, and so does the exporter's view of it."""
        self.itl_sum = self.ttft_sum = 0.0
        self.itl_count = self.ttft_count = 0
        self.prompt_total = 0
        self.last_token = -math.inf
        self.probes = ProbeLog(self.probes.slow_s)
        self.live = LiveSignals(self.live.window_s, self.live.scrape_s, self.live.phase)

    def fault_name(self) -> str | None:
        return self.faults.active.name if self.faults.active is not None else None

    def record(self, stats: RequestStats, kind: int = REAL) -> None:
        """A request finished (vLLM's per-request histograms observe it): a real one, a canary or a probe."""
        self.finished.append((stats.last_token, stats.e2e, stats.prompt_tokens, stats.generation_tokens, kind))

    def read_metrics(self, t: float) -> None:
        """The exporter reads vLLM's /metrics at t (a probe start) and recomputes its live signals."""
        w = self.live.window_s
        self.live.read(t, self.itl_sum, self.itl_count, self.ttft_sum, self.ttft_count,
                       self.probes.ttft_median(t, 2 * w), self.prompt_total,
                       self.engine.kv_usage() if self.spec.backend == "vllm" else None)

    def vllm_gauges(self) -> tuple[int, int, float] | None:
        """What vLLM's /metrics shows now: (num_requests_running, num_requests_waiting, kv_cache_usage_perc); None
        when the port refuses connections. Read-only.

        A hung engine core publishes no stats, so its gauges stay at its last step's: the running batch and the KV
        it holds do not change while the engine is stalled, and the queue counts only the requests that waited when
        it froze (the ones queued since are not in the gauge). Client aborts of frozen requests (after the client's
        deadline) do shrink this model's running batch, which a hung vLLM's gauge would not show.
        A plain server (the Linkerd replica's) shows its requests in progress as running, no queue and no KV.
        """
        if self.fault_name() == "refused":
            return None
        eng = self.engine
        if not isinstance(eng, EngineModel):
            return eng.num_running, 0, 0.0
        if eng.stalled:
            at = eng._stalled_at
            waiting = sum(1 for s in eng._waiting if s.arrival <= at)  # type: ignore[operator]
        else:
            waiting = eng.num_waiting
        return eng.num_running, waiting, eng.kv_usage()

    def forget_before(self, t: float) -> None:
        """Drop records older than t (ticks only move forward)."""
        fin, err = self.finished, self.errors
        while fin and fin[0][0] <= t:
            fin.popleft()
        while err and err[0] <= t:
            err.popleft()


def observe(node: VirtualNode, now: float, scn: Scenario,
            gateway: tuple[bool, bool, bool, bool] | None = None,
            stat: tuple[int, int] | None = None, hardware: Mapping[str, float] | None = None) -> NodeObs:
    """The node's signals at tick `now`, computed as the recording rules and exporters would show them.

    normalized latency = sum(e2e) / (omega * sum(prompt tokens) + sum(generated tokens)) over the requests
    that finished in (now - signal_lag - window, now - signal_lag]; no sample when none did. The exporter's probes
    are not among them (its traffic counters), and the request rate leaves the canaries out as well. Gauges (probe,
    GPU flags) are read as of now - gauge_lag; the KV-cache usage is the exporter's fast path's, as last scraped
    (else vLLM's own gauge now). gateway: (DOWN, DOWN by error-limit, DOWN (agent),
    agent disabled) as HAProxy's runtime API shows them now, for a policy behind HAProxy's reflexes
    (bench.lb.Gateway); None: no reflexes. stat: (scur, stot) of the server in HAProxy's `show stat` now
    (the balancer's model); None: unknown. The live signals are the exporter's, as last scraped (LiveSignals).
    hardware: when the controller last read each GPU signal (gpu_throttled, pcie_degraded, gpu_xid; bench.engine
    keeps the schedule), which then shows the node's last full-page scrape before that read (GpuFlags); None: read
    now, from the exporter's flags now.
    """
    # the recording rule is evaluated every rule_eval_s: a tick reads its last evaluation at least signal_lag old
    # (with 5 s ticks on the evaluation grid this is now - signal_lag); latency_at says which one it is
    hi = math.floor((now - scn.signal_lag_s) / scn.rule_eval_s + 1e-9) * scn.rule_eval_s
    lo = hi - scn.window_s
    node.forget_before(lo)
    e2e = weighted = 0.0
    n = done = 0
    for t, lat, p, g, kind in node.finished:
        if t > hi:
            break
        done += 1
        if kind == PROBE:
            continue
        e2e += lat
        weighted += scn.omega * p + g
        n += kind == REAL
    errors = sum(1 for t in node.errors if t <= hi)
    name = node.fault_name()
    busy = node.engine.num_running > 0 or n > 0  # the GPU flags need utilization > 0.5
    flags = (scn.gpu_evidence and name in THERMAL_FAULTS and busy, scn.gpu_evidence and name == "pcie" and busy,
             node.xid_at is not None and now - node.xid_at < 300.0)
    node.gpu.note(now, flags)
    gpu: list[bool | None] = list(flags)
    if hardware is not None:
        for k, signal in enumerate(GPU_SIGNALS):
            seen = node.gpu.at(hardware.get(signal, now))
            gpu[k] = None if seen is None else seen[k]
    probe = node.probes.at(now - scn.gauge_lag_s) if scn.probes else None
    live_itl, live_ttft, probe_median, prefill_rate, decode_batch, live_kv = node.live.at(now)
    if not scn.live_signals:  # an engine without these series: the exporter's probe median and KV reading remain
        live_itl = live_ttft = prefill_rate = decode_batch = None
    if live_kv is None and node.spec.backend == "vllm":  # signals.kv_cache_query: else vLLM's own series
        live_kv = node.engine.kv_usage()
    return NodeObs(
        latency=e2e / weighted if weighted > 0 else None,
        request_rate=n / scn.window_s,
        error_ratio=errors / (done + errors) if done + errors else None,
        kv_cache_usage=live_kv,
        gpu_throttled=gpu[0],
        pcie_degraded=gpu[1],
        gpu_xid=gpu[2],
        probe_result=probe[0] if probe else None,
        probe_ttft=probe[1] if probe else None,
        probe_failures=probe[2] if probe else None,
        probe_at=probe[3] if probe else None,
        live_itl=live_itl,
        live_ttft=live_ttft,
        probe_ttft_median=probe_median,
        live_prefill_rate=prefill_rate,
        live_decode_batch=decode_batch,
        latency_at=hi,
        gateway_sessions=stat[0] if stat is not None else None,
        gateway_started=stat[1] if stat is not None else None,
        down=gateway is not None and gateway[0],
        gateway_marked_down=gateway is not None and gateway[1],
        agent_down=gateway is not None and gateway[2],
        agent_off=gateway is not None and gateway[3],
    )


_NODE_INPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(NodeInput))
_OPTIONAL = tuple(f.name for f in dataclasses.fields(NodeObs) if f.name in _NODE_INPUT_FIELDS - {"latency",
                                                                                               "request_rate"})


def node_input(spec: NodeSpec, obs: NodeObs | None, canary: float | None = None) -> NodeInput:
    """The controller's NodeInput for one node; each optional signal only where NodeInput has the field."""
    if obs is None:
        return NodeInput(base_weight=spec.base_weight, peer_group=spec.peer_group, canary=canary)
    extra = {k: getattr(obs, k) for k in _OPTIONAL}
    return NodeInput(base_weight=spec.base_weight, latency=obs.latency, request_rate=obs.request_rate,
                     peer_group=spec.peer_group, canary=canary, **extra)
