"""End to end: on the demo stack (simulated fleet, exporters, HAProxy, Prometheus with the rendered rules,
controller) under load and a thermal fault, every query of both dashboards returns data at least once.
Bounded: about 45 s."""

import json
import time

import pytest

from dashboards.config import DashboardConfig
from dashboards.lint import expressions
from dashboards.promql import substitute
from dashboards.render import render_all
from sim.loadgen import LoadConfig, run_load
from sim.localstack import POOL, LocalStack, StackSpec
from tests.stack import require

pytestmark = pytest.mark.e2e

DEADLINE_S = 45.0
FAULT_AT_S = 4.0


def test_every_dashboard_query_returns_data_on_the_demo_stack():
    require("haproxy", "prometheus", "alertmanager")
    stack = LocalStack(StackSpec(nodes=5, seed=3))
    load = None
    try:
        stack.start()
        # Rendered from the stack's own config: its rules record rate10s / rate1m, not rate30s / rate5m.
        cfg = DashboardConfig.from_config(stack.cfg)
        values = {"pool": POOL, "node": ".*", "instance": ".*", "gpu": ".*",
                  "__rate_interval": "10s", "__interval": "2s", "__range": "1m"}
        pending = {}
        for name, text in render_all(cfg).items():
            for where, expr in expressions(json.loads(text)):
                pending[f"{name}: {where}"] = substitute(expr, values)
        assert len(pending) > 60
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=15, duration_s=DEADLINE_S + 10,
                                                      seed=3, timeout_s=10)))
        t0 = time.monotonic()
        faulted = False
        while pending and time.monotonic() - t0 < DEADLINE_S:
            if not faulted and time.monotonic() - t0 >= FAULT_AT_S:
                # k=8: the controller degrades, then drains node2; the fake GPU reports thermal slowdown.
                stack.set_fault("node2", "thermal", k=8)
                faulted = True
            for key, expr in list(pending.items()):
                if stack.prometheus.query(expr):
                    del pending[key]
            time.sleep(0.5)
        missing = "\n".join(f"{k}\n    {e}" for k, e in pending.items())
        assert not pending, f"no data within {DEADLINE_S:.0f} s:\n{missing}"
    finally:
        if load is not None:
            load.cancel()
        stack.stop()
