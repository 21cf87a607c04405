"""Every link and variable resolves: the dashboards' links (dashboard, panel, data and cell links) open a rendered
dashboard with variables it defines, every $variable used is defined, multi-value ones are matched with =~, and the
alerts' dashboard_url opens the Pool overview at variables it has. Grafana is not run here: the JSON is walked."""

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from grayguard.config import parse_config
from grayguard.dashboards import gpu, pool
from grayguard.dashboards.lint import link_problems, links, variables
from grayguard.dashboards.promql import label_values_selector
from grayguard.dashboards.render import BUILDERS, render_all
from grayguard.rules.render import ALERTS, GPU_DASHBOARD_UID, POOL_DASHBOARD_UID, render_alerts

REPO = Path(__file__).resolve().parents[2]
POOL_JSON, GPU_JSON = "grayguard-pool-overview.json", "grayguard-gpu-health.json"


def committed() -> dict[str, dict]:
    return {name: json.loads((REPO / "dashboards" / name).read_text()) for name in BUILDERS}


def test_the_committed_dashboards_resolve():
    assert link_problems(committed()) == []


def test_every_variable_query_is_a_label_values_selector():
    """Each query variable is label_values(selector, label), so its selector is among the expressions that promtool
    and Prometheus parse (test_live.py, test_queries.py); pool, node and instance take several values or All."""
    for name, doc in committed().items():
        for v in doc["templating"]["list"]:
            if v["type"] == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                assert label_values_selector(q), f"{name}: ${v['name']}: {q!r}"
                assert v.get("multi") and v.get("includeAll") and v.get("allValue") == ".*", f"{name} ${v['name']}"


def links_to(doc: dict, uid: str) -> list[str]:
    return [where for where, lk in links(doc) if lk.get("url", "").startswith(f"/d/{uid}")]


def test_the_dashboards_link_each_other_both_ways():
    docs = committed()
    pool_doc, gpu_doc = docs[POOL_JSON], docs[GPU_JSON]
    assert pool_doc["uid"] == POOL_DASHBOARD_UID and gpu_doc["uid"] == GPU_DASHBOARD_UID
    to_gpu, to_pool = links_to(pool_doc, GPU_DASHBOARD_UID), links_to(gpu_doc, POOL_DASHBOARD_UID)
    # by name at the top, from the out-of-rotation table (its instances, the panel), from every per-node panel
    assert "dashboard link 'grayguard / GPU health'" in to_gpu
    assert "panel 'Nodes out of rotation now' column 'instance' link 'grayguard / GPU health: this node'" in to_gpu
    assert len(to_gpu) > 15
    assert "dashboard link 'grayguard / Pool overview'" in to_pool
    assert "panel 'GPUs' column 'node' link 'grayguard / Pool overview: this node'" in to_pool
    assert len(to_pool) > 10


def test_the_out_of_rotation_table_comes_first():
    p = committed()[POOL_JSON]["panels"]
    assert p[0]["type"] == "row" and p[0]["title"] == "Pool now"
    table = p[1]
    assert table["title"] == "Nodes out of rotation now" and table["type"] == "table"
    assert table["gridPos"] == {"x": 0, "y": 1, "w": 24, "h": 6}
    order = table["transformations"][0]["options"]["indexByName"]
    assert sorted(order, key=order.get)[:4] == ["pool", "node", "state", "reason"]
    # the whole pool, whatever $node selects: a node picked from an alert does not hide the others
    assert "$node" not in table["targets"][0]["expr"]
    assert "Why: state and reason now" not in [x["title"] for x in p]  # it was the same table, screens down


def broken(mutate) -> list[str]:
    docs = copy.deepcopy(committed())
    mutate(docs)
    return link_problems(docs)


def panel(doc: dict, title: str) -> dict:
    (p,) = [p for p in doc["panels"] if p.get("title") == title]
    return p


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: panel(d[POOL_JSON], "Peer score")["targets"][0].update(expr='grayguard_node_score{pool=~"$poll"}'),
     "$poll is not a variable"),
    (lambda d: panel(d[POOL_JSON], "Peer score")["targets"][0].update(expr='grayguard_node_score{pool="$pool"}'),
     "$pool takes several values: match it with =~"),
    (lambda d: d[GPU_JSON].update(uid="grayguard-gpu"), "no rendered dashboard has uid 'grayguard-gpu-health'"),
    (lambda d: d[GPU_JSON]["templating"]["list"].pop(2), "grayguard-gpu-health has no variable 'instance'"),
    (lambda d: d[GPU_JSON].update(tags=[]), "no other dashboard has the tags ['grayguard']"),
    (lambda d: d[POOL_JSON]["links"][0].update(keepTime=False), "drops the time range"),
    (lambda d: panel(d[POOL_JSON], "Nodes out of rotation now")["links"][0].update(url="https://x/d/a"),
     "is no /d/<uid> link"),
])
def test_the_check_catches_what_does_not_resolve(mutate, expected):
    assert any(expected in p for p in broken(mutate)), broken(mutate)


def test_render_refuses_a_dangling_link(monkeypatch):
    monkeypatch.setattr(gpu, "UID", "grayguard-gpu-renamed")  # the pool dashboard still links the old uid
    monkeypatch.setitem(BUILDERS, GPU_JSON, gpu.build)
    with pytest.raises(ValueError, match="no rendered dashboard has uid 'grayguard-gpu-health'"):
        render_all()
    assert pool.UID == POOL_DASHBOARD_UID


# ---- the alerts' links ----------------------------------------------------------------------------------------

GO_TEMPLATE = re.compile(r"\{\{.*?\}\}")


def alert_annotations(grafana_url: str | None) -> dict[str, dict[str, str]]:
    data = yaml.safe_load((REPO / "grayguard.example.yaml").read_text())
    data["rules"]["grafana_url"] = grafana_url
    text = render_alerts(parse_config(data), {"chat": 0.5})
    return {r["alert"]: r["annotations"] for g in yaml.safe_load(text)["groups"] for r in g["rules"]}


def test_every_alert_links_the_pool_dashboard_at_variables_it_has():
    docs = {d["uid"]: d for d in committed().values()}
    annotations = alert_annotations("https://grafana.example:3000/")
    assert set(annotations) == set(ALERTS)
    for alert, a in annotations.items():
        assert "dashboard_url" in a, alert
        assert ("gpu_dashboard_url" in a) == alert.startswith("GrayguardGpu"), alert
        for key in ("dashboard_url", "gpu_dashboard_url"):
            if key not in a:
                continue
            path = GO_TEMPLATE.sub("", re.sub(r"\{\{ with .*?\{\{ end \}\}", "", a[key]))
            m = re.fullmatch(r"https://grafana\.example:3000/d/([\w-]+)(?:\?(.*))?", path)
            assert m and m.group(1) in docs, f"{alert} {key}: {a[key]}"
            names = re.findall(r"var-(\w+)=", a[key])  # those inside {{ with query }} too
            assert set(names) <= variables(docs[m.group(1)]), f"{alert} {key}: {names}"
        # an alert about one node (its node or its instance in the text) names the node and its reason
        if re.search(r"\{\{ \$labels\.(node|instance) \}\} (of|in) pool", a["description"]):
            assert {"node", "reason"} <= set(a), alert


def test_no_dashboard_url_without_grafana():
    annotations = alert_annotations(None)
    assert not any("dashboard_url" in a or "gpu_dashboard_url" in a for a in annotations.values())
    assert "node" in annotations["GrayguardProbeFailing"] and "reason" in annotations["GrayguardNodeDegraded"]
