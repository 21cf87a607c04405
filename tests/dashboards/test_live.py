"""The Pool overview's "Live signals (1 s)" row: it reads the series the exporter's live fast path really exports
(exporters/fastpath.py, on /metrics/fast) and vLLM's own running, waiting and generated tokens (the exporter's live
gauges of those are on its full page only, not stored: issue 34), draws the controller's live thresholds from the
config, and its queries are valid PromQL that compute what the panels say (promtool on fixed series)."""

import json
import shutil
import subprocess

import pytest
import yaml

from grayguard.config import ThresholdsConfig, parse_config
from grayguard.dashboards import live
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import expressions
from grayguard.dashboards.promql import metric_names, substitute
from grayguard.dashboards.render import render_all
from grayguard.exporters.fastpath import LiveCollector
from grayguard.exporters.live import LiveSignals
from grayguard.exporters.server import Exporter
from tests.support.stack import require

POOL_JSON = "grayguard-pool-overview.json"
# what the exporter's LiveCollector exports, and the part of it on /metrics/fast (scraped every second, stored)
LIVE_FAMILIES = {fam.name for fam in LiveCollector(LiveSignals).describe()}
FAST_PAGE = {n for names in Exporter("http://127.0.0.1:1", port=0, nvml=None).fast_registry
             ._collector_to_names.values() for n in names}
# vLLM's own series the row reads in place of the exporter's full-page-only live gauges
ENGINE = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"}
NODE_INFO = "grayguard_node_info"  # the controller's node <-> instance link: every live series is named by its node
VARIABLES = {"pool": "chat", "node": ".*", "instance": ".*"}


def pool_doc(cfg: DashboardConfig | None = None) -> dict:
    return json.loads(render_all(cfg)[POOL_JSON])


def live_panels(doc: dict) -> list[dict]:
    """The panels under the live row, up to the next row."""
    out, inside = [], False
    for p in doc["panels"]:
        if p["type"] == "row":
            inside = p["title"] == live.TITLE
        elif inside:
            out.append(p)
    return out


def panel(doc: dict, title: str) -> dict:
    (p,) = [p for p in live_panels(doc) if p["title"] == title]
    return p


