"""Fuzz the parsers of what the controller reads (issue 12, acceptance): HAProxy runtime-API replies and Prometheus
HTTP API answers. Whatever arrives, no exception escapes but the classified ones (HaproxyError, PromError), and what
is returned has the types the controller relies on."""

from __future__ import annotations

import json
import math

import responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grayguard.config import PrometheusConfig
from grayguard.controller.haproxy import (
    HaproxyError,
    ServerState,
    classify_reply,
    host_port,
    parse_backend_algos,
    parse_servers_state,
)
from grayguard.promclient import PromError, PrometheusClient, Sample

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_HTTP = settings(FUZZ, max_examples=150)  # each example goes through requests and `responses`
PROM = "http://prom.fuzz:9090"

# ---- HAProxy runtime API ---------------------------------------------------------------------------------------
STATE_COLS = ["be_id", "be_name", "srv_id", "srv_name", "srv_addr", "srv_op_state", "srv_admin_state",
              "srv_uweight", "srv_iweight", "srv_time_since_last_change", "srv_check_status", "srv_check_result",
              "srv_check_health", "srv_check_state", "srv_agent_state", "bk_f_forced_id", "srv_f_forced_id",
              "srv_fqdn", "srv_port", "srvrecord", "srv_use_ssl", "srv_check_port", "srv_check_addr",
              "srv_agent_addr", "srv_agent_port"]
token = st.one_of(st.text(min_size=1, max_size=12).filter(lambda t: not any(c.isspace() for c in t)),
                  st.integers(-2**70, 2**70).map(str), st.sampled_from(["-", "::1", "[::1]", "0", "1", "256", "nan"]))
NAME_COLS = {"be_name", "srv_name", "srv_addr", "srv_fqdn", "srvrecord", "srv_check_addr", "srv_agent_addr"}
good_name = st.from_regex(r"[A-Za-z0-9_.:-]{1,12}", fullmatch=True) | st.sampled_from(["::1", "10.0.0.1", "-"])


def cell(col):
    """Mostly what HAProxy writes in this column, sometimes anything."""
    good = good_name if col in NAME_COLS else st.integers(0, 300).map(str)
    return st.one_of(good, good, good, token)


@st.composite
def servers_state_text(draw):
    """Mostly well-formed `show servers state` output with random cells, headers and stray lines."""
    cols = draw(st.one_of(st.just(STATE_COLS), st.just(STATE_COLS), st.permutations(STATE_COLS),
                          st.lists(st.sampled_from(STATE_COLS), max_size=30),
                          st.permutations(STATE_COLS).flatmap(  # every column, some twice
                              lambda c: st.lists(st.sampled_from(STATE_COLS), min_size=1, max_size=3).map(
                                  lambda twice: c + twice))))
    lines = [draw(st.sampled_from(["1", "1", "1", "1 ", "2", "", "# 1"]))]
    lines.append("# " + " ".join(cols))
    for _ in range(draw(st.integers(0, 5))):
        row = [draw(cell(c)) for c in cols]
        cut = draw(st.integers(0, 3))  # a short or a long row, sometimes
        row = row[:len(row) - cut] if draw(st.booleans()) else row + draw(st.lists(token, max_size=cut))
        lines.append(" ".join(row))
    if draw(st.integers(0, 4)) == 0:
        lines.insert(draw(st.integers(1, len(lines))), draw(st.text(max_size=40)))
    return draw(st.sampled_from(["\n", "\r\n"])).join(lines)


def _check_states(got):
    assert isinstance(got, list)
    for s in got:
        assert isinstance(s, ServerState)
        assert isinstance(s.backend, str) and isinstance(s.name, str) and isinstance(s.address, str)
        assert all(isinstance(v, int) for v in (s.weight, s.initial_weight, s.admin_state, s.op_state))


@FUZZ
@given(st.one_of(st.text(), servers_state_text()))
def test_parse_servers_state_raises_only_haproxy_errors(text):
    try:
        got = parse_servers_state(text)
    except HaproxyError:
        return
    _check_states(got)



