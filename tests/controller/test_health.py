"""/healthz fails when the controller's tick loop stalls and /readyz until it has ticked (controller/health.py):
the pure verdicts, the loop and its server with an injected clock, and a real `grayguard controller` process."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry

from grayguard.config import load_config, parse_config
from grayguard.controller.cmd_controller import run_loop, tick_budget_s
from grayguard.controller.health import MIN_STALL_S, Beat, Verdict, health, readiness, stall_limit_s
from grayguard.controller.httpserver import serve
from grayguard.localstack.procs import free_port, start_process, wait_until
from tests.support.ctl_helpers import FakeHaproxy, FakeProm, fake_controller, samples, servers


# ---- the pure decisions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interval,budget,limit", [(1.0, 0.0, 10.0), (0.1, 0.0, 10.0), (5.0, 0.0, 50.0),
                                                   (1.0, 8.0, 16.0), (5.0, 30.0, 60.0)])
def test_the_stall_limit_is_ten_ticks_at_least_ten_seconds_and_never_under_the_ticks_own_deadlines(interval, budget,
                                                                                                   limit):
    assert stall_limit_s(interval, budget) == limit


def test_the_shipped_defaults_stall_limit():
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}]})
    assert stall_limit_s(cfg.tick_interval_s, tick_budget_s(cfg)) >= max(MIN_STALL_S, 10 * cfg.tick_interval_s)


@pytest.mark.parametrize("now,last,ok,reason", [
    (105.0, None, True, "ok: starting, the first tick has not completed yet (5.0s)"),
    (110.0, None, True, "ok: starting, the first tick has not completed yet (10.0s)"),  # at the limit: still alive
    (111.0, None, False, "stalled: no tick has completed in the 11s since the loop started (stall limit 10s)"),
    (200.0, 195.5, True, "ok: the last tick completed 4.5s ago (stall limit 10s)"),
    (200.0, 189.0, False, "stalled: the last tick completed 11s ago (stall limit 10s)"),
])
def test_health(now, last, ok, reason):
    assert health(now, 100.0, last, 10.0) == Verdict(ok, reason)


def test_readiness():
    assert readiness(0) == Verdict(False, "not ready: the first tick has not completed yet")
    assert readiness(0, knows_leadership=False).ok is False
    assert readiness(1, knows_leadership=False) == Verdict(False, "not ready: the registry has not answered, so "
                                                                  "this replica does not know whether it leads")
    assert readiness(3) == Verdict(True, "ready: 3 tick(s) completed")


def test_a_beat_follows_its_clock():
    t = [50.0]
    b = Beat(clock=lambda: t[0])
    t[0] = 70.0
    assert not b.health(10.0).ok and b.completed == 0
    b.done()
    assert b.health(10.0).ok and b.completed == 1 and b.last == 70.0


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
