"""Startup says what would make every node count as stale: a query whose data has no age on this engine."""

from __future__ import annotations

from types import SimpleNamespace

from grayguard.config import parse_config
from grayguard.controller.cmd_controller import staleness_checks
from grayguard.promclient import PromError, Sample

CFG = parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}]})


class Prom:
    def __init__(self, answers):
        self.answers = answers

    def query(self, q):
        a = self.answers.get(q, [])
        if isinstance(a, Exception):
            raise a
        return a


def check(answers):
    return staleness_checks(SimpleNamespace(cfg=CFG, prom=Prom(answers)))


LAT, RATE = CFG.signals.latency_query, CFG.signals.request_rate_query
ONE = [Sample({"instance": "a:1"}, 0.02, 1000.0)]


def test_recorded_series_with_an_age_is_fine():
    assert check({LAT: ONE, f"timestamp({LAT})": ONE, RATE: ONE, f"timestamp({RATE})": ONE}) == []


def test_no_data_yet_is_not_a_problem_to_report_here():
    assert check({}) == []


def test_an_expression_without_timestamp_is_named():
    # VictoriaMetrics answers nothing for timestamp(<expression>): every node would be stale, the pool would hold
    problems = check({LAT: ONE, RATE: ONE, f"timestamp({RATE})": ONE})
    assert len(problems) == 1 and problems[0].startswith("signals.latency_query: 1 series, but timestamp()")


def test_an_unreachable_prometheus_is_said_with_its_kind():
    problems = check({LAT: PromError("connect", "refused"), RATE: ONE, f"timestamp({RATE})": ONE})
    assert problems == ["signals.latency_query: cannot query Prometheus yet (connect)"]
