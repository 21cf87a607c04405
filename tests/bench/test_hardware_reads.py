"""The benchmark reads the GPU evidence as the shipped controller does: each signal once in
signals.hardware_every_s on the controller's own schedule (controller.ticker.next_read), and what it reads is the
node's last full-page scrape before that read (bench.node.GpuFlags). It read the flags of the instant before, which
made a thermal drain in the engine 2-3 s earlier than on the real stack (the cross-check's one DIFF)."""

from __future__ import annotations

from grayguard.bench.engine import HARDWARE_SLOTS, Run
from grayguard.bench.node import GpuFlags
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario
from tests.controller.test_hardware_cadence import HW, answers, controller
from tests.support.ctl_helpers import FakeProm


def scenario(**kw) -> Scenario:
    pool = tuple(NodeSpec(f"node{i}") for i in range(4))
    return Scenario("hw", pool, LoadSpec(utilization=0.4), (FaultSpec("node1", "thermal", 20.0),),
                    duration_s=40.0, seed=3, control_start_s=10.0, **kw)


def test_the_engine_reads_each_gpu_signal_when_the_controller_would():
    """The same ticks through the controller's read_optional and the engine's read_hardware: the same signals are
    read on the same ticks."""
    events: list = []
    ctl, clock = controller(5.0, FakeProm(answers, events))
    assert tuple(HW) == HARDWARE_SLOTS  # the shipped hardware signals, without the peer-group label
    run = Run(scenario(), "grayguard")
    query_of = {q: name for name, q in HW.items()}
    for k in range(23):
        t = 10.0 + k
        clock.t = t
        n = len(events)
        ctl.read_optional()
        by_controller = {query_of[q] for _, q in events[n:] if q in query_of}
        last = dict(run.hardware_read)
        by_engine = {name for name, at in run.read_hardware(t).items() if last.get(name) != at}
        assert by_engine == by_controller, (t, by_engine, by_controller)


def test_the_evidence_waits_for_a_scrape_and_a_read():
    flags = GpuFlags(scrape_s=5.0, phase=1.5, keep_s=11.0)
    flags.note(0.0, (False, False, False))
    assert flags.at(1.0) is None  # before the first scrape
    for t in range(1, 23):
        flags.note(float(t), (t >= 20, False, False))
    assert flags.at(21.0) == (False, False, False)  # the last scrape was at 16.5
    assert flags.at(22.0) == (True, False, False)  # a scrape at 21.5 saw the flags of the tick at 21
    assert flags.at(12.0) == (False, False, False)  # a read as old as keep_s still finds its scrape


def test_the_shipped_timing_is_later_than_reading_the_flags_at_once():
    """A thermal node (x6 from 20 s) in a 4-node pool: at the shipped timing its drain waits for the evidence,
    later than with the evidence read at every tick from a scrape every second (hardware_every_s 0). Both drain
    only the faulty node, within the issue's 10 s."""
    def drained(scn: Scenario) -> float:
        res = Run(scn, "grayguard").execute()
        assert {i for _, i, _, d, _ in res.timeline if d} == {1}
        return min(t for t, i, _, d, _ in res.timeline if i == 1 and d)
    shipped = drained(scenario())
    at_once = drained(scenario(hardware_every_s=0.0, full_scrape_s=1.0))
    assert 20.0 < at_once < shipped <= 30.0, (at_once, shipped)
