"""The exporter's fast path in the benchmark (issue 13): live ITL / TTFT, the probe TTFT median, HAProxy's stat.

Checked against a direct computation from the engine's own events, recorded by a wrapper around each node's
engine: what vLLM observed, what the exporter read at each probe start, and what Prometheus scraped.
"""

from __future__ import annotations

import statistics

import pytest

from grayguard.bench.engine import NO_SERVER, Run
from grayguard.bench.node import LiveSignals, ProbeLog, observe
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, PinnedLoad, Scenario
from grayguard.sim.loadgen import LengthDist
from grayguard.sim.model import FirstToken, StepDone


class Recorder:
    """An engine that records what vLLM's histograms observe: (time, itls) per step, (time, ttft) per first token."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.steps: list[tuple[float, tuple[float, ...]]] = []
        self.first: list[tuple[float, float, object]] = []  # (time, ttft, request id)
        self.sent: dict[object, float] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, req_id, prompt_tokens: int, max_tokens: int, now: float) -> None:
        self.sent[req_id] = now
        self._engine.submit(req_id, prompt_tokens, max_tokens, now)

    def advance(self, now: float) -> list:
        evs = self._engine.advance(now)
        for ev in evs:
            if type(ev) is StepDone and ev.itls:
                self.steps.append((ev.time, ev.itls))
            elif type(ev) is FirstToken:
                self.first.append((ev.time, ev.time - self.sent[ev.req_id], ev.req_id))
        return evs


def pool(n: int) -> tuple[NodeSpec, ...]:
    return tuple(NodeSpec(f"node{i}") for i in range(n))


def recorded_run(scn: Scenario, policy: str = "leastconn") -> tuple[Run, list[Recorder]]:
    r = Run(scn, policy)
    recs = []
    for node in r.nodes:
        node.engine = Recorder(node.engine)
        recs.append(node.engine)
    return r, recs


def view(r: Run, t: float) -> dict[str, object]:
    """Every node's observations at a tick at t, as Run.tick builds them."""
    r.execute(until=t)
    for k in range(len(r.nodes)):
        r.advance(k, t)
    return {n.spec.name: observe(n, t, r.scn, None, (r.lb.active[n.index], r.lb.stot[n.index])) for n in r.nodes}


def mean_between(rows, lo: float, hi: float) -> float | None:
    vals = [v for t, v in rows if lo < t <= hi]
    return sum(vals) / len(vals) if vals else None


def test_live_values_match_a_direct_computation_and_lag_by_the_scrape():
    scn = Scenario("live", pool(2), LoadSpec(utilization=0.5), duration_s=30.0, seed=3)
    r, recs = recorded_run(scn)
    w, lagged = scn.live_window_s, 0
    for t in (2.0, 4.3, 8.0, 12.5, 17.0, 21.3, 25.0, 28.7):
        obs = view(r, t)
        for node, rec in zip(r.nodes, recs, strict=True):
            o = obs[node.spec.name]
            scrapes = [node.live.phase + j * scn.fast_scrape_s for j in range(40)]
            s = max(x for x in scrapes if x <= t)
            reads = sorted(v for rid, v in rec.sent.items() if isinstance(rid, int) and rid < 0)  # probe starts
            last = max((x for x in reads if x <= s), default=None)
            if last is None:
                assert o.live_itl is o.live_ttft is o.probe_ttft_median is None
                continue
            lagged += max(x for x in reads if x <= t) > last  # the exporter has computed since that scrape
            old = [x for x in reads if x <= last - w]
            base = max(old) if old else reads[0] if last - reads[0] >= w / 2 else None
            if base is None:
                assert o.live_itl is None and o.live_ttft is None
            else:
                itls = [(st, x) for st, xs in rec.steps for x in xs]
                assert o.live_itl == pytest.approx(mean_between(itls, base, last), rel=1e-9)
                real = [(ft, v) for ft, v, rid in rec.first if not (isinstance(rid, int) and rid < 0)]
                want = mean_between(real, base, last)  # the exporter leaves its probes out (no canaries here)
                assert o.live_ttft == (None if want is None else pytest.approx(want, rel=1e-9))
            probes = [(ft, v) for ft, v, rid in rec.first if isinstance(rid, int) and rid < 0 and ft <= last]
            recent = [v for ft, v in probes[-5:] if ft > last - 2 * w]
            assert o.probe_ttft_median == (statistics.median(recent) if len(recent) >= 3 else None)
        if t >= 12.0:
            assert all(o.live_itl is not None and o.live_ttft is not None for o in obs.values())
    assert lagged > 0  # some ticks saw an older computation than the exporter's newest


