"""Issue 12, items 4 (one writer per host) and 10 (the state file is never trusted blindly).

A state file that is a JSON list, null, holds wrong types or an unknown state used to crash the controller
at startup, raise in every tick, or leave a node stuck in a state no transition leaves; a state path under
a regular file gave a traceback, and a failed save failed the tick. Now the loader checks every field and
falls back to no state (the controller then seeds every node from HAProxy), and a failed save is counted.
Two controllers on one state file used to alternate drain/ready every tick; now the second one exits 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import responses
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.live import LiveMemory
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeState
from grayguard.controller.scoring import Noise
from grayguard.controller.signals import SignalMemory
from grayguard.controller.statefile import StateError, StateFile, StateLock, StateLockError, dump_states, load_states
from grayguard.vocab import STATES, State
from tests.support.ctl_helpers import make_controller, prom_answers, servers

SICK = {f"127.0.0.1:{9100 + i}": (0.2 if i == 0 else 0.02) for i in range(4)}


def doc(node: dict) -> str:
    return json.dumps({"version": 1, "pools": {"chat": {"node0": node}}})


# ---- the loader ---------------------------------------------------------------------------------------------
BAD = [
    ("[]", "got a list"),
    ("null", "got null"),
    ('"text"', "got a string"),
    ('{"version": 1, "pools": null}', "pools: expected an object"),
    ('{"version": 1, "pools": {"chat": []}}', "pools.chat: expected an object"),
    ('{"version": 1, "pools": {"chat": {"node0": 3}}}', "pools.chat.node0: expected an object"),
    ('{"version": "1", "pools": {}}', "version"),
    (doc({"state": "zombie"}), "pools.chat.node0.state: unknown state 'zombie'"),
    (doc({"state": 1}), "pools.chat.node0.state: expected a string"),
    (doc({"since": "yesterday"}), "pools.chat.node0.since: expected a finite number"),
    (doc({"since": True}), "pools.chat.node0.since: expected a finite number"),
    ('{"version": 1, "pools": {"chat": {"node0": {"ema": NaN}}}}', "pools.chat.node0.ema: expected a finite number"),
    ('{"version": 1, "pools": {"chat": {"node0": {"score": Infinity}}}}', "pools.chat.node0.score"),
    (doc({"canary_ok": 1.5}), "pools.chat.node0.canary_ok: expected a whole number"),
    (doc({"canary_ok": -1}), "pools.chat.node0.canary_ok: expected a whole number >= 0"),
    (doc({"weight": 1000}), "pools.chat.node0.weight: must be in 0..256"),
    (doc({"window": {"cut": "yes"}}), "pools.chat.node0.window.cut: expected true or false"),
    (doc({"window": {"z": "high"}}), "pools.chat.node0.window.z: expected a finite number"),
    (doc({"reason": ["x"]}), "pools.chat.node0.reason: expected a string"),
    (doc({"signals": None}), "pools.chat.node0.signals: expected an object"),
    (doc({"signals": {"probe_bad": "many"}}), "pools.chat.node0.signals.probe_bad: expected a whole number"),
    (doc({"signals": {"kv_saturated": 1}}), "pools.chat.node0.signals.kv_saturated: expected true or false"),
    (doc({"factors": "latency"}), "pools.chat.node0.factors: expected a list"),
    (doc({"factors": [["latency", 0.5]]}), "pools.chat.node0.factors[0]"),
    (doc({"factors": [["latency", 2.0, "x"]]}), "pools.chat.node0.factors[0]: a weight factor must be in [0, 1]"),
    (doc({"gone_since": {}}), "pools.chat.node0.gone_since: expected a finite number"),
    # a learned noise no sample can make: 1e300 blinded the detector for eleven hours, a negative time never learned
    (doc({"window": {"noise": {"dev": 1e300, "seconds": 60}}}), "pools.chat.node0.window.noise.dev: a learned noise"),
    (doc({"live_itl": {"noise": {"dev": -0.1}}}), "pools.chat.node0.live_itl.noise.dev: a learned noise is in [0, 3]"),
    (doc({"live_itl": {"noise": {"seconds": -1e300}}}), "pools.chat.node0.live_itl.noise.seconds: a noise is learned"),
    # a learned share of probes no probe can make: 5.0 made every run of the node's peers need more probes than a pool
    # sends, so no node of the pool was cut or drained for its probes again
    (doc({"signals": {"probe_waited_share": 5.0}}), "pools.chat.node0.signals.probe_waited_share: a share of probes"),
    (doc({"signals": {"probe_failed_share": -0.5}}), "pools.chat.node0.signals.probe_failed_share: a share of probes"),
    ("{" * 100000, "not JSON"),
    ("\ufeff{", "not JSON"),
]


@pytest.mark.parametrize("text, problem", BAD, ids=[p[:50] for _, p in BAD])
def test_invalid_state_file_starts_empty_and_says_why(tmp_path, caplog, text, problem):
    f = tmp_path / "state.json"
    f.write_text(text)
    with caplog.at_level(logging.WARNING, "grayguard.state"):
        assert StateFile(f).load() == {}
    assert problem in caplog.text and "seeded from HAProxy" in caplog.text
    assert not f.exists() and (tmp_path / "state.json.corrupt").read_text() == text  # set aside, not lost


def test_binary_garbage_starts_empty(tmp_path, caplog):
    f = tmp_path / "state.json"
    f.write_bytes(b"\xff\xfe\x00garbage")
    assert StateFile(f).load() == {}
    assert "not valid" in caplog.text


def test_good_state_file_round_trips_with_vocabulary_members(tmp_path):
    s = {"chat": {"node0": NodeState(state=State.QUARANTINED, since=5.0, ema=0.1, weight=0, cause="probe",
                                     factors=(("probe", 0.3, "probe slow"),), signals=SignalMemory(probe_bad=2))}}
    sf = StateFile(tmp_path / "state.json")
    assert sf.save(s) and not sf.save(s)  # written once, then unchanged
    back = StateFile(tmp_path / "state.json").load()
    assert back == s and back["chat"]["node0"].state is State.QUARANTINED


def test_older_and_newer_files_still_load():
    text = doc({"state": "degraded", "since": 1, "future_field": [1, 2], "signals": {"future": 1}})
    st_ = load_states(text)["chat"]["node0"]
    assert st_.state == State.DEGRADED and st_.since == 1.0 and st_.signals == SignalMemory()


# ---- fuzz: no exception escapes the loader but StateError; StateFile.load never raises -----------------------
FIELD_VALUES = st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True, allow_infinity=True) | \
    st.sampled_from(list(STATES) + ["zombie", "", "probe", "seeded"]) | st.lists(st.integers(), max_size=2) | \
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2) | \
    st.lists(st.lists(st.sampled_from(["latency", 0.5, 2, None, "x"]), max_size=4), max_size=2)
NODE_FIELDS = [f.name for f in dataclasses.fields(NodeState)]
MEM_FIELDS = [f.name for f in dataclasses.fields(SignalMemory)]
NODE = st.dictionaries(st.sampled_from(NODE_FIELDS), FIELD_VALUES, max_size=6) | \
    st.builds(lambda d, m: {**d, "signals": m}, st.dictionaries(st.sampled_from(NODE_FIELDS), FIELD_VALUES, max_size=3),
              st.dictionaries(st.sampled_from(MEM_FIELDS), FIELD_VALUES, max_size=4) | FIELD_VALUES)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=10)
DOCS = st.builds(lambda v, pools: {"version": v, "pools": pools}, st.sampled_from([1, 1, 1, 2, "1", None, True]),
                 st.dictionaries(st.text(max_size=4), st.dictionaries(st.text(max_size=4), NODE | JSONISH,
                                                                      max_size=3) | JSONISH, max_size=2)) | JSONISH


@settings(max_examples=400, deadline=None)
@given(DOCS)
def test_fuzz_loader_only_raises_state_error(d):
    try:
        text = json.dumps(d)  # NaN and Infinity included: Python's json writes and reads them
    except ValueError:
        return
    try:
        states = load_states(text)
    except StateError:
        return
    for nodes in states.values():  # what loads is usable: a known state, typed numbers
        for s in nodes.values():
            assert s.state in STATES
            assert all(isinstance(getattr(s, k), int) and not isinstance(getattr(s, k), bool)
                       for k in ("canary_ok",))
            assert isinstance(s.signals, SignalMemory)
            dump_states({"p": {"n": s}})  # and it can be saved again


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")) |
       DOCS.map(lambda d: json.dumps(d, default=str)))
def test_fuzz_state_file_load_never_raises(fuzz_dir, text):
    f = fuzz_dir / "state.json"
    f.write_text(text, encoding="utf-8", errors="surrogateescape")
    got = StateFile(f).load()
    assert isinstance(got, dict)


# ---- a state path under a regular file; saves that fail ------------------------------------------------------
def test_state_path_under_a_regular_file(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    m = ControllerMetrics.create()
    sf = StateFile(tmp_path / "file" / "state.json", save_errors=m.state_save_errors)
    assert sf.load() == {}
    assert "cannot be read" in caplog.text
    caplog.clear()
    s = {"chat": {"node0": NodeState(state=State.DEGRADED)}}
    assert sf.save(s) is False and sf.save(s) is False  # never raises
    assert m.registry.get_sample_value("grayguard_state_save_errors_total") == 2
    assert len([r for r in caplog.records if "not saved" in r.getMessage()]) == 1  # said once, counted twice


def tick(ctl):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        prom_answers(rsps, SICK, now=ctl.clock())
        return ctl.tick()


def test_failed_save_does_not_fail_the_tick(haproxy_factory, tmp_path):
    """Real HAProxy: the node is drained although the state file cannot be written, and the next tick goes on."""
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    (tmp_path / "file").write_text("x")
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    ctl.state_file = StateFile(tmp_path / "file" / "state.json", save_errors=ctl.metrics.state_save_errors)
    for _ in range(3):
        result = tick(ctl)  # raised NotADirectoryError (FileExistsError) before
        t[0] += 5
    assert result.held is None and not result.errors
    assert ctl.states["chat"]["node0"].state == State.QUARANTINED
    assert RuntimeClient(hap.endpoint).get_weight("vllm_chat", "node0")[0] == 0
    assert ctl.metrics.registry.get_sample_value("grayguard_state_save_errors_total") >= 3


def test_controller_with_an_unknown_state_starts_from_haproxy(haproxy_factory, tmp_path):
    """A node stored in a state no transition leaves must not stay there: the file is refused, the tick runs."""
    hap = haproxy_factory({"vllm_chat": servers(4)})
    f = tmp_path / "state.json"
    f.write_text(doc({"state": "zombie", "since": 1.0}))
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], state_file=StateFile(f))
    assert ctl.states == {}
    result = tick(ctl)
    assert result.held is None and not result.errors
    assert all(s.state in STATES for s in ctl.states["chat"].values())
    assert '"zombie"' not in f.read_text()


def test_a_state_file_from_a_clock_ahead_does_not_freeze_the_timers(haproxy_factory, tmp_path):
    """Real HAProxy: the file of a run whose wall clock was an hour ahead (NTP stepped it back before this start)
    holds node0 drained since an hour in this clock's future. Before on_this_clock it stayed drained that hour (its
    minimum quarantine counted from then) and the pool's noise learned nothing; now its timers run from this
    clock's now: node0 goes to its canaries within min_quarantine_s (20 s)."""
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ahead = t[0] + 3600
    noise = LiveMemory(noise=Noise(0.2, 60.0, ahead))
    f = tmp_path / "state.json"
    f.write_text(dump_states({"chat": {
        "node0": NodeState(state=State.QUARANTINED, since=ahead, cause="latency", weight=0, window=noise),
        **{f"node{i}": NodeState(since=ahead - 600, weight=100, window=noise) for i in range(1, 4)}}}))
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], state_file=StateFile(f))
    assert all(s.since <= t[0] and s.window.noise.at <= t[0] for s in ctl.states["chat"].values())
    fine = {k: 0.02 for k in SICK}
    while True:
        with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
            prom_answers(rsps, fine, now=t[0])
            result = ctl.tick()
        assert not result.errors
        if ctl.states["chat"]["node0"].state != State.QUARANTINED:
            break
        assert RuntimeClient(hap.endpoint).get_weight("vllm_chat", "node0")[0] == 0  # drained meanwhile
        t[0] += 1.0
        assert t[0] - 1000.0 <= 21.0, "node0's quarantine counted from a time this clock has not reached"
    assert ctl.states["chat"]["node0"].state == State.CANARY


