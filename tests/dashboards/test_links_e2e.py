"""The joins on grayguard_node_info, on a real Prometheus with seeded series: the out-of-rotation table, a vLLM-side
panel named and picked by node, the GPU table's node column and the node variable return the expected rows, for one
pool, several and All. The controller is scraped as the example scrapes it (no honor_labels: grayguard_node_info's
instance is stored as exported_instance); the exporter-side series keep their own pool and instance. ~5 s."""

import json

import pytest
from prometheus_client import CollectorRegistry, Gauge

from grayguard.controller.metrics import ControllerMetrics
from grayguard.dashboards.lint import expressions
from grayguard.dashboards.promql import substitute
from grayguard.dashboards.render import render_all
from tests.support.stack import (
    prometheus_config,
    require,
    serve_registry,
    start_prometheus,
    static_job,
    wait_until,
)

pytestmark = pytest.mark.e2e

# (pool, node, instance, state, reason); gpu4:8000 (chat) is a vLLM no controller tracks
NODES = [("chat", "node1", "gpu1:8000", "quarantined", "latency"),
         ("chat", "node2", "gpu2:8000", "healthy", "none"),
         ("chat", "node3", "gpu3:8000", "healthy", "kv_cache"),  # healthy, no new traffic: its KV cache is full
         ("batch", "node9", "gpu9:8000", "degraded", "probe")]
INSTANCES = [("chat", i) for i in ("gpu1:8000", "gpu2:8000", "gpu3:8000", "gpu4:8000")] + [("batch", "gpu9:8000")]


def controller() -> CollectorRegistry:
    m = ControllerMetrics.create()
    for pool, node, instance, state, reason in NODES:
        m.node_info.labels(pool, node, "vllm_" + pool, instance).set(1)
        m.node_state.labels(pool, node, state).set(1)
        m.node_reason.labels(pool, node, state, reason).set(1)
    return m.registry


def exporters() -> CollectorRegistry:
    r = CollectorRegistry()
    fails = Gauge("grayguard_probe_consecutive_failures", "", ["pool", "instance"], registry=r)
    info = Gauge("grayguard_gpu_info", "", ["pool", "instance", "gpu", "uuid", "name", "pci_bus_id", "driver_version"],
                 registry=r)
    for n, (pool, instance) in enumerate(INSTANCES):
        fails.labels(pool, instance).set(n)
        info.labels(pool, instance, "0", f"GPU-{n}", "H100", f"0000:0{n}:00.0", "550.54").set(1)
    return r


def queries() -> dict[str, str]:
    """'file: where' -> expr of both dashboards (the default render)."""
    return {f"{name}: {where}": expr for name, text in render_all().items()
            for where, expr in expressions(json.loads(text))}


def rows(result: list[dict], *labels: str) -> set[tuple]:
    return {tuple(r["metric"].get(lb) for lb in labels) for r in result}


def test_the_node_joins_return_the_expected_rows():
    require("prometheus")
    q = queries()
    table = q["grayguard-pool-overview.json: panel 'Nodes out of rotation now' A"]
    failures = q["grayguard-pool-overview.json: panel 'Consecutive probe failures' A"]
    gpus = q["grayguard-gpu-health.json: panel 'GPUs' A"]
    node_var = q["grayguard-pool-overview.json: variable $node"]
    with serve_registry(controller()) as ctl, serve_registry(exporters()) as exp:
        jobs = [static_job("grayguard-controller", [ctl.target]),
                {**static_job("grayguard-exporter", [exp.target]), "honor_labels": True}]
        with start_prometheus(prometheus_config(jobs, interval="1s")) as prom:
            wait_until(lambda: len(prom.query("grayguard_node_info")) == 4 and
                       len(prom.query("grayguard_gpu_info")) == 5, 30, interval_s=0.5, what="both scrapes")
            assert all(r["metric"]["exported_instance"] for r in prom.query("grayguard_node_info"))

            def run(expr: str, **values: str) -> list[dict]:
                return prom.query(substitute(expr, {"pool": "chat", "node": ".*", "instance": ".*", "gpu": ".*",
                                                    **values}))

            # every node not healthy or cut, with its vLLM address, whatever $node selects
            cols = ("pool", "node", "state", "reason", "instance")
            chat = {("chat", "node1", "quarantined", "latency", "gpu1:8000"),
                    ("chat", "node3", "healthy", "kv_cache", "gpu3:8000")}
            assert rows(run(table), *cols) == chat
            assert rows(run(table, node="node2"), *cols) == chat
            both = chat | {("batch", "node9", "degraded", "probe", "gpu9:8000")}
            assert rows(run(table, pool=".*"), *cols) == both  # All
            assert rows(run(table, pool="chat|batch"), *cols) == both  # several, as Grafana joins them

            # an exporter panel named by node and picked by node; the untracked instance is kept, by its name
            cols = ("pool", "node", "instance")
            assert rows(run(failures), *cols) == {("chat", "node1", "gpu1:8000"), ("chat", "node2", "gpu2:8000"),
                                                  ("chat", "node3", "gpu3:8000"), ("chat", "gpu4:8000", "gpu4:8000")}
            picked = run(failures, node="node1|node3")
            assert rows(picked, *cols) == {("chat", "node1", "gpu1:8000"), ("chat", "node3", "gpu3:8000"),
                                           ("chat", "gpu4:8000", "gpu4:8000")}
            assert {r["metric"]["node"]: float(r["value"][1]) for r in picked} == {
                "node1": 0.0, "node3": 2.0, "gpu4:8000": 3.0}  # the values are the exporter's, untouched

            # the GPU table names each GPU's node; an untracked GPU keeps its row
            got = run(gpus, pool="chat|batch")
            assert rows(got, "instance", "gpu", "node", "name") == {
                ("gpu1:8000", "0", "node1", "H100"), ("gpu2:8000", "0", "node2", "H100"),
                ("gpu3:8000", "0", "node3", "H100"), ("gpu4:8000", "0", None, "H100"),
                ("gpu9:8000", "0", "node9", "H100")}

            # the node variable's selector, for one pool and for All
            assert rows(run(node_var), "node") == {("node1",), ("node2",), ("node3",)}
            assert len(run(node_var, pool=".*")) == 4
