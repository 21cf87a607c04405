"""The real engine's /metrics pages (tests/fixtures/vllm, recorded by `python -m grayguard.localstack.vllm_fixtures`)
against
what the project reads from them and what the simulator claims to be.

- The exporter's parser reads each page: the series it uses are there under real vLLM's names, a hung engine's
  counters are frozen, a preempting one counts its preemptions.
- The simulator's page, after the same requests as the idle page's, has the same metric names, types and label
  names as the real one; every difference is written down, with its reason, in sim_differences.yaml (a difference
  nobody wrote down fails, and so does a written one that no longer exists).
- The shipped recording rules, run by promtool on two real pages as a node's scrapes, give every vllm signal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grayguard.exporters.engineload import parse_engine_load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
PAGES = ("idle", "loaded", "hung", "preempting")


def page(name: str) -> str:
    return (FIXTURES / f"{name}.prom").read_text()


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """vllm: family -> (type, label names of its samples, le/quantile aside)."""
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name.startswith("vllm:"):
            labels = frozenset(k for s in f.samples for k in s.labels if k not in ("le", "quantile"))
            out[f.name] = (f.type, labels)
    return out


def value(text: str, name: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


@pytest.mark.parametrize("name", PAGES)
def test_the_exporter_reads_every_series_it_uses_from_each_real_page(name):
    load = parse_engine_load(page(name))
    for field in ("generation_tokens", "running", "prompt_tokens", "waiting", "itl_sum", "itl_count", "ttft_sum",
                  "ttft_count", "kv_usage"):
        assert getattr(load, field) is not None, f"{name}: {field} absent"
    assert 0 <= load.kv_usage <= 1


def test_the_pages_tell_the_story_they_were_taken_for():
    idle, loaded, hung, pre = (parse_engine_load(page(n)) for n in PAGES)
    assert value(page("idle"), "vllm:request_success_total") == 10 and idle.running == 0
    assert loaded.running >= 2 and loaded.generation_tokens > idle.generation_tokens  # the 8 streams run at once
    # hung: the engine stopped with streams in flight; its gauges keep their last values (not 0)
    assert hung.running + hung.waiting >= 1, "a hung engine's num_requests_running stays at its last value"
    assert value(page("preempting"), "vllm:num_preemptions_total") > 0 and pre.kv_usage > 0.5


def test_the_simulators_page_has_real_vllms_names_types_and_labels_or_a_written_reason():
    from grayguard.sim.fleet import FleetThread
    from grayguard.sim.node import DEFAULT_MODEL

    with FleetThread(n=1, seed=1) as ft:
        url = ft.nodes[0].url
        for _ in range(10):  # the idle page's requests
            r = requests.post(url + "/v1/completions", timeout=30, json={
                "model": DEFAULT_MODEL, "prompt": list(range(1, 12)), "max_tokens": 10})
            assert r.status_code == 200, r.text
        sim = families(requests.get(url + "/metrics", timeout=10).text)
    real = families(page("idle"))
    known = yaml.safe_load((FIXTURES / "sim_differences.yaml").read_text())
    found = {"only_real": sorted(set(real) - set(sim)), "only_sim": sorted(set(sim) - set(real)),
             "type": sorted(n for n in set(real) & set(sim) if real[n][0] != sim[n][0]),
             "labels": sorted(n for n in set(real) & set(sim) if real[n][1] != sim[n][1])}
    for kind, names in found.items():
        written = known.get(kind) or {}
        unwritten = [n for n in names if n not in written]
        stale = [n for n in written if n not in names]
        detail = {n: (real.get(n), sim.get(n)) for n in unwritten}
        assert not unwritten, f"{kind}: differences nobody wrote down in sim_differences.yaml: {detail}"
        assert not stale, f"{kind}: sim_differences.yaml lists differences that are gone: {stale}"
        assert all(isinstance(why, str) and why.strip() for why in written.values()), f"{kind}: a reason is empty"


RECORDING = Path(__file__).resolve().parents[2] / "rules" / "grayguard-recording.rules.yml"
INSTANCE = "10.0.0.1:8000"


def promtool_series(before: str, after: str, steps: int, interval_s: int) -> list[dict]:
    """promtool input series: every vllm: sample of `after`, labelled as the scrape labels it (job, pool, instance);
    counters and histogram buckets rise in even steps from their value in `before`, gauges hold `after`'s value."""
    def samples(text: str) -> dict[tuple, tuple[str, float]]:
        out = {}
        for f in text_string_to_metric_families(text):
            for s in f.samples:
                if s.name.startswith("vllm:") and not s.name.endswith("_created"):
                    labels = {**s.labels, "job": "vllm", "pool": "chat", "instance": INSTANCE}
                    out[(s.name, tuple(sorted(labels.items())))] = (f.type, s.value)
        return out
    old, new = samples(before), samples(after)
    series = []
    for (name, labels), (kind, v) in sorted(new.items()):
        start = old.get((name, labels), (kind, v))[1] if kind in ("counter", "histogram") else v
        step = (v - start) / steps
        sel = "{" + ",".join(f'{k}="{val}"' for k, val in labels) + "}"
        series.append({"series": name + sel, "values": f"{start:g}+{step:g}x{steps}"})
    return series


def test_the_shipped_recording_rules_give_every_vllm_signal_on_real_vllms_pages(tmp_path):
    """Two real pages (idle, then hung: 8 requests finished between them) as a node's scrapes over 6 minutes: each
    vllm recording rule of the shipped file gives the node (or its pool) one series, so no rule names a series or a
    label real vLLM does not have."""
    import shutil
    import subprocess

    from tests.support.stack import require
    require("promtool")
    rules = yaml.safe_load(RECORDING.read_text())
    names = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    vllm_names = [n for n in names if n.split(":")[1].startswith("vllm_")]
    assert len(vllm_names) >= 12
    tests = [{"interval": "5s", "input_series": promtool_series(page("idle"), page("hung"), 72, 5),
              "promql_expr_test": [
                  {"expr": f'count({n}{{{"instance" if n.startswith("instance:") else "pool"}='
                           f'"{INSTANCE if n.startswith("instance:") else "chat"}"}})',
                   "eval_time": "6m", "exp_samples": [{"labels": "{}", "value": 1}]} for n in vllm_names]}]
    shutil.copy(RECORDING, tmp_path / RECORDING.name)
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": [RECORDING.name], "evaluation_interval": "5s",
                                                     "tests": tests}, sort_keys=False))
    res = subprocess.run([shutil.which("promtool"), "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
