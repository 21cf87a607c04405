"""The existing policies' runs are bit-identical to those before the peers' balancers and hooks (issue 32).

tests/bench/golden_existing_policies.json holds a digest of every per-request outcome (server, status, TTFT, e2e,
retries), the weight timeline, HAProxy's state changes and the canary count of four small fault scenarios under
each policy that predates bench.peers (grayguard excepted: its outcome is checked, not its digest), computed on
commit 05a5e8f (before they existed). A change of the engine,
the balancers or the simulator that is meant to move these results regenerates it, and says so in its commit:
`.venv/bin/python -m tests.bench.test_existing_policies_unchanged`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from grayguard.bench.engine import RunResult, run
from grayguard.bench.spec import FaultSpec, LoadSpec, NodeSpec, Scenario

GOLDEN = Path(__file__).with_name("golden_existing_policies.json")
# grayguard is not among them: its decisions are meant to change as its detector does; what its runs here must keep is
# an outcome (test_grayguard_drains_the_faulty_node_and_only_it), and tests/controller/test_detector_tables.py says
# what each of its detectors protects
POLICIES = ("roundrobin", "leastconn", "seeds", "envoy", "envoy-one", "haproxy", "oracle")
FAULTS = ("thermal", "cuda_error", "refused", "hang")


def scenario(fault: str) -> Scenario:
    pool = tuple(NodeSpec(f"node{i}") for i in range(4))
    return Scenario(f"golden/{fault}", pool, LoadSpec(utilization=0.4), (FaultSpec("node1", fault, 20.0),),
                    duration_s=50.0, seed=11, control_start_s=10.0)


def digest(res: RunResult) -> str:
    """Every per-request outcome and every state change of one run, hashed (floats by their exact repr)."""
    return hashlib.sha256(repr((res.node, res.status, res.ttft, res.e2e, list(res.retried), res.timeline,
                                res.gateway, res.canaries)).encode()).hexdigest()


@pytest.mark.parametrize("fault", FAULTS)
def test_existing_policies_give_the_same_runs(fault):
    golden = json.loads(GOLDEN.read_text())
    scn = scenario(fault)
    got = {f"{scn.name} {p}": digest(run(scn, p)) for p in POLICIES}
    assert got == {k: golden[k] for k in got}


@pytest.mark.parametrize("fault", FAULTS)
def test_grayguard_drains_the_faulty_node_and_only_it(fault):
    """The same four runs under grayguard: node1 (faulty from 20 s) cut within 5 s and drained within 10 s (the
    issue's targets; GPU evidence, read once in 5 s, takes a few seconds to witness a thermal drain), no other node
    ever touched."""
    res = run(scenario(fault), "grayguard")
    changes = [(t, i, w, drained) for t, i, w, drained, _ in res.timeline if t > 0]
    cut_at = min((t for t, i, w, d in changes if i == 1 and (d or w < 100)), default=None)
    drained_at = min((t for t, i, _, d in changes if i == 1 and d), default=None)
    assert cut_at is not None and 20.0 < cut_at <= 25.0, changes
    assert drained_at is not None and 20.0 < drained_at <= 30.0, changes
    assert [c for c in changes if c[1] != 1] == []


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({f"golden/{f} {p}": digest(run(scenario(f), p)) for f in FAULTS for p in POLICIES},
                                 indent=1, sort_keys=True) + "\n")
