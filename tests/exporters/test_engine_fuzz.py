"""Hostile /metrics pages for every engine profile: the parser never raises, and a garbled sample is no evidence
(None), never a wrong number or 0 (absent is not zero)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.engines import ENGINES
from grayguard.exporters.engineload import parse_engine_load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def page(engine: str) -> str:
    """The engine's fixture page (tests/fixtures/engines/), vLLM's a page of the names the exporter reads."""
    return vllm_page() if engine == "vllm" else (FIXTURES / f"{engine}.metrics.txt").read_text()


def vllm_page() -> str:
    return "\n".join(f'{name}{{model_name="m",engine="0"}} {v}' for name, v in (
        ("vllm:generation_tokens_total", 120), ("vllm:prompt_tokens_total", 900), ("vllm:num_requests_running", 3),
        ("vllm:num_requests_waiting", 1), ("vllm:kv_cache_usage_perc", 0.4),
        ("vllm:inter_token_latency_seconds_sum", 2.5), ("vllm:inter_token_latency_seconds_count", 100),
        ("vllm:time_to_first_token_seconds_sum", 3.0), ("vllm:time_to_first_token_seconds_count", 10),
        ("vllm:e2e_request_latency_seconds_sum", 9.0), ("vllm:e2e_request_latency_seconds_count", 10),
        ("vllm:request_prompt_tokens_sum", 900), ("vllm:request_generation_tokens_sum", 120))) + "\n"


def finite_or_none(load) -> bool:
    return all(v is None or (isinstance(v, float | int) and math.isfinite(v))
               for v in dataclasses.asdict(load).values())


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None)
@given(noise=st.text(max_size=300), cut=st.integers(min_value=0, max_value=20000))
def test_any_text_or_a_torn_page_parses_to_finite_values_or_none(engine, noise, cut):
    text = page(engine)
    for t in (noise, text[:cut], text[:cut] + noise + text[cut:]):
        assert finite_or_none(parse_engine_load(t, engine))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("garbage", ["NaN", "+Inf", "-Inf", "abc", ""])
def test_one_garbled_sample_makes_its_field_none_and_leaves_the_others(engine, garbage):
    text = page(engine)
    good = parse_engine_load(text, engine)
    fields = {k: v for k, v in dataclasses.asdict(good).items() if v is not None}
    assert fields, f"{engine}: the fixture page gives no field at all"
    lines = text.splitlines()
    # garble every sample line of one series, field by field: the field it feeds goes None, no other field moves
    names = sorted({ln.split("{")[0].split(" ")[0] for ln in lines if ln and not ln.startswith("#")})
    moved_any = False
    for name in names:
        bad = "\n".join(
            (ln.rsplit(" ", 1)[0] + " " + garbage) if ln.split("{")[0].split(" ")[0] == name else ln for ln in lines)
        got = dataclasses.asdict(parse_engine_load(bad, engine))
        for k, v in fields.items():
            if got[k] != v:
                assert got[k] is None, f"{engine}: {name} garbled to {garbage!r} turned {k} from {v} into {got[k]}"
                moved_any = True
    assert moved_any, f"{engine}: garbling no series changed any field: the test tests nothing"