def _states_by_name(text):
    """The reference: every line read by name (dict(zip(header, fields))), as parse_servers_state did before it read
    a full line by position."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0].strip() != "1":
        raise HaproxyError("bad_reply", "")
    header, out = [], []
    for ln in lines[1:]:
        if ln.startswith("#"):
            header = ln.lstrip("# ").split()
            continue
        f = dict(zip(header, ln.split(), strict=False))
        try:
            out.append(ServerState(
                backend=f["be_name"], name=f["srv_name"], address=host_port(f["srv_addr"], f["srv_port"]),
                weight=int(f["srv_uweight"]), initial_weight=int(f["srv_iweight"]),
                admin_state=int(f["srv_admin_state"]), op_state=int(f["srv_op_state"]),
                fqdn=None if f.get("srv_fqdn", "-") == "-" else f["srv_fqdn"],
                check_status=int(f["srv_check_status"]) if f.get("srv_check_status", "").isdigit() else None,
                agent_state=int(f["srv_agent_state"]) if f.get("srv_agent_state", "").isdigit() else None))
        except (KeyError, ValueError) as e:
            raise HaproxyError("bad_reply", str(e)) from e
    return out


@settings(FUZZ, max_examples=150)
@given(servers_state_text())
def test_parse_servers_state_by_position_reads_what_by_name_reads(text):
    try:
        want = _states_by_name(text)
    except HaproxyError:
        want = None
    try:
        got = parse_servers_state(text)
    except HaproxyError:
        got = None
    assert got == want


@FUZZ
@given(st.text())
def test_classify_reply_never_raises(reply):
    ok, kind = classify_reply(reply)
    assert isinstance(ok, bool) and isinstance(kind, str) and (ok == (kind == ""))


STAT_COLS = ["pxname", "svname", "qcur", "scur", "status", "weight", "algo", "mode"]


@st.composite
def stat_csv(draw):
    cols = draw(st.one_of(st.just(STAT_COLS), st.permutations(STAT_COLS), st.lists(st.sampled_from(STAT_COLS),
                                                                                  max_size=10)))
    junk = st.text(alphabet=st.characters(blacklist_characters=",\n\r"), max_size=8)
    cell = st.one_of(st.sampled_from(["BACKEND", "FRONTEND", "s1", "be", "roundrobin", "static-rr"]), junk)
    rows = []
    for _ in range(draw(st.integers(0, 4))):
        n = len(cols) + draw(st.integers(-2, 2))
        rows.append(",".join(draw(st.lists(cell, min_size=max(n, 0), max_size=max(n, 0)))))
    return "\n".join([draw(st.sampled_from(["# ", "# ", "#", ""])) + ",".join(cols), *rows])


@FUZZ
@given(st.one_of(st.text(), stat_csv()))
def test_parse_backend_algos_raises_only_haproxy_errors(text):
    try:
        got = parse_backend_algos(text)
    except HaproxyError:
        return
    assert isinstance(got, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in got.items())


# ---- Prometheus HTTP API ---------------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(allow_nan=False),
                    st.text(max_size=10), st.sampled_from(["NaN", "+Inf", "-Inf", "1.5", "0", "1e400"]))
anything = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                          max_size=4), max_leaves=12)
good_labels = st.dictionaries(st.sampled_from(["instance", "pool", "__name__", "job"]), st.text(max_size=8),
                              max_size=3)
labels = st.one_of(good_labels, good_labels, st.dictionaries(st.text(max_size=8), anything, max_size=3), anything)
good_pair = st.tuples(st.one_of(st.floats(0, 2e9), st.integers(0, 2**40)),
                      st.one_of(st.floats().map(str), st.sampled_from(["NaN", "+Inf", "1"]))).map(list)
pair = st.one_of(good_pair, good_pair, good_pair, st.lists(scalars, max_size=3), anything)
element = st.one_of(st.fixed_dictionaries({"metric": labels, "value": pair}),
                    st.fixed_dictionaries({"metric": labels, "value": pair}),
                    st.fixed_dictionaries({"metric": labels, "values": st.one_of(st.lists(pair, max_size=3),
                                                                                 anything)}),
                    anything)


@st.composite
def prom_body(draw):
    """A Prometheus-shaped JSON answer with random parts, or any JSON at all."""
    kinds = st.one_of(st.sampled_from(["vector", "scalar", "matrix", "string"]), anything)
    data = st.fixed_dictionaries({"resultType": kinds, "result": st.one_of(st.lists(element, max_size=4), pair,
                                                                          anything)})
    good_vector = st.fixed_dictionaries({"resultType": st.just("vector"), "result": st.lists(
        st.fixed_dictionaries({"metric": good_labels, "value": good_pair}), max_size=4)})
    good_matrix = st.fixed_dictionaries({"resultType": st.just("matrix"), "result": st.lists(
        st.fixed_dictionaries({"metric": good_labels, "values": st.lists(good_pair, max_size=3)}), max_size=3)})
    return draw(st.one_of(st.fixed_dictionaries({"status": st.just("success"), "data": good_vector}),
                          st.fixed_dictionaries({"status": st.just("success"), "data": good_matrix}),
                          st.fixed_dictionaries({"status": st.just("success"), "data": data}),
                          st.fixed_dictionaries({"status": st.one_of(st.just("success"), anything),
                                                 "data": st.one_of(data, anything), "error": anything}),
                          anything))


def _answer(body, status=200):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        kw = {"body": body} if isinstance(body, bytes | str) else {"body": json.dumps(body)}
        rsps.get(f"{PROM}/api/v1/query", status=status, **kw)
        rsps.get(f"{PROM}/api/v1/query_range", status=status, **kw)
        c = PrometheusClient(PrometheusConfig(url=PROM, timeout_s=1.0))
        out = []
        for call in (lambda: c.query("up"), lambda: c.query_range("up", 0, 60, 15)):
            try:
                out.append(call())
            except PromError:
                out.append(None)
        return out


def _check_samples(got):
    assert isinstance(got, list)
    for s in got:
        assert isinstance(s, Sample) and isinstance(s.value, float) and isinstance(s.timestamp, float)
        assert math.isfinite(s.timestamp)
        assert isinstance(s.labels, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in s.labels.items())
        hash(frozenset(s.labels.items()))  # the tick keys series by their label set


def _check_matrix(got):
    assert isinstance(got, list)
    for lbls, pts in got:
        assert isinstance(lbls, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in lbls.items())
        assert all(isinstance(t, float) and isinstance(v, float) for t, v in pts)


@FUZZ_HTTP
@given(prom_body())
def test_prometheus_json_answers_raise_only_prom_errors(body):
    instant, matrix = _answer(body)
    if instant is not None:
        _check_samples(instant)
    if matrix is not None:
        _check_matrix(matrix)


@FUZZ_HTTP
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.integers(1, 200).map(lambda n: "[" * n + "]" * n), st.just("[" * 100000)),
       st.sampled_from([200, 200, 204, 302, 400, 422, 500, 503]))
def test_prometheus_raw_bodies_raise_only_prom_errors(body, status):
    instant, matrix = _answer(body, status)
    if instant is not None:
        _check_samples(instant)
    if matrix is not None:
        _check_matrix(matrix)
