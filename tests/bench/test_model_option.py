"""grayguard bench --model: the shipped latency model or the one fitted to published vLLM measurements."""

from grayguard.bench.cli import CALIBRATED_CAPACITY_X, for_model, model_params
from grayguard.bench.scenarios import load_suite
from grayguard.sim.calibrate import CALIBRATED


def test_the_calibrated_model_runs_the_same_share_of_capacity():
    scns = {s.name: s for s in load_suite("default")[0]}
    s = scns["thermal/n8/homog/steady"]
    assert model_params("shipped") is None and model_params("calibrated") == CALIBRATED["h100"]
    assert for_model(s, "shipped") is s
    cal = for_model(s, "calibrated")
    assert cal.load.utilization == s.load.utilization * CALIBRATED_CAPACITY_X
    assert cal.faults == s.faults and cal.nodes == s.nodes
    fixed = next(x for x in scns.values() if x.load.rate is not None)  # an absolute rate stays as it is
    assert for_model(fixed, "calibrated") is fixed
