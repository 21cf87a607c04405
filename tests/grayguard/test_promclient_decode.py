"""An instant query's answer is decoded to typed elements by msgspec (promclient.decode_instant) and, when it is not a
plain successful vector, by json and the element-by-element checks: on any answer's bytes the Samples, or the
PromError (kind and message), are those of the json decoding and element-by-element parse it replaced, kept here as
the reference. Garbage of every kind is still classified."""

from __future__ import annotations

import json
import math

import pytest
import responses
from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard import promclient
from grayguard.config import PrometheusConfig
from grayguard.promclient import PromError, PrometheusClient, Sample, _pair, _parse_labels

PROM = "http://prom.test:9090"


def _reference(result: list) -> list[Sample]:
    """The element-by-element parse, as query() did it after json.loads."""
    out = []
    for item in result:
        if not isinstance(item, dict) or "value" not in item:
            raise PromError("bad_response", f"malformed vector element {str(item)[:120]!r}")
        ts, val = _pair(item["value"])
        out.append(Sample(_parse_labels(item.get("metric", {})), val, ts))
    return out


def _outcome(parse, result):
    """What parse makes of result: the samples (NaN shown as nan) or the error's kind and message."""
    try:
        got = parse(result)
    except PromError as e:
        return ("error", e.kind, str(e))
    assert all(type(s.labels) is dict for s in got)
    return ("ok", repr([(s.labels, s.value, s.timestamp) for s in got]))


class Text(str):
    pass


class Labels(dict):
    pass


NAMES = st.sampled_from(("__name__", "instance", "pool", "job", "result"))
GOOD_LABELS = st.dictionaries(NAMES, st.text(max_size=6), max_size=4)
STAMP = st.one_of(st.floats(0, 2e9), st.integers(0, 2**40), st.sampled_from(("1700000000.5", "NaN", "+Inf", "x")),
                  st.sampled_from((math.nan, math.inf, -math.inf, 10**400, True, None)))
VALUE = st.one_of(st.floats(allow_nan=True).map(repr), st.sampled_from(("NaN", "+Inf", "-Inf", "1e400", "0", "x", "")),
                  st.floats(allow_nan=False), st.integers(-5, 5), st.sampled_from((10**400, True, None, [], {})))
GOOD_PAIR = st.tuples(st.floats(0, 2e9), st.floats(0, 10).map(repr)).map(list)
PAIR = st.one_of(GOOD_PAIR, GOOD_PAIR, st.tuples(STAMP, VALUE).map(list), st.lists(STAMP, max_size=3),
                 st.tuples(st.floats(0, 2e9), st.floats(0, 10).map(repr)), st.none(), st.text(max_size=3))
LABELS = st.one_of(GOOD_LABELS, GOOD_LABELS, GOOD_LABELS,
                   st.dictionaries(NAMES, st.one_of(st.integers(), st.none(), st.text(max_size=3).map(Text)),
                                   min_size=1, max_size=2),
                   GOOD_LABELS.map(Labels), st.dictionaries(st.integers(0, 3), st.text(max_size=2), min_size=1,
                                                            max_size=2),
                   st.none(), st.lists(st.text(max_size=3), max_size=2))
GOOD = st.fixed_dictionaries({"metric": GOOD_LABELS, "value": GOOD_PAIR})
ELEMENT = st.one_of(GOOD, GOOD, GOOD, st.fixed_dictionaries({"metric": LABELS, "value": PAIR}),
                    st.fixed_dictionaries({"value": PAIR}), st.fixed_dictionaries({"metric": LABELS}),
                    st.fixed_dictionaries({"metric": GOOD_LABELS, "values": st.lists(GOOD_PAIR, max_size=2)}),
                    st.none(), st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=2))


@settings(max_examples=500, deadline=None)
@given(st.lists(ELEMENT, max_size=6))
def test_an_answer_decodes_as_json_and_element_by_element(result):
    body = _body(result)
    assert _outcome(promclient.decode_instant, body) == _outcome(_reference, json.loads(body)["data"]["result"])


def _body(result: list, **top) -> bytes:
    """The answer's bytes as Prometheus sends them (json.dumps writes NaN and Infinity literals, which only the
    general path reads: those answers take it)."""
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}, **top}).encode()


@settings(max_examples=200, deadline=None)
@given(st.lists(GOOD, max_size=8))
def test_a_well_formed_answer_takes_the_typed_path(result):
    body = _body(result, warnings=["extra fields are ignored"])
    assert _outcome(promclient.decode_instant, body) == _outcome(_reference, result)
    assert promclient._VECTOR.decode(body).data.result is not None  # msgspec took it: no fallback


@pytest.mark.parametrize(("body", "kind", "message"), [
    (b"<html>", "bad_response", "answered non-JSON: '<html>'"),
    (b'{"status": "error", "errorType": "bad_data", "error": "parse error"}', "query", "query failed: parse error"),
    (b'{"status": "success"}', "bad_response", "no data object"),
    (b'{"status": "success", "data": {"resultType": "matrix", "result": []}}', "bad_response", "expected a vector"),
    (b"[" * 100_000, "bad_response", "non-JSON"),
])
def test_answers_that_are_not_a_vector_are_classified(body, kind, message):
    with pytest.raises(PromError) as e:
        promclient.decode_instant(body)
    assert e.value.kind == kind and message in str(e.value)


def test_a_scalar_answer_is_one_sample_without_labels():
    body = b'{"status": "success", "data": {"resultType": "scalar", "result": [1000, "2.5"]}}'
    assert promclient.decode_instant(body) == [Sample({}, 2.5, 1000.0)]