def test_a_thermal_node_shows_in_live_itl_within_seconds_while_the_30s_signal_has_not_moved():
    fault_at = 40.0
    scn = Scenario("thermal3", pool(4), LoadSpec(utilization=0.4),
                   (FaultSpec("node0", "thermal", fault_at, None, {"k": 3.0}),), duration_s=fault_at + 15, seed=2)
    r, _ = recorded_run(scn)

    def ratios(t: float) -> tuple[float, float]:
        obs = view(r, t)
        peer_itl = statistics.median(obs[f"node{i}"].live_itl for i in (1, 2, 3))
        peer_lat = statistics.median(obs[f"node{i}"].latency for i in (1, 2, 3))
        return obs["node0"].live_itl / peer_itl, obs["node0"].latency / peer_lat

    itl, _lat = ratios(fault_at - 1)
    assert 0.85 < itl < 1.15
    itl, lat = ratios(fault_at + scn.live_window_s + 2.5)  # a full window, a reading, a scrape
    assert 2.4 < itl < 3.6
    assert lat < 1.3  # finished requests over 30 s, read 5 s late: still mostly pre-fault work


def test_a_node_without_traffic_has_no_live_itl_or_ttft_but_its_probes_show():
    one = LengthDist(200, 1.0, 8, 4000)
    load = LoadSpec(utilization=None, rate=0.0, pinned=(PinnedLoad("node0", 0.0, 30.0, 4.0, one, one),))
    scn = Scenario("idle", pool(2), load, duration_s=30.0, seed=5)
    r, _ = recorded_run(scn)
    obs = view(r, 20.0)
    assert obs["node0"].live_itl is not None and obs["node0"].gateway_started > 0
    idle = obs["node1"]
    assert idle.live_itl is None  # 1-token probes decode nothing: no token, no data (not zero)
    assert idle.live_ttft is None  # the only first tokens were the exporter's probes, which it leaves out
    assert idle.probe_ttft_median is not None and idle.probe_ttft_median < 0.1
    assert idle.gateway_sessions == 0 and idle.gateway_started == 0
    assert idle.request_rate == 0 and idle.latency is None  # vLLM counted the probes; the rules do not


def test_probe_ttft_median_needs_three_recent_answered_probes():
    log = ProbeLog()
    log.finish(1.0, "ok", 0.04)
    log.finish(2.0, "timeout", None)
    log.finish(2.5, "bad_response", 0.9)  # garbage text: not an answer
    log.finish(3.0, "slow", 0.5)
    assert log.ttft_median(3.0, 10.0) is None
    log.finish(4.0, "ok", 0.06)
    assert log.ttft_median(4.0, 10.0) == 0.06
    assert log.ttft_median(3.5, 10.0) is None  # the third had not ended yet
    assert log.ttft_median(12.0, 10.0) is None  # the first is older than the horizon
    for i in range(3):
        log.finish(5.0 + i, "ok", 0.01)
    assert log.ttft_median(8.0, 10.0) == 0.01  # the last 5: 0.5, 0.06, 0.01, 0.01, 0.01
    scn = Scenario("early", pool(2), LoadSpec(utilization=0.3), duration_s=10.0, seed=1)
    r, recs = recorded_run(scn)
    obs = view(r, 2.0)  # at most two probes have been answered by the reading before the scrape
    assert all(o.probe_ttft_median is None for o in obs.values())


