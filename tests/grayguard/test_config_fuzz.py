"""Whatever YAML a config holds, the parser answers with a Config or a ConfigError, never a crash."""

import dataclasses
import math
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grayguard.config import (
    Config,
    ConfigError,
    HaproxyConfig,
    PoolConfig,
    PrometheusConfig,
    RecoveryConfig,
    RulesConfig,
    SignalsConfig,
    ThresholdsConfig,
    load_config,
    parse_config,
)

HUGE = 10**400  # beyond a float
TOO_LONG = 10**5000  # beyond Python's 4300-digit int-to-text limit
BIG = st.sampled_from([400, 5000]).map(lambda digits: 10**digits)  # mapped: hypothesis cannot repr TOO_LONG
STRINGS = ["", "a", "b", "a b", "x;shutdown", "5s", "1m30s", "soon", "http://h:1", "https://h", "localhost:9090",
           "unix:/s", "/s", "h:1", "nohost", "vllm:", "vllm_", "page", "ticket", "GrayguardNodeDegraded",
           "GrayguardNo-Such", "instance", "0bad", 'a"b', "g1"]
KEYS = st.one_of(st.sampled_from(STRINGS), st.text(max_size=6), st.integers(-2, 2), st.none(), st.booleans())
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([0, 1, 3, 256, 257, -1]), BIG, BIG.map(lambda n: -n),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(STRINGS), st.text(max_size=8))
ANY = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                   max_leaves=8)


def typed(tp) -> st.SearchStrategy:
    """Values of the annotated type (mostly plausible, some out of range), mixed with any YAML value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:
        return st.none() | typed(next(a for a in args if a is not type(None)))
    if dataclasses.is_dataclass(tp):
        return section(tp)
    if origin is tuple:
        return st.lists(typed(args[0]), max_size=3) | ANY
    if origin is dict:
        return st.dictionaries(KEYS, typed(args[1]), max_size=3) | ANY
    base = {
        bool: st.booleans(),
        int: st.integers(-2, 300) | BIG,
        float: st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 0.5, 1, 2.0, 3.5]) | BIG,
        str: st.sampled_from(STRINGS) | st.text(max_size=8),
    }[tp]
    return base | base | ANY


def fields_of(cls, max_fields: int) -> st.SearchStrategy:
    """A mapping of up to max_fields of cls's fields, each with a plausible or junk value."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return st.lists(st.sampled_from(names), max_size=max_fields, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({n: typed(hints[n]) for n in chosen}))


def section(cls, max_fields: int = 3) -> st.SearchStrategy:
    """A section: mostly a few fields (so that the checks behind the first bad one run too), else junk."""
    mapping = fields_of(cls, max_fields)
    return mapping | mapping | mapping | st.builds(lambda m, k, v: {**m, k: v}, mapping, KEYS, ANY) | ANY


# Mostly well-formed configs (a section or two perturbed), so that the checks behind the first bad field run too.
NAMES = st.sampled_from(["a", "b", "c", "d", "e", "f", "g"])
FAIR_POOL = st.builds(lambda name, backend, rest: {**rest, "name": name, "backend": backend},
                      NAMES | NAMES | typed(str), NAMES | NAMES | typed(str),
                      st.just({}) | fields_of(PoolConfig, max_fields=2))
POOLS = st.lists(FAIR_POOL, min_size=1, max_size=3) | st.lists(FAIR_POOL, min_size=1, max_size=3) | \
    st.lists(FAIR_POOL | section(PoolConfig, max_fields=6), max_size=3) | ANY
SECTIONS = {"prometheus": PrometheusConfig, "haproxy": HaproxyConfig, "signals": SignalsConfig,
            "thresholds": ThresholdsConfig, "recovery": RecoveryConfig, "rules": RulesConfig}
CONFIGS = st.builds(
    lambda pools, top, sections: {"pools": pools, **top, **sections},
    POOLS,
    st.just({}) | fields_of(Config, max_fields=2),
    st.lists(st.sampled_from(sorted(SECTIONS)), max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: section(SECTIONS[name]) for name in chosen})),
) | ANY


@settings(max_examples=300, deadline=None)
@given(CONFIGS)
def test_only_config_errors_escape(data):
    try:
        cfg = parse_config(data)
    except ConfigError as e:
        assert isinstance(e.path, str) and e.problem
        return
    # What passes is usable: a pool per backend, no NaN where the policy compares.
    assert len({p.name for p in cfg.pools}) == len({p.backend for p in cfg.pools}) == len(cfg.pools)
    assert not any(math.isnan(v) for v in dataclasses.astuple(cfg.thresholds))


@pytest.fixture(scope="module")
def tmp_dir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40) | st.binary(max_size=20).map(lambda b: b.decode("latin-1")))
def test_any_file_is_a_config_or_a_config_error(tmp_dir, text):
    f = tmp_dir / "c.yaml"
    f.write_text(text)
    try:
        assert isinstance(load_config(f), Config)
    except ConfigError as e:
        assert isinstance(e.path, str)


# Crashes the fuzzing found (each was a TypeError, OverflowError, ValueError or RecursionError before).
@pytest.mark.parametrize("data, path, problem", [
    ({1: 2, "x": 3}, "x", "unknown field"),  # mixed key types could not be sorted
    ({1: 2, None: 3}, "1", "unknown field"),
    ({0: 1}, "0", "unknown field"),  # a falsy key lost its path
    ({"pools": [{"name": "a", "backend": "b"}], "tick_interval_s": HUGE}, "tick_interval_s",
     "number out of range"),
    ({"pools": [{"name": "a", "backend": "b"}], "listen_address": TOO_LONG}, "listen_address",
     "expected a string, got <int too large to show>"),
    ({"pools": [{"name": "a", "backend": "b"}], "prometheus": {"headers": {TOO_LONG: "x"}}}, "prometheus.headers",
     "keys must be strings, got <int too large to show>"),
    ({TOO_LONG: 1}, "<int too large to show>", "unknown field"),
])
def test_fuzz_regressions(data, path, problem):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.path == path and problem in str(e.value)


@pytest.mark.parametrize("content, problem", [
    (b"pools: " + b"1" * 5000, "not valid YAML: Exceeds the limit"),  # PyYAML's int() raised ValueError
    (b"x: " + b"[" * 100_000, "not valid YAML: nested too deeply"),  # RecursionError
    (b"a: 2024-02-30", "not valid YAML: day is out of range"),  # PyYAML's date() raised ValueError
    (b"\xff\xfe", "not UTF-8 text"),  # UnicodeDecodeError, and it has no strerror
])
def test_unreadable_files_are_config_errors(tmp_path, content, problem):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert e.value.path == "" and problem in str(e.value)
