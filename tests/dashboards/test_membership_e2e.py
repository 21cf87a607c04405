"""End to end: on the registry stack (etcd, nodes registering, the controller process with the election and discovery:
registry) under load, with a node that joins and one that crashes, every query of the Pool overview's "Membership and
leadership" row returns a number at least once, the leader panels name the one replica, and GrayguardNoLeader stays
silent. Bounded: 45 s of polling, ~25 s when all goes well."""

import json
import math
import time

import pytest

from grayguard.dashboards import membership
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.promql import substitute
from grayguard.dashboards.render import render_all
from grayguard.localstack.registrystack import RegistryStack
from grayguard.localstack.stack import POOL, StackSpec
from grayguard.sim.loadgen import LoadConfig, run_load
from tests.support.stack import require

pytestmark = pytest.mark.e2e

DEADLINE_S = 45.0
VALUES = {"pool": POOL, "node": ".*", "instance": ".*", "__rate_interval": "10s", "__interval": "2s"}


def row_queries(doc: dict, title: str) -> dict[str, str]:
    """'panel A' -> expr of the panels under the row called title."""
    out, inside = {}, False
    for p in doc["panels"]:
        if p.get("type") == "row":
            inside = p.get("title") == title
        elif inside:
            out |= {f"{p['title']} {t['refId']}": substitute(t["expr"], VALUES) for t in p["targets"]}
    return out


def finite(result):
    return [(r["metric"], float(r["value"][1])) for r in result if math.isfinite(float(r["value"][1]))]


def test_every_membership_query_returns_data_on_the_registry_stack():
    require("etcd", "haproxy", "prometheus", "alertmanager")
    stack = RegistryStack(StackSpec(nodes=3, seed=3), hosts=("node4",))
    load = None
    try:
        stack.start()
        doc = json.loads(render_all(DashboardConfig.from_config(stack.cfg))["grayguard-pool-overview.json"])
        pending = row_queries(doc, membership.TITLE)
        assert len(pending) >= 15
        story = {
            "one leader": (pending["Leaders A"], lambda res: [v for _, v in finite(res)] == [1.0]),
            "the replica leads": (pending["Which replica leads A"],
                                  lambda res: any(v == 1.0 and m.get("id") for m, v in finite(res))),
            "a join counted": (pending["Joins and removals A"],
                               lambda res: any(m.get("action") == "add" and v > 0 for m, v in finite(res))),
            "a removal counted": (pending["Joins and removals A"],
                                  lambda res: any(m.get("action") == "delete" and v > 0 for m, v in finite(res))),
        }
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=6, duration_s=DEADLINE_S + 10,
                                                      seed=3, timeout_s=10)))
        stack.wait_registered(["node1", "node2", "node3", "node4"])
        t0 = time.monotonic()
        joined = killed = False
        while (pending or story) and time.monotonic() - t0 < DEADLINE_S:
            if not joined and time.monotonic() - t0 >= 2:
                stack.start_host("node5")
                joined = True
            if not killed and time.monotonic() - t0 >= 6:
                stack.kill_host("node4")
                killed = True
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
        leader_id = stack.controller_status()["leadership"]["id"]
        assert {m["id"] for m, v in finite(stack.prometheus.query("grayguard_controller_leader == 1"))} == {leader_id}
        assert stack.prometheus.query('ALERTS{alertname="GrayguardNoLeader"}') == []
    finally:
        if load is not None:
            load.cancel()
            time.sleep(1.0)  # the cancelled load closes its session: let its requests end before the loop stops
        stack.stop()
