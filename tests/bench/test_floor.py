"""bench/floor.py: the least work of a tick, timed with the controller's own pieces on the stand-in's answers."""

from __future__ import annotations

import json

import pytest

from grayguard.bench import floor
from grayguard.promclient import _instant, decode_instant


def test_the_decision_pass_visits_every_node_once_with_or_without_scoring():
    inputs, states = floor.pools_of(60, 20)
    assert [len(p) for p in inputs] == [20, 20, 20]
    assert all(s.keys() == p.keys() for p, s in zip(inputs, states, strict=True))
    assert floor.decision_pass(inputs, states, False) == floor.decision_pass(inputs, states, True) == 60


def test_the_answers_are_the_default_configs_eighteen_with_a_series_a_node():
    bodies = floor.answer_bodies(40)
    assert len(bodies) == 18
    for b in bodies:
        samples = _instant(json.loads(b)["data"])  # the general path takes every one
        assert len(samples) == 40 and all(s.timestamp > 0 for s in samples)
        assert repr(decode_instant(b)) == repr(samples)  # the client's decoding gives the same (repr: NaN is nan)


def test_the_command_prints_each_floor_and_refuses_nonsense(capsys):
    assert floor.main(["--nodes", "40", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for what in ("decision pass ", "decision pass + peer scoring", "json.loads of 18 answers",
                 "18 answers, json + checks", "18 answers, the client's decoding", "40 nodes in pools of 20"):
        assert what in out
    assert "target" not in out  # the shares of the targets are shown at 10,000 nodes only
    with pytest.raises(SystemExit) as e:
        floor.main(["--nodes", "10", "--pool-size", "20"])
    assert e.value.code == 2


def test_at_ten_thousand_nodes_each_line_says_its_share_of_the_target():
    lines = floor.format_floor(10000, 20, {"decision pass": 50.0, "json.loads of 18 answers": 250.0,
                                           "answer bytes": 2.0 * 2**20})
    assert "(50% of the 100 ms target)" in lines[1] and "(50% of the 500 ms target)" in lines[2]
    assert "2.0 MiB of JSON" in lines[0]
