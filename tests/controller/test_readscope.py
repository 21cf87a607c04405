"""Sharded reads (controller/readscope.py): a replica that leads some pools asks Prometheus for their series only.
The wrapped queries are evaluated by Prometheus' own engine (promtool): the led pools' series and the unlabelled
ones come back as they are, metric name and sample times included; the controller wraps every query (and reads
only those pools' backends from HAProxy) while it leads a strict part of the pools, and none when it leads them all
or runs without a registry."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from grayguard.bench.ticklocal import Leads
from grayguard.controller import readscope
from tests.support.ctl_helpers import OPTIONAL, FakeHaproxy, FakeProm, fake_controller, samples
from tests.support.stack import prometheus_config, require, start_prometheus

SERIES = [("a", "10.0.0.1:8000", 1), ("b", "10.0.0.2:8000", 2), ("c", "10.0.0.3:8000", 3), (None, "10.0.0.4:8000", 4)]


def test_no_scope_leaves_the_query_alone_and_a_scope_names_each_pool_once_in_order():
    assert readscope.scoped("up", None) == "up"
    q = readscope.scoped("timestamp(x)", {"p2", "p1"})
    assert q == ('(timestamp(x)) and on(pool) (vector(1) or label_replace(vector(1), "pool", "p1", "", "") or '
                 'label_replace(vector(1), "pool", "p2", "", ""))')
    assert readscope.scoped("x", []) == "(x) and on(pool) (vector(1))"  # only the unlabelled series
    assert 'label_replace(vector(1), "pool", "a\\"b\\\\", "", "")' in readscope.scoped("x", ['a"b\\'])


@given(st.sets(st.text(min_size=1, max_size=12), max_size=6), st.sampled_from(["x", "timestamp(a:b{c=\"d\"})",
                                                                        'max by (pool) (y) and z']))
def test_the_stand_ins_read_back_what_scoped_wrote(pools, inner):
    """parse_scoped (the answer server's and FakeProm's reading of the wrapper) is scoped's inverse, for any pool
    name (quotes and backslashes too) and any query."""
    assert readscope.parse_scoped(readscope.scoped(inner, pools)) == (inner, sorted(pools))
    assert readscope.unscoped(readscope.scoped(inner, pools)) == inner
    assert readscope.parse_scoped(inner) is None and readscope.unscoped(inner) == inner


def _labels(name: str | None, pool: str | None, instance: str) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in (("instance", instance), ("pool", pool)) if v is not None)
    return f"{name or ''}{{{inner}}}"


def test_prometheus_answers_the_led_pools_and_the_unlabelled_series_as_they_are(tmp_path):
    require("promtool")
    promtool = shutil.which("promtool")
    name = "instance:vllm_normalized_latency_seconds_per_token:rate30s"  # the default latency_query: a bare name
    # samples at 0-3 s, evaluated at 1 m: timestamp() must give 3 (the sample's time), not 60 (the evaluation's)
    series = [{"series": _labels(name, p, i), "values": f"{v} {v} {v} {v}"} for p, i, v in SERIES]
    led = ["a", "c"]
    kept = [(p, i, v) for p, i, v in SERIES if p in led or p is None]
    tests = [
        {"expr": readscope.scoped(name, led), "eval_time": "1m",
         "exp_samples": [{"labels": _labels(name, p, i), "value": v} for p, i, v in kept]},
        {"expr": readscope.scoped(f"timestamp({name})", led), "eval_time": "1m",
         "exp_samples": [{"labels": _labels(None, p, i), "value": 3} for p, i, _ in kept]},
        {"expr": readscope.scoped(f"max by (pool, instance) ({name})", ["b"]), "eval_time": "1m",  # an aggregation
         "exp_samples": [{"labels": _labels(None, p, i), "value": v} for p, i, v in SERIES if p in ("b", None)]},
    ]
    doc = {"tests": [{"interval": "1s", "input_series": series, "promql_expr_test": tests}]}
    (tmp_path / "scope.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    res = subprocess.run([promtool, "test", "rules", "scope.test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def _controller(led):
    events: list = []
    pools = [{"name": p, "backend": f"be_{p}"} for p in ("a", "b", "c")]
    hap = FakeHaproxy("unix:/h", {f"be_{p}": [("n1", f"10.0.{k}.1:8000", 100)] for k, p in enumerate("abc")},
                      events)
    ctl = fake_controller(pools, [hap], FakeProm(lambda q: samples({}, 0.0), events), canary=lambda url: None,
                          extra={"signals": {**{f"{k}_query": "" for k in OPTIONAL},
                                             "kv_cache_query": "vllm:gpu_cache_usage_perc"}})
    if led is not None:
        ctl.leadership = Leads(led)
    ctl.tick()
    return [e[1] for e in events if e[0] == "query"], [e[1:] for e in events if e[0] == "show"], ctl.cfg.signals


@pytest.mark.parametrize("led", [None, ("a", "b", "c")])
def test_a_controller_that_leads_every_pool_reads_the_queries_as_configured(led):
    asked, shown, sig = _controller(led)
    assert sorted(asked) == sorted([sig.latency_query, sig.request_rate_query, f"timestamp({sig.latency_query})",
                                    f"timestamp({sig.request_rate_query})", sig.kv_cache_query])
    assert shown == [("unix:/h",)]  # the whole table


def test_a_replica_that_leads_some_pools_reads_their_series_only():
    asked, shown, sig = _controller(("c", "a"))
    plain = [sig.latency_query, sig.request_rate_query, f"timestamp({sig.latency_query})",
             f"timestamp({sig.request_rate_query})", sig.kv_cache_query]
    assert sorted(asked) == sorted(readscope.scoped(q, ["a", "c"]) for q in plain)
    assert shown == [("unix:/h", ("be_a", "be_c"))]  # its backends only


def test_a_standby_reads_nothing():
    asked, shown, _ = _controller(())
    assert asked == [] and shown == []


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["prometheus", "victoria-metrics"])
def test_a_real_backend_takes_a_long_scoped_query_by_post(tmp_path, backend):
    """300 led pools make a query of some 17,000 characters: PrometheusClient sends it as a POST form, and a real
    Prometheus (or VictoriaMetrics, MetricsQL) answers the led pool's series, the unlabelled one, and nothing of a
    pool not led."""
    require(backend)
    from grayguard.config import PrometheusConfig
    from grayguard.localstack.victoria import start_victoria_metrics
    from grayguard.promclient import LONG_PARAMS, PrometheusClient

    led = [f"p{i}" for i in range(300)]
    series = ('label_replace(vector(5), "pool", "p7", "", "") or label_replace(vector(6), "pool", "other", "", "") '
              'or label_replace(vector(7), "instance", "a:1", "", "")')
    start = (lambda: start_prometheus(prometheus_config([], interval="1s"), workdir=tmp_path / "prom")) \
        if backend == "prometheus" else (lambda: start_victoria_metrics(workdir=tmp_path / "vm"))
    with start() as server:
        client = PrometheusClient(PrometheusConfig(url=server.url))
        q = readscope.scoped(series, led)
        assert len(q) > LONG_PARAMS
        got = sorted((sorted(s.labels.items()), s.value) for s in client.query(q))
        assert got == [([("instance", "a:1")], 7.0), ([("pool", "p7")], 5.0)]
        assert [s.labels for s in client.query(readscope.scoped(series, ["p8"]))] == [{"instance": "a:1"}]