def test_one_bad_element_among_many_is_named():
    good = [{"metric": {"instance": f"10.0.0.{i}:8000"}, "value": [1000.0, "0.5"]} for i in range(100)]
    for bad, message in (({"metric": {"instance": 7}, "value": [1000.0, "1"]}, "malformed label set"),
                         ({"metric": None, "value": [1000.0, "1"]}, "malformed label set"),
                         ({"metric": {}, "value": [1000.0, "x"]}, "unparseable sample value 'x'"),
                         ({"metric": {}, "value": ["NaN", "1"]}, "sample timestamp 'NaN' is not a finite number"),
                         ({"metric": {}, "value": [1000.0]}, "malformed sample"),
                         ({"metric": {}, "value": "12"}, "malformed sample"),
                         ({"metric": {}}, "malformed vector element"), ([], "malformed vector element")):
        with pytest.raises(PromError) as e:
            promclient.decode_instant(_body([*good[:50], bad, *good[50:]]))
        assert e.value.kind == "bad_response" and message in str(e.value)
    # no "metric": an empty label set, as before
    assert promclient.decode_instant(_body([*good, {"value": [1000.0, "2"]}]))[-1] == Sample({}, 2.0, 1000.0)
    # Prometheus' own spellings of the values that are not numbers, and a timestamp beyond any float
    got = promclient.decode_instant(_body([{"value": [1000, v]} for v in ("NaN", "+Inf", "-Inf")]))
    assert math.isnan(got[0].value) and got[1:] == [Sample({}, math.inf, 1000.0), Sample({}, -math.inf, 1000.0)]
    with pytest.raises(PromError, match="not a finite number"):
        promclient.decode_instant(b'{"status": "success", "data": {"resultType": "vector", "result": '
                                  b'[{"value": [1e999, "1"]}]}}')


@responses.activate
def test_query_decodes_a_large_answer_and_garbage_is_classified():
    result = [{"metric": {"__name__": "gg:latency", "instance": f"10.0.{i // 256}.{i % 256}:8000", "pool": f"p{i % 7}"},
               "value": [1700000000.5, repr(i / 7)]} for i in range(2000)]
    result[3]["value"][1] = "NaN"
    body = {"status": "success", "data": {"resultType": "vector", "result": result}}
    responses.get(f"{PROM}/api/v1/query", body=json.dumps(body))
    got = PrometheusClient(PrometheusConfig(url=PROM)).query("q")
    assert [(s.labels, s.timestamp) for s in got] == [(r["metric"], 1700000000.5) for r in result]
    assert math.isnan(got[3].value) and got[7].value == 1.0
    result[1500]["value"] = [1700000000.5, {"not": "a number"}]
    responses.replace(responses.GET, f"{PROM}/api/v1/query", body=json.dumps(body))
    with pytest.raises(PromError) as e:
        PrometheusClient(PrometheusConfig(url=PROM)).query("q")
    assert e.value.kind == "bad_response" and "unparseable sample value" in str(e.value)


def test_a_sample_is_an_immutable_named_tuple():
    """Built with tuple.__new__ (decode_instant): the same Sample as its constructor's, fields by name."""
    s = Sample({"instance": "a"}, 0.5, 1000.0)
    assert s == Sample(labels={"instance": "a"}, value=0.5, timestamp=1000.0) != Sample({}, 0.5, 1000.0)
    assert (s.labels, s.value, s.timestamp) == ({"instance": "a"}, 0.5, 1000.0)
    assert repr(s) == "Sample(labels={'instance': 'a'}, value=0.5, timestamp=1000.0)"
    assert s._replace(value=2.0) == Sample({"instance": "a"}, 2.0, 1000.0)
    with pytest.raises(AttributeError):
        s.value = 1.0  # type: ignore[misc]
    bulk = promclient.decode_instant(_body([{"metric": {"instance": "a"}, "value": [1000, "0.5"]}]))
    assert bulk == [s] and type(bulk[0]) is Sample and repr(bulk[0]) == repr(s)
    with pytest.raises(TypeError):
        Sample({}, 1.0)  # type: ignore[call-arg]  # every field is needed


@responses.activate
def test_concurrent_answers_are_decoded_one_at_a_time(monkeypatch):
    """A tick's queries run in threads: their answers are read at once, decoded and shaped in turn (one thread in
    the CPU-bound part at a time), and each query still gets its own samples."""
    import threading
    import time as _time
    from concurrent.futures import ThreadPoolExecutor

    for k in range(8):
        responses.get(f"{PROM}/api/v1/query", match=[responses.matchers.query_param_matcher({"query": f"q{k}"})],
                      json={"status": "success", "data": {"resultType": "vector", "result": [
                          {"metric": {"instance": f"n{k}"}, "value": [1000, str(k)]}]}})
    inside, most, lock = [0], [0], threading.Lock()
    shape = promclient.decode_instant

    def counted(data):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        _time.sleep(0.02)  # long enough for the others to arrive while this one decodes
        try:
            return shape(data)
        finally:
            with lock:
                inside[0] -= 1
    monkeypatch.setattr(promclient, "decode_instant", counted)
    client = PrometheusClient(PrometheusConfig(url=PROM))
    with ThreadPoolExecutor(max_workers=8) as ex:
        got = list(ex.map(client.query, [f"q{k}" for k in range(8)]))
    assert got == [[Sample({"instance": f"n{k}"}, float(k), 1000.0)] for k in range(8)]
    assert most[0] == 1
