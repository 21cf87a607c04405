"""The engine's own stalls (exporters/hang.py Stalls): a long step is no hang.

On 4 real vLLM servers sharing 2 CPU cores (tests/fixtures/vllm/runs) an engine went 2-3 s without a token and then
stepped on; the agent's one-timeout hang verdict took such nodes out of rotation once or twice a run. The node's own
silences are learned, and a probe's silence is a hang once it outlasts them.
"""

from __future__ import annotations

import pytest

from grayguard.exporters.agent import verdict
from grayguard.exporters.engineload import EngineLoad
from grayguard.exporters.hang import HANG_MARGIN, STALL_CAP_S, STALLS_KEPT, Progress, Stalls, judged
from grayguard.exporters.probe import ProbeState


def _load(tokens: float, prompt: float | None = 0.0) -> EngineLoad:
    return EngineLoad(generation_tokens=tokens, running=1, prompt_tokens=prompt)


def test_a_stall_is_the_span_between_two_readings_that_saw_the_counters_move():
    s = Stalls().observe(_load(10), 100.0)
    assert (s.tokens, s.moved_at, s.recent) == (10, 100.0, ())
    s = s.observe(_load(10), 101.0).observe(_load(10), 102.0)  # silent: moved_at stays
    assert s.moved_at == 100.0 and s.silent_for(102.5) == 2.5
    s = s.observe(_load(10, prompt=5.0), 103.0)  # a prefill counts as progress
    assert s.recent == (3.0,) and s.moved_at == 103.0
    assert s.observe(None, 104.0) is s and s.observe(EngineLoad(running=1), 104.0) is s  # no evidence


def test_a_restart_or_a_hang_that_ended_teaches_nothing_and_only_the_last_stalls_count():
    s = Stalls().observe(_load(100), 0.0).observe(_load(5), 1.0)  # counters went back: a restart
    assert s.recent == () and (s.tokens, s.moved_at) == (5, 1.0)
    s = s.observe(_load(6), 1.0 + STALL_CAP_S + 5)  # a 15 s silence: a hang, not a stall to learn
    assert s.recent == ()
    t = 100.0
    for k in range(STALLS_KEPT + 10):
        t += 1.0 + (2.0 if k == 0 else 0.0)
        s = s.observe(_load(10 + k), t)
    assert len(s.recent) == STALLS_KEPT and max(s.recent) == 1.0  # the old 3 s stall has aged out


def test_the_hang_waits_out_the_node_s_longest_recent_stall():
    assert Stalls().hang_after() == 0.0  # nothing learned: the first silent timeout is a hang, as before
    s = Stalls(10, 0.0, (1.0, 3.0, 1.0))
    assert s.hang_after() == pytest.approx(HANG_MARGIN * 3.0)
    assert Stalls(10, 0.0, (9.0,)).hang_after() == STALL_CAP_S
    quiet = Progress(tokens=0, running=1, window=2.0)
    assert judged(quiet, s, now=2.5).hung is False  # silent 2.5 s on a node that stalls 3 s: not yet
    assert judged(quiet, s, now=4.6).hung is True
    assert judged(Progress(tokens=3, running=1, window=2.0), Stalls(), now=9.0).hung is False
    assert Progress(tokens=0, running=1, window=2.0).hung  # without the node's stalls: as before
    assert judged(None, s, now=1.0) is None


def test_the_agent_says_why_a_silent_probe_is_not_yet_a_hang():
    within = ProbeState(last_result="timeout", last_progress=Progress(0, 1, 2.0, silent_for=2.4, hang_after=4.5))
    v = verdict(within, 999.5, 1000.0, interval=1.0, deadline=2.0)
    assert not v.down and "within this engine's stalls: a hang after 4.5s" in v.why
    past = ProbeState(last_result="timeout", last_progress=Progress(0, 1, 2.0, silent_for=4.6, hang_after=4.5))
    v = verdict(past, 999.5, 1000.0, interval=1.0, deadline=2.0)
    assert v.down and v.cause == "hang" and "no token in 4.6s" in v.why