def steps(p: dict) -> list:
    return [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_the_live_row_follows_the_30s_window_row():
    rows = [p["title"] for p in pool_doc()["panels"] if p["type"] == "row"]
    assert rows[rows.index("What is slow, since when") + 1] == "Live signals (1 s)"
    assert [p["title"] for p in live_panels(pool_doc())] == [
        "Live inter-token latency per node", "Live ITL vs pool median", "Live TTFT per node",
        "Probe TTFT median per node", "Running / waiting requests per node", "Decode batch per node",
        "Live tokens per second per node", "KV-cache usage per node"]


def test_live_queries_read_only_series_the_fast_path_exports():
    assert "grayguard_live_decode_batch" in FAST_PAGE and "grayguard_live_itl_seconds" in FAST_PAGE
    read = set()
    for p in live_panels(pool_doc()):
        for t in p["targets"]:
            names = metric_names(substitute(t["expr"], VARIABLES)) - {NODE_INFO}
            allowed = (LIVE_FAMILIES & FAST_PAGE) | ENGINE
            assert names and names <= allowed, f"{p['title']} {t['refId']}: {names - allowed}"
            read |= names
    # every live signal on the fast page has a panel; none that is on the full page only (not stored by default)
    assert read == (LIVE_FAMILIES & FAST_PAGE) | ENGINE, "a live series without a panel"
    assert not read & (LIVE_FAMILIES - FAST_PAGE)


def test_live_panels_are_labelled():
    for p in live_panels(pool_doc()):
        d = p["fieldConfig"]["defaults"]
        assert p["type"] == "timeseries" and d.get("unit"), p["title"]
        read = {n for t in p["targets"] for n in metric_names(t["expr"])} - {NODE_INFO}
        # the description names every series the panel reads (and then says why it matters)
        assert all(n in p["description"] for n in read), p["title"]
        assert len(p["description"]) > 200, p["title"]
        for t in p["targets"]:
            median = t["legendFormat"] == "{{pool}} median"
            # every node named as the controller and the alerts name it (grayguard_node_info), kept to $node
            assert median or ("{{node}}" in t["legendFormat"] and 'node=~"$node"' in t["expr"]), p["title"]
            # one series per node: the fast and the full scrape carry the same value under two jobs (max); vLLM's
            # series, scraped once, summed over its model_name/engine labels
            assert "max by (pool, instance)" in t["expr"] or "sum by (pool, instance)" in t["expr"], p["title"]
            assert 'instance=~"$instance"' in t["expr"] or median, p["title"]
    assert panel(pool_doc(), "Live ITL vs pool median")["fieldConfig"]["defaults"]["unit"] == "suffix:x"
    assert panel(pool_doc(), "Live inter-token latency per node")["fieldConfig"]["defaults"]["unit"] == "s"


def test_live_thresholds_are_the_controller_defaults():
    t = ThresholdsConfig()
    p = panel(pool_doc(), "Live ITL vs pool median")
    assert steps(p) == [None, t.live_drift, t.live_cut_ratio]
    assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    assert f"live_cut_ratio ({t.live_cut_ratio:g}x)" in p["description"]
    assert f"live_drift ({t.live_drift:g}x)" in p["description"]
    assert f"quarantine_score ({t.quarantine_score:g}) noise widths" in p["description"]
    assert f"{t.live_batch_slope!r} * clamp_min(" in p["targets"][0]["expr"]


def test_live_thresholds_follow_the_config():
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}],
                        "thresholds": {"live_cut_ratio": 1.3, "live_drift": 1.05, "live_batch_slope": 0,
                                       "live_probe_confirm": 1.4}})
    doc = pool_doc(DashboardConfig.from_config(cfg))
    p = panel(doc, "Live ITL vs pool median")
    assert steps(p) == [None, 1.05, 1.3]
    assert "grayguard_live_decode_batch" not in p["targets"][0]["expr"]  # slope 0: the controller compares raw ITLs
    assert "(1.4x)" in panel(doc, "Probe TTFT median per node")["description"]


# ---- what the queries compute, in promtool -------------------------------------------------------------

SLOPE = 1 / 64  # exact in binary, so promtool's exact comparison holds (the default 0.015 is not)
# node -> series -> value; every node is scraped twice (fast and full job). d is idle (no token: no ITL, TTFT,
# batch); e is another pool's, far slower, and must change nothing here.
FLEET = {
    ("chat", "a:8000"): {"itl": 0.02, "decode_batch": 1, "ttft": 0.1, "probe": 0.2, "running": 8, "waiting": 0,
                         "generated": 400, "prompt": 1000, "kv": 0.1},
    # b runs a batch of 33: its raw ITL is 1.5x a's, and at equal batch (1 + 32/64 = 1.5) the same as a's
    ("chat", "b:8000"): {"itl": 0.03, "decode_batch": 33, "ttft": 0.1, "probe": 0.2, "running": 33, "waiting": 0,
                         "generated": 660, "prompt": 1000, "kv": 0.3},
    ("chat", "c:8000"): {"itl": 0.06, "decode_batch": 1, "ttft": 0.4, "probe": 0.3, "running": 9, "waiting": 3,
                         "generated": 150, "prompt": 1000, "kv": 0.9},
    ("chat", "d:8000"): {"probe": 0.25, "running": 0, "waiting": 0, "generated": 0, "prompt": 0, "kv": 0.0},
    ("other", "e:8000"): {"itl": 1.0, "decode_batch": 1, "ttft": 9.0, "probe": 9.0, "running": 1, "waiting": 9,
                          "generated": 1, "prompt": 1, "kv": 1.0},
}
SERIES = {"itl": live.ITL, "decode_batch": live.BATCH, "ttft": live.TTFT, "probe": live.PROBE_MEDIAN,
          "prompt": live.PROMPT, "kv": live.KV}
