"""A probe counts once, however many ticks read it (2026-12-07).

The controller reads each node's last probe every tick. Before, it could not tell a probe read again from a new one,
so its runs counted ticks: with `--probe.interval 5s` one slow probe was a run of five and cut a node its live signals
do not measure to 30 % on the next tick, until three ticks of one good probe cleared it. The exporter now names the
probe it shows by when it was sent (`grayguard_probe_last_sent_timestamp_seconds`); the shipped probe-result query
returns it as the result's value, and a run moves only on a probe it has not counted (NodeInput.probe_at)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import yaml

from grayguard.config import PoolConfig, SignalsConfig, parse_config
from grayguard.controller import decide
from grayguard.controller.haproxy import ServerState
from grayguard.controller.loop import Controller
from grayguard.controller.policy import NodeInput, Policy, decide_pool
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.server import Exporter
from grayguard.promclient import PrometheusClient, Sample
from grayguard.vocab import State
from tests.exporters.test_http import FakeVllm
from tests.support.stack import REPO, prometheus_config, require, start_prometheus, static_job, wait_until

PEERS = 10


def _tick(prev, now, n0_result, n0_sent, n0_failures=0, n0_ttft=0.4):
    """One tick of a 10-node pool without live signals (an engine without a fast path: the probes judge it): the
    peers answer a new ok probe every tick; node n0 shows `n0_result` of the probe sent at `n0_sent`."""
    inputs = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result="ok", probe_ttft=0.03,
                                 probe_failures=0, probe_at=now - 0.5) for i in range(1, PEERS)}
    inputs["n0"] = NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result=n0_result,
                             probe_ttft=n0_ttft if n0_result in ("ok", "slow") else None,
                             probe_failures=n0_failures, probe_at=n0_sent)
    d = decide_pool(prev, inputs, Policy(), now)
    return {m: nd.state for m, nd in d.nodes.items()}, d.nodes["n0"]


def _run(shown):
    """n0's states over ticks 1 s apart; shown: each tick's (result, sent, failures)."""
    prev, out = {}, []
    for k, (result, sent, failures) in enumerate(shown):
        prev, nd = _tick(prev, 1000.0 + k, result, sent, failures)
        out.append(nd.state.state)
    return out


def test_one_slow_probe_read_on_five_ticks_is_one_slow_probe():
    # a probe every 5 s: the first slow probe shows for five ticks, and cuts nothing (probe_consecutive: 2)
    assert _run([("slow", 999.5, 0)] * 5) == [State.HEALTHY] * 5
    # the next probe slow too: the run is two probes, and the node is cut when it comes
    assert _run([("slow", 999.5, 0)] * 5 + [("slow", 1004.5, 0)]) == [State.HEALTHY] * 5 + [State.DEGRADED]


def test_without_the_probes_time_every_tick_counts_as_before():
    # an exporter before 2026-12-07 or a custom query without the send time: unknown identity, the tick's count
    assert _run([("slow", None, 0)] * 2) == [State.HEALTHY, State.DEGRADED]


@pytest.mark.parametrize("value", [2.0, 1.7e9])
def test_a_value_that_is_no_recent_time_names_no_probe(value):
    # a probe-result query of one's own that counts series (2, for ever), or a time an hour and more away from the
    # controller's: taken for one probe, no run would ever move again; it is no identity, and every tick counts
    assert _run([("slow", value, 0)] * 2) == [State.HEALTHY, State.DEGRADED]


def test_a_probe_shown_slow_while_it_waits_is_the_same_probe_when_it_ends_slow():
    # the exporter shows a probe past its slow threshold as slow at once, and again when it ends slow: one probe
    assert _run([("slow", 1000.2, 0), ("slow", 1000.2, 0)]) == [State.HEALTHY, State.HEALTHY]


def test_a_probe_shown_slow_that_ends_in_a_timeout_counts_as_a_failure():
    # the same probe, another result: its failure is news (the exporter's streak counts it)
    states = _run([("slow", 1000.2, 0), ("timeout", 1000.2, 1), ("timeout", 1002.0, 2)])
    assert states[:2] == [State.HEALTHY, State.HEALTHY] and states[2] == State.QUARANTINED


def test_a_cut_is_cleared_by_good_probes_not_by_ticks_reading_one():
    shown = [("slow", 999.5, 0), ("slow", 1000.5, 0)] + [("ok", 1001.5, 0)] * 5
    prev = {}
    for k, (result, sent, failures) in enumerate(shown):
        prev, nd = _tick(prev, 1000.0 + k, result, sent, failures, n0_ttft=0.4 if result == "slow" else 0.03)
    assert nd.state.state == State.DEGRADED  # one good probe, read five times: not probe_ok_to_clear (3) good probes
    for k, sent in enumerate((1006.5, 1007.5)):
        prev, nd = _tick(prev, 1007.0 + k, "ok", sent, 0, n0_ttft=0.03)
    assert nd.state.state == State.HEALTHY  # the third good probe clears it


def test_a_failure_streak_without_the_exporters_count_moves_once_a_probe():
    # probe_failures absent (a custom query): the controller counts failed probes itself, once each
    prev = {}
    for k in range(4):
        prev, nd = _tick(prev, 1000.0 + k, "connect_error", 999.5, None)
    assert nd.state.signals.probe_bad == 1 and nd.state.state == State.HEALTHY
    prev, nd = _tick(prev, 1004.0, "connect_error", 1003.5, None)
    assert nd.state.signals.probe_bad == 2 and nd.state.state == State.QUARANTINED


def _servers(n: int) -> dict[str, ServerState]:
    return {f"n{i}": ServerState("p", f"n{i}", f"10.0.0.{i}:8000", 100, 100, 0, 2) for i in range(n)}


def test_the_probe_results_value_is_its_send_time_and_1_is_unknown():
    pool = PoolConfig(name="p", backend="p")
    at = 1.7e9 + 1.0  # Prometheus' evaluation time
    opt = {"probe_result": [Sample({"pool": "p", "instance": "10.0.0.0:8000", "result": "slow"}, 1.7e9 + 0.25, at),
                            Sample({"pool": "p", "instance": "10.0.0.1:8000", "result": "ok"}, 1.0, at),
                            Sample({"pool": "p", "instance": "10.0.0.2:8000", "result": "ok"}, 0.0, at)]}
    sig = decide.signal_maps(pool, _servers(3), opt)
    assert sig["probe_result"] == {"n0": "slow", "n1": "ok"}  # 0: not the last result (an old one-hot exporter)
    assert sig["probe_at"] == {"n0": 1.7e9 + 0.25}


def test_the_shipped_query_gives_each_probes_send_time_or_1_on_a_real_promtool(tmp_path):
    """The shipped probe_result_query on promtool: a node whose exporter exports the send time gets it as the
    value of its one result series; an older exporter's node gets 1; the result's label is kept."""
    require("promtool")
    fast = 'job="grayguard-exporter-fast",pool="chat"'
    series = [
        {"series": f'grayguard_probe_last_result{{{fast},instance="a:8000",result="slow"}}', "values": "1x5"},
        {"series": f'grayguard_probe_last_sent_timestamp_seconds{{{fast},instance="a:8000"}}',
         "values": "1700000003x5"},
        {"series": f'grayguard_probe_last_result{{{fast},instance="b:8000",result="ok"}}', "values": "1x5"},
    ]
    tests = [{"interval": "1s", "input_series": series, "promql_expr_test": [{
        "expr": SignalsConfig().probe_result_query, "eval_time": "3s",
        "exp_samples": [{"labels": '{instance="a:8000",pool="chat",result="slow"}', "value": 1700000003},
                        {"labels": '{instance="b:8000",pool="chat",result="ok"}', "value": 1}]}]}]
    (tmp_path / "t.test.yml").write_text(yaml.safe_dump({"tests": tests}))
    res = subprocess.run([shutil.which("promtool"), "test", "rules", "t.test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.e2e
def test_the_controller_reads_each_probes_identity_from_the_real_exporter_through_a_real_prometheus(tmp_path):
    """A real exporter probing a stand-in vLLM every 3 s; a real Prometheus scrapes its fast page every second and its
    full page (the shipped relabelling drops the fast page's series there); the controller's own read of the shipped
    probe-result query gives the same send time on the ticks that read one probe, and a new one with the next probe.
    A slow probe is shown slow while it waits, and keeps its send time when it ends."""
    require("prometheus")
    vllm = FakeVllm()
    probe = ProbeConfig(interval=3.0, jitter=0.0, slow_threshold=0.3, deadline=5.0, startup_grace=0, api_key_env=None)
    exporter = Exporter(vllm.url, port=0, nvml=None, probe=probe).start()
    try:
        target, labels = exporter.url.removeprefix("http://"), {"pool": "chat", "instance": "10.0.0.10:8000"}
        shipped = yaml.safe_load((REPO / "rules" / "prometheus.example.yml").read_text())["scrape_configs"]
        drop = next(sc["metric_relabel_configs"] for sc in shipped if sc["job_name"] == "grayguard-exporter")
        full = {**static_job("grayguard-exporter", [target], labels, "5s"), "metric_relabel_configs": drop}
        fast = {**static_job("grayguard-exporter-fast", [target], labels, "1s"), "metrics_path": "/metrics/fast"}
        with start_prometheus(prometheus_config([full, fast])) as prom:
            cfg = parse_config({"pools": [{"name": "chat", "backend": "chat"}], "prometheus": {"url": prom.url}})
            ctl = Controller(cfg, PrometheusClient(cfg.prometheus), [])
            pool, servers = cfg.pools[0], {"n0": ServerState("chat", "n0", "10.0.0.10:8000", 100, 100, 0, 2)}

            def shown() -> tuple[str | None, float | None]:
                sig = decide.signal_maps(pool, servers, ctl.read_optional())
                return sig["probe_result"].get("n0"), sig["probe_at"].get("n0")

            first = wait_until(lambda: (s := shown())[1] is not None and s, timeout_s=30, what="a probe's send time")
            assert first[0] == "ok" and abs(first[1] - time.time()) < 10
            reads = [first]
            while len({at for _, at in reads}) < 3:  # three probes' identities, read every 0.5 s
                time.sleep(0.5)
                reads.append(shown())
                assert len(reads) < 60, reads
            ats = [at for _, at in reads]
            assert ats == sorted(ats) and len(ats) >= 6  # each probe read on several ticks, under one send time
            assert 2.5 < ats[-1] - ats[0] < 9  # the probes 3 s apart
            assert prom.query("count(grayguard_probe_last_sent_timestamp_seconds)")[0]["value"][1] == "1"  # fast job's
            vllm.mode, vllm.delay = "slow", 2.0  # the next probe waits 2 s for its first token
            slow = wait_until(lambda: (s := shown())[0] == "slow" and s, timeout_s=15, what="the slow probe shown")
            assert slow[1] > ats[-1]
            vllm.mode = "fast"
            reads = [slow]
            while reads[-1][1] == slow[1]:  # while it waits, and once it ended (2 s), until the next probe's
                time.sleep(0.25)
                reads.append(shown())
                assert len(reads) < 60, reads
            assert set(reads[:-1]) == {slow}  # one probe, slow, under one send time
            assert reads[-1][0] == "ok" and reads[-1][1] > slow[1] + 2  # the next, sent after the slow one ended
    finally:
        exporter.stop()
        vllm.close()
