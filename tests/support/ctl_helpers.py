"""Build a Controller for tests: a real HAProxy endpoint and Prometheus answers from `responses`, or fake seams."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from grayguard.config import parse_config
from grayguard.controller import decide, readscope
from grayguard.controller.haproxy import DRAIN_MASK, CommandResult, RuntimeClient, ServerState
from grayguard.controller.live import LiveMemory
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeState
from grayguard.controller.scoring import NOISE_S, Noise
from grayguard.promclient import PrometheusClient, Sample

PROM = "http://prom.test:9090"
LAT_Q = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
RATE_Q = "instance:vllm_request_rate:rate30s"


def servers(n=4, base_port=9100, weight=100):
    return [(f"node{i}", f"127.0.0.1:{base_port + i}", weight) for i in range(n)]


OPTIONAL = decide.OPTIONAL


def make_controller(endpoints, extra=None, canary=None, clock=time.time, dry_run=False, state_file=None):
    doc = {"prometheus": {"url": PROM, "timeout_s": 0.5},
           "haproxy": {"endpoints": list(endpoints)},
           "pools": [{"name": "chat", "backend": "vllm_chat"}],
           # the 30 s window evaluated every 15 s: two samples make one observation, so a sick node's window asks
           # for a quarantine on its second tick (these tests tick with a new sample each time)
           "rules": {"control_interval": "15s"},
           # these tests are about latency: the optional signals are off unless a test turns one on
           "signals": {f"{k}_query": "" for k in OPTIONAL}}
    for k, v in (extra or {}).items():
        doc[k] = {**doc[k], **v} if k in ("signals", "rules") else v
    cfg = parse_config(doc)
    return Controller(cfg, PrometheusClient(cfg.prometheus), [RuntimeClient(e, 1.0) for e in cfg.haproxy.endpoints],
                      canary=canary, metrics=ControllerMetrics.create(), clock=clock, dry_run=dry_run,
                      state_file=state_file)


def vector(values: dict[str, float | str], now: float | None = None) -> dict:
    ts = time.time() if now is None else now
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"instance": k, "pool": "chat"}, "value": [ts, str(v)]} for k, v in values.items()]}}


def prom_answers(rsps, latencies: dict[str, float | str], rate: float = 5.0, now: float | None = None,
                 age: float = 0.0):
    """Register one answer per query (responses matches on the query string); the data is `age` s old
    (`timestamp()` of each query: evaluated at now, the data's own time now - age)."""
    from responses import matchers
    ts = time.time() if now is None else now
    for q, body in ((LAT_Q, vector(latencies, ts)), (RATE_Q, vector({k: rate for k in latencies}, ts))):
        rsps.get(f"{PROM}/api/v1/query", json=body, match=[matchers.query_param_matcher({"query": q})])
        stamped = vector({k: ts - age for k in latencies}, ts)
        rsps.get(f"{PROM}/api/v1/query", json=stamped,
                 match=[matchers.query_param_matcher({"query": f"timestamp({q})"})])


# -- fake seams: no sockets, no HTTP (the Controller takes any object with these methods) --------------------
class FakeHaproxy:
    """RuntimeClient's seam over an in-memory table: show_servers_state() and apply(); every call is recorded."""

    def __init__(self, endpoint: str, backends: dict[str, list[tuple[str, str, int]]], events: list):
        self.endpoint, self.events = endpoint, events
        self.table = {(b, n): ServerState(b, n, a, w, w, 0, 2) for b, srvs in backends.items() for n, a, w in srvs}

    def show_servers_state(self, backend=None):
        self.events.append(("show", self.endpoint))
        return [s for s in self.table.values() if backend in (None, s.backend)]

    def show_backends_state(self, backends):
        self.events.append(("show", self.endpoint, tuple(backends)))
        return [s for s in self.table.values() if s.backend in backends]

    def apply(self, commands):
        self.events.append(("apply", self.endpoint, tuple(c.render() for c in commands)))
        for c in commands:
            s = self.table[(c.backend, c.server)]
            if c.kind == "weight":
                s = replace(s, weight=c.value)
            else:
                s = replace(s, admin_state=(s.admin_state | DRAIN_MASK) if c.value == "drain"
                            else s.admin_state & ~DRAIN_MASK)
            self.table[(c.backend, c.server)] = s
        return [CommandResult(c, True, "") for c in commands]


class FakeProm:
    """PrometheusClient's seam: query(q) -> the samples answers(q) gives (a dict or a function); recorded.

    timestamp(q), unless the dict answers it, is answered as Prometheus does for data sampled at the
    evaluation time (fresh): q's samples, each with its timestamp as the value."""

    def __init__(self, answers, events: list):
        self.answers, self.events = answers, events

    def query(self, q):
        self.events.append(("query", q))
        return self._evaluate(q)

    def _evaluate(self, q):
        scoped = readscope.parse_scoped(q)
        if scoped:  # controller/readscope.py's wrapper, as Prometheus evaluates it (tests/controller/test_readscope.py)
            inner, led = scoped
            return [s for s in self._evaluate(inner) if s.labels.get("pool", "") in {*led, ""}]
        if q.startswith("timestamp(") and not (isinstance(self.answers, dict) and q in self.answers):
            # as Prometheus answers timestamp() of a series sampled at the evaluation time: fresh data
            return [Sample({k: v for k, v in s.labels.items() if k != "__name__"}, s.timestamp, s.timestamp)
                    for s in self._answer(q.removeprefix("timestamp(")[:-1])]
        return self._answer(q)

    def _answer(self, q):
        return self.answers(q) if callable(self.answers) else self.answers.get(q, [])


def samples(values: dict[str, float], now: float, pool: str = "chat") -> list[Sample]:
    return [Sample({"instance": k, "pool": pool}, v, now) for k, v in values.items()]


def fake_controller(pools: list[dict], haproxies, prom, canary=None, clock=time.time, extra=None):
    """A Controller over fake seams; pools as in the config (name, backend, ...)."""
    doc = {"prometheus": {"url": PROM}, "haproxy": {"endpoints": [h.endpoint for h in haproxies]},
           "pools": pools, "state_file": None, "signals": {f"{k}_query": "" for k in OPTIONAL}, **(extra or {})}
    return Controller(parse_config(doc), prom, haproxies, canary=canary, metrics=ControllerMetrics.create(),
                      clock=clock)


def settle(ctl: Controller, timeout_s: float = 10.0) -> None:
    """Wait until every canary the controller started has returned: its next tick then takes the rounds (they run
    off the tick, controller/canary_rounds.py). For canaries that answer at once, as a fleet's do within a tick."""
    assert ctl.workers is None or ctl.workers.wait_idle(timeout_s), f"a canary still runs after {timeout_s:g}s"


def tick_settled(ctl: Controller):
    """One tick, then wait for the canaries it started (settle); the tick's result."""
    r = ctl.tick()
    settle(ctl)
    return r


class Sampler:
    """Calls fn every interval in a thread until stopped; the results, with their monotonic times."""

    def __init__(self, fn, interval_s: float):
        self.fn, self.interval, self.rows, self.done = fn, interval_s, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(self.interval):
            self.rows.append((time.monotonic(), self.fn()))

    def close(self):
        self.done.set()
        self.thread.join(5)


def seasoned(**kw) -> NodeState:
    """A NodeState of a controller that has seen its fleet for a minute: a quiet one, whose healthy nodes stray by
    less than min_spread (scoring.Noise: a fresh controller starts from PRIOR_SPREAD and is careful at first)."""
    quiet = Noise(0.02, NOISE_S)
    live_itl, window = kw.pop("live_itl", LiveMemory()), kw.pop("window", LiveMemory())
    return NodeState(window=replace(window, noise=quiet), live_itl=replace(live_itl, noise=quiet), **kw)
