"""End-to-end on NGINX as the gateway: the demo's scenario (a thermally throttled node in a simulated fleet, scraped by
a real Prometheus with grayguard's rules) with a real nginx in front of the fleet and the real controller steering it
through its rendered upstream file (gateway.kind: nginx). The slow node's weight in the file is cut, then it is
`down` (drained); nginx reloads each time and its own access log shows the node's share of the traffic fall, then
stop. Every wait shares one deadline; about 35 s. Then `grayguard demo --gateway nginx`, shortened: about 40 s."""

import contextlib
import io
import json
import threading
import time

import pytest

from grayguard.demo.cli import DemoOptions, run_scenario
from grayguard.localstack.nginx import NginxStack
from grayguard.localstack.stack import StackSpec
from grayguard.promclient import PrometheusClient
from grayguard.sim.loadgen import LoadConfig, run_load
from tests.support.stack import require, wait_until

pytestmark = pytest.mark.e2e

SLOW = "node2"
BUDGET_S = 120  # every wait of the test together, after the stack is up


class Deadline:
    """wait_until bounded by what is left of one budget for the whole test."""

    def __init__(self, budget_s):
        self.end = time.monotonic() + budget_s

    def wait(self, predicate, timeout_s, what, interval_s=0.2):
        return wait_until(predicate, max(0.1, min(timeout_s, self.end - time.monotonic())), interval_s, what)


class FileWatch:
    """Polls the upstream file every 50 ms: the slow node's (wall time, weight, drained) at each change."""

    def __init__(self, stack):
        self.stack, self.seen, self.stop = stack, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(0.05):
            with contextlib.suppress(Exception):  # a poll mid-replace: the next one reads it
                w = self.stack.nginx_weights()[SLOW]
                if not self.seen or self.seen[-1][1:] != w:
                    self.seen.append((time.time(), *w))

    def first(self, pred):
        return next((t for t, w, d in self.seen if pred(w, d)), None)


def share(served, addr, start, end):
    """(the node's share of the requests nginx started in [start, end), how many it started in all)."""
    window = [a for t, a in served if start <= t < end]
    return (sum(a == addr for a in window) / len(window) if window else None), len(window)


def ticks(stack, result):
    return stack.controller.metrics.registry.get_sample_value("grayguard_ticks_total", {"result": result}) or 0


def test_nginx_gateway_cuts_then_drains_a_slow_node():
    require("nginx", "haproxy", "prometheus", "alertmanager")
    stack = NginxStack(StackSpec(nodes=4, seed=3, controller=False, control_window="10s"))
    with stack:
        deadline = Deadline(BUDGET_S)
        addr = next(n.address for n in stack.nodes if n.name == SLOW)
        records: list = []
        load = stack.fleet.submit(run_load(LoadConfig(url=stack.gateway_url, rate=12, duration_s=140, seed=3,
                                                      timeout_s=20), sink=records))
        watch = FileWatch(stack)
        try:
            prom = PrometheusClient(stack.cfg.prometheus)
            deadline.wait(lambda: len(prom.query(stack.cfg.signals.latency_query)) == 4, 45,
                          "the recorded latency of all 4 nodes")
            stack.start_controller()
            deadline.wait(lambda: ticks(stack, "ok") >= 3, 20, "three good controller ticks through nginx")
            assert stack.nginx_weights() == {n.name: (100, False) for n in stack.nodes}
            assert stack.controller.haproxies[0].reloads == 0  # converged: nothing written, no reload
            watch.thread.start()

            fault_at = time.time()
            stack.set_fault(SLOW, "thermal", k=10)  # the demo's fault: every phase x10
            deadline.wait(lambda: watch.first(lambda w, d: d) is not None, 45, f"{SLOW} down in nginx's file")
            cut_at = watch.first(lambda w, d: w < 100)
            drained_at = watch.first(lambda w, d: d)
            assert cut_at is not None and cut_at <= drained_at, watch.seen
            weights = stack.nginx_weights()
            assert [n for n, (_, d) in weights.items() if d] == [SLOW], weights
            assert "down;" in next(ln for ln in stack.nginx.upstreams["vllm_chat"].read_text().splitlines()
                                   if f"node={SLOW} " in ln)
            # the file is put in place before `nginx -t` and `nginx -s reload` run (controller/nginx.py write): the
            # watch can see it first, so the reload is waited for (a loaded CI machine saw 0 at once)
            deadline.wait(lambda: stack.controller.haproxies[0].reloads >= 1, 15, "nginx reloaded, the node drained")

            # nginx reloaded: from a second after the drain no new request reaches the node, the others take them
            settle = drained_at + 1.0
            deadline.wait(lambda: share(stack.nginx.served(), addr, settle, time.time())[1] >= 40, 30,
                          "40 requests through nginx after the drain")
            after, n_after = share(stack.nginx.served(), addr, settle, time.time())
            before, n_before = share(stack.nginx.served(), addr, fault_at - 15, fault_at)
            assert n_before >= 40 and before >= 0.15, (before, n_before)  # round robin: about a quarter
            assert after == 0.0, (after, n_after)
            # while only cut (the demo's fault: about a second, weight 1 of 301) it took less than its quarter
            cut, n_cut = share(stack.nginx.served(), addr, cut_at + 0.2, drained_at)
            assert n_cut < 5 or cut < before, (cut, n_cut, before, watch.seen)

            m = stack.controller.metrics.registry
            assert not m.get_sample_value("grayguard_haproxy_errors_total",
                                          {"endpoint": stack.controller.haproxies[0].endpoint, "kind": "check_failed"})
            states = stack.node_states()
            assert states[SLOW] in ("quarantined", "canary"), states
            assert all(s == "healthy" for n, s in states.items() if n != SLOW), states
        finally:
            watch.stop.set()
            load.cancel()
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: all(r.status != "pending" for r in records), 8, 0.1, "the load's requests to end")


def test_the_demo_scenario_runs_on_nginx(tmp_path):
    """`grayguard demo --gateway nginx`, shortened as tests/demo/test_stack_e2e.py runs it (about 40 s)."""
    require("nginx", "haproxy", "prometheus", "alertmanager")
    opts = DemoOptions(nodes=5, rate=12, duration_s=36, fault="thermal", fault_node="node2", fault_start_s=13,
                       fault_end_s=None, fault_params={"k": 8}, live="off", seed=3, control_window="10s",
                       timeout_s=6, gateway="nginx")
    out = io.StringIO()
    r = run_scenario(opts, tmp_path / "report", out)
    log = out.getvalue()
    assert "through NGINX" in log
    assert r["quarantine_s"] is not None and r["quarantine_s"] - r["fault_start_s"] <= 30, log
    # the weights the report plots are nginx's file's: the cut is seen there, no later than a poll after the drain
    assert r["first_weight_cut_s"] is not None and r["first_weight_cut_s"] <= r["quarantine_s"] + 1.0, log
    assert r["false_quarantines"] == [], log
    samples = json.loads((tmp_path / "report" / "report.json").read_text())["samples"]
    drained = [s for s in samples if s["nodes"].get("node2", {}).get("drained")]
    assert drained and all(not v.get("drained") for s in drained for n, v in s["nodes"].items() if n != "node2")
