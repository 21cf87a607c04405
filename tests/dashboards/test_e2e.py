"""End to end: on the demo stack (simulated fleet, exporters, HAProxy, Prometheus with the rendered rules,
controller) under load and a thermal fault, every query of both dashboards returns a number (not just NaN)
at least once, and the state and throttle panels show the faulty node. Bounded: 45 s of polling, ~20 s
when all goes well."""

import json
import math
import time

import pytest

from grayguard.dashboards import membership
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import expressions
from grayguard.dashboards.promql import substitute
from grayguard.dashboards.render import render_all
from grayguard.localstack.stack import POOL, LocalStack, StackSpec
from grayguard.sim.loadgen import LoadConfig, run_load
from tests.support.stack import require

pytestmark = pytest.mark.e2e

DEADLINE_S = 45.0
FAULT_AT_S = 4.0
VALUES = {"pool": POOL, "node": ".*", "instance": ".*", "gpu": ".*",
          "__rate_interval": "10s", "__interval": "2s", "__range": "1m"}


def row_titles(doc: dict, title: str) -> list[str]:
    """Titles of the panels under the row called title (up to the next row)."""
    out, inside = [], False
    for p in doc["panels"]:
        if p.get("type") == "row":
            inside = p.get("title") == title
        elif inside:
            out.append(p["title"])
    return out


def finite(result: list[dict]) -> list[tuple[dict, float]]:
    """(labels, value) of the samples that are numbers (a histogram_quantile of nothing is NaN)."""
    out = []
    for r in result:
        v = float(r["value"][1])
        if math.isfinite(v):
            out.append((r["metric"], v))
    return out


def test_every_dashboard_query_returns_data_on_the_demo_stack():
    require("haproxy", "prometheus", "alertmanager")
    # the probe detector in shadow mode, so that the shadow panel has a finding to show (node2's slow probes);
    # the live ITL and the window still cut and drain node2
    stack = LocalStack(StackSpec(nodes=5, seed=3, overrides={"detectors": {"probe": {"enforce": False}}}))
    load = None
    try:
        stack.start()
        # Rendered from the stack's own config: its rules record rate10s / rate1m, not rate30s / rate5m.
        cfg = DashboardConfig.from_config(stack.cfg)
        docs = {name: json.loads(text) for name, text in render_all(cfg).items()}
        # The membership row needs a registry (etcd, discovery, the election): test_membership_e2e.py has it.
        elsewhere = {f"panel {t!r}" for t in row_titles(docs["grayguard-pool-overview.json"], membership.TITLE)}
        pending = {f"{name}: {where}": substitute(expr, VALUES)
                   for name, doc in docs.items() for where, expr in expressions(doc)
                   if where.rsplit(" ", 1)[0] not in elsewhere}
        assert len(pending) > 60
        # The panels tell the fault's story: node2 degraded or worse, its GPU held down by a thermal reason.
        node2 = next(n.address for n in stack.nodes if n.name == "node2")
        story = {
            "node2 degraded or worse on 'Node state'": (
                pending["grayguard-pool-overview.json: panel 'Node state' A"],
                lambda res: any(m["node"] == "node2" and v >= 2 for m, v in finite(res))),
            "node2's GPU slowed down on 'Clocks held down'": (
                pending["grayguard-gpu-health.json: panel 'Clocks held down' A"],
                lambda res: any(m["instance"] == node2 and v == 2 for m, v in finite(res))),
        }
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=15, duration_s=DEADLINE_S + 10,
                                                      seed=3, timeout_s=10)))
        t0 = time.monotonic()
        faulted = False
        while (pending or story) and time.monotonic() - t0 < DEADLINE_S:
            if not faulted and time.monotonic() - t0 >= FAULT_AT_S:
                # k=8: the controller degrades, then drains node2; the fake GPU reports thermal slowdown.
                stack.set_fault("node2", "thermal", k=8)
                faulted = True
            for key, expr in list(pending.items()):
                if finite(stack.prometheus.query(expr)):
                    del pending[key]
            for key, (expr, seen) in list(story.items()):
                if seen(stack.prometheus.query(expr)):
                    del story[key]
            time.sleep(0.5)
        missing = "\n".join(f"{k}\n    {e}" for k, e in pending.items())
        assert not pending, f"no data within {DEADLINE_S:.0f} s:\n{missing}"
        assert not story, f"not seen within {DEADLINE_S:.0f} s: {list(story)}"
    finally:
        if load is not None:
            load.cancel()
            time.sleep(1.0)  # the cancelled load closes its session: let its requests end before the loop stops
        stack.stop()
