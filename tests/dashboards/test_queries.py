"""Every dashboard query parses (a real Prometheus says so) and reads only series that exist: grayguard's
exporter and controller series, vLLM's, and what the recording rules record."""

import json
import re
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry

from grayguard.config import load_config, parse_config
from grayguard.controller.discovery import DiscoveryMetrics
from grayguard.controller.membersync import MembershipMetrics
from grayguard.controller.metrics import ControllerMetrics
from grayguard.dashboards import membership
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import expressions
from grayguard.dashboards.promql import label_values_selector, metric_names, substitute, zero_fill
from grayguard.dashboards.render import render_all
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.server import Exporter
from grayguard.rules.render import recording_rule_names
from grayguard.sim.metrics import VllmMetrics
from tests.support.stack import prometheus_config, require, start_prometheus

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "grayguard.example.yaml"
METRICS_DOC = REPO / "docs" / "metrics.md"
VLLM_REFERENCE = REPO.parent / "shared" / "reference" / "vllm-nvml-metrics.md"  # present beside a checkout
# Values for Grafana's template variables: a pool name, All (.*) for the multi-value ones.
VARIABLES = {"pool": "chat", "node": ".*", "instance": ".*", "gpu": ".*"}


def registry_names(registry) -> set[str]:
    """Every sample name a registry exposes (counters with _total, histograms with _bucket/_sum/_count)."""
    return {n for names in registry._collector_to_names.values() for n in names}


def controller_registry() -> CollectorRegistry:
    """Every series the controller's code defines: its own, the discovery's and the membership step's."""
    r = ControllerMetrics.create().registry
    DiscoveryMetrics.create(r)
    MembershipMetrics(r)
    return r


def registry_labels(registry) -> dict[str, set[str]]:
    """Sample name -> the label names the code gives it (histogram buckets add `le`)."""
    out: dict[str, set[str]] = {}
    for collector, names in registry._collector_to_names.items():
        labels = set(getattr(collector, "_labelnames", ()))
        for n in names:
            out[n] = labels | ({"le"} if n.endswith("_bucket") else set())
    return out


TARGET_LABELS = {"job", "instance"}  # what Prometheus adds to every scraped series
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^{}]*)\}")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^()]*)\)")


def allowed_names(cfg) -> set[str]:
    """Series grayguard exports (docs and registries), vLLM exposes, or the rules of cfg record."""
    names = set(re.findall(r"`(grayguard_[a-z0-9_]+)`", METRICS_DOC.read_text()))
    names |= registry_names(Exporter("http://127.0.0.1:1", port=0, nvml=FakeNvml([healthy_h100(0)])).registry)
    names |= registry_names(controller_registry())
    names |= registry_names(VllmMetrics("m", 4096).registry)  # the simulator's vLLM, same names as vLLM 0.33
    if VLLM_REFERENCE.is_file():
        for base in re.findall(r"`(vllm:[a-z_]+)`", VLLM_REFERENCE.read_text()):
            names |= {base, *(base + sfx for sfx in ("_bucket", "_sum", "_count"))}
    names |= set(recording_rule_names(cfg))
    names.add("ALERTS")  # the series Prometheus writes for grayguard's own alert rules
    return names


def all_expressions(dcfg=None):
    for name, text in render_all(dcfg).items():
        for where, expr in expressions(json.loads(text)):
            yield f"{name}: {where}", substitute(expr, VARIABLES)


def test_metric_names_of_an_expression():
    e = ('sum by (pool, le) (rate(vllm:time_to_first_token_seconds_bucket{pool="chat", instance=~".*"}[1m])) '
         '/ on (pool) group_left () instance:x:rate30s offset 5m > bool 0 '
         'or label_replace(0 * up{job="a b"}, "kind", "none", "", "") unless {__name__=~"vllm[:_]y_total"}'
         " and max_over_time(grayguard_z[5m:1m]) * 1e-05 + time()")
    assert metric_names(e) == {"vllm:time_to_first_token_seconds_bucket", "instance:x:rate30s", "up",
                               "vllm:y_total", "grayguard_z"}
    assert label_values_selector('label_values(a{pool="$pool"}, node)') == 'a{pool="$pool"}'
    assert label_values_selector("query_result(up)") is None


def test_template_variables_are_all_substituted():
    assert substitute('x{a=~"$node", b="${pool}"}[$__rate_interval]', {"node": ".*", "pool": "p"}) == \
        'x{a=~".*", b="p"}[1m]'
    with pytest.raises(KeyError, match="unknown"):
        substitute("x{a=\"$unknown\"}", {})


def test_zero_fill_keeps_absent_when_the_witness_is_absent():
    e = zero_fill("sum(rate(a_total[1m]))", "sum(rate(b_total[1m]))", "kind")
    assert e.startswith("(sum(rate(a_total[1m])))\nor on () label_replace(0 * (sum(rate(b_total[1m])))")