def test_live_signals_fall_back_to_half_a_window_and_report_no_tokens_as_none():
    live = LiveSignals(window_s=5.0, scrape_s=1.0, phase=0.5)
    live.read(0.0, 0.0, 0, 0.0, 0, None)
    live.read(2.0, 1.0, 10, 0.3, 2, None)  # 2 s of data: under half a window
    live.read(3.0, 1.5, 20, 0.3, 2, 0.05)  # 3 s: the oldest reading serves as the base
    live.read(6.0, 1.5, 20, 0.9, 5, 0.05)  # the base is the reading at 0.0 (the newest at least 5 s old)
    live.read(8.0, 1.5, 20, 1.2, 6, 0.05)  # base 3.0: no token in between
    assert [c[1:3] for c in live.computed] == [(None, None), (None, None), (0.075, 0.15), (0.075, 0.18),
                                              (None, pytest.approx(0.225))]
    assert live.at(0.4) == (None, None, None, None, None, None)  # no scrape yet
    assert live.at(2.9) == (None, None, None, None, None, None)  # the 2.5 scrape saw the reading at 2.0
    # the 7.5 scrape saw the reading at 6.0, not 8.0; 1.5 s of inter-token gaps in 6 s: 0.25 sequences decoding
    assert live.at(7.9) == (0.075, 0.18, 0.05, 0.0, 0.25, None)
    # no prompt finished: 0 tokens/s, a value; no token: no ITL, and no batch to measure it at
    assert live.at(8.5) == (None, pytest.approx(0.225), 0.05, 0.0, None, None)


def test_the_prefill_rate_is_prompt_tokens_over_the_span():
    live = LiveSignals(window_s=5.0, scrape_s=1.0, phase=0.0)
    live.read(0.0, 0.0, 0, 0.0, 0, None, 0)
    live.read(5.0, 1.0, 10, 0.5, 5, None, 4000)
    assert live.computed[-1][4] == 800.0


def test_the_kv_usage_is_the_readings_gauge_as_last_scraped():
    live = LiveSignals(window_s=5.0, scrape_s=1.0, phase=0.0)
    live.read(0.5, 0.0, 0, 0.0, 0, None, 0, 0.2)
    live.read(1.5, 0.0, 0, 0.0, 0, None, 0, 0.9)
    assert live.at(1.9)[5] == 0.2  # the 1.0 scrape saw the 0.5 reading
    assert live.at(2.0)[5] == 0.9


def test_gateway_stat_counts_requests_on_and_sent_to_each_server():
    scn = Scenario("stat", pool(4), LoadSpec(utilization=0.4),
                   (FaultSpec("node1", "cuda_error", 5.0, None, {}),), duration_s=20.0, seed=4)
    r = Run(scn, "haproxy")
    t = 12.0
    obs = view(r, t)
    res = r.execute()
    before = [i for i, a in enumerate(res.t) if a < t]
    sent = sum(res.retried[i] + (res.status[i] != NO_SERVER) for i in before)  # a retry is one more attempt
    assert sum(o.gateway_started for o in obs.values()) == sent
    assert sum(res.retried[i] for i in before) > 0
    on = sum(1 for i in before if res.node[i] >= 0 and res.t[i] + res.e2e[i] > t)
    assert sum(o.gateway_sessions for o in obs.values()) == on


def test_a_probe_waiting_past_the_slow_threshold_reads_slow_as_the_exporter_exports_it():
    log = ProbeLog(slow_s=0.3)
    log.start(0.0)
    log.finish(0.05, "ok", 0.05, sent=0.0)
    log.start(1.0)  # this one waits 1.2 s for its first token
    assert log.at(1.2) == ("ok", 0.05, 0, 0.0)  # waited 0.2 s: under the threshold (the probe sent at 0 shown)
    assert log.at(1.5) == ("slow", 0.5, 0, 1.0)  # still waiting: slow already, TTFT at least what it waited
    log.finish(2.2, "slow", 1.2, sent=1.0)
    assert log.at(1.9) == ("slow", pytest.approx(0.9), 0, 1.0)  # read late (a scrape lag): it was waiting then
    assert log.at(2.3) == ("slow", 1.2, 0, 1.0)  # the same probe, ended: the same send time (one probe)
    log.start(3.0)
    log.finish(5.0, "timeout", None, sent=3.0)
    log.start(6.0)
    assert log.at(5.5) == ("timeout", 1.2, 1, 3.0) and log.at(6.9) == ("timeout", 1.2, 1, 3.0)  # a failure stays
