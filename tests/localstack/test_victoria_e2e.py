"""End-to-end on VictoriaMetrics instead of Prometheus: the simulated fleet scraped by vmagent into
VictoriaMetrics, grayguard's rules evaluated by vmalert (to Alertmanager and the webhook pager), and the
controller querying through vmauth with a bearer token. A thermally throttled node is drained and paged,
as on Prometheus (tests/demo/test_stack_e2e.py). About 50-60 s; every wait shares one 100 s deadline."""

import contextlib
import secrets
import time

import pytest
import requests

from grayguard.localstack.stack import StackSpec
from grayguard.localstack.victoria import BINARIES, VictoriaStack
from grayguard.promclient import PrometheusClient
from grayguard.sim.loadgen import LoadConfig, run_load
from tests.support.stack import require, wait_until

pytestmark = pytest.mark.e2e

TOKEN_ENV = "GRAYGUARD_TEST_VM_TOKEN"
SLOW = "node2"
BUDGET_S = 100  # every wait of the test together, after the stack is up (start and teardown take a few s)


class Deadline:
    """wait_until bounded by what is left of one budget for the whole test."""

    def __init__(self, budget_s):
        self.end = time.monotonic() + budget_s

    def wait(self, predicate, timeout_s, what, interval_s=0.5):
        return wait_until(predicate, max(0.1, min(timeout_s, self.end - time.monotonic())), interval_s, what)


def quarantine_pages(hook, node):
    return [a for a in hook.alerts("/page")
            if a["labels"].get("alertname") == "GrayguardNodeQuarantined" and a["labels"].get("node") == node]


def stop_load(records):
    """Let the cancelled load's requests in flight end (each within its 6 s deadline) before the fleet stops."""
    # A timeout here is no failure: the fleet's stop ends them, and the test's own failure must show.
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(r.status != "pending" for r in records), 8, 0.1, "the load's requests to end")


def refused(resp, *codes):
    return resp.status_code in codes and '"success"' not in resp.text


def ticks(stack, result):
    return stack.controller.metrics.registry.get_sample_value("grayguard_ticks_total", {"result": result}) or 0


def test_victoria_metrics_stack_quarantines_a_slow_node_and_pages(monkeypatch):
    require("haproxy", "prometheus", "alertmanager", *BINARIES)
    token = secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, token)
    # The demo's timings (tests/demo/test_stack_e2e.py): 10 s rate windows, 1 s scrape, evaluation and ticks.
    stack = VictoriaStack(StackSpec(nodes=4, seed=3, controller=False, control_window="10s"), token_env=TOKEN_ENV)
    with stack:
        query = f"{stack.query_url}/api/v1/query"
        # vmauth lets only the controller's token through: no token is 401, an unknown one 400 (vmauth 1.79).
        assert refused(requests.get(query, params={"query": "up"}, timeout=5), 401)
        assert refused(requests.get(query, params={"query": "up"}, headers={"Authorization": "Bearer wrong"},
                                    timeout=5), 400, 401)
        ok = requests.get(query, params={"query": "up"}, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        assert ok.status_code == 200 and ok.json()["status"] == "success"

        deadline = Deadline(BUDGET_S)
        records: list = []
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=12, duration_s=110, seed=3,
                                                      timeout_s=6), sink=records))
        try:
            # Warm-up: vmalert's recorded latency of every node is queryable through vmauth. VictoriaMetrics
            # makes a series it has never seen searchable up to ~10 s after its first sample, so this takes
            # the 10 s rate window plus about 10 s.
            prom = PrometheusClient(stack.cfg.prometheus)
            assert stack.cfg.prometheus.url == stack.vmauth.url and "Authorization" in prom.headers
            deadline.wait(lambda: len(prom.query(stack.cfg.signals.latency_query)) == 4, 45,
                          "the recorded latency of all 4 nodes through vmauth")
            stack.start_controller()
            deadline.wait(lambda: ticks(stack, "ok") >= 3, 20, "three good controller ticks through vmauth", 0.2)
            assert not any(drained for _, drained in stack.haproxy_weights().values())

            stack.set_fault(SLOW, "thermal", k=10)
            deadline.wait(lambda: stack.haproxy_weights()[SLOW] == (0, True), 45, f"{SLOW} drained in HAProxy")
            weights = stack.haproxy_weights()
            assert [n for n, (_, drained) in weights.items() if drained] == [SLOW], weights

            page = deadline.wait(lambda: quarantine_pages(stack.webhook, SLOW), 30,
                                 f"the quarantine page for {SLOW}", 0.1)[0]
            assert page["labels"]["pool"] == "chat" and page["labels"]["severity"] == "page"
            assert page["annotations"]["runbook_url"].endswith("docs/runbook.md#grayguardnodequarantined")
            assert page["generatorURL"].startswith(stack.vmalert.url), page  # vmalert sent it, not Prometheus
            # Alerts as Prometheus' API lists them, from vmalert through VictoriaMetrics' proxy.
            assert [a for a in stack.prometheus.alerts() if a["labels"]["alertname"] == "GrayguardNodeQuarantined"
                    and a["labels"]["node"] == SLOW and a["state"] == "firing"]
            others = {a["labels"]["node"] for a in stack.webhook.alerts("/page")
                      if a["labels"].get("alertname") == "GrayguardNodeQuarantined"} - {SLOW}
            assert not others, others

            # The recording rules, chained on vmalert (rate -> pool median), see the slow node too: its ratio to
            # the median, as the dashboard queries it.
            addr = next(n.address for n in stack.nodes if n.name == SLOW)
            ratio = (f'instance:vllm_normalized_latency_seconds_per_token:rate10s{{instance="{addr}"}} '
                     "/ on (pool) group_left () (pool:vllm_normalized_latency_seconds_per_token:median_rate10s > 0)")
            deadline.wait(lambda: [s for s in prom.query(ratio) if s.value >= 2], 30,
                          f"{SLOW} at least 2x the pool median in vmalert's recorded series")
            assert stack.vmalert.rule_errors() == {}  # every grayguard rule evaluates on MetricsQL

            # The controller's re-render learned a TTFT baseline from VictoriaMetrics and vmalert reloaded the
            # new alert (rules.reload_url is vmalert's /-/reload; re-renders run every 30 s).
            deadline.wait(lambda: "GrayguardTtftRegression" in stack.vmalert.rule_names(), 40,
                          "vmalert to load the re-rendered alert rules")

            m = stack.controller.metrics.registry
            assert not m.get_sample_value("grayguard_prometheus_errors_total", {"kind": "http_4xx"})
        finally:
            load.cancel()
            stop_load(records)
