"""The scenario engine: one scenario, one policy, in virtual time (discrete events, no sockets, no clock).

Arrivals go through a model of HAProxy's balancer (weighted leastconn or roundrobin) to simulated nodes
(sim.model.EngineModel stepped lazily: `advance(t)` whenever something must know a node's state at t);
faults are set and cleared on schedule; every control tick the policy's detector sees the observations
the recording rules would give and sets weights, the way the controller's loop applies them. grayguard's
canaries are real 1-token requests to the node and its peers; the decision waits for them as the live
loop does. Client deadlines abort requests (vLLM then forgets them: they never reach its histograms).
"""

from __future__ import annotations

import copy
import heapq
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from grayguard.bench.lb import Gateway, make_balancer
from grayguard.bench.node import CANARY, PROBE, NodeObs, VirtualNode, observe
from grayguard.bench.policies import Assign, make_policy
from grayguard.bench.spec import FaultSpec, Scenario, make_arrivals
from grayguard.config import HARDWARE_SIGNALS
from grayguard.controller.ticker import next_read
from grayguard.sim.model import Finished, FirstToken, ModelParams, StepDone

PENDING, OK, TIMEOUT, ERROR, GARBAGE, NO_SERVER = range(6)
STATUS_NAMES = ("pending", "ok", "timeout", "error", "garbage", "no_server")
PROBE_PROMPT_TOKENS = 8  # "The capital of France is" plus the prober's random prefix (canaries: the same)


@dataclass
class RunResult:
    """Everything one run produced; metrics are computed from it (bench.metrics)."""

    scenario: Scenario
    policy: str
    t: list[float]  # arrival times (the scenario's arrivals, in order)
    node: list[int]  # server index per request (-1: none)
    status: list[int]  # OK, TIMEOUT, ERROR, GARBAGE, NO_SERVER
    ttft: list[float]  # from arrival; NaN when no first token
    e2e: list[float]  # from arrival to the end (answer, error or deadline)
    # (time, node index, weight, drained, state) each time a server's assignment changed; t=0 rows: start.
    timeline: list[tuple[float, int, int, bool, str]] = field(default_factory=list)
    # (tick time, {node: normalized latency}) as the controller would read them.
    signals: list[tuple[float, dict[str, float | None]]] = field(default_factory=list)
    canaries: int = 0
    wall_s: float = 0.0
    retried: bytearray = field(default_factory=bytearray)  # retries (redispatches) per request
    # HAProxy's own state changes: (time, node index, marked down, why: error-limit | check fall | check rise |
    # agent | agent up | agent disabled)
    gateway: list[tuple[float, int, bool, str]] = field(default_factory=list)
    # (time, node index, cut) each time a node's cut changed: held below its state's weight by a finding (grayguard's
    # detector says so; a weight alone does not tell a cut warm-up from a warm-up)
    cuts: list[tuple[float, int, bool]] = field(default_factory=list)


class _CanaryRound:
    """Canary requests in flight for one tick: the decision waits for their answers or the deadline."""

    def __init__(self, now: float, deadline: float, obs: dict[str, NodeObs]) -> None:
        self.now, self.deadline, self.obs = now, deadline, obs
        self.requests: dict[int, tuple[str, int, float]] = {}  # rid -> (target name, node index, sent)
        self.ttft: dict[str, float | None] = {}

    def next_time(self, nodes: list[VirtualNode]) -> float:
        t = self.deadline
        for name, k, _sent in self.requests.values():
            if name not in self.ttft:
                t = min(t, nodes[k].engine.next_event_time())
        return t

    def done(self) -> bool:
        return all(name in self.ttft for name, _k, _s in self.requests.values())


# the hardware signals the controller reads on their schedule, in its order: the shipped config's (no peer-group
# label: the suite's peer groups are configured per server)
HARDWARE_SLOTS = tuple(n for n in HARDWARE_SIGNALS if n != "peer_group")


