"""Detectors in shadow mode (issue 33): `detectors.<name>.enforce: false` runs the detector, memory and all, and
reports what it asks for (NodeDecision.shadow, the logs, grayguard_node_shadow_*) while no weight, state or drain
follows it.

What is checked:
- the config section: names, types, errors that name the field;
- a shadowed detector's findings are what the enforced detector would have applied, on the same tick from the same
  states (fuzzed with full inputs), and with every detector shadowed no signal ever cuts, degrades or drains a node;
- its memory runs on: enforced again, a detector that has seen a slow node cuts it on the next tick;
- the live loop against a real HAProxy: a shadowed CUDA-error probe drains nothing, and is logged, counted once,
  exported and shown in /status.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import responses
from hypothesis import given, settings
from hypothesis import strategies as st
from responses import matchers

from grayguard.config import ConfigError, DetectorsConfig, SignalsConfig, parse_config
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.policy import IN_ROTATION, NodeInput, Policy, decide_pool
from grayguard.vocab import Detector, DrainCause, Signal, State
from tests.controller.test_decide_fuzz import histories, run
from tests.support.ctl_helpers import PROM, make_controller, prom_answers, servers

ALL = frozenset(Detector)
SOFT_CAUSES = {DrainCause.LATENCY, DrainCause.PROBE, DrainCause.ERRORS, DrainCause.KV_CACHE}
# the factor a detector's finding stands for, by the signal the enforced decision writes it under
SIGNAL_OF = {Detector.LATENCY: Signal.LATENCY, Detector.LIVE: Signal.LIVE, Detector.PROBE: Signal.PROBE,
             Detector.ERRORS: Signal.ERRORS}


def _cfg(detectors) -> object:
    return parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}], "detectors": detectors})


def test_the_config_names_each_detector_and_shadows_those_not_enforced():
    assert {f.name for f in dataclasses.fields(DetectorsConfig)} == {d.value for d in Detector}
    assert _cfg({}).detectors.shadow() == frozenset()
    assert _cfg({"live": {"enforce": False}, "probe": {"enforce": True}}).detectors.shadow() == {"live"}
    assert _cfg(None).detectors.shadow() == frozenset()


@pytest.mark.parametrize("detectors, path", [
    ({"lives": {"enforce": False}}, "detectors.lives"),
    ({"live": {"enforce": "no"}}, "detectors.live.enforce"),
    ({"live": {"enforced": False}}, "detectors.live.enforced"),
    ({"live": False}, "detectors.live"),
    (["live"], "detectors"),
])
def test_a_bad_detectors_section_names_the_field(detectors, path):
    with pytest.raises(ConfigError) as e:
        _cfg(detectors)
    assert e.value.path == path


def _slow_pool(itl3: float) -> dict[str, NodeInput]:
    """Four nodes with live data; n3's live ITL itl3 s against the others' 10 ms."""
    return {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result="ok", probe_ttft=0.02,
                               probe_ttft_median=0.02 * (4 if i == 3 and itl3 > 0.01 else 1),
                               live_itl=itl3 if i == 3 else 0.01, live_ttft=0.05, live_decode_batch=4.0)
            for i in range(4)}


def test_a_shadowed_live_detector_reports_the_cut_and_the_quarantine_and_applies_neither():
    enforced, shadowed = Policy(), Policy(shadow=frozenset({Detector.LIVE}))
    prev_e = prev_s = {}
    asked = []
    for k in range(12):
        inputs = _slow_pool(0.08)
        de, ds = decide_pool(prev_e, inputs, enforced, 1000.0 + k), decide_pool(prev_s, inputs, shadowed, 1000.0 + k)
        prev_e = {n: nd.state for n, nd in de.nodes.items()}
        prev_s = {n: nd.state for n, nd in ds.nodes.items()}
        n3 = ds.nodes["n3"]
        assert n3.state.state == State.HEALTHY and n3.weight == 100 and not n3.drain and not n3.state.factors
        asked.append({f.detector: (f.factor < 1.0, f.quarantine is not None) for f in n3.shadow})
        assert all(not nd.shadow for n, nd in ds.nodes.items() if n != "n3")
    assert de.nodes["n3"].state.state == State.QUARANTINED  # what enforcing it did
    assert asked[0] == {Detector.LIVE: (True, False)}  # the cut at once, as enforced
    assert {Detector.LIVE: (True, True)} in asked  # and the quarantine once sustained
    assert prev_s["n3"].live_itl.cut  # the detector ran: its memory holds the cut it asked for
    # enforced again (a restart with the detector on): the memory it kept cuts on the next tick
    again = decide_pool(prev_s, _slow_pool(0.08), enforced, 1012.0)
    assert again.nodes["n3"].state.state in (State.DEGRADED, State.QUARANTINED)
    assert again.nodes["n3"].weight is not None and again.nodes["n3"].weight < 100


def test_a_shadowed_probe_cuda_error_drains_nothing():
    inputs = {**_slow_pool(0.01), "n1": dataclasses.replace(_slow_pool(0.01)["n1"], probe_result="cuda_error")}
    d = decide_pool({}, inputs, Policy(shadow=frozenset({Detector.PROBE})), 1000.0)
    n1 = d.nodes["n1"]
    assert n1.state.state == State.HEALTHY and not n1.drain
    assert [(f.detector, f.quarantine is not None) for f in n1.shadow] == [(Detector.PROBE, True)]
    assert "CUDA" in n1.shadow[0].quarantine
    assert decide_pool({}, inputs, Policy(), 1000.0).nodes["n1"].state.state == State.QUARANTINED


@settings(max_examples=300, deadline=None)
@given(histories(), st.sampled_from([0.1, 0.5]))
def test_shadowed_findings_are_what_enforcing_them_would_apply_on_the_same_tick(seq, fraction):
    from grayguard.config import RecoveryConfig, ThresholdsConfig
    t, r = ThresholdsConfig(max_ejected_fraction=fraction), RecoveryConfig()
    enforced, shadowed = Policy(t, r), Policy(t, r, shadow=ALL)
    prev, _ = run(seq[:-1], enforced)
    now = 1000.0 + len(seq) - 1
    de, ds = decide_pool(prev, seq[-1], enforced, now), decide_pool(prev, seq[-1], shadowed, now)
    for n, nd in ds.nodes.items():
        e = de.nodes[n]
        found = {f.detector: f for f in nd.shadow}
        in_rotation = n in prev and prev[n].state in IN_ROTATION and not seq[-1][n].hold
        if in_rotation:
            # every cut the enforced decision applies is a finding of the shadowed one, and the other way round
            assert {k: f for k, f, _ in e.state.factors} == {SIGNAL_OF[d]: f.factor for d, f in found.items()
                                                              if f.factor < 1.0}
        if e.state.state == State.QUARANTINED and e.previous != State.QUARANTINED and e.state.cause in SOFT_CAUSES:
            assert any(f.quarantine is not None for f in found.values()), (n, e.state.reason)
        # shadowed, no signal of ours cuts, degrades or drains a node this tick (a drained node keeps what it had)
        assert not (in_rotation and nd.state.factors)
        assert not (nd.state.state == State.QUARANTINED and nd.previous != State.QUARANTINED
                    and nd.state.cause in SOFT_CAUSES)
        if nd.previous == State.HEALTHY:
            assert nd.state.state != State.DEGRADED


@settings(max_examples=200, deadline=None)
@given(histories())
def test_with_every_detector_shadowed_no_signal_ever_acts(seq):
    _, decisions = run(seq, Policy(shadow=ALL))
    for d in decisions:
        for nd in d.nodes.values():
            assert nd.state.state != State.DEGRADED and not nd.state.factors
            assert not (nd.state.state == State.QUARANTINED and nd.state.cause in SOFT_CAUSES)


ADDRS = [f"127.0.0.1:{9100 + i}" for i in range(4)]


def test_the_loop_logs_counts_exports_and_shows_a_shadowed_finding_and_drains_nothing(haproxy_factory, caplog):
    sig = SignalsConfig()
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], extra={
        "signals": {"probe_result_query": sig.probe_result_query}, "detectors": {"probe": {"enforce": False}}})
    key = {"pool": "chat", "node": "node1", "detector": "probe"}
    caplog.set_level(logging.INFO, logger="grayguard")
    for _ in range(2):
        t[0] += 1.0
        with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
            prom_answers(rsps, {a: 0.02 for a in ADDRS}, now=t[0])
            rsps.get(f"{PROM}/api/v1/query", json={"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"instance": a, "pool": "chat", "result": "cuda_error" if a == ADDRS[1] else "ok"},
                 "value": [t[0], "1"]} for a in ADDRS]}},
                match=[matchers.query_param_matcher({"query": sig.probe_result_query})])
            assert ctl.tick().held is None
    assert ctl.states["chat"]["node1"].state == State.HEALTHY
    w = {s.name: (s.weight, s.drain) for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}
    assert w["node1"] == (100, False)
    reg = ctl.metrics.registry
    assert reg.get_sample_value("grayguard_node_shadow_quarantine", key) == 1
    assert reg.get_sample_value("grayguard_shadow_findings_total", {"pool": "chat", "detector": "probe",
                                                                    "asks": "quarantine"}) == 1  # once, two ticks
    said = [r.getMessage() for r in caplog.records if "shadow: detector probe" in r.getMessage()]
    assert len(said) == 1 and "node=node1" in said[0] and "would quarantine it" in said[0] and "CUDA" in said[0]
    node1 = next(x for x in ctl.status()["pools"][0]["nodes"] if x["node"] == "node1")
    assert [f["detector"] for f in node1["shadow"]] == ["probe"] and "CUDA" in node1["shadow"][0]["quarantine"]


def test_a_replay_of_a_real_run_with_the_live_detector_shadowed_says_what_it_would_have_done(tmp_path):
    """The committed real-vLLM run replayed with `detectors.live.enforce: false`: the throttled node's live findings
    are counted in the summary, and the replay no longer cuts it on the live ITL."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from grayguard.config import load_config
    from grayguard.controller.recorder import read
    from grayguard.controller.replay import recording_decisions, summarize
    repo = Path(__file__).resolve().parents[2]
    run_dir = repo / "tests" / "fixtures" / "vllm" / "runs" / "thermal-1.5rps-quiet"
    cfg = yaml.safe_load((run_dir / "grayguard.yaml").read_text())
    cfg["detectors"] = {"live": {"enforce": False}}
    (tmp_path / "shadow.yaml").write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "replay", "--config.file", str(tmp_path / "shadow.yaml"),
                        "--recording", str(run_dir / "recording.jsonl.gz"), "--out", str(tmp_path / "d.jsonl")],
                       cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "shadow: live:cut x" in p.stderr
    shadowed = summarize(json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines())
    enforced = summarize(recording_decisions(read(run_dir / "recording.jsonl.gz"),
                                             load_config(str(run_dir / "grayguard.yaml"), series=False)))
    node3 = "chat/node3"  # the throttled node
    assert shadowed[node3]["shadow"].get("live:cut", 0) >= 1 and not enforced[node3]["shadow"]
    for r in (json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()):
        assert not (r["state"] == State.DEGRADED and r["reason"].startswith("live ITL")), r  # no live cut applied
