"""The Prometheus cost benchmark: the stand-in serves what grayguard reads, and a tiny run on the real Prometheus
measures real evaluations and answers every query with one series per node. No assertion on speed."""

from __future__ import annotations

import argparse
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grayguard.bench import promcost, promtarget
from grayguard.bench.controller import add_arguments
from grayguard.bench.promcost import measure
from grayguard.bench.promresult import (
    PHASES,
    GroupCost,
    Phase,
    PromCost,
    QueryCost,
    findings,
    format_cost,
    format_side_by_side,
    own_series_per_node,
)
from grayguard.bench.promwindow import fused_query
from grayguard.config import SignalsConfig, parse_config
from grayguard.controller.decide import OPTIONAL
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.fastpath import FAST_SERIES
from grayguard.exporters.gpumetrics import describe_families
from grayguard.exporters.server import Exporter
from grayguard.rules.render import render_all
from grayguard.sim.metrics import VllmMetrics

NODES = 40
# read by a rule or query but not served: absent on a healthy fleet (no XID yet), and vLLM's old KV-cache name
NOT_SERVED = {"grayguard_gpu_xid_errors_total", "vllm:gpu_cache_usage_perc"}


def served() -> set[str]:
    """Every series name the stand-in's three pages carry."""
    fams = promtarget.vllm_families() + promtarget.exporter_families() + promtarget.fast_families()
    return {name + suffix for name, _, series in fams for suffix, _, _ in series}


def stored_per_node() -> int:
    """The series a node's pages leave in Prometheus: the full exporter job drops the fast page's copies
    (rules/prometheus.example.yml's metric_relabel_configs)."""
    setup = promcost.prometheus_setup([1])
    drop = {sc["job_name"]: re.compile(sc["metric_relabel_configs"][0]["regex"]) for sc in setup["scrape_configs"]
            if sc.get("metric_relabel_configs")}
    return sum(1 for job, (_, fams) in promtarget.pages().items() for name, _, series in fams for suffix, _, _ in series
               if not (job in drop and drop[job].fullmatch(name + suffix)))


def described(registry) -> set[str]:
    """Every series name a registry's collectors say they may serve (counters with _total)."""
    return {f.name + ("_total" if f.type == "counter" else "") for c in list(registry._collector_to_names)
            for f in c.describe()}


def test_the_fast_page_carries_every_series_of_the_exporters_fast_path():
    e = Exporter("http://127.0.0.1:9", nvml=None, agent=("127.0.0.1", 0))  # built, not started
    fast = {name for name, _, _ in promtarget.fast_families()}
    assert described(e.fast_registry) == fast == set(FAST_SERIES)  # exactly the 9
    assert len(fast) == sum(len(series) for _, _, series in promtarget.fast_families()) == 9  # one series each


def test_the_full_page_serves_what_the_exporter_serves_with_the_gpu_judgements_as_one_mask():
    e = Exporter("http://127.0.0.1:9", nvml=FakeNvml([healthy_h100(0)]), agent=("127.0.0.1", 0))  # not started
    real = described(e.registry)
    full = {name for name, _, _ in promtarget.exporter_families()}
    assert full <= real, full - real
    assert set(promtarget.LIVE) | {"grayguard_agent_down"} <= full  # every live value, served on the full page
    fams = {name: series for name, _, series in promtarget.exporter_families()}
    assert [extra for _, extra, _ in fams["grayguard_probe_results_total"]] == [',result="ok"', ',result="slow"']
    assert [extra.split("counter_type=")[1] for _, extra, _ in fams["grayguard_gpu_ecc_errors"]] == ['"volatile"'] * 2
    (info,) = fams["grayguard_gpu_info"]
    assert 'pcie_max_generation="5",pcie_max_width="16"' in info[1]
    gone = {"grayguard_gpu_lost", "grayguard_gpu_row_remap_pending", "grayguard_gpu_row_remap_failure",
            "grayguard_gpu_slowed_under_load", "grayguard_gpu_pcie_degraded_under_load",
            "grayguard_gpu_pcie_link_max_generation", "grayguard_gpu_pcie_link_max_width"}
    assert not gone & full and not gone & real
    slow, ok = (n for n in promtarget.fleet(promtarget.POOL_SIZE) if n.slow > 1 or n.instance.endswith(".1:8000"))
    assert promtarget.static_values(slow)["flags"] == 0x8 and promtarget.static_values(ok)["flags"] == 0
    # stored a node: the full page less what the full job drops (the fast page's and the unread live values)
    assert stored_per_node() - promtarget.series_per_node()["vllm"] == 16 + 9


