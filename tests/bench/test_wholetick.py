"""The whole tick on real parts: a tiny fleet behind a real HAProxy and a real Prometheus, the real Controller.tick()
timed part by part. Checks the measurement's structure, never its speed."""

from __future__ import annotations

import argparse

import pytest

from grayguard.bench import promtarget
from grayguard.bench.controller import add_arguments
from grayguard.bench.promresult import PromCost
from grayguard.bench.tickresult import PARTS, MemoryMark, TickCost, TickSample, format_tick, tick_findings, verdict
from grayguard.bench.wholetick import fleet_backends, measure_tick
from tests.support.stack import require

NODES, TICKS = 60, 3  # 3 pools of 20; node n0 of pool0 is the slow one


def test_every_stand_in_node_is_a_server_of_its_pools_backend_at_its_instance():
    backends = fleet_backends(NODES)
    nodes = promtarget.fleet(NODES)
    assert list(backends) == ["pool0", "pool1", "pool2"] and all(len(s) == 20 for s in backends.values())
    assert {(be, addr) for be, servers in backends.items() for _, addr, _ in servers} == \
        {(n.pool, n.instance) for n in nodes}
    assert backends["pool0"][0][:2] == ("n0", nodes[0].instance) and nodes[0].slow > 1


def test_bench_controller_whole_tick_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert not a.no_whole_tick and a.whole_tick_nodes == "1000,10000" and a.whole_tick_ticks == 30
    assert a.whole_tick_seconds == 300
    a = p.parse_args(["--no-whole-tick", "--whole-tick-nodes", "60", "--whole-tick-ticks", "3",
                      "--whole-tick-seconds", "20"])
    assert a.no_whole_tick and a.whole_tick_nodes == "60" and a.whole_tick_ticks == 3 and a.whole_tick_seconds == 20


def cost_of(*ticks: TickSample) -> TickCost:
    return TickCost(10000, 500, 1.0, len(ticks), PromCost(10000, 10, {}, {}), ticks=list(ticks))


def test_the_verdict_says_over_within_or_not_a_whole_tick():
    whole = {"tick": 0.6, "decide": 0.1}
    assert "OVER the 500 ms target (1.2x)" in verdict(cost_of(TickSample(whole, 0.5)))
    assert "within the 500 ms target" in verdict(cost_of(TickSample({"tick": 0.4, "decide": 0.1}, 0.3)))
    held = cost_of(TickSample({"tick": 0.1}, 0.1, held="Prometheus timeout"), TickSample(whole, 0.5))
    assert "not a whole tick: 1 of 2 ticks held" in verdict(held)
    assert "1 of 2 ticks held every weight: Prometheus timeout" in "\n".join(tick_findings(held))
    assert "nan" in "\n".join(format_tick(held))  # a part no tick ran: no number made up


def test_a_run_cut_short_and_memory_growth_are_noted():
    t = TickSample({"tick": 0.6, "decide": 0.1}, 0.5, decided=500)
    c = cost_of(t, t)
    c.ticks_asked, c.budget_s = 30, 300
    c.memory = [MemoryMark(1, 100 * 2**20, 1, 1), MemoryMark(2, 200 * 2**20, 1, 1)]
    notes = "\n".join(tick_findings(c))
    assert "2 of 30 ticks ran: no tick starts after 300 s" in notes
    assert "resident memory grew 100.0 MiB between tick 1 and tick 2 (pools decided: 500 and 500)" in notes


@pytest.fixture(scope="module")
def tiny() -> TickCost:
    require("haproxy", "prometheus")
    return measure_tick(NODES, TICKS)


def test_a_tiny_run_times_every_part_of_every_tick(tiny):
    c = tiny
    assert c.servers == NODES and c.backends == 3 and c.haproxy_version and c.prom.version
    assert c.prom.nodes_with_data == NODES and len(c.ticks) == TICKS and not c.held
    for t in c.ticks:
        assert set(t.seconds) == {"tick"} | {key for key, _ in PARTS}
        assert t.decided == 3 and t.cpu_s > 0 and t.rss_bytes > 0
        parts = sum(v for k, v in t.seconds.items() if k not in ("tick", "rest"))
        assert all(v >= 0 for k, v in t.seconds.items() if k != "rest") and parts <= t.seconds["tick"]
        assert t.seconds["tick"] - parts == pytest.approx(t.seconds["rest"], abs=1e-6)
        assert t.seconds["haproxy_read"] > 0 and t.seconds["prometheus"] > 0 and t.seconds["decide"] > 0
    # every query sent on every tick but the hardware signals', read once in signals.hardware_every_s (5 s)
    from grayguard.config import HARDWARE_SIGNALS
    assert len(c.prom.queries) >= 18
    assert all(len(q.times) == TICKS for name, q in c.prom.queries.items() if name not in HARDWARE_SIGNALS)
    hardware = [len(q.times) for name, q in c.prom.queries.items() if name in HARDWARE_SIGNALS]
    assert hardware and all(1 <= n <= 2 + (TICKS - 1) // 5 for n in hardware)


def test_the_slow_node_is_written_through_the_runtime_api(tiny):
    c = tiny
    wrote = [t for t in c.ticks if t.commands]
    assert wrote and all(t.batches >= 1 and t.seconds["write"] > 0 and not t.refused for t in wrote)


def test_a_tiny_run_reports_memory_and_the_rule_groups(tiny):
    c = tiny
    assert [m.tick for m in c.memory] == [1, 2, 3]
    assert all(m.rss_bytes > 0 and m.blocks > 0 and m.kept_bytes > 0 for m in c.memory)
    assert set(c.prom.groups) == {"grayguard-control", "grayguard-human", "grayguard-controller.alerts",
                                  "grayguard-node.alerts"}
    ran = {name for name, g in c.prom.groups.items() if g.last_duration_s and g.last_duration_s > 0}
    assert "grayguard-control" in ran  # the warm-up waited for its recorded latency
    # Prometheus runs a group first at an offset within its interval: a group slower than the run may not have yet
    assert all(g.interval_s > c.prom.data_span_s - 1 for name, g in c.prom.groups.items() if name not in ran)
    assert {"controller (this process)", "Prometheus", "HAProxy", "stand-in"} <= set(c.cores)
    text = "\n".join(format_tick(c))
    assert f"{NODES} nodes in 3 backends" in text and "verdict: whole tick median" in text
    assert "runtime-API writes" in text and "grayguard-control" in text
