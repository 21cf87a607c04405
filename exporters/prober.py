"""The micro-probe's shell: an asyncio loop in its own thread streams one-token completions from vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from grayguard.engines import DEFAULT_ENGINE
from grayguard.exporters.engineload import EngineLoad
from grayguard.exporters.fastpath import LiveCollector
from grayguard.exporters.hang import Progress, Stalls, judged, token_progress
from grayguard.exporters.live import LIVE_WINDOW_S, Answer, LiveSignals, Reading, add_answer, add_reading, live_signals
from grayguard.exporters.probe import (
    ANSWERED,
    RESULTS,
    Observation,
    ProbeState,
    advance,
    classify,
    event_usage,
    failure_detail,
    may_be_starting,
    not_ready_reason,
    settle,
)
from grayguard.exporters.probehttp import VllmClient
from grayguard.exporters.synthetic import NONE, Tally, Traffic, account, probe_tally
from grayguard.exporters.traffic import TrafficCollector
from grayguard.health import Beat
from grayguard.vocab import ProbeResult

log = logging.getLogger(__name__)
# 10 ms to 10 s, with the default slow threshold (0.3 s) and deadline (2 s) as bucket bounds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)
ERROR_KINDS = ("model_discovery", "api_key", "internal")


@dataclass(frozen=True)
class ProbeConfig:
    """Knobs of the micro-probe (the CLI flags map one to one)."""

    interval: float = 1.0  # seconds between probes (1 s: garbage text is drained within ~5 s, docs/benchmarks.md)
    jitter: float = 0.2  # +- this fraction of the interval, so that a fleet's probes do not align
    slow_threshold: float = 0.3  # first chunk later than this (s): slow
    deadline: float = 2.0  # no first chunk by then (s): timeout; the connection is closed
    model: str | None = None  # None: the first model of /v1/models
    prompt: str = "The capital of France is"
    api_key_env: str | None = "VLLM_API_KEY"  # environment variable holding vLLM's --api-key
    api_key_file: str | None = None  # file holding it (re-read every probe; wins over the variable)
    # a backend not ready yet (refused, /health not 200, model not in /v1/models) counts as starting at most
    # this long (s) after the start; None: no bound; 0: never starting (failures count at once)
    startup_grace: float | None = 1800.0
    # longest wait for vLLM's /metrics, read at each probe's start and again when it times out: the hang evidence
    metrics_timeout: float = 1.0
    # W (s): the live values are deltas of those /metrics readings over about this span (exporters/live.py)
    live_window: float = LIVE_WINDOW_S
    # which engine the node runs (grayguard/engines.py): its API for the probe, its /metrics names for the rest
    engine: str = DEFAULT_ENGINE


class Prober:
    """Probes one vLLM every interval in a background thread; a scrape reads only its last results."""

    def __init__(self, base_url: str, config: ProbeConfig | None = None, *,
                 registry: CollectorRegistry | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 env: Mapping[str, str] = os.environ):
        self.config = config or ProbeConfig()
        self._rng, self._clock, self._wall, self._env = rng or random.Random(), clock, wall, env
        self._cond = threading.Condition()
        self._state = ProbeState()
        self._count = 0
        self._last_ts: float | None = None
        self._last_at: float | None = None  # clock() when the last probe ended (the wall time is for the metric)
        self._last_sent: float | None = None  # wall time the last probe that ended was sent (its identity)
        self._inflight_since: float | None = None  # clock() when the probe now waiting for its first token was sent
        self._inflight_sent: float | None = None  # its wall time then
        self._started = clock()
        self._readings: tuple[Reading, ...] = ()  # vLLM's /metrics over the live window (exporters/live.py)
        self._stalls = Stalls()  # the engine's own silences, learned (exporters/hang.py: a long step is no hang)
        self._answers: tuple[Answer, ...] = ()  # the last answered probes, for the probe TTFT median
        self._probes: Tally = NONE  # every probe vLLM finished with a token so far: what they added to its counters
        self._traffic = Traffic()  # vLLM's finished requests less those probes (exporters/synthetic.py)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        # what /healthz and /readyz watch (exporters/liveness.py): every completed round, and every completed read of
        # vLLM's /metrics (the live fast path), failed ones too
        self.rounds, self.reads = Beat(clock), Beat(clock)
        self.client = VllmClient(base_url, model=self.config.model, prompt=self.config.prompt, rng=self._rng,
                                 clock=clock, on_discovery_error=lambda: self.errors.labels("model_discovery").inc(),
                                 engine=self.config.engine)
        r = registry if registry is not None else CollectorRegistry()
        self.ttft = Histogram("grayguard_probe_ttft_seconds", "Time to the first streamed chunk of ok/slow probes",
                              buckets=TTFT_BUCKETS, registry=r)
        self.results = Counter("grayguard_probe_results", "Probes by result", ["result"], registry=r)
        self.errors = Counter("grayguard_exporter_probe_errors", "Prober trouble that is not the backend's result",
                              ["kind"], registry=r)
        for result in RESULTS:  # ok and slow from the start; a failure appears at its first count, at 1 (as XIDs)
            if result in ANSWERED:
                self.results.labels(result)
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        self.state_collector = _StateCollector(self)
        self.live_collector = LiveCollector(self.live)
        self.traffic_collector = TrafficCollector(self.traffic)
        r.register(self.state_collector)
        r.register(self.live_collector)
        r.register(self.traffic_collector)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start probing in a daemon thread with its own event loop."""
        self._started = self._clock()
        self.rounds, self.reads = Beat(self._clock), Beat(self._clock)  # the loop starts now
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="prober", daemon=True)
        self._thread.start()
        ready.wait(5)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the loop (an in-flight probe is aborted and its connection closed) and join it."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout)

    def run_once(self) -> str:
        """Run one probe now, synchronously, and record it (for tests and one-shot checks)."""
        async def once() -> str:
            async with self._session() as session:
                return await self._probe_and_record(session)
        return asyncio.run(once())

    @property
    def base_url(self) -> str:
        """The vLLM this prober probes."""
        return self.client.base_url

    # --- reading the state -------------------------------------------------------------------
    @property
    def state(self) -> ProbeState:
        """The state after the last probe."""
        with self._cond:
            return self._state

    @property
    def count(self) -> int:
        """Probes completed so far."""
        with self._cond:
            return self._count

    def snapshot(self) -> tuple[ProbeState, float | None]:
        """The state after the last probe and when it ended (clock(), None before the first), read together."""
        with self._cond:
            return self._state, self._last_at

    def exported(self) -> tuple[ProbeState, float | None, float | None]:
        """The state the gauges show now, the wall time of the last probe's end, and the wall time the probe whose
        result they show was sent (its identity: the controller counts each probe once, however many ticks read it).

        A probe still waiting for its first token past the slow threshold is slow already, whatever it ends as
        (slow, or a timeout at the deadline): when the last probe answered, the gauges say `slow` with the time
        waited so far as its TTFT (a lower bound) at once, not when the answer comes, and that probe's send time. A
        last probe that failed stays as it was: the failure is the news, and its streak goes on counting.
        """
        with self._cond:
            state, ts, sent = self._state, self._last_ts, self._last_sent
            since, inflight_sent = self._inflight_since, self._inflight_sent
        if since is not None and state.last_result in ANSWERED:
            waited = self._clock() - since
            if waited > self.config.slow_threshold:
                state = dataclasses.replace(state, last_result=ProbeResult.SLOW, last_ttft=waited)
                sent = inflight_sent
        return state, ts, sent

    def live(self) -> LiveSignals:
        """The live values now (exporters/live.py), from the recent /metrics readings and answered probes."""
        with self._cond:
            readings, answers = self._readings, self._answers
        return live_signals(readings, answers, self._clock(), self.config.live_window)

    def traffic(self) -> Traffic | None:
        """The node's traffic counters without the probes; None while unknown (no usable reading yet, or none within
        the live window: a stuck prober or a vLLM whose /metrics does not answer says nothing)."""
        with self._cond:
            t = self._traffic
        if t.at is None or self._clock() - t.at > self.config.live_window:
            return None
        return t

    def wait_for_probes(self, count: int, timeout: float) -> bool:
        """Block until at least count probes have completed; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count >= count, timeout)

    # --- the loop ----------------------------------------------------------------------------
    def _thread_main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._task = loop.create_task(self._main())
        ready.set()
        try:
            loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        cfg = self.config
        async with self._session() as session:
            await asyncio.sleep(self._rng.uniform(0, cfg.interval * cfg.jitter))
            while True:
                try:
                    await self._probe_and_record(session)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not end probing: count it, try again next interval
                    log.exception("probe failed unexpectedly")
                    self.errors.labels("internal").inc()
                self.rounds.done()  # failed or not, the round completed: the loop is alive
                await asyncio.sleep(cfg.interval * (1 + self._rng.uniform(-cfg.jitter, cfg.jitter)))

    def _session(self) -> aiohttp.ClientSession:
        # force_close: every probe gets a fresh connection, and closing it aborts the request in vLLM.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=None), trust_env=False)

    async def _probe_and_record(self, session: aiohttp.ClientSession) -> str:
        since = self._clock() - self._started
        # Until the backend is first seen ready, ask it whether it is ready (not whether it ever answered a
        # probe): a ready vLLM that hangs or answers garbage is a fault from the first probe. Asked before
        # the probe, so that a backend turning ready in between is probed ready, not reported broken.
        asked = may_be_starting(self.state, since_start=since, startup_grace=self.config.startup_grace)
        headers = self._headers()  # the API key is read once per probe
        not_ready = None
        if asked:
            check = await self.client.readiness(session, headers, self.config.deadline)
            not_ready = not_ready_reason(check, self.client.model)
        # vLLM's token counter now, alongside the probe: if the probe times out, did vLLM generate anything meanwhile?
        before = asyncio.ensure_future(self._engine_load(session, headers))
        try:
            with self._cond:
                self._inflight_since = self._clock()  # cleared by _record, with the result it ends as
                self._inflight_sent = self._wall()
            obs = await self.client.observe(session, headers, self.config.deadline)
            raw = classify(obs, self.config.slow_threshold)
            progress = await self._progress(session, headers, before) if raw == ProbeResult.TIMEOUT else None
            result = self._record(obs, raw, since, not_ready, ready=asked and not_ready is None, progress=progress)
            await before  # recorded already; let the read end (within metrics_timeout) rather than abort it midway
            return result
        finally:
            before.cancel()  # only when stopping or on a bug
            with self._cond:
                self._inflight_since = None

    async def _engine_load(self, session: aiohttp.ClientSession,
                           headers: dict[str, str]) -> tuple[EngineLoad | None, float]:
        load = await self.client.engine_load(session, headers, self.config.metrics_timeout)
        at = self._clock()
        with self._cond:  # every read, failed ones too (no series: no live values), feeds the live window
            reading = Reading(at, load or EngineLoad(), self._probes)
            self._readings = add_reading(self._readings, reading, self.config.live_window)
            self._stalls = self._stalls.observe(load, at)  # the engine's own silences (exporters/hang.py)
            self._traffic = account(self._traffic, reading.load, self._probes, at)
        self.reads.done()
        return load, at

    async def _progress(self, session: aiohttp.ClientSession, headers: dict[str, str],
                        before: asyncio.Future[tuple[EngineLoad | None, float]]) -> Progress | None:
        """vLLM's token progress between the probe's start and its timeout (None: no evidence)."""
        first, first_at = await before
        if first is None:
            return None
        second, second_at = await self._engine_load(session, headers)
        with self._cond:
            stalls = self._stalls
        return judged(token_progress(first, second, second_at - first_at), stalls, second_at)

    def _record(self, obs: Observation, raw: str, since: float, not_ready: str | None, *, ready: bool,
                progress: Progress | None = None) -> str:
        detail = failure_detail(obs)
        with self._cond:
            previous = self._state
            result = settle(raw, previous, not_ready=not_ready, since_start=since,
                            startup_grace=self.config.startup_grace)
            self._state = advance(previous, result, obs.ttft, ready=ready, detail=detail, progress=progress)
            self._last_sent = self._inflight_sent if self._inflight_since is not None else None
            self._inflight_since = None
            self._count += 1
            self._last_ts = self._wall()
            self._last_at = self._clock()
            self.results.labels(result).inc()
            if result in ANSWERED and obs.ttft is not None:
                self.ttft.observe(obs.ttft)
                self._answers = add_answer(self._answers, Answer(self._last_at, obs.ttft))
            usage = event_usage(obs.first_event) if obs.first_event is not None and obs.ttft is not None else None
            if usage is not None:  # vLLM finished it with its token (garbage too): a request in its counters
                # vLLM's e2e of it: the TTFT measured here less the HTTP overhead learned (exporters/synthetic.py)
                self._probes += probe_tally(obs.ttft, *usage, gap=self._traffic.gap)  # type: ignore[arg-type]
            self._cond.notify_all()
        if result != previous.last_result:
            level = logging.WARNING if result not in ANSWERED and result != ProbeResult.STARTING else logging.INFO
            if result == ProbeResult.STARTING:
                why = f": not ready ({not_ready})"
            else:
                why = f": {detail}" if detail and result not in ANSWERED else ""
            log.log(level, "probe %s: %s (was %s)%s", self.base_url, result, previous.last_result, why)
        return result

    def _api_key(self) -> str | None:
        cfg = self.config
        if cfg.api_key_file:
            try:
                with open(cfg.api_key_file, encoding="utf-8") as f:
                    return f.read().strip() or None
            except OSError as e:
                self.errors.labels("api_key").inc()
                log.warning("cannot read API key file %s: %s", cfg.api_key_file, e)
                return None
        return self._env.get(cfg.api_key_env) if cfg.api_key_env else None

    async def observe(self, session: aiohttp.ClientSession) -> Observation:
        """One probe under the deadline (see VllmClient.observe), with the probe headers and API key."""
        return await self.client.observe(session, self._headers(), self.config.deadline)

    def _headers(self) -> dict[str, str]:
        headers = {"X-LLM-Probe": "true", "Accept": "text/event-stream"}
        key = self._api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers


class _StateCollector:
    """Exports the prober's last result, TTFT, failure streak, end time and the send time of the probe shown (absent
    until known)."""

    def __init__(self, prober: Prober):
        self._p = prober

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        state, ts, sent = self._p.exported()
        fams = self._families()
        last, ttft, fails, stamp, sent_at = fams
        if state.last_result is not None:  # one series, the last result's: not one a result (7 zeros on two pages)
            last.add_metric([state.last_result], 1)
        if state.last_ttft is not None:
            ttft.add_metric([], state.last_ttft)
        fails.add_metric([], state.consecutive_failures)
        if ts is not None:
            stamp.add_metric([], ts)
        if sent is not None and state.last_result is not None:
            sent_at.add_metric([], sent)
        return iter(fams)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (GaugeMetricFamily("grayguard_probe_last_result", "1, labelled with the last probe's result (the "
                                  "only series of the family)", labels=["result"]),
                GaugeMetricFamily("grayguard_probe_last_ttft_seconds", "TTFT of the last ok or slow probe"),
                GaugeMetricFamily("grayguard_probe_consecutive_failures",
                                  "Probes in a row that failed (timeout, connect, http, cuda, bad response)"),
                GaugeMetricFamily("grayguard_probe_last_timestamp_seconds", "Unix time the last probe ended"),
                GaugeMetricFamily("grayguard_probe_last_sent_timestamp_seconds",
                                  "Unix time the probe grayguard_probe_last_result shows was sent (its identity)"))
