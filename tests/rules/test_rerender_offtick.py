"""Issue 12, item 16: alert re-rendering runs off the control tick, and its reload target is configurable.

Before, the re-render ran inside the tick job (a promtool check of up to 60 s held every tick back, and a
tick that raised skipped it), and it always POSTed <prometheus>/-/reload, which Mimir and Thanos do not
have: a 404, retried on every re-render for ever.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from grayguard.config import parse_config
from grayguard.controller.cmd_controller import make_rerender, run_loop
from grayguard.controller.metrics import ControllerMetrics
from grayguard.httpserve import serve
from grayguard.rules.rerender import RuleRerenderer


class FakeController:
    """What run_loop needs of a Controller: tick(), close(), metrics, cfg, dry_run, leadership."""

    def __init__(self, rerender_interval_s: float, fail: bool = False):
        self.cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}],
                                 "rules": {"rerender_interval_s": rerender_interval_s}})
        self.metrics = ControllerMetrics.create()
        self.dry_run = False
        self.leadership = None  # alone: no registry, no election
        self.ticks = 0
        self.fail = fail

    def close(self):  # run_loop closes the controller's canary workers at its end; this one has none
        pass

    def tick(self):
        self.ticks += 1
        if self.fail:  # e.g. a bug, or (before issue 12) a state file that could not be saved
            raise OSError("state file not saved")


def run_in_thread(ctl, interval_s, rerender):
    stop = threading.Event()
    t = threading.Thread(target=run_loop, args=(ctl, interval_s, stop), kwargs={"rerender": rerender}, daemon=True)
    t.start()
    return stop, t


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_slow_rerender_does_not_hold_the_ticks_and_never_overlaps_itself():
    ctl = FakeController(rerender_interval_s=0.01)
    release = threading.Event()
    running, peak, calls = [0], [0], [0]
    lock = threading.Lock()

    def slow_rerender():  # promtool taking its time
        with lock:
            running[0] += 1
            calls[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1

    began = time.monotonic()
    stop, t = run_in_thread(ctl, 0.05, slow_rerender)
    try:
        assert wait_for(lambda: calls[0] == 1)
        before = ctl.ticks
        # ticks go on while the re-render is held: five of them, polled with a deadline rather than counted in a
        # fixed second (CI's loaded 2 cores ran 3 in one second of the 20 due; a re-render that held the tick runs none)
        assert wait_for(lambda: ctl.ticks - before >= 5, timeout_s=20.0), \
            f"{ctl.ticks - before} ticks ran in 20 s while the re-render was busy"
        assert not release.is_set() and running[0] == 1  # all of them while the first re-render still ran
        assert calls[0] == 1 and peak[0] == 1  # the re-render job did not start a second copy
        release.set()
        assert wait_for(lambda: calls[0] >= 3)  # and it runs again once the first is done
    finally:
        release.set()
        stop.set()
        t.join(15)
    slots = (time.monotonic() - began) / 0.05
    assert peak[0] == 1
    # A re-render skipped because the previous one still ran is not a skipped tick. On a loaded machine ticks
    # wake late and some are skipped for real, but every slot is either run or skipped once: had the busy
    # re-render's passed-over slots (one every 10 ms here) been counted too, they would outnumber the tick slots.
    skipped = ctl.metrics.registry.get_sample_value("grayguard_ticks_total", {"result": "skipped"}) or 0
    assert ctl.ticks + skipped <= slots + 2, (ctl.ticks, skipped, slots)


def test_rerender_continues_when_the_tick_fails():
    ctl = FakeController(rerender_interval_s=0.05, fail=True)
    calls = [0]
    stop, t = run_in_thread(ctl, 0.05, lambda: calls.__setitem__(0, calls[0] + 1))
    try:
        assert wait_for(lambda: calls[0] >= 3), "the re-render stopped with the failing tick"
        assert ctl.ticks >= 2
    finally:
        stop.set()
        t.join(15)
    assert ctl.metrics.registry.get_sample_value("grayguard_ticks_total", {"result": "error"}) >= 2


# ---- the reload target -----------------------------------------------------------------------------------------
class FakeProm:
    """A real HTTP server: a baseline query answering a new value each time (so every re-render changes a
    file and owes a reload), and a reload endpoint answering `reload_status`."""

    def __init__(self, reload_status: int):
        self.queries = 0
        self.reloads: list[str] = []

        def query(_req):
            self.queries += 1
            body = {"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"pool": "chat"}, "value": [1700000000, str(0.5 + self.queries / 10)]}]}}
            return 200, "application/json", json.dumps(body).encode()

        def reload(req):
            self.reloads.append(req.path)
            return reload_status, "text/plain", b"404 page not found\n" if reload_status == 404 else b"ok\n"

        self.srv = serve("127.0.0.1:0", {"GET /api/v1/query": query, "POST /-/reload": reload,
                                         "POST /api/v1/rules/reload": reload})
        self.url = self.srv.url

    def close(self):
        self.srv.stop()


def cfg_for(url: str, tmp_path, **rules):
    return parse_config({"pools": [{"name": "chat", "backend": "b"}], "prometheus": {"url": url},
                         "rules": {"output_dir": str(tmp_path), "promtool": "", **rules}})


def test_reload_404_is_said_once_and_not_retried(tmp_path):
    prom = FakeProm(reload_status=404)  # Mimir, Thanos: there is no /-/reload
    try:
        rr = RuleRerenderer(cfg_for(prom.url, tmp_path))
        results = [rr.rerender() for _ in range(4)]
    finally:
        prom.close()
    assert prom.queries == 4 and all(r.changed for r in results)  # the files keep being re-rendered...
    assert prom.reloads == ["/-/reload"]  # ...but the missing endpoint was POSTed once (before: 4 times)
    errors = [r.error for r in results if r.error]
    assert len(errors) == 1 and "HTTP 404" in errors[0] and "rules.reload_url" in errors[0]
    assert results[0].reload_error == "not_found" and all(r.reload_error is None for r in results[1:])


def test_make_rerender_logs_the_404_once_and_counts_it(tmp_path, caplog):
    prom = FakeProm(reload_status=404)
    m = ControllerMetrics.create()
    try:
        rerender = make_rerender(cfg_for(prom.url, tmp_path, rerender_interval_s=60), m)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                rerender()
    finally:
        prom.close()
    assert len([r for r in caplog.records if "HTTP 404" in r.getMessage()]) == 1
    assert m.registry.get_sample_value("grayguard_rules_reload_errors_total", {"kind": "not_found"}) == 1


def test_reload_target_is_configurable(tmp_path):
    prom = FakeProm(reload_status=200)
    try:
        rr = RuleRerenderer(cfg_for(prom.url, tmp_path, reload_url=f"{prom.url}/api/v1/rules/reload"))
        res = rr.rerender()
    finally:
        prom.close()
    assert res.changed and res.reloaded and prom.reloads == ["/api/v1/rules/reload"]


def test_reload_none_posts_nothing(tmp_path):
    for off in ("none", ""):
        prom = FakeProm(reload_status=200)
        try:
            rr = RuleRerenderer(cfg_for(prom.url, tmp_path / (off or "empty"), reload_url=off))
            results = [rr.rerender() for _ in range(2)]
        finally:
            prom.close()
        assert all(r.changed and not r.reloaded and r.error is None for r in results)
        assert prom.reloads == [] and rr.reload_pending is False


def test_run_loop_reads_the_interval_from_the_config():
    ctl = FakeController(rerender_interval_s=0)  # 0: never, even with a re-render function
    calls = [0]
    stop, t = run_in_thread(ctl, 0.05, lambda: calls.__setitem__(0, calls[0] + 1))
    try:
        assert wait_for(lambda: ctl.ticks >= 3)
    finally:
        stop.set()
        t.join(15)
    assert calls[0] == 0
