"""The probes' pure verdicts (grayguard/health.py), shared by the controller, the actuator and the exporter: the stall
limit, liveness and readiness of one loop, several loops' verdicts as one line, and the handler's answer."""

from __future__ import annotations

import pytest

from grayguard.health import Beat, Verdict, combined, health, probe, readiness, stall_limit_s


# ---- the pure decisions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interval,budget,limit", [(1.0, 0.0, 10.0), (0.1, 0.0, 10.0), (5.0, 0.0, 50.0),
                                                   (1.0, 8.0, 16.0), (5.0, 30.0, 60.0)])
def test_the_stall_limit_is_ten_ticks_at_least_ten_seconds_and_never_under_the_ticks_own_deadlines(interval, budget,
                                                                                                   limit):
    assert stall_limit_s(interval, budget) == limit


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


def test_several_loops_fail_together_naming_only_the_stalled_ones():
    ok_a, ok_b = Verdict(True, "ok: a"), Verdict(True, "ok: b")
    bad_a, bad_b = Verdict(False, "stalled: a"), Verdict(False, "stalled: b")
    empty = Verdict(True, "ok: nothing")
    assert combined([ok_a, ok_b], empty) == Verdict(True, "ok: a; ok: b")
    assert combined([ok_a, bad_b], empty) == Verdict(False, "stalled: b")
    assert combined([bad_a, ok_b, bad_b], empty) == Verdict(False, "stalled: a; stalled: b")
    assert combined([], empty) is empty


@pytest.mark.parametrize("verdict,status", [(Verdict(True, "ok: x"), 200), (Verdict(False, "stalled: x"), 503)])
def test_the_handler_answers_the_verdict_in_one_plain_line(verdict, status):
    assert probe(lambda: verdict)(None) == (status, "text/plain; charset=utf-8", (verdict.reason + "\n").encode())