# vLLM's own series, scraped once by its job: two engines (data-parallel ranks) a node, the gauges split between them
VLLM_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
STEPS, EVAL = 10, "5s"  # one sample a second
# vLLM's generated tokens, a counter: in a group of its own, scraped every 15 s (promtool's 1 s series do not fill a
# 1m rate window), rising by 15 x the per-second value each scrape; the rate ($__rate_interval: 1m) at 2m
GENERATED, GENERATED_PANEL = "vllm:generation_tokens_total", ("Live tokens per second per node", "A")


def quantile(q: float, values: list[float]) -> float:
    """Prometheus' quantile aggregation (weighted average of the two nearest ranks)."""
    v = sorted(values)
    rank = q * (len(v) - 1)
    lo = max(0, int(rank // 1))
    hi = min(len(v) - 1, lo + 1)
    w = rank - rank // 1
    return v[lo] * (1 - w) + v[hi] * w


def per_node(key: str, pool: str = "chat") -> dict[str, float]:
    return {i: s[key] for (p, i), s in FLEET.items() if p == pool and key in s}


def at_equal_batch() -> dict[str, float]:
    """The dashboard's comparison, the load model's batch term at its prior (controller/loadmodel.py):
    ITL / (1 + slope x (batch - 1))."""
    b = per_node("decode_batch")
    return {i: v / (1 + SLOPE * max(0.0, b[i] - 1)) for i, v in per_node("itl").items()}


# The controller's grayguard_node_info: a as Prometheus stores it scraped without honor_labels (its instance moved to
# exported_instance), b with them; c and d are tracked by no controller (named by their instance), e is another pool's.
NODES = {"a:8000": "node-a", "b:8000": "node-b", "e:8000": "node-e"}


def node_samples(values: dict[str, float], only: set[str] | None = None) -> list[dict]:
    """Samples per node, named by the node (or the instance of an untracked one); only: the nodes $node selects."""
    return [{"labels": f'{{instance="{i}", node="{NODES.get(i, i)}", pool="chat"}}', "value": v}
            for i, v in sorted(values.items()) if only is None or i not in NODES or NODES[i] in only]


def median_sample(values: dict[str, float]) -> list[dict]:
    return [{"labels": '{pool="chat"}', "value": quantile(0.5, list(values.values()))}]


# panel -> the FLEET keys its queries A, B... read per node; "median" adds the pool's median node of the first
PANELS = {
    "Live inter-token latency per node": ("itl", "median"),
    "Live TTFT per node": ("ttft", "median"),
    "Probe TTFT median per node": ("probe", "median"),
    "Running / waiting requests per node": ("running", "waiting"),
    "Decode batch per node": ("decode_batch",),
    "Live tokens per second per node": ("generated", "prompt"),
    "KV-cache usage per node": ("kv", "median"),
}


def expected() -> dict[tuple[str, str], list[dict]]:
    """(panel, refId) -> the samples the query returns on FLEET."""
    adj = at_equal_batch()
    med = quantile(0.5, list(adj.values()))
    out = {("Live ITL vs pool median", "A"): node_samples({i: v / med for i, v in adj.items()})}
    for title, keys in PANELS.items():
        for ref, key in zip("ABC", keys, strict=False):
            out[(title, ref)] = median_sample(per_node(keys[0])) if key == "median" else node_samples(per_node(key))
    return out


def input_series() -> list[dict]:
    jobs = ("grayguard-exporter-fast", "grayguard-exporter")
    info = [{"series": 'grayguard_node_info{job="grayguard-controller", instance="ctl:9300", pool="chat", '
                       'node="node-a", backend="chat", exported_instance="a:8000"}', "values": f"1+0x{STEPS}"},
            {"series": 'grayguard_node_info{pool="chat", node="node-b", backend="chat", instance="b:8000"}',
             "values": f"1+0x{STEPS}"},
            {"series": 'grayguard_node_info{pool="other", node="node-e", backend="other", instance="e:8000"}',
             "values": f"1+0x{STEPS}"}]
    out = info + [{"series": f'{SERIES[k]}{{job="{job}", pool="{p}", instance="{i}"}}', "values": f"{v}+0x{STEPS}"}
                  for (p, i), s in FLEET.items() for k, v in s.items() if k in SERIES for job in jobs]
    for (p, i), s in FLEET.items():
        vllm = f'job="vllm", pool="{p}", instance="{i}", model_name="m"'
        for k, name in VLLM_GAUGES.items():
            half = s[k] // 2
            out += [{"series": f'{name}{{{vllm}, engine="0"}}', "values": f"{half}+0x{STEPS}"},
                    {"series": f'{name}{{{vllm}, engine="1"}}', "values": f"{s[k] - half}+0x{STEPS}"}]
    return out


def generated_series() -> list[dict]:
    info = [s for s in input_series() if s["series"].startswith("grayguard_node_info")]
    return [{**s, "values": "1+0x10"} for s in info] + [
        {"series": f'{GENERATED}{{job="vllm", pool="{p}", instance="{i}", model_name="m", engine="0"}}',
         "values": f"1000+{15 * s['generated']}x10"} for (p, i), s in FLEET.items()]


def run_promtool(tmp_path, argv: list[str], name: str, doc: dict) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run([shutil.which("promtool"), *argv, name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_live_quantile_model():
    assert quantile(0.5, [3, 1, 2]) == 2 and quantile(0.5, [1, 2, 3, 4]) == 2.5
    assert at_equal_batch()["b:8000"] == pytest.approx(at_equal_batch()["a:8000"])  # the fixture's point


def test_live_queries_compute_what_the_panels_say(tmp_path):
    """Every live query on a fixed fleet, evaluated by promtool: it parses, dedupes the two scrape jobs, keeps to
    the pool, leaves idle nodes out of the ITL (absent, not 0), and compares ITLs at equal batch."""
    require("promtool")
    doc = pool_doc(DashboardConfig(live_batch_slope=SLOPE))
    exp = expected()
    targets = {(p["title"], t["refId"]): t["expr"] for p in live_panels(doc) for t in p["targets"]}
    assert set(targets) == set(exp), "a live query without an expectation here (or one gone)"
    tests = [{"expr": substitute(e, VARIABLES), "eval_time": EVAL, "exp_samples": exp[k]}
             for k, e in sorted(targets.items()) if k != GENERATED_PANEL]
    rate = [{"expr": substitute(targets[GENERATED_PANEL], VARIABLES), "eval_time": "2m",
             "exp_samples": exp[GENERATED_PANEL]}]
    # selecting one node ($instance) keeps the pool's median as the denominator
    ratio = targets[("Live ITL vs pool median", "A")]
    one = [s for s in exp[("Live ITL vs pool median", "A")] if "c:8000" in s["labels"]]
    tests.append({"expr": substitute(ratio, {**VARIABLES, "instance": "c:8000"}), "eval_time": EVAL,
                  "exp_samples": one})
    assert one[0]["value"] == pytest.approx(3.0)
    # selecting nodes by name ($node, several at once as Grafana joins them): a and b through grayguard_node_info,
    # whichever way the controller was scraped; c and d, which no controller tracks, are kept
    picked = [s for s in exp[("Live ITL vs pool median", "A")] if "b:8000" not in s["labels"]]
    tests.append({"expr": substitute(ratio, {**VARIABLES, "node": "node-a|node-x"}), "eval_time": EVAL,
                  "exp_samples": picked})
    assert len(picked) == 2 and '"node-a"' in picked[0]["labels"]
    res = run_promtool(tmp_path, ["test", "rules"], "live.test.yml", {"tests": [
        {"interval": "1s", "input_series": input_series(), "promql_expr_test": tests},
        {"interval": "15s", "input_series": generated_series(), "promql_expr_test": rate}]})
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses every query, annotation and variable selector of both dashboards (the default render),
    as recording rules: no Prometheus to start (test_queries.py also asks a real one, as an e2e test)."""
    require("promtool")
    rules = [{"record": f"dashboard:query_{n}:test", "expr": substitute(e, {**VARIABLES, "gpu": ".*"})}
             for n, (_, e) in enumerate(w for text in render_all().values() for w in expressions(json.loads(text)))]
    assert len(rules) > 60
    res = run_promtool(tmp_path, ["check", "rules"], "dashboards.rules.yml",
                       {"groups": [{"name": "dashboards", "rules": rules}]})
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
