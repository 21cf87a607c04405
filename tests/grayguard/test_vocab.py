"""grayguard.vocab is the one copy of the vocabulary: its members are their strings, and the packages use it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from grayguard.vocab import (
    EJECTED,
    IN_ROTATION,
    PROBE_ANSWERED,
    PROBE_FAILURES,
    PROBE_FAULTS,
    PROBE_RESULTS,
    STATES,
    DrainCause,
    ProbeResult,
    Signal,
    State,
)

REPO = Path(__file__).resolve().parents[2]
STATE_NAMES = frozenset(s.value for s in State)
LITERALS = (ast.Tuple, ast.List, ast.Set, ast.Dict)
# Copies of the state names in files outside this change; fix the file, then drop its line here.
PENDING: set[tuple[str, frozenset[str]]] = set()  # reason_code(): `in EJECTED`


@pytest.mark.parametrize("kind", [State, ProbeResult, Signal, DrainCause])
def test_members_are_their_strings(kind):
    for m in kind:
        assert m == m.value and m.value == m and isinstance(m, str)
        assert str(m) == f"{m}" == format(m) == m.value
        assert hash(m) == hash(m.value) and {m.value: 1}[m] == 1
        assert json.dumps({m: [m]}) == json.dumps({m.value: [m.value]})
        assert kind(m.value) is m


def test_the_words():
    assert STATES == ("healthy", "degraded", "quarantined", "canary", "slow_start")
    assert PROBE_RESULTS == ("ok", "slow", "timeout", "connect_error", "http_error", "cuda_error", "bad_response",
                             "starting")
    assert set(Signal) == {"latency", "probe", "errors", "kv_cache", "live"}
    assert set(DrainCause) == {"latency", "probe", "errors", "gateway", "seeded", "kv_cache"}
    # seeded: found drained by a controller with no state; gateway: HAProxy's error-limit fired
    assert set(DrainCause) - {"seeded", "gateway"} <= set(Signal)


def test_ejected_and_in_rotation_partition_the_states():
    assert set(STATES) == EJECTED | IN_ROTATION and not EJECTED & IN_ROTATION
    assert {"quarantined", "canary"} == EJECTED


def test_probe_result_sets():
    assert PROBE_ANSWERED | PROBE_FAULTS | {ProbeResult.STARTING} == set(PROBE_RESULTS)
    assert not PROBE_ANSWERED & PROBE_FAULTS and ProbeResult.STARTING not in PROBE_FAULTS
    assert {"cuda_error"} == PROBE_FAULTS - PROBE_FAILURES


def test_exporter_uses_the_probe_results():
    from grayguard.exporters import probe

    assert probe.RESULTS == PROBE_RESULTS
    assert probe.ANSWERED == PROBE_ANSWERED
    assert {*PROBE_FAILURES, "cuda_error"} == probe.FAILURES


def test_controller_uses_the_vocabulary():
    from grayguard.controller import metrics, policy, replay, signals

    assert metrics.STATES == STATES
    assert (policy.HEALTHY, policy.DEGRADED, policy.QUARANTINED, policy.CANARY, policy.SLOW_START) == STATES
    assert policy.EJECTED is EJECTED and policy.IN_ROTATION is IN_ROTATION
    assert signals.PROBE_FAILURES == PROBE_FAILURES and signals.PROBE_CUDA == "cuda_error"
    assert set(PROBE_RESULTS) == replay.PROBE_CLASSES
    assert all(r in replay.DESCRIPTION for r in PROBE_RESULTS)  # `grayguard replay --help` lists them all


def test_dashboard_state_codes_cover_exactly_the_states():
    from grayguard.dashboards import pool

    names = [name for _, name, _ in pool.STATE_CODES]
    assert sorted(names) == sorted(STATES)
    assert len({code for code, _, _ in pool.STATE_CODES}) == len(STATES)
    assert all(f'state="{s}"' in pool.state_code("m") for s in STATES)


def test_bench_quarantine_states_are_the_drained_ones():
    from grayguard.bench import metrics

    assert metrics.QUARANTINE_STATES == EJECTED


def test_state_file_loads_known_states_and_refuses_unknown_ones():
    from grayguard.controller.statefile import StateError, dump_states, load_states

    doc = {"version": 1, "pools": {"p": {"a": {"state": "quarantined", "cause": "probe"}, "c": {}}}}
    st = load_states(json.dumps(doc))["p"]
    assert st["a"].state == "quarantined" and st["a"].cause == "probe"
    assert st["c"].state == "healthy"
    assert json.loads(dump_states({"p": st}))["pools"]["p"]["a"]["state"] == "quarantined"
    # an unknown state would stick for ever (no transition leaves it): the file is refused, nodes are seeded
    doc["pools"]["p"]["b"] = {"state": "no_such_state", "cause": ""}
    with pytest.raises(StateError, match="unknown state"):
        load_states(json.dumps(doc))


def _strings(node: ast.AST) -> set[str]:
    """The string constants of a literal, nested literals included (calls and names are not looked into)."""
    out: set[str] = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            out.add(child.value)
        elif isinstance(child, LITERALS):
            out |= _strings(child)
    return out


def state_name_copies(source: str) -> list[tuple[int, frozenset[str]]]:
    """(line, names) of every tuple/list/set/dict literal that holds two or more state names as strings."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, LITERALS):
            names = frozenset(_strings(node) & STATE_NAMES)
            if len(names) >= 2:
                hits.append((node.lineno, names))
    return hits


def test_the_copy_detector():
    assert state_name_copies('X = ("healthy", "degraded")\n') == [(1, {"healthy", "degraded"})]
    assert state_name_copies("X = frozenset({'quarantined',\n    'canary'})\n") == [(1, {"quarantined", "canary"})]
    nested = 'X = (("0", "healthy", "green"),\n     ("1", "canary", "red"))\n'
    assert [names for _, names in state_name_copies(nested)] == [{"healthy", "canary"}]
    assert state_name_copies('X = {"healthy": 0, "degraded": 1}\n')
    assert not state_name_copies('X = ("healthy", "ok")\nY = f("healthy", "canary")\nZ = "healthy, degraded"\n')


def test_no_package_keeps_its_own_copy_of_the_states():
    packages = sorted(p.parent for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    assert REPO / "controller" in packages and REPO / "dashboards" in packages
    found = set()
    for path in (f for pkg in packages for f in sorted(pkg.rglob("*.py"))):
        rel = path.relative_to(REPO).as_posix()
        if rel == "grayguard/vocab.py":
            continue
        found |= {(rel, line, names) for line, names in state_name_copies(path.read_text())}
    new = sorted((rel, line, sorted(names)) for rel, line, names in found if (rel, names) not in PENDING)
    assert not new, f"use grayguard.vocab (State, STATES, EJECTED, IN_ROTATION) instead of copies: {new}"
    fixed = PENDING - {(rel, names) for rel, _, names in found}
    assert not fixed, f"fixed, so drop it from PENDING: {fixed}"
