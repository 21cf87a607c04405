"""The hardware signals (GPU evidence, peer groups) are read once in signals.hardware_every_s, spread over the ticks,
their last answer standing in between; everything else every tick (controller/loop.py read_optional)."""

from __future__ import annotations

import pytest

from grayguard.config import HARDWARE_SIGNALS, ConfigError, parse_config
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.promclient import PromError, Sample
from tests.support.ctl_helpers import PROM, FakeProm

HW = {"gpu_throttled": "hw_a", "pcie_degraded": "hw_b", "gpu_ecc": "hw_c", "gpu_xid": "hw_d"}
LIVE = "live_q"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def controller(every: float, prom) -> tuple[Controller, Clock]:
    signals = {"hardware_every_s": every, "live_itl_query": LIVE, **{f"{k}_query": q for k, q in HW.items()}}
    off = {"probe_result", "probe_ttft", "probe_failures", "error_ratio", "kv_cache", "live_ttft", "probe_ttft_median",
           "live_prefill_rate", "live_decode_batch"}
    cfg = parse_config({"prometheus": {"url": PROM}, "haproxy": {"endpoints": ["unix:/nonexistent"]},
                        "pools": [{"name": "chat", "backend": "be"}], "state_file": None,
                        "signals": {**{f"{k}_query": "" for k in off}, **signals}})
    clock = Clock()
    return Controller(cfg, prom, [], metrics=ControllerMetrics.create(), clock=clock), clock


def answers(q: str) -> list[Sample]:
    return [Sample({"instance": "n1", "pool": "chat", "q": q}, 1.0, 0.0)]


def sent(events: list, since: int = 0) -> list[str]:
    return [q for _, q in events[since:]]


def test_each_hardware_signal_is_read_once_an_interval_spread_over_the_ticks():
    events: list = []
    ctl, clock = controller(5.0, FakeProm(answers, events))
    per_tick = []
    for _ in range(21):  # 21 one-second ticks
        n = len(events)
        got = ctl.read_optional()
        assert set(got) == {*HW, "live_itl"}  # every signal has its answer on every tick
        per_tick.append(sent(events, n))
        clock.t += 1.0
    assert all(LIVE in qs for qs in per_tick)  # the live signal: every tick
    assert set(per_tick[0]) == {LIVE, *HW.values()}  # the first tick reads everything
    for q in HW.values():  # then once in 5 s: at ticks 1-4 one each (spread), and every 5 ticks after
        ticks = [i for i, qs in enumerate(per_tick) if q in qs]
        assert len(ticks) == 5 and all(b - a == 5 for a, b in zip(ticks[1:], ticks[2:], strict=False)), (q, ticks)
    assert max(sum(q in HW.values() for q in qs) for qs in per_tick[1:]) == 1  # never all at once again


def test_a_failed_hardware_read_is_absent_and_read_again_the_next_tick():
    events: list = []
    fail = {"on": True}

    def flaky(q: str) -> list[Sample]:
        if q == HW["gpu_ecc"] and fail["on"]:
            raise PromError("timeout", "slow")
        return answers(q)

    class Prom(FakeProm):
        def query(self, q):
            self.events.append(("query", q))
            return flaky(q)
    ctl, clock = controller(5.0, Prom(flaky, events))
    assert "gpu_ecc" not in ctl.read_optional()  # absent, not the last answer, not zero
    clock.t += 1.0
    fail["on"] = False
    n = len(events)
    assert "gpu_ecc" in ctl.read_optional() and HW["gpu_ecc"] in sent(events, n)  # due again at once


def test_zero_reads_every_tick_and_a_changed_query_is_due_at_once():
    events: list = []
    ctl, clock = controller(0.0, FakeProm(answers, events))
    for _ in range(3):
        n = len(events)
        ctl.read_optional()
        assert set(sent(events, n)) == {LIVE, *HW.values()}
        clock.t += 1.0
    events.clear()
    ctl, clock = controller(5.0, FakeProm(answers, events))
    ctl.read_optional()
    clock.t += 0.5
    ctl._read_scope = lambda: {"chat"}  # a replica that now leads part of the pools: its queries are scoped
    n = len(events)
    ctl.read_optional()
    assert all(q.startswith("(") for q in sent(events, n))  # every query sent again, scoped
    assert len(sent(events, n)) == 1 + len(HW)


@pytest.mark.parametrize("value", [-1, float("nan"), 301])
def test_a_bad_cadence_names_the_field(value):
    with pytest.raises(ConfigError, match="signals.hardware_every_s"):
        parse_config({"pools": [{"name": "p", "backend": "b"}], "signals": {"hardware_every_s": value}})


def test_the_hardware_signals_are_optional_signals():
    from grayguard.controller.decide import OPTIONAL
    assert set(HARDWARE_SIGNALS) <= set(OPTIONAL)