def node_series() -> set[str]:
    """Every series name a node exposes: the real exporter's (GPU families included) and the simulated vLLM's."""
    e = Exporter("http://127.0.0.1:9", nvml=None, agent=("127.0.0.1", 0))  # built, not started
    assert e.prober is not None
    fams = [*e.registry.collect(), *e.fast_registry.collect(), *describe_families(),
            *e.prober.traffic_collector.describe(),  # absent until the exporter has read vLLM
            *VllmMetrics("m", 8192).registry.collect()]
    return {f.name + suffix for f in fams for suffix in ("", "_total", "_sum", "_count", "_bucket")}


def test_every_node_series_the_rules_and_the_queries_read_is_served():
    cfg = parse_config({"pools": [{"name": "p", "backend": "p"}]})
    exprs = [r["expr"] for text in render_all(cfg).values() for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    exprs += [getattr(SignalsConfig(), f"{n}_query") for n in OPTIONAL]
    read = {m for e in exprs for m in re.findall(r"(?<![\w:])(?:vllm:\w+|grayguard_\w+)", e)}
    of_nodes = {m for m in read if m.startswith("vllm:") or m in node_series()}  # not the controller's own
    assert of_nodes - served() == NOT_SERVED


def test_the_stand_in_moves_like_a_fleet_with_a_slow_node():
    nodes = promtarget.fleet(40)
    assert [n.slow > 1 for n in nodes].count(True) == 1 and nodes[0].slow > 1 and nodes[20].slow == 1
    vllm = promtarget.Page(nodes, promtarget.vllm_families(), promtarget.traffic, seed=1)
    fast = promtarget.Page(nodes, promtarget.fast_families(), promtarget.live, seed=2)

    def values(page, name):
        text = page.render().decode()
        return {s.labels["instance"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name}
    first = values(vllm, "vllm:e2e_request_latency_seconds_sum")
    vllm.last -= 5  # five seconds of traffic since
    later = values(vllm, "vllm:e2e_request_latency_seconds_sum")
    assert len(first) == 40 and all(later[i] > first[i] for i in first)
    itl = values(fast, "grayguard_live_itl_seconds")
    slow, others = itl.pop(nodes[0].instance), sorted(itl.values())
    assert slow > 2 * others[len(others) // 2] and len(set(others)) > 1  # noisy, one node slow


def test_bench_controller_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).no_prometheus is False and p.parse_args([]).prometheus_nodes == "1000,10000"
    a = p.parse_args(["--no-prometheus", "--prometheus-nodes", "40", "--prometheus-seconds", "5"])
    assert a.no_prometheus and a.prometheus_nodes == "40" and a.prometheus_seconds == 5
    assert p.parse_args([]).no_before is False and p.parse_args(["--no-before"]).no_before
    assert p.parse_args([]).no_victoria is False and p.parse_args(["--no-victoria"]).no_victoria


def test_a_prometheus_that_cannot_keep_up_is_reported_as_such():
    fast = "grayguard-exporter-fast"
    c = PromCost(10000, 10, {"vllm": 45, fast: 19}, {"vllm": "5s", fast: "1s"},
                 nodes_with_data=9000, data_span_s=200, held=2, ticks=[5.0] * 5,
                 phases={p: Phase(30, 1e5, 1.0) for p in PHASES},
                 groups={"grayguard-control": GroupCost("grayguard-control", 5, missed=3)},
                 queries={"latency": QueryCost("q", [5.0], None, ["timeout"])},
                 scrapes={"vllm": (100, 2, 12.0), fast: (300, 0, 0.9)})
    notes = "\n".join(findings(c))
    for said in ("only 9000 of 10000 nodes", "no evaluation of grayguard-control", "skipped 3 evaluations",
                 "vllm: 100 scrapes of 120 due, 2 failed", "grayguard-exporter-fast: 300 scrapes of 600 due",
                 "2 of 5 ticks held", "latency 1x timeout", "held 200 s of data"):
        assert said in notes
    assert c.offered_samples_per_s == 10000 * 45 / 5 + 10000 * 19
    assert "nan" in "\n".join(format_cost(c))  # no evaluation: no number made up


@pytest.fixture(scope="module")
def tiny():
    return measure(NODES, seconds=14)  # 7 s alone, 7 s ticking: each sees the 5 s control group at least once


def test_a_tiny_run_on_the_real_prometheus_measures_real_work(tiny):
    c = tiny
    assert c.nodes_with_data == NODES and c.targets == 1 and c.version
    assert set(c.groups) == {"grayguard-control", "grayguard-human", "grayguard-controller.alerts",
                             "grayguard-node.alerts"}
    control = c.groups["grayguard-control"]
    assert control.interval_s == 5
    for phase in PHASES:
        assert control.evals[phase] and all(t > 0 for t in control.evals[phase]), phase
        assert c.phases[phase].samples_per_s > 0 and c.phases[phase].prometheus_cores > 0, phase
    for g in c.groups.values():  # the human group runs every minute: longer than this run, it may not have run yet
        assert not g.failures and (g.last_duration_s or 0) >= 0, g.name
        assert g.last_duration_s or g.interval_s > c.warmup_s + c.window_s, g.name
    assert c.head_series >= NODES * stored_per_node() and c.rss_max > 0
    assert set(c.scrapes) == {"vllm", "grayguard-exporter", "grayguard-exporter-fast"}
    assert all(n > 0 and failed == 0 for n, failed, _ in c.scrapes.values())


def test_a_tiny_run_answers_every_query_of_the_tick_with_one_series_per_node(tiny):
    c = tiny
    assert c.ticks and all(t > 0 for t in c.ticks) and not c.held
    wanted = {"latency", "request_rate", "latency_timestamp", "request_rate_timestamp"}
    wanted |= {n for n in OPTIONAL if n != "peer_group" and getattr(SignalsConfig(), f"{n}_query")}
    assert set(c.queries) == wanted  # peer_group is off by default (no pool has a peer_group_label)
    for name, q in c.queries.items():
        assert not q.errors, name
        assert q.series == (0 if name == "gpu_xid" else NODES), name  # no XID on a healthy fleet
    # the hardware signals once in signals.hardware_every_s (5 s), the live ones every tick
    assert len(c.queries["gpu_ecc"].times) <= len(c.ticks) // 5 + 1 < len(c.queries["live_itl"].times) == len(c.ticks)
    text = "\n".join(format_cost(c))
    assert f"{NODES} nodes in 2 pools" in text and "grayguard-control" in text and "live_itl" in text
    # the fused query answers the same series as the one-metric signals' queries together, every round timed
    assert c.fused is not None
    n, series, fused, separate = c.fused
    # 7: the GPU evidence's two queries decode a bit of grayguard_gpu_flags (floor(x / bit) % 2), not one metric
    assert n == 7 and series == n * NODES and len(fused) == len(separate) > 0 and "fused into one query" in text


def test_the_one_metric_signals_fuse_into_one_query_that_keeps_their_names():
    queries = {"live_itl_query": "max by (pool, instance) (grayguard_live_itl_seconds)",
               "kv_cache_query": "max by (pool, instance) (a) or b",  # not one metric: left alone
               "probe_result_query": "max by (pool, instance, result) (grayguard_probe_last_result == 1)",
               "live_ttft_query": "max by (pool, instance) (grayguard_live_ttft_seconds)"}
    fused, names = fused_query(queries)
    assert fused == ('max by (__name__, pool, instance) '
                     '({__name__=~"grayguard_live_itl_seconds|grayguard_live_ttft_seconds"})')
    assert names == {"grayguard_live_itl_seconds": "live_itl_query", "grayguard_live_ttft_seconds": "live_ttft_query"}
    assert fused_query({"live_itl_query": queries["live_itl_query"]}) is None  # one signal: nothing to fuse


def test_bench_controller_decision_verdict_and_the_realistic_trace(capsys):
    from grayguard.bench.controller import decision_verdict, run
    assert decision_verdict([{"nodes": 1000, "median_s": 0.05}, {"nodes": 10000, "median_s": 0.55}]) == [
        "  10000 / 1000 nodes: 11.0x the median time", "  verdict: median 550 ms at 10000 nodes: OVER the 100 ms "
        "target (5.5x)"]
    assert decision_verdict([{"nodes": 10000, "median_s": 0.08}], ratio=False) == [
        "  verdict: median 80 ms at 10000 nodes: within the 100 ms target"]
    assert decision_verdict([{"nodes": 40, "median_s": 0.01}]) == []  # no 10,000 nodes measured: no verdict
    p = argparse.ArgumentParser()
    add_arguments(p)
    # the controller's own tick has its test (tests/bench/test_ticklocal.py): at its default sizes (1,000 and 10,000
    # nodes) it was three minutes of this one
    assert run(p.parse_args(["--nodes", "40,100", "--ticks", "2", "--scale-ticks", "3", "--haproxy-batch", "0",
                             "--no-prometheus", "--no-whole-tick", "--no-local-tick"])) == 0
    out = capsys.readouterr().out
    assert "100 / 40 nodes:" in out and "on the realistic trace" in out and "memory after tick    3" in out


def test_the_before_design_serves_the_pages_issue_34_started_from():
    now, before = promtarget.pages("shipped"), promtarget.pages("before")

    def names(job: str, pages: dict) -> set[str]:
        return {name for name, _, _ in pages[job][1]}
    # the one-hot last result: one series a result on both exporter pages, one per node now
    for job in ("grayguard-exporter", "grayguard-exporter-fast"):
        fams = {name: series for name, _, series in before[job][1]}
        assert len(fams["grayguard_probe_last_result"]) == len(promtarget.PROBE_RESULTS)
        assert len({name: series for name, _, series in now[job][1]}["grayguard_probe_last_result"]) == 1
    # the GPU's judgements: one mask now; before, lost and the row remaps as 0/1 series, no derived flag
    assert "grayguard_gpu_flags" in names("grayguard-exporter", now)
    assert {"grayguard_gpu_lost", "grayguard_gpu_row_remap_pending"} <= names("grayguard-exporter", before)
    assert "grayguard_gpu_flags" not in names("grayguard-exporter", before)
    assert "grayguard_gpu_slowed_under_load" not in names("grayguard-exporter", before)
    # the probe results: all eight before, ok and slow now; the fast page: 20 series before, 8 then, 9 now (the probe's
    # send time, 2026-12-07)
    assert promtarget.series_per_node("before")["grayguard-exporter-fast"] == 20
    assert promtarget.series_per_node("shipped")["grayguard-exporter-fast"] == 9
    # NVML's clock-event reasons: one 0/1 series a reason before, the mask now (one series a GPU; 0x40 on the slow
    # node, hw_thermal_slowdown)
    old = {name: series for name, _, series in before["grayguard-exporter"][1]}
    new = {name: series for name, _, series in now["grayguard-exporter"][1]}
    assert len(old["grayguard_gpu_clock_event_reason_active"]) == len(promtarget.CLOCK_REASONS) == 9
    assert len(new["grayguard_gpu_clock_event_reasons"]) == 1 and "grayguard_gpu_clock_event_reason_active" not in new
    slow, ok = (n for n in promtarget.fleet(promtarget.POOL_SIZE) if n.slow > 1 or n.instance.endswith(".1:8000"))
    assert promtarget.static_values(slow)["reasons"] == 0x40 and promtarget.static_values(ok)["reasons"] == 0
    with pytest.raises(ValueError, match="design"):
        promtarget.pages("after")


@pytest.fixture(scope="module")
def tiny_before():
    return measure(NODES, seconds=14, design="before")


def test_a_tiny_run_of_the_before_design_answers_its_own_queries_and_prints_beside_the_shipped(tiny_before, tiny):
    b = tiny_before
    assert b.design == "before" and b.nodes_with_data == NODES and not b.held
    assert "grayguard-control" in b.groups and all(not g.failures for g in b.groups.values())
    for name, q in b.queries.items():  # the frozen queries (GPU joins, the one-hot result) on the frozen pages
        assert not q.errors, name
        assert q.series == (0 if name == "gpu_xid" else NODES), name
    assert "pcie_link_generation" in b.queries["pcie_degraded"].promql  # the join, not the derived flag
    # the fast series' copies on the full page are stored before, dropped now
    assert own_series_per_node(b) > own_series_per_node(tiny) > 0
    text = "\n".join(format_side_by_side(b, tiny))
    assert "side by side" in text and "grayguard-control median, alone (ms)" in text
    assert "queries sent a tick" in text and "targets at 1,000 nodes" not in text  # the targets are said at 1,000 only


def test_a_tiny_run_on_victoria_metrics_measures_real_work_beside_prometheus(tiny):
    from grayguard.bench.vmcost import format_vm_cost, measure_victoria
    from tests.support.stack import require
    require("victoria-metrics", "vmalert")
    c = measure_victoria(NODES, seconds=14)
    assert c.nodes_with_data == NODES and not c.held and c.ticks and all(t > 0 for t in c.ticks)
    assert all(c.cores[p] > 0 and c.rows_per_s[p] > 0 for p in PHASES) and c.rss_max > 0
    assert c.groups["grayguard-control"]["alone"] and c.intervals["grayguard-control"] == 5
    for name, q in c.queries.items():  # every query of the tick answered by VictoriaMetrics, one series a node
        assert not q.errors and q.series == (0 if name == "gpu_xid" else NODES), name
    text = "\n".join(format_vm_cost(c, tiny))
    assert "VictoriaMetrics" in text and "Prometheus" in text and "grayguard-control median, alone (ms)" in text


def test_the_ingest_floor_is_prometheus_scraping_alone():
    from grayguard.bench import ingestfloor
    r = ingestfloor.measure(NODES, warmup_s=7, seconds=3, progress=lambda s: None)  # every job scraped (5 s) once
    assert r["cores"] > 0 and r["samples_per_s"] > 0 and r["rss_bytes"] > 0
    # every node's stored series, and nothing recorded: no rule ran
    assert NODES * 45 <= r["head_series"] < NODES * sum(promtarget.series_per_node().values()) + 1000