class Run:
    """The state of one run; `Run(scn, policy).execute()` returns the RunResult."""

    def __init__(self, scn: Scenario, policy: str, params: ModelParams | None = None) -> None:
        self.scn = scn
        self.nodes = [VirtualNode(spec, i, scn, params) for i, spec in enumerate(scn.nodes)]
        self.index = {n.spec.name: n.index for n in self.nodes}
        self.detector, balancer = make_policy(policy, scn.nodes, scn)
        self.lb = make_balancer(balancer, len(self.nodes), scn.seed)
        self.lazy = balancer == "roundrobin"  # roundrobin needs no node state to pick
        self.weights = [n.base_weight for n in scn.nodes]
        self.drained = [False] * len(self.nodes)
        self.state = ["healthy"] * len(self.nodes)
        self.cut = [False] * len(self.nodes)
        arr = make_arrivals(scn)
        self.arr = arr
        r = len(arr)
        self.res = RunResult(scn, policy, arr.t, [-1] * r, [PENDING] * r, [math.nan] * r, [math.nan] * r)
        self.res.timeline = [(0.0, k, w, False, "healthy") for k, w in enumerate(self.weights)]
        self.res.retried = bytearray(r)
        self.garbage = bytearray(r)
        self.midstream = bytearray(r)
        self.deadlines: deque[tuple[float, int]] = deque()
        self.canary: _CanaryRound | None = None
        self._synthetic_id = 0  # canaries and probes have negative request ids
        self.now = 0.0
        self.ai = 0
        interval = self.detector.interval_s
        self.next_tick = (scn.control_start_s or interval) if interval else math.inf
        # the controller's reads of the GPU evidence (signals.hardware_every_s): when each signal was last read, and
        # when it is due next
        self.hardware_read: dict[str, float] = {}
        self.hardware_due: dict[str, float] = {}
        # a balancer that reads the nodes (a peer's: bench.peers) is refreshed every refresh_s; HAProxy's never are
        self.next_refresh = self.lb.refresh_s or math.inf
        self._schedule_faults(0.0)
        # pool membership (Scenario.absent): (time, node index, joins, its Absence); absent nodes are not in HAProxy
        self.absent = [False] * len(self.nodes)
        self.member_events = []
        for a in scn.absent:
            k = self.index[a.node]
            if a.from_s <= 0:
                self.absent[k] = True
            else:
                self.member_events.append((a.from_s, k, False, a))
            self.member_events.append((a.until_s, k, True, a))
        self.member_events.sort(key=lambda x: (x[0], x[2], x[1]))
        self.mi = 0
        self.probe_inflight: dict[int, tuple[int, float]] = {}  # rid -> (node index, sent)
        self.probe_ids: set[int] = set()  # probes waiting for their answer, which the exporter will tally
        self.untallied: set[int] = set()  # probes that timed out, but that a plain server still finishes
        self.probe_deadlines: deque[tuple[float, int]] = deque()
        self.probe_rng = random.Random(scn.seed * 31 + 5)
        self.probe_due: list[tuple[float, int]] = []
        if scn.probes:
            self.probe_due = [(self.probe_rng.uniform(0, scn.probe_interval_s), k) for k in range(len(self.nodes))]
            heapq.heapify(self.probe_due)
        rx = self.detector.reflexes
        self.gw = Gateway(rx, len(self.nodes)) if rx is not None else None
        self.res.gateway = self.gw.events if self.gw is not None else []
        self.check_due: list[tuple[float, int]] = []  # HAProxy's active health checks (reflexes only)
        self.agent_due: list[tuple[float, int]] = []  # HAProxy's agent checks of the exporters (reflexes only)
        if rx is not None:
            self.check_due = [(self.probe_rng.uniform(0, rx.check_inter_s), k) for k in range(len(self.nodes))]
            heapq.heapify(self.check_due)
            if scn.probes:  # without its probe the exporter answers "up": the agent never changes anything
                self.agent_due = [(self.probe_rng.uniform(0, rx.agent_inter_s), k) for k in range(len(self.nodes))]
                heapq.heapify(self.agent_due)

    # -- plumbing ---------------------------------------------------------------------------------
    def advance(self, k: int, t: float) -> None:
        """Bring node k to time t and account for everything that happened on it."""
        node = self.nodes[k]
        evs = node.engine.advance(t)
        if not evs:
            return
        res = self.res
        status = res.status
        for ev in evs:
            tp = type(ev)
            if tp is StepDone:
                if ev.generated:
                    node.last_token = ev.time
                node.prompt_total += ev.prompt_tokens  # vLLM's prompt_tokens_total: prompts whose first token came
                if ev.itls:  # vLLM observes one ITL per decoding sequence per step
                    node.itl_sum += sum(ev.itls)
                    node.itl_count += len(ev.itls)
                continue
            if tp is FirstToken:
                node.last_token = ev.time
                rid = ev.req_id
                if rid < 0:
                    f = node.faults.active  # the prober rejects garbage text as a bad response
                    bad = f is not None and f.name == "garbage" and node.rng.random() < f.params["rate"]
                    c = self.canary
                    if rid in self.probe_inflight:
                        _k, sent = self.probe_inflight.pop(rid)
                        ttft = ev.time - sent
                        node.probes.finish(ev.time, "bad_response" if bad else
                                           "slow" if ttft > self.scn.probe_slow_s else "ok", ttft, sent=sent)
                    elif c is not None and rid in c.requests:
                        name, _k, sent = c.requests[rid]
                        ttft = ev.time - sent
                        c.ttft[name] = None if bad else ttft
                    else:
                        continue
                    if rid not in self.probe_ids:  # the exporter's live TTFT leaves its own probes out
                        node.ttft_sum += ttft  # vLLM's TTFT histogram sees canaries too: the exporter cannot tell
                        node.ttft_count += 1
                    continue
                node.ttft_sum += ev.time - res.t[rid]  # submitted at its arrival (retries: the same instant)
                node.ttft_count += 1
                if status[rid] == PENDING:
                    res.ttft[rid] = ev.time - res.t[rid]
                    self.lb.first_byte(k, ev.time, res.ttft[rid])  # the stream's first bytes reach the gateway
                    if self.gw is not None:  # the status line (200) reached HAProxy
                        self.gw.answered(k)
                    if self.midstream[rid]:  # cuda_error midstream: an error event after the first token
                        node.engine.abort(rid)
                        node.errors.append(ev.time)
                        self._end(rid, k, ERROR, ev.time)
            elif tp is Finished:
                rid = ev.req_id
                if rid >= 0:
                    node.record(ev.stats)
                elif rid in self.probe_ids:  # vLLM counts it; the exporter's traffic counters take it out
                    self.probe_ids.discard(rid)
                    node.record(ev.stats, PROBE)
                elif rid in self.untallied:  # a probe that timed out and finished later: the exporter never saw it
                    self.untallied.discard(rid)
                    node.record(ev.stats)
                else:  # a canary: in the latency sums, out of the request rate (the rules subtract the controller's)
                    node.record(ev.stats, CANARY)
                if rid >= 0 and status[rid] == PENDING:
                    self._end(rid, k, GARBAGE if self.garbage[rid] else OK, ev.time)

    def _end(self, rid: int, k: int, st: int, t: float) -> None:
        self.res.status[rid] = st
        self.res.e2e[rid] = t - self.res.t[rid]
        if math.isnan(self.res.ttft[rid]):  # it ends without a first byte: the gateway's wait for one ends too
            self.lb.first_byte(k, t, self.res.e2e[rid])
        self.lb.ended(k, t)
        self.apply(self.detector.on_result(self.nodes[k].spec.name, st in (OK, GARBAGE), t), t)

    def apply(self, changes: dict[str, Assign], t: float) -> None:
        gw = self.gw
        for name, a in changes.items():
            k = self.index[name]
            if (a.weight, a.drained, a.state) != (self.weights[k], self.drained[k], self.state[k]):
                self.weights[k], self.drained[k], self.state[k] = a.weight, a.drained, a.state
                self.res.timeline.append((t, k, a.weight, a.drained, a.state))
            if a.cut != self.cut[k]:
                self.cut[k] = a.cut
                self.res.cuts.append((t, k, a.cut))
            if gw is not None:  # `enable agent` / `disable agent`
                gw.set_agent(k, a.agent, t)

    # -- events -----------------------------------------------------------------------------------
    def _eligible(self, exclude: list[int]) -> list[bool]:
        """The `drained` list the balancer sees: drained, marked down by HAProxy, absent, or already tried."""
        gw = self.gw
        absent = self.absent if True in self.absent else None
        if gw is None and not exclude and absent is None:
            return self.drained
        down = gw.out if gw is not None else [False] * len(self.nodes)
        if absent is not None:
            down = [g or a for g, a in zip(down, absent, strict=True)]
        return [d or g or j in exclude for j, (d, g) in enumerate(zip(self.drained, down, strict=True))]

    def _fails_at_once(self, node: VirtualNode, t: float) -> str | None:
        """How an attempt on node fails before anything is sent back: 'conn-failure', '500', or None."""
        f = node.faults.active
        if f is None:
            return None
        if f.name == "refused":
            return "conn-failure"
        if f.name == "cuda_error" and f.params["mode"] == "http" and node.rng.random() < f.params["rate"]:
            node.errors.append(t)  # HTTP 500 before any output; vLLM counts finished_reason=error
            return "500"
        return None

    def arrival(self, i: int) -> None:
        t = self.arr.t[i]
        pin = self.arr.pin[i]
        if not self.lazy:
            for k in range(len(self.nodes)):
                self.advance(k, t)
        gw = self.gw
        res = self.res
        tried: list[int] = []
        if gw is not None:
            gw.request(t)
        sticky = pin >= 0 and not self.absent[pin] and (gw is None or not gw.out[pin])  # else: balanced
        k = pin if sticky else self.lb.pick(self.weights, self._eligible([]), t)
        while True:
            if k is None:  # HAProxy answers 503 itself
                res.status[i], res.e2e[i] = NO_SERVER, 0.0
                if gw is not None:
                    gw.response_failed(t)
                return
            node = self.nodes[k]
            res.node[i] = k
            why = self._fails_at_once(node, t)
            if why is None:
                break
            self.lb.failed_at_once(k, t, why)  # sent to the server all the same: HAProxy's stot counts it
            if gw is None:
                res.status[i], res.e2e[i] = ERROR, 0.0
                self.apply(self.detector.on_result(node.spec.name, False, t), t)
                return
            gw.failed(k, t)
            tried.append(k)
            rx = gw.rx
            retry = len(tried) <= rx.retries and why in rx.retry_on and (why == "conn-failure" or gw.budget_ok(t))
            nxt = None
            if retry:  # redispatch: the balancer picks again among the servers not tried yet
                nxt = self.lb.pick(self.weights, self._eligible(tried), t) if rx.redispatch else k
            if nxt is None:
                res.status[i], res.e2e[i] = ERROR, 0.0
                gw.response_failed(t)
                self.apply(self.detector.on_result(node.spec.name, False, t), t)
                return
            res.retried[i] += 1
            k = nxt
        node = self.nodes[k]
        f = node.faults.active
        if f is not None and f.name == "cuda_error" and f.params["mode"] == "midstream" \
                and node.rng.random() < f.params["rate"]:
            self.midstream[i] = 1
        if f is not None and f.name == "garbage" and node.rng.random() < f.params["rate"]:
            self.garbage[i] = 1
        if self.lazy:
            self.advance(k, t)
        node.engine.submit(i, self.arr.prompt[i], self.arr.gen[i], t)
        self.advance(k, t)
        self.lb.started(k, t)
        self.deadlines.append((t + self.scn.load.timeout_s, i))

    def health_check(self) -> None:
        """HAProxy's active check of one server (GET /health): 200 unless the process refuses connections."""
        t, k = heapq.heappop(self.check_due)
        assert self.gw is not None
        if self.absent[k]:  # not in the backend: nothing to check
            heapq.heappush(self.check_due, (t + self.gw.rx.check_inter_s, k))
            return
        self.gw.check(k, t, self.nodes[k].fault_name() != "refused")
        heapq.heappush(self.check_due, (t + self.gw.next_check_in(k), k))

    def agent_check(self) -> None:
        """HAProxy's agent check of one server: the exporter answers its verdict on its last probe, now."""
        t, k = heapq.heappop(self.agent_due)
        assert self.gw is not None
        if self.absent[k]:
            heapq.heappush(self.agent_due, (t + self.gw.rx.agent_inter_s, k))
            return
        self.advance(k, t)  # every probe that ended by t is in the log
        self.gw.agent(k, t, self.nodes[k].probes.agent_down)
        heapq.heappush(self.agent_due, (t + self.gw.rx.agent_inter_s, k))

    def deadline(self) -> None:
        t, rid = self.deadlines.popleft()
        if self.res.status[rid] != PENDING:
            return
        k = self.res.node[rid]
        self.advance(k, t)
        if self.res.status[rid] == PENDING:
            self.nodes[k].engine.abort(rid)
            self._end(rid, k, TIMEOUT, t)

    def fault(self, t: float, k: int, spec: FaultSpec, clear: bool) -> None:
        node = self.nodes[k]
        self.advance(k, t)
        if clear:
            if node.fault_name() == spec.fault:  # a scheduled clear only clears its own fault
                node.faults.clear(t)
                node.engine.resume(t)
                self.apply(self.detector.on_fault(node.spec.name, t, clear=True), t)
            return
        self.apply(self.detector.on_fault(node.spec.name, t, clear=False), t)
        was_hang = node.fault_name() == "hang"
        node.faults.set(spec.fault, spec.params, t)
        if spec.fault == "cuda_error":
            node.xid_at = t  # the exporter sees the XID once
        if spec.fault == "hang":
            node.engine.stall(t)
        elif was_hang:
            node.engine.resume(t)

    def member(self, t: float, k: int, joins: bool, a) -> None:
        """Node k leaves the pool (removed from HAProxy's backend) or joins it (added, at its base weight)."""
        self.advance(k, t)
        self.absent[k] = not joins
        if not joins:
            return
        node = self.nodes[k]
        if a.from_s > 0:  # it was running before: vLLM restarted
            node.restart()
        if self.gw is not None:
            self.gw.rejoin(k)
        base = node.spec.base_weight
        if (self.weights[k], self.drained[k]) != (base, False):
            self.weights[k], self.drained[k], self.state[k] = base, False, "healthy"
            self.res.timeline.append((t, k, base, False, "healthy"))

    def read_hardware(self, t: float) -> dict[str, float]:
        """The tick at t reads the GPU signals that are due, as the controller does (loop.read_optional: each once in
        hardware_every_s, spread over the ticks; 0: every tick); when each was last read."""
        every, slots = self.scn.hardware_every_s, HARDWARE_SLOTS
        for k, name in enumerate(slots):
            due = self.hardware_due.get(name)
            if every <= 0 or due is None or t >= due - 1e-9:
                self.hardware_read[name] = t
                if every > 0:
                    self.hardware_due[name] = next_read(due, t, every, k, len(slots))
        return self.hardware_read

    def tick(self, t: float) -> None:
        for k in range(len(self.nodes)):
            self.advance(k, t)
        gw, lb = self.gw, self.lb
        hardware = self.read_hardware(t)
        obs = {n.spec.name: observe(n, t, self.scn, None if gw is None else (
            gw.out[n.index], gw.hana[n.index], gw.agent_down[n.index], not gw.agent_on[n.index]),
            (lb.active[n.index], lb.stot[n.index]), hardware) for n in self.nodes if not self.absent[n.index]}
        self.res.signals.append((t, {name: o.latency for name, o in obs.items()}))
        rounds = self.detector.canaries(t)
        if not rounds:
            self.apply(self.detector.tick(t, obs, {}), t)
            return
        c = _CanaryRound(t, t + self.detector.policy.recovery.canary_timeout_s, obs)  # type: ignore[attr-defined]
        for target in sorted({m for _n, targets in rounds for m in targets}):
            k = self.index[target]
            node = self.nodes[k]
            rid = self._new_id()
            c.requests[rid] = (target, k, t)
            self.res.canaries += 1
            f = node.faults.active
            if f is not None and (f.name == "refused" or f.name == "cuda_error" and f.params["mode"] == "http"
                                  and node.rng.random() < f.params["rate"]):
                c.ttft[target] = None
                continue
            node.engine.submit(rid, PROBE_PROMPT_TOKENS, 1, t)
            self.advance(k, t)
        self.canary = c
        self.canary_step(t)

    def lb_refresh(self, t: float) -> None:
        """A peer balancer's periodic read of the nodes (its metrics scrape, its reconnect attempts)."""
        self.next_refresh += self.lb.refresh_s  # type: ignore[operator]
        for k in range(len(self.nodes)):
            self.advance(k, t)
        self.lb.refresh(t, [None if self.absent[n.index] else n.vllm_gauges() for n in self.nodes])

    def _new_id(self) -> int:
        self._synthetic_id -= 1
        return self._synthetic_id

    def probe_send(self) -> None:
        """The exporter's micro-probe: 1 token, 2 s deadline; the next one probe_interval_s +-20 % later.

        As it starts a probe the exporter also reads vLLM's /metrics for its live signals (VirtualNode.read_metrics).
        """
        t, k = heapq.heappop(self.probe_due)
        scn = self.scn
        heapq.heappush(self.probe_due, (t + scn.probe_interval_s * self.probe_rng.uniform(0.8, 1.2), k))
        if self.absent[k]:  # its exporter starts with it
            return
        node = self.nodes[k]
        self.advance(k, t)
        f = node.faults.active
        if f is not None and f.name == "refused":  # /metrics refuses too: no reading, the last values stay
            node.probes.finish(t, "connect_error", None)
            return
        node.read_metrics(t)  # the exporter's fast path reads vLLM's /metrics as each probe starts
        if f is not None and f.name == "cuda_error" and f.params["mode"] == "http" \
                and node.rng.random() < f.params["rate"]:
            node.probes.finish(t, "cuda_error", None)
            return
        rid = self._new_id()
        self.probe_inflight[rid] = (k, t)
        self.probe_ids.add(rid)
        node.probes.start(t)
        self.probe_deadlines.append((t + scn.probe_deadline_s, rid))
        node.engine.submit(rid, PROBE_PROMPT_TOKENS, 1, t)
        self.advance(k, t)

    def probe_deadline(self) -> None:
        t, rid = self.probe_deadlines.popleft()
        if rid not in self.probe_inflight:
            return
        k, sent = self.probe_inflight[rid]
        self.advance(k, t)
        if self.probe_inflight.pop(rid, None) is not None:
            node = self.nodes[k]
            # the exporter's hang evidence: vLLM holds requests (the probe's at least) and made no token since
            # the probe was sent; a loaded node that still makes tokens is slow, not hung
            hung = node.last_token <= sent and node.engine.num_running + getattr(node.engine, "num_waiting", 0) > 0
            self.probe_ids.discard(rid)  # no answer: the exporter tallies nothing
            if not node.engine.abort(rid):  # vLLM forgets it; a plain server finishes it anyway, counted
                self.untallied.add(rid)
            node.probes.finish(t, "timeout", None, hung=hung, sent=sent)

    def canary_step(self, t: float) -> None:
        c = self.canary
        assert c is not None
        for _rid, (name, k, _s) in c.requests.items():
            if name not in c.ttft:
                self.advance(k, t)
        if not c.done() and t < c.deadline:
            return
        for rid, (name, k, _s) in c.requests.items():
            if name not in c.ttft:
                self.nodes[k].engine.abort(rid)
                c.ttft[name] = None
        self.canary = None
        self.apply(self.detector.tick(c.now, c.obs, c.ttft), t)

    # -- the loop ---------------------------------------------------------------------------------
    def _schedule_faults(self, after: float) -> None:
        self.fault_events = []
        for f in self.scn.faults:
            if f.at_s < after:
                raise ValueError(f"{self.scn.name}: fault at {f.at_s}s is before the branch point {after}s")
            self.fault_events.append((f.at_s, self.index[f.node], f, False))
            if f.until_s is not None:
                self.fault_events.append((f.until_s, self.index[f.node], f, True))
        self.fault_events.sort(key=lambda x: (x[0], x[3]))
        self.fi = 0

    def branch(self, scn: Scenario) -> Run:
        """A copy of this run (stopped with execute(until=T)) that continues as `scn` from T.

        scn must have the same traffic (same healthy twin) and no fault before T: the copy is then exactly
        what a full run of scn would have been at T. Scenarios that share their traffic share the prefix.
        """
        if scn.traffic_key() != self.scn.traffic_key():
            raise ValueError(f"{scn.name}: different traffic, cannot branch from {self.scn.name}")
        b = copy.deepcopy(self)
        b.scn = b.res.scenario = scn
        b._schedule_faults(self.now)
        return b

    def execute(self, until: float = math.inf) -> RunResult:
        """Process events until `until` (exclusive; default: the end); the result is complete only at the end."""
        started = time.perf_counter()
        scn, arr = self.scn, self.arr
        inf = math.inf
        interval = self.detector.interval_s
        end = scn.duration_s
        n_arr = len(arr)
        times = arr.t
        faults = self.fault_events
        n_faults = len(faults)
        while True:
            ai, fi = self.ai, self.fi
            t_arr = times[ai] if ai < n_arr else inf
            t_fault = faults[fi][0] if fi < n_faults else inf
            t_dead = self.deadlines[0][0] if self.deadlines else inf
            t_tick = self.next_tick if self.next_tick <= end else inf
            t_can = self.canary.next_time(self.nodes) if self.canary is not None else inf
            t_probe = self.probe_due[0][0] if self.probe_due and self.probe_due[0][0] < end else inf
            t_pdead = self.probe_deadlines[0][0] if self.probe_deadlines else inf
            t_check = self.check_due[0][0] if self.check_due and self.check_due[0][0] < end else inf
            t_agent = self.agent_due[0][0] if self.agent_due and self.agent_due[0][0] < end else inf
            t_member = self.member_events[self.mi][0] if self.mi < len(self.member_events) else inf
            t_lbr = self.next_refresh if self.next_refresh < end else inf
            t = min(t_arr, t_fault, t_dead, t_tick, t_can, t_probe, t_pdead, t_check, t_agent, t_member, t_lbr)
            if t == inf or t >= until:
                break
            self.now = t
            if t == t_member:
                _t, k, joins, a = self.member_events[self.mi]
                self.mi += 1
                self.member(t, k, joins, a)
            elif t == t_check:
                self.health_check()
            elif t == t_agent:
                self.agent_check()
            elif t == t_pdead:
                self.probe_deadline()
            elif t == t_probe:
                self.probe_send()
            elif t == t_fault:
                _t, k, spec, clear = faults[fi]
                self.fi = fi + 1
                self.fault(t, k, spec, clear)
            elif t == t_can:
                self.canary_step(t)
            elif t == t_tick:
                self.next_tick += interval  # type: ignore[operator]
                if self.canary is None:  # a tick still waiting for canaries is not started twice
                    self.tick(t)
            elif t == t_dead:
                self.deadline()
            elif t == t_lbr:
                self.lb_refresh(t)
            else:
                self.ai = ai + 1
                self.arrival(ai)
        if until < inf:
            self.now = until
        self.res.wall_s += time.perf_counter() - started
        return self.res


def run(scn: Scenario, policy: str, *, healthy: bool = False, params: ModelParams | None = None) -> RunResult:
    """Run one scenario (or, with healthy=True, its fault-free twin) under one policy."""
    return Run(scn.healthy_twin() if healthy else scn, policy, params).execute()


def run_family(scenarios: list[Scenario], policy: str, params: ModelParams | None = None) -> list[RunResult]:
    """Run scenarios that share their traffic: the common fault-free prefix once, then one branch each.

    Returns one RunResult per scenario, in order; each equals what run(scenario, policy) returns.
    """
    if not scenarios:
        return []
    split = min((f.at_s for s in scenarios for f in s.faults), default=math.inf)
    root = Run(scenarios[0].healthy_twin(), policy, params)
    if split == math.inf or len(scenarios) == 1:
        return [Run(s, policy, params).execute() for s in scenarios]
    root.execute(until=split)
    out = []
    for s in scenarios:
        b = root.branch(s)
        b.res.wall_s = 0.0
        out.append(b.execute())
    return out