# ---- one writer per host ---------------------------------------------------------------------------------------
def test_lock_is_exclusive_and_names_the_holder(tmp_path):
    sf = tmp_path / "state.json"
    with StateLock(sf) as first:
        with pytest.raises(StateLockError) as e:
            StateLock(sf).acquire()
        assert e.value.holder == os.getpid() and f"pid {os.getpid()}" in str(e.value)
        assert first.path == tmp_path / "state.json.lock"
    StateLock(sf).acquire().release()  # released: free again


def controller_config(tmp_path, state_file) -> str:
    f = tmp_path / "grayguard.yaml"
    f.write_text(yaml.safe_dump({
        "prometheus": {"url": "http://127.0.0.1:9", "timeout_s": 0.5},
        "haproxy": {"endpoints": [f"unix:{tmp_path}/no-haproxy.sock"], "timeout_s": 0.5},
        "pools": [{"name": "chat", "backend": "vllm_chat"}], "tick_interval_s": 1,
        "rules": {"rerender_interval_s": 0}, "state_file": str(state_file)}))
    return str(f)


def grayguard(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", *args], capture_output=True,
                          text=True, timeout=60, **kw)


def test_second_controller_exits_2_naming_the_first(tmp_path):
    sf = tmp_path / "state.json"
    cfg = controller_config(tmp_path, sf)
    first = subprocess.Popen([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", cfg, "--no-http"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / "state.json.lock"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        assert lock.read_text().strip() == str(first.pid)
        second = grayguard("--config.file", cfg)
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
        once = grayguard("--config.file", cfg, "--once")  # a one-shot tick writes too: refused as well
        assert once.returncode == 2 and f"pid {first.pid}" in once.stderr
        dry = grayguard("--config.file", cfg, "--once", "--dry-run")  # writes nothing: needs no lock
        assert dry.returncode == 1 and "pid" not in dry.stderr and "HOLD" in dry.stdout
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    after = grayguard("--config.file", cfg, "--once")  # the lock went with the first controller
    assert after.returncode == 1 and "holds" not in after.stderr


def test_state_path_under_a_regular_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = controller_config(tmp_path, tmp_path / "file" / "state.json")
    for args in (("--check",), ("--once",)):
        p = grayguard("--config.file", cfg, *args)
        assert p.returncode == 2 and "state_file" in p.stderr and "Traceback" not in p.stderr, p.stderr
