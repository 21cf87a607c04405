"""Engine profiles in the recording rules, pure: the committed engines rule file is the render of its config, its
promtool test (rules/tests/engines.test.yml) feeds series named as on each engine's fixture page, and pools[].engine
is validated. promtool itself runs the test in tests/rules/test_promtool.py (every rules/tests/*.test.yml)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from grayguard.config import ConfigError, load_config, parse_config
from grayguard.rules.render import pool_engines, render_recording

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "rules" / "tests"
FIXTURES = REPO / "tests" / "fixtures" / "engines"
PREFIXES = {"sglang:": "sglang", "tgi_": "tgi", "llamacpp:": "llamacpp", "nv_": "triton"}
EXPORTER = {"grayguard_traffic_requests_total", "grayguard_traffic_request_seconds_total"}


def test_the_committed_engines_rules_are_the_render_of_their_config():
    cfg = load_config(TESTS / "grayguard-engines-test.yaml")
    assert pool_engines(cfg) == ["vllm", "sglang", "tgi", "llamacpp", "triton"]
    assert (TESTS / "grayguard-engines-recording.rules.yml").read_text() == render_recording(cfg)


def test_every_promtool_input_is_named_as_on_its_engines_fixture_page():
    doc = yaml.safe_load((TESTS / "engines.test.yml").read_text())
    seen = set()
    for group in doc["tests"]:
        for s in group["input_series"]:
            name = re.match(r"[^{]+", s["series"]).group(0)
            if name in EXPORTER:  # the exporter's own series beside an engine, not an engine's
                continue
            engine = next(e for p, e in PREFIXES.items() if name.startswith(p))
            page = (FIXTURES / f"{engine}.metrics.txt").read_text()
            older = name == "llamacpp:kv_cache_usage_ratio"  # builds before the unified KV cache (the README's list)
            assert older or re.search(rf"^{re.escape(name)}[{{ ]", page, re.M), (engine, name)
            seen.add(engine)
    assert seen == set(PREFIXES.values())


def test_vllm_alone_renders_no_other_engines_series():
    text = render_recording(parse_config({"pools": [{"name": "a", "backend": "a"}]}))
    assert not any(p in text for p in PREFIXES)


def test_an_engine_without_a_signal_gets_vllms_name_there_absent_not_zero():
    text = render_recording(parse_config({"pools": [{"name": "t", "backend": "t", "engine": "tgi"}]}))
    assert "rate(tgi_request_duration_sum[30s])" in text
    assert "vllm:kv_cache_usage_perc" in text  # TGI has no KV usage: the rule reads a series no TGI page has
    assert "vllm:e2e_request_latency_seconds_sum" not in text  # ... but TGI's own where it has one


@pytest.mark.parametrize("engine", ["ollama", "", "VLLM"])
def test_an_unknown_engine_is_a_config_error_naming_the_field(engine):
    with pytest.raises(ConfigError, match=r"pools\[0\]\.engine: must be one of vllm, sglang"):
        parse_config({"pools": [{"name": "a", "backend": "a", "engine": engine}]})


def test_only_an_engine_that_counts_no_tokens_gets_the_seconds_per_request_branch():
    for engine in ("vllm", "sglang", "tgi", "llamacpp"):
        text = render_recording(parse_config({"pools": [{"name": "a", "backend": "a", "engine": engine}]}))
        assert "nv_inference_request_duration_us" not in text and "seconds per" not in text, engine
    text = render_recording(parse_config({"pools": [{"name": "n", "backend": "n", "engine": "triton"}]}))
    assert 'rate(nv_inference_request_duration_us{model="ensemble"}[30s])) * 1e-06' in text
    # only on Triton's nodes: an idle vLLM node's traffic counters never give it seconds per request
    marker = 'sum by (pool, instance) (nv_inference_request_success{model="ensemble"})'
    assert f"and on (pool, instance)\n                {marker}" in text
