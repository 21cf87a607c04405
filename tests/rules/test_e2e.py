"""End to end with real binaries: the controller's metrics -> Prometheus (rendered rules) -> Alertmanager
(the example config, receivers retargeted) -> a webhook. And a live re-render + /-/reload."""

import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily

from grayguard.config import parse_config
from grayguard.controller.metrics import STATES, ControllerMetrics
from grayguard.rules.render import baseline_query, render_all
from grayguard.rules.rerender import RuleRerenderer, write_if_changed
from tests.support.stack import (
    EXAMPLE_AM,
    WebhookReceiver,
    alertmanager_config,
    prometheus_config,
    require,
    serve_registry,
    start_alertmanager,
    start_prometheus,
    static_job,
    wait_until,
)

pytestmark = pytest.mark.e2e

RUNBOOK = "https://github.com/grayguard/grayguard/blob/main/docs/runbook.md"


def e2e_config(**rules):
    return parse_config({
        "pools": [{"name": "chat", "backend": "vllm_chat"}, {"name": "code", "backend": "vllm_code"}],
        # Seconds, not minutes: the controller alerts fire at once, the control and human groups run every second.
        "rules": {"control_interval": "1s", "human_interval": "1s",
                  "alert_for": {"GrayguardNodeQuarantined": "0s", "GrayguardSafeguardEngaged": "0s"},
                  **rules},
    })


def set_state(m, pool, node, state):
    for s in STATES:
        m.node_state.labels(pool, node, s).set(1 if s == state else 0)


def named(alerts, alertname, pool):
    return [a for a in alerts if a["labels"].get("alertname") == alertname and a["labels"].get("pool") == pool]


def test_quarantine_pages_and_safeguard_inhibits_its_pool(tmp_path):
    require("prometheus", "alertmanager")
    cfg = e2e_config()
    rules_dir = tmp_path / "rules"
    write_if_changed(rules_dir, render_all(cfg), promtool=None)

    m = ControllerMetrics.create()
    m.last_success.set(time.time())
    set_state(m, "chat", "node1", "quarantined")   # chat: one node drained -> a page
    set_state(m, "chat", "node2", "healthy")
    set_state(m, "code", "node7", "quarantined")   # code: drained, but the safeguard is engaged ->
    set_state(m, "code", "node8", "degraded")      # only the safeguard page reaches a person
    m.pool_safeguard.labels("chat").set(0)
    m.pool_safeguard.labels("code").set(1)

    # The inhibition needs the safeguard alert at Alertmanager before code's notification goes out: that is what the
    # shipped group_wait (30 s) waits for. At the suite's 1 s, a safeguard alert Prometheus sent a second after the
    # quarantine one (a busy machine) let the quarantine page out once in a CI run; 5 s keeps the design's margin.
    with WebhookReceiver() as hook, serve_registry(m.registry) as ctl, \
            start_alertmanager(alertmanager_config(EXAMPLE_AM, hook, group_wait="5s"), workdir=tmp_path / "am") as am, \
            start_prometheus(prometheus_config([static_job("grayguard-controller", [ctl.target])],
                                               interval="1s", alertmanager_urls=[am.url]),
                             sorted(rules_dir.glob("*.rules.yml")), workdir=tmp_path / "prom") as prom:
        page = hook.wait_for(lambda h: named(h.alerts("/page"), "GrayguardNodeQuarantined", "chat"),
                             timeout_s=30, what="the quarantine page for pool chat")[0]
        assert page["labels"]["node"] == "node1"
        assert page["labels"]["severity"] == "page"
        assert page["annotations"]["runbook_url"] == f"{RUNBOOK}#grayguardnodequarantined"
        assert "node1" in page["annotations"]["description"] and "chat" in page["annotations"]["description"]

        safeguard = hook.wait_for(lambda h: named(h.alerts("/page"), "GrayguardSafeguardEngaged", "code"),
                                  timeout_s=30, what="the safeguard page for pool code")[0]
        assert safeguard["annotations"]["runbook_url"] == f"{RUNBOOK}#grayguardsafeguardengaged"

        # Alertmanager has code's quarantine alert, and holds it back because of the safeguard.
        suppressed = wait_until(
            lambda: [a for a in am.alerts(alertname="GrayguardNodeQuarantined", pool="code")
                     if a["status"]["state"] == "suppressed" and a["status"]["inhibitedBy"]],
            20, 0.2, "code's quarantine alert to be inhibited")
        assert suppressed[0]["labels"]["node"] == "node7"
        # Prometheus fires it all the same: the inhibition is Alertmanager's doing.
        assert named(prom.alerts(), "GrayguardNodeQuarantined", "code")[0]["state"] == "firing"
        # The notification for pool code went out (safeguard) without the quarantine page.
        assert not named(hook.alerts(status=None), "GrayguardNodeQuarantined", "code")
        for n in hook.received("/page"):
            if n.payload["groupLabels"].get("pool") == "code":
                assert {a["labels"]["alertname"] for a in n.alerts} == {"GrayguardSafeguardEngaged"}
        # Nothing was routed as a ticket (degraded alerts wait 15m; code's is inhibited anyway).
        assert hook.alerts("/ticket") == []


class FakeTtft:
    """vLLM's TTFT histogram, growing 100 requests per 0.1 s: P99 = 0.75 s exactly."""

    def __init__(self):
        self.t0 = time.time()

    def collect(self):
        n = int((time.time() - self.t0) * 10) * 100
        h = HistogramMetricFamily("vllm:time_to_first_token_seconds", "TTFT", labels=["model_name", "engine"])
        # le 0.25: 50 %, 0.5: 98 %, 1: 100 % -> rank 99 in (0.5, 1]: 0.5 + 0.5 * (99-98)/(100-98)
        h.add_metric(["m", "0"], [("0.25", n // 2), ("0.5", n * 98 // 100), ("1.0", n), ("+Inf", n)],
                     sum_value=0.4 * n)
        yield h


def test_rerenderer_learns_a_baseline_and_reloads_prometheus(tmp_path):
    require("prometheus", "promtool")
    cfg = e2e_config()
    rules_dir = tmp_path / "rules"
    write_if_changed(rules_dir, render_all(cfg), promtool=None)  # no baselines yet
    reg = CollectorRegistry()
    reg.register(FakeTtft())
    with serve_registry(reg) as vllm, \
            start_prometheus(prometheus_config([static_job("vllm", [vllm.target], {"pool": "chat"})], interval="1s"),
                             sorted(rules_dir.glob("*.rules.yml")), workdir=tmp_path / "prom") as prom:
        assert "GrayguardTtftRegression" not in prom.rule_names()
        prom.wait_for(baseline_query(cfg), lambda res: res and res[0]["metric"]["pool"] == "chat", timeout_s=30)

        rr = RuleRerenderer(cfg, rules_dir, prom.url)
        res = rr.maybe_rerender()
        assert (res.changed, res.reloaded, res.error) == (True, True, None), res
        assert rr.baselines["chat"] == pytest.approx(0.75)
        assert 'p99_rate5m{pool="chat"} > 2 * 0.75' in (rules_dir / "grayguard-alerts.rules.yml").read_text()
        wait_until(lambda: "GrayguardTtftRegression" in prom.rule_names(), 10, 0.2, "the reloaded rules")

        again = rr.rerender()  # same baseline: nothing to write, no reload
        assert (again.changed, again.reloaded, again.error) == (False, False, None)
