"""/healthz fails when the controller's tick loop stalls and /readyz until it has ticked (grayguard/health.py; its pure
verdicts: tests/grayguard/test_health.py): the loop and its server with an injected clock, and a real `grayguard
controller` process."""

from __future__ import annotations

import sys
import threading
import time

import requests
import yaml
from prometheus_client import CollectorRegistry

from grayguard.config import load_config, parse_config
from grayguard.controller.cmd_controller import run_loop, tick_budget_s
from grayguard.controller.httpserver import serve
from grayguard.health import MIN_STALL_S, Beat, readiness, stall_limit_s
from grayguard.localstack.procs import free_port, start_process, wait_until
from tests.support.ctl_helpers import FakeHaproxy, FakeProm, fake_controller, samples, servers


# ---- the controller's stall limit ----------------------------------------------------------------------------
def test_the_shipped_defaults_stall_limit():
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}]})
    assert stall_limit_s(cfg.tick_interval_s, tick_budget_s(cfg)) >= max(MIN_STALL_S, 10 * cfg.tick_interval_s)


# ---- the loop and its server, the clock injected ------------------------------------------------------------------
def get(url: str) -> tuple[int, str]:
    r = requests.get(url, timeout=5)
    return r.status_code, r.text


def test_a_stalled_tick_loop_fails_healthz_and_recovers_when_it_moves_again():
    """A tick blocked inside Prometheus' answer (any wedge: a lock, a hung call without a deadline) stops the beats;
    past the stall limit /healthz is 503, and the next completed tick makes it 200 again."""
    blocked, entered, release = threading.Event(), threading.Event(), threading.Event()

    def answers(q):
        if blocked.is_set():
            entered.set()
            release.wait(30)
        return samples({n: 0.02 for n, _, _ in servers(3)}, time.time())

    events: list = []
    hap = FakeHaproxy("unix:/nonexistent/hap.sock", {"vllm_chat": servers(3)}, events)
    ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [hap], FakeProm(answers, events),
                          extra={"tick_interval_s": 0.05})
    t = [1000.0]
    beat = Beat(clock=lambda: t[0])
    limit = stall_limit_s(ctl.cfg.tick_interval_s)
    srv = serve("127.0.0.1:0", ctl.metrics.registry, ctl.status, health=lambda: beat.health(limit),
                ready=lambda: readiness(beat.completed, ctl.knows_leadership))
    stop = threading.Event()
    loop = threading.Thread(target=run_loop, args=(ctl, ctl.cfg.tick_interval_s, stop), kwargs={"beat": beat},
                            daemon=True)
    try:
        assert get(srv.url + "/readyz")[0] in (200, 503)  # served from the start
        loop.start()
        wait_until(lambda: get(srv.url + "/readyz")[0] == 200, 10, what="/readyz 200 after the first tick")
        assert get(srv.url + "/healthz") == (200, "ok: the last tick completed 0.0s ago (stall limit 10s)\n")
        blocked.set()
        assert entered.wait(10), "no tick reached Prometheus"
        t[0] += limit - 1  # the tick hangs: still within the limit
        assert get(srv.url + "/healthz")[0] == 200
        t[0] += 2
        assert get(srv.url + "/healthz") == (503, "stalled: the last tick completed 11s ago (stall limit 10s)\n")
        assert get(srv.url + "/readyz")[0] == 200  # ready it was: a stall is liveness' business
        blocked.clear()
        release.set()
        wait_until(lambda: get(srv.url + "/healthz")[0] == 200, 10, what="/healthz 200 once a tick completes")
    finally:
        release.set()
        stop.set()
        loop.join(10)
        srv.stop()
    assert not loop.is_alive()


def test_before_the_first_tick_readyz_is_503_and_healthz_waits_for_the_stall_limit():
    t = [0.0]
    beat = Beat(clock=lambda: t[0])
    srv = serve("127.0.0.1:0", CollectorRegistry(), dict,
                health=lambda: beat.health(10.0), ready=lambda: readiness(beat.completed))
    try:
        assert get(srv.url + "/readyz") == (503, "not ready: the first tick has not completed yet\n")
        assert get(srv.url + "/healthz")[0] == 200
        t[0] = 10.5
        assert get(srv.url + "/healthz")[0] == 503
        beat.done()
        assert get(srv.url + "/readyz") == (200, "ready: 1 tick(s) completed\n")
        assert get(srv.url + "/healthz")[0] == 200
    finally:
        srv.stop()


# ---- a real `grayguard controller` ------------------------------------------------------------------------------
def controller(tmp_path, haproxy, extra=None):
    port = free_port()
    cfg = tmp_path / "grayguard.yaml"
    cfg.write_text(yaml.safe_dump({
        "prometheus": {"url": f"http://127.0.0.1:{free_port()}", "timeout_s": 0.5},  # nothing there: ticks hold
        "haproxy": {"endpoints": [haproxy.endpoint], "timeout_s": 0.5},
        "pools": [{"name": "chat", "backend": "vllm_chat"}], "tick_interval_s": 0.5,
        "rules": {"rerender_interval_s": 0}, "state_file": str(tmp_path / "state.json"), **(extra or {})}))
    proc = start_process([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(cfg),
                          "--web.listen-address", f"127.0.0.1:{port}"], tmp_path / "controller.log",
                         ready_url=f"http://127.0.0.1:{port}/metrics", timeout_s=30)
    return proc, f"http://127.0.0.1:{port}"


def test_a_running_controller_is_healthy_and_ready(tmp_path, haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(2)})
    proc, url = controller(tmp_path, hap)
    try:
        wait_until(lambda: get(url + "/readyz")[0] == 200, 20, what="/readyz 200")
        status, text = get(url + "/healthz")
        cfg = load_config(tmp_path / "grayguard.yaml")
        limit = stall_limit_s(cfg.tick_interval_s, tick_budget_s(cfg))  # 21 s: twice its 0.5 s deadlines, in turn
        assert status == 200 and text.startswith("ok: the last tick completed") and f"stall limit {limit:g}s" in text
        assert get(url + "/status")[0] == 200  # the probes come beside what was served before
    finally:
        proc.stop()


def test_a_replica_that_cannot_reach_its_registry_is_alive_but_not_ready(tmp_path, haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(2)})
    proc, url = controller(tmp_path, hap, {"registry": {"url": f"http://127.0.0.1:{free_port()}", "timeout_s": 0.5}})
    try:
        wait_until(lambda: "tick" in get(url + "/healthz")[1] and get(url + "/healthz")[0] == 200, 20,
                   what="/healthz 200")
        wait_until(lambda: "last tick completed" in get(url + "/healthz")[1], 20, what="a completed tick")
        assert get(url + "/readyz") == (503, "not ready: the registry has not answered, so this replica does not "
                                             "know whether it leads\n")
    finally:
        proc.stop()
