"""Chaos on the real local stack: the simulated fleet under load behind two real HAProxy instances of one
tier, a real Prometheus and Alertmanager, the webhook pager, and `grayguard controller` as a child process
with a state file. Each test breaks one part while a node is quarantined (a CUDA error, and no canary
within the module: it must stay out) or while a new fault arrives, and checks what the issue promises:

- Prometheus killed and restarted: weights held, GrayguardControllerStale fires, control resumes;
- HAProxy reloaded with and without a server-state file, and killed outright: weights and drains repaired
  on the next tick;
- one of two HAProxy instances down: the other still updated, the error counted;
- Alertmanager down: the page arrives once it is back;
- the controller SIGKILLed while a node is quarantined: the node stays out on restart (with its state
  file, and without it: seeded from HAProxy).

One stack serves the module (about 15 s to start and warm up); every scenario puts back what it broke, and
an autouse fixture restarts any part a failed scenario left down. Each faulty node is its own, under an
ejection cap of 4 of 8. Demo timings: 1 s ticks and scrapes, 10 s rate windows. About 65-80 s in all.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from grayguard.localstack.stack import DEMO_ALERT_FOR, LocalStack, StackSpec
from grayguard.sim.loadgen import LoadConfig, run_load
from tests.support.stack import require, wait_until

pytestmark = pytest.mark.e2e

QUARANTINED = "node1"  # CUDA errors from the first scenario on (healed only inside the controller scenarios)
HAPROXY_DOWN_NODE, ALERTMANAGER_DOWN_NODE, PROMETHEUS_DOWN_NODE = "node2", "node3", "node4"
EJECTED = {"quarantined", "canary"}
OUT = (0, True)  # (weight, drained) of a node out of rotation
# "Repaired on the next tick": the tick running when the part came back may have read it before; the next
# one repairs it; one more may end while the test looks. Counted in ticks, so a slow machine is no excuse.
REPAIR_TICKS = 3
STALE_S = 5  # rules.controller_stale_s here: GrayguardControllerStale after 5 s without a good tick


@pytest.fixture(scope="module")
def stack():
    require("haproxy", "prometheus", "alertmanager")
    spec = StackSpec(
        nodes=8, seed=3, controller=False, haproxies=2, controller_process=True,
        overrides={"thresholds": {"max_ejected_fraction": 0.5},  # 4 of 8: one node per scenario
                   # no canary during the module: a quarantined node stays quarantined, its `since` unchanged
                   "recovery": {"min_quarantine_s": 300},
                   "rules": {"controller_stale_s": STALE_S,
                             "alert_for": {**DEMO_ALERT_FOR, "GrayguardControllerStale": "0s"}}})
    st = LocalStack(spec)
    records: list = []
    load = None
    try:
        st.start()
        load = st.fleet.submit(run_load(LoadConfig(url=st.gateway_url, rate=16, duration_s=900, seed=3,
                                                   timeout_s=6), sink=records))
        # Like the demo: the controller starts once the 10 s rate windows are full of traffic.
        t0 = time.monotonic()
        wait_until(lambda: len(st.prometheus.query(st.cfg.signals.latency_query)) == 8, 30, 0.5,
                   "the recorded latency of all 8 nodes")
        wait_until(lambda: time.monotonic() - t0 >= 12, 13, 0.2, "full 10 s rate windows")
        st.start_controller()
        wait_until(lambda: ticks(st) >= 2, 15, 0.2, "two controller ticks")
        yield st
    finally:
        if load is not None:
            load.cancel()
            # Each request in flight ends within its 6 s deadline; the last record may be an arrival the
            # cancel caught before it was sent, pending for ever.
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: all(r.status != "pending" for r in records[:-1]), 10, 0.1, "the load to end")
        st.stop()


@pytest.fixture(autouse=True)
def whole(stack):
    """Every part running before a scenario (a failed one may have left something down)."""
    for i, hp in enumerate(stack.haproxies):
        if hp.proc is None or not hp.proc.running():
            stack.start_haproxy(i)
    if not stack.prometheus.proc.running():
        stack.restart_prometheus()
    if not stack.alertmanager.proc.running():
        stack.restart_alertmanager()
    if stack.controller_proc is not None and not stack.controller_proc.running():
        stack.kill_controller()  # reaps it
    if stack.controller_proc is None:
        stack.start_controller()
    yield stack


# ---- helpers ---------------------------------------------------------------------------------------
def ticks(st: LocalStack) -> float:
    return st.controller_metric("grayguard_ticks_total") or 0


def metric(st: LocalStack, name: str, **labels: str) -> float:
    return st.controller_metric(name, **labels) or 0


def endpoint(st: LocalStack, i: int) -> str:
    return st.haproxies[i].endpoint


def weight(st: LocalStack, node: str, i: int = 0):
    return st.haproxy_weights(i)[node]


def out_everywhere(st: LocalStack, node: str) -> bool:
    return all(weight(st, node, i) == OUT for i in range(len(st.haproxies)))


def wait_repaired(st: LocalStack, repaired, what: str) -> float:
    """Wait until repaired() and check it took at most REPAIR_TICKS controller ticks; returns the ticks."""
    start = ticks(st)
    wait_until(repaired, 15, 0.05, what)
    took = ticks(st) - start
    assert took <= REPAIR_TICKS, f"{what}: {took:g} ticks"
    return took


def quarantine(st: LocalStack, node: str, timeout_s: float = 20) -> None:
    """A CUDA error on node (its canaries keep failing), and wait until every HAProxy has it out."""
    if st.fleet.fault_status().get(node, {}).get("fault") != "cuda_error":
        st.set_fault(node, "cuda_error")
    wait_until(lambda: out_everywhere(st, node), timeout_s, 0.2, f"{node} drained on every HAProxy")


def wait_good_ticks(st: LocalStack, n: int, timeout_s: float = 10) -> None:
    """n more ticks of the running controller."""
    start = ticks(st)
    wait_until(lambda: ticks(st) >= start + n, timeout_s, 0.1, f"{n} more controller ticks")


class Watch:
    """Samples HAProxy in the background: every (instance, node, (weight, drained)) that breaks expect()."""

    def __init__(self, st: LocalStack, expect, instances=(0, 1)):
        self.st, self.expect, self.instances = st, expect, instances
        self.bad: list = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for i in self.instances:
                try:
                    weights = self.st.haproxy_weights(i)
                except Exception:  # noqa: BLE001 - an instance that is down has no weights to check
                    continue
                self.samples += 1
                self.bad += [(i, n, w) for n, w in weights.items() if not self.expect(n, w)]

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ---- the controller killed -------------------------------------------------------------------------
def node_status(st: LocalStack, node: str) -> dict:
    return next(n for p in st.controller_status()["pools"] for n in p["nodes"] if n["node"] == node)


def saved_state(st: LocalStack, node: str) -> str | None:
    """The node's state in the controller's state file."""
    return json.loads(st.state_file.read_text())["pools"]["chat"][node]["state"]


@contextlib.contextmanager
def healed(st: LocalStack, node: str):
    """The quarantined node's fault cleared until the block ends (then it is back, so the node stays out).

    While it lasts, nothing a restarted controller reads on its first ticks says the node is sick (its probes
    answer), so only what the controller remembers, or what HAProxy shows, can keep it out.
    """
    st.clear_fault(node)
    try:
        # answering: ok, or slow on a loaded 2-core machine (its first chunk past the exporter's 0.3 s)
        wait_until(lambda: st.prometheus.query(
            f'grayguard_probe_last_result{{node="{node}",result=~"ok|slow"}} == 1'), 60, 0.2,
            f"{node}'s probes to answer again")
        yield
    finally:
        st.set_fault(node, "cuda_error")


def test_controller_sigkilled_while_a_node_is_quarantined_keeps_it_out_on_restart(stack):
    quarantine(stack, QUARANTINED)
    wait_until(lambda: saved_state(stack, QUARANTINED) in EJECTED, 5, 0.2, "the state file to have it out")
    before = node_status(stack, QUARANTINED)
    with healed(stack, QUARANTINED), Watch(stack, lambda n, w: n != QUARANTINED or w == OUT) as watch:
        stack.kill_controller()  # SIGKILL: no clean-up; the flock on state.json.lock dies with the process
        stack.start_controller()  # it would exit 2 if the dead one's lock were still held
        wait_good_ticks(stack, 3)
        after = node_status(stack, QUARANTINED)
    assert watch.samples > 0 and watch.bad == [], watch.bad
    # Its own state came back from the state file: same cause, same clock. A CUDA error opens the node's circuit
    # (the agent marks it down: cause gateway), which goes half-open at the canary interval: the restart may fall
    # after that, so the stage is quarantined (the same since) or the canary stage that follows it.
    assert before["state"] == "quarantined" and after["state"] in ("quarantined", "canary"), (before, after)
    assert after["drain_cause"] == before["drain_cause"] != "seeded", after
    assert after["state"] != "quarantined" or after["since"] == before["since"], after


def test_controller_sigkilled_and_its_state_file_lost_still_keeps_the_node_out(stack):
    quarantine(stack, QUARANTINED)
    with healed(stack, QUARANTINED), Watch(stack, lambda n, w: n != QUARANTINED or w == OUT) as watch:
        stack.kill_controller()
        stack.state_file.unlink()
        stack.start_controller()
        wait_good_ticks(stack, 3)
        after = node_status(stack, QUARANTINED)
    assert watch.samples > 0 and watch.bad == [], watch.bad
    assert after["state"] in EJECTED and after["drain_cause"] == "seeded", after  # seeded from HAProxy's drain


# ---- HAProxy reloaded and killed -------------------------------------------------------------------
def test_haproxy_reload_with_a_server_state_file_keeps_weights_and_drains(stack):
    quarantine(stack, QUARANTINED)
    before = stack.haproxy_weights(0)
    old_pid = stack.haproxy_pid(0)
    with Watch(stack, lambda n, w: n != QUARANTINED or w == OUT, instances=(0,)) as watch:
        stack.reload_haproxy(0, server_state=True)
        assert stack.haproxy_pid(0) != old_pid
        after = stack.haproxy_weights(0)  # the new process applied the dumped state before serving
        wait_good_ticks(stack, 2)
    assert after[QUARANTINED] == OUT and {n for n, (_, d) in after.items() if d} == \
        {n for n, (_, d) in before.items() if d}, (before, after)
    assert watch.bad == [], watch.bad


def test_haproxy_reload_without_a_server_state_file_is_repaired_on_the_next_tick(stack):
    quarantine(stack, QUARANTINED)
    ep = endpoint(stack, 0)
    writes = metric(stack, "grayguard_haproxy_writes_total", endpoint=ep)
    stack.reload_haproxy(0, server_state=False)  # the new process starts from the config: all ready, weight 100
    wait_repaired(stack, lambda: weight(stack, QUARANTINED) == OUT, f"{QUARANTINED} drained again")
    # The controller did it (HAProxy had nothing to load it from): its writes to this endpoint went up.
    assert metric(stack, "grayguard_haproxy_writes_total", endpoint=ep) > writes
    assert stack.node_states()[QUARANTINED] in EJECTED


def test_haproxy_killed_outright_is_repaired_once_it_is_back(stack):
    quarantine(stack, QUARANTINED)
    ep = endpoint(stack, 0)
    errors = metric(stack, "grayguard_haproxy_errors_total", endpoint=ep)
    stack.kill_haproxy(0)  # SIGKILL: its weights and drains die with it
    wait_until(lambda: metric(stack, "grayguard_haproxy_errors_total", endpoint=ep) > errors, 5, 0.1,
               "the controller to count the dead HAProxy")
    assert weight(stack, QUARANTINED, 1) == OUT  # the other instance of the tier is untouched
    stack.start_haproxy(0)  # from the config: every server ready at weight 100
    wait_repaired(stack, lambda: weight(stack, QUARANTINED) == OUT, f"{QUARANTINED} drained again")
    assert stack.node_states()[QUARANTINED] in EJECTED


def test_one_of_two_haproxies_down_the_other_is_still_updated_and_the_error_counted(stack):
    quarantine(stack, QUARANTINED)
    node, down = HAPROXY_DOWN_NODE, endpoint(stack, 1)
    errors = metric(stack, "grayguard_haproxy_errors_total", endpoint=down)
    stack.kill_haproxy(1)
    try:
        stack.set_fault(node, "cuda_error")
        wait_until(lambda: weight(stack, node, 0) == OUT, 20, 0.2, f"{node} drained on the HAProxy that is up")
        wait_until(lambda: metric(stack, "grayguard_haproxy_errors_total", endpoint=down) > errors, 5, 0.1,
                   "the controller to count the HAProxy that is down")
        assert metric(stack, "grayguard_data_stale") == 0  # one endpoint down holds nothing
    finally:
        stack.start_haproxy(1)
    # Back from the config: both drains repaired on the next tick.
    wait_repaired(stack, lambda: weight(stack, node, 1) == OUT and weight(stack, QUARANTINED, 1) == OUT,
                  "both drains repaired on the restarted HAProxy")


# ---- Alertmanager down -----------------------------------------------------------------------------
def quarantine_pages(st: LocalStack, node: str) -> list:
    return [a for a in st.webhook.alerts("/page") if a["labels"].get("alertname") == "GrayguardNodeQuarantined"
            and a["labels"].get("node") == node]


def firing(st: LocalStack, alertname: str, **labels: str) -> list:
    return [a for a in st.prometheus.alerts() if a["labels"].get("alertname") == alertname
            and a["state"] == "firing" and labels.items() <= a["labels"].items()]


def test_alertmanager_down_the_page_arrives_once_it_is_back(stack):
    node = ALERTMANAGER_DOWN_NODE
    stack.stop_alertmanager()
    try:
        stack.set_fault(node, "cuda_error")
        wait_until(lambda: weight(stack, node) == OUT, 40, 0.2, f"{node} drained")
        wait_until(lambda: firing(stack, "GrayguardNodeQuarantined", node=node), 15, 0.2,
                   f"Prometheus to fire GrayguardNodeQuarantined for {node}")
        assert quarantine_pages(stack, node) == []  # nobody to deliver it
    finally:
        stack.restart_alertmanager()
    page = wait_until(lambda: quarantine_pages(stack, node), 15, 0.1, f"the quarantine page for {node}")[0]
    assert page["labels"]["pool"] == "chat" and page["labels"]["severity"] == "page"


# ---- Prometheus killed -----------------------------------------------------------------------------
def stale_alert_fired_since(st: LocalStack, t: float) -> list:
    window = max(1, int(time.time() - t) + 1)
    return st.prometheus.query(
        f'max_over_time(ALERTS{{alertname="GrayguardControllerStale",alertstate="firing"}}[{window}s])')


def test_prometheus_killed_and_restarted_weights_held_stale_alert_fires_control_resumes(stack):
    quarantine(stack, QUARANTINED)
    node, outage_s = PROMETHEUS_DOWN_NODE, 8  # longer than rules.controller_stale_s
    before = [stack.haproxy_weights(i) for i in (0, 1)]
    held = metric(stack, "grayguard_ticks_total", result="held")
    stack.kill_prometheus()
    killed = time.time()
    try:
        wait_until(lambda: metric(stack, "grayguard_data_stale") == 1, 5, 0.1, "the controller to hold")
        stack.set_fault(node, "cuda_error")  # unseen while Prometheus is down
        with Watch(stack, lambda n, w: False) as watch:  # every sample recorded: compared below
            wait_until(lambda: time.time() - killed >= outage_s, outage_s + 1, 0.1, "the outage")
        held = metric(stack, "grayguard_ticks_total", result="held") - held
        assert held >= outage_s / 2, held  # the controller kept ticking, and held
    finally:
        stack.restart_prometheus()
    restarted = time.time()
    changed = [(i, n, w) for i, n, w in watch.bad if before[i][n] != w]
    assert watch.samples > 0 and changed == [], changed  # weights held, the quarantined node still out
    # Prometheus scrapes the controller's last good tick, older than rules.controller_stale_s.
    wait_until(lambda: stale_alert_fired_since(stack, restarted), 10, 0.2, "GrayguardControllerStale to fire")
    # Control resumes: the fresh fault is caught, the controller's data is fresh again.
    wait_until(lambda: out_everywhere(stack, node), 20, 0.2, f"{node} drained after the restart")
    wait_until(lambda: metric(stack, "grayguard_data_stale") == 0
               and metric(stack, "grayguard_last_successful_tick_timestamp_seconds") > restarted, 10, 0.2,
               "a good tick on fresh data")
    assert stack.node_states()[node] in EJECTED
