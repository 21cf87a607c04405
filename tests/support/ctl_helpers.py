"""Build a Controller for tests: a real HAProxy endpoint, Prometheus answers from `responses`."""

from __future__ import annotations

import time

from controller.haproxy import RuntimeClient
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from grayguard.config import parse_config
from grayguard.promclient import PrometheusClient

PROM = "http://prom.test:9090"
LAT_Q = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
RATE_Q = "instance:vllm_request_rate:rate30s"


def servers(n=4, base_port=9100, weight=100):
    return [(f"node{i}", f"127.0.0.1:{base_port + i}", weight) for i in range(n)]


OPTIONAL = Controller.OPTIONAL


def make_controller(endpoints, extra=None, canary=None, clock=time.time, dry_run=False, state_file=None):
    doc = {"prometheus": {"url": PROM, "timeout_s": 0.5},
           "haproxy": {"endpoints": list(endpoints)},
           "pools": [{"name": "chat", "backend": "vllm_chat"}],
           "thresholds": {"sustain_ticks": 2},
           # these tests are about latency: the optional signals are off unless a test turns one on
           "signals": {f"{k}_query": "" for k in OPTIONAL}}
    for k, v in (extra or {}).items():
        doc[k] = {**doc[k], **v} if k == "signals" else v
    cfg = parse_config(doc)
    return Controller(cfg, PrometheusClient(cfg.prometheus), [RuntimeClient(e, 1.0) for e in cfg.haproxy.endpoints],
                      canary=canary, metrics=ControllerMetrics.create(), clock=clock, dry_run=dry_run,
                      state_file=state_file)


def vector(values: dict[str, float | str], now: float | None = None) -> dict:
    ts = time.time() if now is None else now
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"instance": k, "pool": "chat"}, "value": [ts, str(v)]} for k, v in values.items()]}}


def prom_answers(rsps, latencies: dict[str, float | str], rate: float = 5.0, now: float | None = None):
    """Register one answer per query (responses matches on the query string)."""
    from responses import matchers
    rsps.get(f"{PROM}/api/v1/query", json=vector(latencies, now),
             match=[matchers.query_param_matcher({"query": LAT_Q})])
    rsps.get(f"{PROM}/api/v1/query", json=vector({k: rate for k in latencies}, now),
             match=[matchers.query_param_matcher({"query": RATE_Q})])
