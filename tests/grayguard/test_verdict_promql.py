"""The verdict from Prometheus (docs/api.md): the two documented queries, evaluated by Prometheus' own engine
(promtool) on the series a real controller exported after a leader's tick drained node0, give each node's weight
with its address and the drained node; docs/api.md shows the same queries."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grayguard.verdict import DRAINED_QUERY, WEIGHT_QUERY
from tests.controller.test_status_schema import ADDR, leader_world
from tests.support.stack import require

ROOT = Path(__file__).resolve().parents[2]


def _series(text: str, names: set[str]) -> list[dict]:
    """promtool input series: the exposition's samples of `names`, each constant over the test's minute."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                labels = ", ".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out.append({"series": f"{s.name}{{{labels}}}", "values": f"{s.value:g}x5"})
    return out


def _labels(name: str | None, **kw: str) -> str:
    return f"{name or ''}{{{', '.join(f'{k}={chr(34)}{v}{chr(34)}' for k, v in sorted(kw.items()))}}}"


def test_the_documented_queries_give_weights_with_addresses_and_the_drained_nodes(tmp_path):
    require("promtool")
    ctl, *_ = leader_world()
    ctl.tick()
    text = generate_latest(ctl.metrics.registry).decode()
    series = _series(text, {"grayguard_node_weight", "grayguard_node_info", "grayguard_node_state"})
    weights = {"node0": 0, "node1": 100, "node2": 100, "node3": 100}
    tests = [
        {"expr": WEIGHT_QUERY, "eval_time": "1m", "exp_samples": [
            {"labels": _labels(None, pool="chat", node=n, instance=f"{ADDR[n][0]}:{ADDR[n][1]}"), "value": w}
            for n, w in weights.items()]},
        {"expr": DRAINED_QUERY, "eval_time": "1m", "exp_samples": [
            {"labels": _labels("grayguard_node_state", pool="chat", node="node0", state="quarantined"), "value": 1}]},
    ]
    (tmp_path / "verdict.test.yml").write_text(yaml.safe_dump(
        {"tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}]}, sort_keys=False))
    res = subprocess.run([shutil.which("promtool"), "test", "rules", "verdict.test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_docs_api_shows_the_same_queries():
    doc = (ROOT / "docs" / "api.md").read_text()
    assert WEIGHT_QUERY in doc and DRAINED_QUERY in doc
