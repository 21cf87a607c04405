"""Issue 34: the series the exporter no longer exports (or no longer stores by default), and the recording rules no
longer record, are read by nothing grayguard ships: no rendered rule or alert (example, dcgm and engines configs), no
dashboard query, no default or example signal query, no query of the runbook. Pure: renders and reads files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from grayguard.config import SignalsConfig, load_config, parse_config
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import expressions
from grayguard.dashboards.render import render_all as render_dashboards
from grayguard.rules.render import render_all as render_rules
from grayguard.vocab import REMOVED_SERIES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "grayguard.example.yaml"
RULES = REPO / "rules"
RUNBOOK = REPO / "docs" / "runbook.md"

# series gone (CHANGELOG.md), each with what reads in its place
REMOVED = REMOVED_SERIES
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def removed_in(text: str) -> set[str]:
    """The removed series a query (or any PromQL text) names, as whole names (not a prefix of a longer one)."""
    return set(_NAME.findall(text)) & set(REMOVED)


def configs():
    return {"example": load_config(EXAMPLE),
            "dcgm": parse_config({"pools": [{"name": "chat", "backend": "b"}], "rules": {"gpu_source": "dcgm"}}),
            "engines": load_config(RULES / "tests" / "grayguard-engines-test.yaml")}


def rule_texts():
    """(where, expr or record name) of every rule rendered for each config, and of every committed rule file."""
    files = {f"{name} {f}": text for name, cfg in configs().items()
             for f, text in render_rules(cfg, {"chat": 0.5}).items()}
    files |= {str(p.relative_to(REPO)): p.read_text() for p in sorted(RULES.glob("*.rules.yml"))
              + sorted(RULES.glob("tests/*.rules.yml"))}
    for where, text in files.items():
        for group in yaml.safe_load(text)["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule.get("alert")
                yield f"{where}: {name}", rule["expr"]
                if "record" in rule:
                    yield f"{where}: recorded", rule["record"]


def dashboard_texts():
    committed = {p.name: p.read_text() for p in sorted((REPO / "dashboards").glob("*.json"))}
    cfgs = [None, *(DashboardConfig.from_config(c) for c in configs().values())]
    for i, cfg in enumerate(cfgs):
        for name, text in (committed if i == 0 else {}).items() | render_dashboards(cfg).items():
            for where, expr in expressions(json.loads(text)):
                yield f"{name} ({'committed' if i == 0 else i}): {where}", expr


def signal_texts():
    for name, cfg in {"defaults": None, **configs()}.items():
        signals = SignalsConfig() if cfg is None else cfg.signals
        for field, query in vars(signals).items():
            if isinstance(query, str):
                yield f"{name} signals.{field}", query


def runbook_blocks(text: str) -> list[str]:
    return re.findall(r"```promql\n(.*?)```", text, re.S)


def runbook_texts():
    for i, block in enumerate(runbook_blocks(RUNBOOK.read_text())):
        yield f"docs/runbook.md promql block {i + 1}", block


@pytest.mark.parametrize("texts", [rule_texts, dashboard_texts, signal_texts, runbook_texts],
                         ids=["rules", "dashboards", "signals", "runbook"])
def test_nothing_reads_a_removed_series(texts):
    found = [(where, n, REMOVED[n]) for where, text in texts() for n in sorted(removed_in(text))]
    assert found == [], "read in place of each: " + "; ".join(f"{w}: {n} -> {r}" for w, n, r in found)


def test_each_source_is_read():
    """Not vacuous: every source yields many queries, and the GPU evidence reads the flags in each."""
    for texts, least in ((rule_texts, 100), (dashboard_texts, 100), (signal_texts, 40), (runbook_texts, 20)):
        got = list(texts())
        assert len(got) >= least, texts.__name__
        assert any("grayguard_gpu_flags" in t for _, t in got), texts.__name__


def test_the_check_catches_a_removed_name_and_only_whole_names():
    assert removed_in("max by (pool, instance, gpu, uuid) (grayguard_gpu_lost) == 1") == {"grayguard_gpu_lost"}
    assert removed_in('(instance:vllm_num_requests_running:sum > 0)') == {"instance:vllm_num_requests_running:sum"}
    assert removed_in("grayguard_gpu_lost_total + grayguard_live_requests_running_x + x:grayguard_agent_down") == set()
    assert removed_in("floor(grayguard_gpu_flags / 1) % 2 == 1") == set()


def test_a_signal_query_naming_a_removed_series_is_a_config_error_naming_the_field_and_its_replacement(
        tmp_path, capsys):
    """A config kept from before issue 34 that reads a removed series would get that signal absent forever (no GPU
    evidence, or every weight held), silently: `config check` refuses it, names the field and what to read."""
    from grayguard.cli import main

    f = tmp_path / "old.yaml"
    f.write_text("pools: [{name: chat, backend: chat}]\nsignals:\n"
                 "  gpu_throttled_query: 'max by (pool, instance) (grayguard_gpu_slowed_under_load)'\n"
                 "  pcie_degraded_query: 'max by (pool, instance) (grayguard_gpu_pcie_degraded_under_load"
                 " or grayguard_gpu_pcie_degraded_under_load)'\n"
                 "  kv_cache_query: 'max by (pool, instance) (grayguard_live_kv_cache_usage_ratio)'\n")
    assert main(["config", "check", "--config.file", str(f), "--no-promql"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"grayguard: config error in {f}:"
    assert err[1:] == [
        "  signals.gpu_throttled_query: reads grayguard_gpu_slowed_under_load, which grayguard no longer exports or "
        "records, so this signal would be absent: read floor(grayguard_gpu_flags / 8) % 2 instead (CHANGELOG.md)",
        "  signals.pcie_degraded_query: reads grayguard_gpu_pcie_degraded_under_load, which grayguard no longer "
        "exports or records, so this signal would be absent: read floor(grayguard_gpu_flags / 32) % 2 instead "
        "(CHANGELOG.md)"]


def test_the_removed_series_table_names_the_flag_bits_of_grayguard_vocab():
    """The replacement a config error offers for a flag is that flag's bit in GPU_FLAGS, not a copy gone stale."""
    from grayguard.vocab import GPU_FLAGS

    for flag, bit in GPU_FLAGS:
        if f"grayguard_gpu_{flag}" in REMOVED_SERIES:
            assert REMOVED_SERIES[f"grayguard_gpu_{flag}"] == f"floor(grayguard_gpu_flags / {bit}) % 2"
