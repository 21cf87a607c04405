"""The controller's process collects garbage less often (controller/gcpolicy.py): its command sets the thresholds
before it ticks, a benchmark gets its own back afterwards, and a cycle is still collected without a gc.collect()."""

from __future__ import annotations

import argparse
import gc
import weakref

import pytest

from grayguard.config import parse_config
from grayguard.controller import cmd_controller, gcpolicy


@pytest.fixture(autouse=True)
def _thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_tune_sets_the_thresholds_and_says_what_they_were():
    gc.set_threshold(700, 10, 10)
    assert gcpolicy.tune() == (700, 10, 10)
    assert gc.get_threshold() == gcpolicy.THRESHOLDS
    assert gcpolicy.THRESHOLDS[0] > 700  # fewer collections than CPython's default, the point of it


def test_tuned_gives_the_previous_thresholds_back_even_on_an_error():
    gc.set_threshold(500, 7, 9)
    with pytest.raises(RuntimeError), gcpolicy.tuned():
        assert gc.get_threshold() == gcpolicy.THRESHOLDS
        raise RuntimeError("a benchmark failing half way")
    assert gc.get_threshold() == (500, 7, 9)


def test_the_controller_command_tunes_the_collector_before_its_first_tick(monkeypatch):
    gc.set_threshold(700, 10, 10)
    seen = []

    class Ctl:
        def tick(self):
            seen.append(gc.get_threshold())
            raise KeyboardInterrupt  # stop here: only the order matters

    monkeypatch.setattr(cmd_controller, "startup_checks", lambda ctl: [])
    cfg = parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}]})
    with pytest.raises(KeyboardInterrupt):
        cmd_controller._run_controller(argparse.Namespace(once=True), cfg, Ctl())  # type: ignore[arg-type]
    assert seen == [gcpolicy.THRESHOLDS]


def test_a_cycle_is_still_collected_without_asking():
    class Node:
        pass

    gc.collect()
    with gcpolicy.tuned():
        a, b = Node(), Node()
        a.other, b.other = b, a  # garbage only the collector can free
        dead = weakref.ref(a)
        del a, b
        kept = [[] for _ in range(gcpolicy.THRESHOLDS[0] + 1000)]  # net allocations past the young threshold
        assert dead() is None
        del kept