@pytest.mark.parametrize("vllm_prefix", ["vllm:", "vllm_", "any"])
def test_every_query_reads_only_known_series(vllm_prefix):
    cfg = load_config(EXAMPLE) if vllm_prefix == "vllm:" else parse_config(
        {"pools": [{"name": "chat", "backend": "b"}], "rules": {"vllm_prefix": vllm_prefix}})
    allowed = allowed_names(cfg) | {n.replace("vllm:", "vllm_") for n in allowed_names(cfg)}
    seen, unknown = set(), []
    for where, expr in all_expressions(DashboardConfig.from_config(cfg)):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        seen |= names
        unknown += [f"{where}: {n}" for n in sorted(names - allowed)]
    assert unknown == []
    assert len(seen) > 50


def test_an_unknown_name_is_caught():
    allowed = allowed_names(load_config(EXAMPLE))
    assert "grayguard_gpu_sm_clock_hertz" in allowed and "vllm:inter_token_latency_seconds_bucket" in allowed
    assert "instance:vllm_normalized_latency_seconds_per_token:rate30s" in allowed
    assert not metric_names("rate(grayguard_gpu_typo_total[1m])") <= allowed


@pytest.mark.e2e
def test_every_query_parses_in_prometheus():
    require("prometheus")
    with start_prometheus(prometheus_config([])) as prom:
        broken = requests.get(prom.url + "/api/v1/query", params={"query": "sum(rate(x[1m])"}, timeout=10)
        assert broken.status_code == 400 and broken.json()["errorType"] == "bad_data"  # the check can fail
        bad = []
        for where, expr in all_expressions():
            r = requests.get(prom.url + "/api/v1/query", params={"query": expr}, timeout=10)
            if r.status_code != 200 or r.json().get("status") != "success":
                bad.append(f"{where}: HTTP {r.status_code} {r.text[:300]}\n{expr}")
        assert bad == []


def row_expressions(doc: dict, title: str):
    """(where, expr) of the panels under the row called title."""
    inside = False
    for p in doc["panels"]:
        if p.get("type") == "row":
            inside = p.get("title") == title
        elif inside:
            for t in p["targets"]:
                yield f"panel {p['title']!r} {t['refId']}", substitute(t["expr"], VARIABLES)


def series_problems(where: str, expr: str, labels: dict[str, set[str]]) -> list[str]:
    """Series of expr the code does not define, and labels it selects or groups by that none of its series has."""
    names = metric_names(expr)
    bad = [f"{where}: {n} is not a series of the controller's code" for n in sorted(names - set(labels))]
    known = TARGET_LABELS | set(re.findall(r'label_replace\([^"]*"(\w+)"', expr))
    for name, body in SELECTOR.findall(expr):
        used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
        bad += [f"{where}: {name} has no label {lb!r}" for lb in sorted(used - labels.get(name, set()) - known)]
    have = known.union(*(labels.get(n, set()) for n in names))
    for clause in GROUPING.findall(expr):
        used = {lb.strip() for lb in clause.split(",") if lb.strip()}
        bad += [f"{where}: no series of it has label {lb!r}" for lb in sorted(used - have)]
    return bad


def test_membership_row_reads_series_the_code_defines_with_labels_they_have():
    """Stricter than docs: every series of the membership and leadership row is defined in controller/ (metrics.py,
    discovery.py, membersync.py), and every label a query selects or groups by is one the code gives that series
    (or Prometheus' job and instance)."""
    labels = registry_labels(controller_registry())
    doc = json.loads(render_all()["grayguard-pool-overview.json"])
    found, bad = set(), []
    for where, expr in row_expressions(doc, membership.TITLE):
        found |= metric_names(expr)
        bad += series_problems(where, expr, labels)
    assert bad == []
    assert {"grayguard_membership_nodes", "grayguard_registry_up", "grayguard_registry_snapshot_age_seconds",
            "grayguard_membership_changes_total", "grayguard_membership_expiries_held", "grayguard_controller_leader",
            "grayguard_controller_led_pools", "grayguard_controller_leader_changes_total"} <= found


def test_the_series_check_catches_a_wrong_name_or_label():
    labels = registry_labels(controller_registry())
    assert labels["grayguard_controller_leader"] == {"id"}
    assert labels["grayguard_controller_leader_changes_total"] == set()  # no id: the replica is its instance
    assert labels["grayguard_membership_changes_total"] == {"pool", "action"}
    assert series_problems("w", 'sum by (id) (increase(grayguard_controller_leader_changes_total{job="c"}[1m]))',
                           labels) == ["w: no series of it has label 'id'"]
    assert series_problems("w", 'max(grayguard_controller_leader{pool="chat"})', labels) == \
        ["w: grayguard_controller_leader has no label 'pool'"]
    assert series_problems("w", "grayguard_membership_node", labels) == \
        ["w: grayguard_membership_node is not a series of the controller's code"]
    ok = ('sum by (kind) (rate(grayguard_discovery_errors_total{job="c"}[1m])) '
          'or label_replace(0 * x, "kind", "", "", "")')
    assert series_problems("w", ok, labels) == ["w: x is not a series of the controller's code"]
