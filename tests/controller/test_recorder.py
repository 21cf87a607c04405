"""The controller's flight recorder (controller/recorder.py) and `grayguard replay --recording`.

The claim that makes a recording worth keeping: decided again offline under the same config, it gives the live
controller's decisions tick for tick. Checked on a live stack (the simulated fleet, a throttled node, the controller
cutting and draining it), then on what another config does with the same evidence; plus the codec and bad files.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from grayguard.config import load_config
from grayguard.controller.decide import CanaryRound, Observation, PoolObservation
from grayguard.controller.haproxy import ServerState
from grayguard.controller.live import LiveMemory
from grayguard.controller.policy import NodeState
from grayguard.controller.recorder import Recorder, RecordingError, decode, encode, read
from grayguard.controller.replay import recording_decisions, summarize
from grayguard.promclient import Sample

REPO = Path(__file__).resolve().parents[2]


def _obs(now: float = 100.0) -> Observation:
    server = ServerState("chat", "node1", "127.0.0.1:8001", 100, 100, 0, 2, check_status=15, status="UP")
    prev = {"node1": NodeState(state="degraded", since=90.0, score=3.5, weight=50, reason="live ITL 2.00x",
                               live_itl=LiveMemory(cut=True, z=4.0))}
    canary = CanaryRound("node2", ("node1",), {"node2": None, "node1": 0.05}, at=99.0, emas={"node1": 0.01})
    return Observation(now, {"latency": [Sample({"instance": "127.0.0.1:8001"}, 0.02, now),
                                         Sample({"instance": "x"}, math.nan, now)]},
                       {"probe_ttft": [Sample({"instance": "127.0.0.1:8001"}, math.inf, now)]},
                       {"chat": PoolObservation({"node1": server}, prev, (canary,))}, max_age_s=math.inf)


def test_an_observation_survives_the_codec_through_json():
    o = _obs()
    back = decode(json.loads(json.dumps(encode(o))))
    assert back.now == o.now and back.max_age_s == math.inf
    assert back.pools["chat"].servers == o.pools["chat"].servers
    assert back.pools["chat"].prev == o.pools["chat"].prev
    assert back.pools["chat"].canaries == o.pools["chat"].canaries
    assert back.samples["latency"][0] == o.samples["latency"][0]
    assert math.isnan(back.samples["latency"][1].value)  # NaN and Inf are values a recording keeps
    assert back.optional["probe_ttft"][0].value == math.inf


def test_a_recording_is_read_back_tick_by_tick_and_gzip_by_its_name(tmp_path):
    for name in ("r.jsonl", "r.jsonl.gz"):
        rec = Recorder(tmp_path / name)
        rec.write(_obs(1.0))
        rec.write(_obs(2.0))
        rec.close()
        rec.write(_obs(3.0))  # after close: nothing, no error
        assert [o.now for o in read(tmp_path / name)] == [1.0, 2.0]
    with gzip.open(tmp_path / "r.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["recording"] == 1


@pytest.mark.parametrize("lines, where", [
    (['{"not": "a header"}'], ":1: not a grayguard recording"),
    (['{"recording": 1}', "{broken"], ":2: not JSON"),
    (['{"recording": 1}', '{"now": 1, "pools": {}, "samples": {"latency": [[1, 2]]}}'], ":2: samples.latency[0]"),
    (['{"recording": 1}', '{"pools": {}}'], ":2: KeyError"),
    (['{"recording": 1}', '{"now": 1, "samples": {}, "pools": {"chat": {"servers": {}, "prev": '
      '{"node1": {"state": "exploded"}}}}}'], ":2: pools.chat.prev"),
])
def test_a_bad_recording_is_an_error_naming_its_line(tmp_path, lines, where):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordingError, match=where.replace("[", r"\[").replace("]", r"\]")):
        list(read(path))


def test_replay_of_a_bad_recording_exits_2_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"recording": 1}\n{broken\n')
    cfg = tmp_path / "g.yaml"
    cfg.write_text((REPO / "grayguard.example.yaml").read_text())
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "replay", "--config.file", str(cfg), "--recording",
                        str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "bad.jsonl:2: not JSON" in p.stderr, p.stderr


@pytest.mark.e2e
def test_the_demo_s_recording_replays_to_the_live_controller_s_decisions_tick_for_tick(tmp_path):
    from grayguard.demo.cli import CONFIG, RECORDING, DemoOptions, run_scenario

    report = tmp_path / "report"
    opts = DemoOptions(nodes=4, rate=20.0, duration_s=40.0, fault_start_s=16.0, fault_end_s=32.0, live="off")
    run_scenario(opts, report, out=open("/dev/null", "w"))  # noqa: SIM115
    cfg = load_config(str(report / CONFIG))
    decisions = list(recording_decisions(read(report / RECORDING), cfg))
    ticks = sorted({d["t"] for d in decisions})
    assert len(ticks) >= 15, f"only {len(ticks)} recorded ticks"
    compared = [d for d in decisions if d["live"] is not None]
    differ = [d for d in compared if d["live"] != d["state"]]
    assert not differ, differ[:5]
    assert any(d["node"] == "node3" and d["state"] != "healthy" for d in compared)  # the run had a decision to match
    assert any(d["node"] == "node3" and d["state"] == "quarantined" for d in compared)
    # another config on the same evidence: no node may be drained (max_ejected_fraction 0), so node3 never is
    import yaml
    other = yaml.safe_load((report / CONFIG).read_text())
    other.setdefault("thresholds", {})["max_ejected_fraction"] = 0.0
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "replay", "--config.file", str(tmp_path / "other.yaml"),
                        "--recording", str(report / RECORDING), "--out", str(tmp_path / "d.jsonl")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "chat/node3" in p.stderr and "differs from the live controller" in p.stderr
    again = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    s = summarize(again)
    assert s["chat/node3"]["differ"] > 0  # it would have decided otherwise than the live run did
    assert s["chat/node3"]["quarantines"] == 0 and "quarantined" not in s["chat/node3"]["ticks"]
    assert len({d["t"] for d in again}) == len(ticks)


def test_a_counterfactual_replay_sees_its_own_writes_where_it_parted_from_the_live_controller():
    from grayguard.controller.haproxy import ADMF_FDRAIN
    from grayguard.controller.replay import _as_written

    drained = ServerState("chat", "node1", "127.0.0.1:8001", 0, 100, ADMF_FDRAIN, 2, status="DRAIN")
    up = ServerState("chat", "node2", "127.0.0.1:8002", 100, 100, 0, 2, status="UP")
    live = {"node1": NodeState(state="quarantined", since=0.0), "node2": NodeState(state="healthy", since=0.0)}
    replayed = {"node1": NodeState(state="healthy", since=0.0), "node2": NodeState(state="healthy", since=0.0)}
    out = _as_written({"node1": drained, "node2": up}, live, replayed, {"node1": (100, False), "node2": (100, False)})
    assert not out["node1"].drain and out["node1"].weight == 100  # the replay never drained it
    assert out["node1"].op_state == drained.op_state  # what HAProxy's checks said stays
    assert out["node2"] is up  # where both agree, the recording is the truth
    assert _as_written({"node1": drained}, live, None, {}) == {"node1": drained}  # the first tick: as recorded
