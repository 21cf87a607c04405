"""grayguard variants as bench policies (`grayguard~knob=value`, `grayguard~shadow=live`): an ablation, or a knob
tried on some seeds and judged on others, runs beside the shipped grayguard on identical traffic."""

from __future__ import annotations

import pytest

from grayguard.bench.engine import run
from grayguard.bench.metrics import transitions
from grayguard.bench.policies import Grayguard, grayguard_variant, make_policy
from grayguard.bench.report import is_peer
from grayguard.bench.scenarios import load_suite

SCN = {s.name: s for s in load_suite("smoke")[0]}
THERMAL = next(s for n, s in SCN.items() if n.startswith("thermal/"))


def test_a_variant_is_grayguard_with_its_overrides():
    p = grayguard_variant("live_batch_slope=0~shadow=live+probe~probe_ok_to_clear=5", THERMAL)
    assert p.thresholds.live_batch_slope == 0 and p.thresholds.probe_ok_to_clear == 5
    assert p.shadow == {"live", "probe"} and p.window_s == THERMAL.window_s
    assert p.window_samples == round(THERMAL.window_s / THERMAL.rule_eval_s)  # the window's samples: one observation
    det, lb = make_policy("grayguard~quarantine_score=3@roundrobin", THERMAL.nodes, THERMAL)
    assert isinstance(det, Grayguard) and lb == "roundrobin" and det.policy.thresholds.quarantine_score == 3.0
    assert not is_peer("grayguard~quarantine_score=3") and is_peer("linkerd")


@pytest.mark.parametrize("name, says", [
    ("grayguard~nope=1", "no numeric thresholds field"),
    ("grayguard~probe_ok_to_clear=two", "not a number"),
    ("grayguard~shadow=livee", "unknown detector"),
    ("grayguard~quarantine_score", "expected name=value"),
    ("grayguard~min_spread=-1", "min_spread"),
    ("leastconn~quarantine_score=3", "only grayguard"),
])
def test_a_bad_variant_is_refused_with_what_is_wrong(name, says):
    with pytest.raises(ValueError, match=says):
        make_policy(name, THERMAL.nodes, THERMAL)


def test_every_detector_shadowed_cuts_nothing_where_grayguard_cuts():
    shipped = transitions(run(THERMAL, "grayguard"))
    shadowed = transitions(run(THERMAL, "grayguard~shadow=latency+live+probe+errors+kv_outlier"))
    # the shipped detector cuts or drains the slowed node (with GPU evidence, one tick's evidence drains it at once)
    assert any(kind in ("cut", "quarantine") for _, _, kind in shipped)
    # shadowed, only HAProxy's reflexes may still take a node out (they act in HAProxy): no cut of ours
    assert not any(kind == "cut" for _, _, kind in shadowed), shadowed
