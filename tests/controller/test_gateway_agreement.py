"""The controller and HAProxy's reflexes agree: a server HAProxy marked DOWN for errors (observe layer7 error-limit)
is quarantined by the controller, stays drained when its health check puts it back, and returns through canaries.
"""

from __future__ import annotations

import http.client
import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller.haproxy import RuntimeClient, ServerState, parse_servers_state
from grayguard.controller.policy import (
    CANARY,
    EJECTED,
    HEALTHY,
    QUARANTINED,
    SLOW_START,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
    max_ejected,
)
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import wait_until
from grayguard.reflexes import CHECK_STATUS_HANA, DEFAULT
from grayguard.vocab import DrainCause
from tests.localstack.test_reflexes import Backend
from tests.support.ctl_helpers import LAT_Q, RATE_Q, FakeProm, fake_controller, samples, tick_settled

P = Policy()
REFLEX = "observe layer7 error-limit"
HEADER = ("# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
          "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
          "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord")


def _state_line(op: int, admin: int, check_status: int) -> str:
    return f"3 b 1 a 127.0.0.1 {op} {admin} 100 100 1 {check_status} 2 0 6 0 0 0 - 8000 -"


# -- reading HAProxy: which DOWN is which -----------------------------------------------------------------------

def test_down_for_errors_is_told_apart_from_down_by_health_check_and_maint():
    def one(op, admin, cs):
        return parse_servers_state(f"1\n{HEADER}\n{_state_line(op, admin, cs)}\n")[0]
    hana = one(0, 0, CHECK_STATUS_HANA)
    assert hana.down and hana.marked_down_for_errors and hana.check_status == 4
    l7sts, l4con = one(0, 0, 16), one(0, 0, 8)  # a failed HTTP check, a refused one
    assert l7sts.down and not l7sts.marked_down_for_errors and not l4con.marked_down_for_errors
    assert not one(2, 0, CHECK_STATUS_HANA).marked_down_for_errors  # UP again: a check overwrote it (or not yet)
    assert not one(0, 0x01, CHECK_STATUS_HANA).marked_down_for_errors  # MAINT: the operator's


# -- the pure core ------------------------------------------------------------------------------------------------

def _inputs(n=4, **kw) -> dict[str, NodeInput]:
    out = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0) for i in range(n)}
    for name, fields in kw.items():
        out[name] = replace(out[name], **fields)
    return out


GATEWAY_DOWN = {"down": True, "gateway_marked_down": True}


def _prev(n=4, t=0.0) -> dict[str, NodeState]:
    return {f"n{i}": NodeState(since=t, ema=0.02) for i in range(n)}


def test_a_server_haproxy_marked_down_for_errors_is_quarantined_with_the_reflex_named():
    d = decide_pool(_prev(), _inputs(n1=GATEWAY_DOWN), P, 100.0)
    nd = d.nodes["n1"]
    assert nd.state.state == QUARANTINED and nd.drain and nd.weight == 0
    assert nd.state.cause == DrainCause.GATEWAY and REFLEX in nd.state.reason
    assert all(d.nodes[n].state.state == HEALTHY for n in ("n0", "n2", "n3"))


def test_a_server_down_by_its_health_check_is_not_quarantined_for_it():
    d = decide_pool(_prev(), _inputs(n1={"down": True}), P, 100.0)
    assert d.nodes["n1"].state.state == HEALTHY and not d.nodes["n1"].drain


def test_back_up_by_its_health_check_it_stays_drained_until_canaries_pass():
    r = P.recovery
    d = decide_pool(_prev(), _inputs(n1=GATEWAY_DOWN), P, 100.0)
    states = {n: nd.state for n, nd in d.nodes.items()}
    # the health check put it back (its /health answers 200): nothing HAProxy shows says "errors" any more
    t = 100.0
    while t < 100.0 + r.canary_interval_s - 1:
        t += 1.0
        d = decide_pool(states, _inputs(), P, t)
        states = {n: nd.state for n, nd in d.nodes.items()}
        assert d.nodes["n1"].state.state == QUARANTINED and d.nodes["n1"].drain and d.nodes["n1"].weight == 0
    # half-open at the canary interval (an error circuit), then canaries decide
    t = 100.0 + r.canary_interval_s
    d = decide_pool(states, _inputs(), P, t)
    states = {n: nd.state for n, nd in d.nodes.items()}
    assert states["n1"].state == CANARY and d.nodes["n1"].drain
    d = decide_pool(states, _inputs(n1={"canary": math.inf}), P, t + r.canary_interval_s)  # still failing
    states = {n: nd.state for n, nd in d.nodes.items()}
    assert states["n1"].state == CANARY and states["n1"].canary_ok == 0 and d.nodes["n1"].drain
    for k in range(r.canary_successes):
        d = decide_pool(states, _inputs(n1={"canary": 0.02}), P, t + (k + 2) * r.canary_interval_s)
        states = {n: nd.state for n, nd in d.nodes.items()}
    nd = d.nodes["n1"]
    assert nd.state.state == SLOW_START and not nd.drain and nd.weight == round(100 * r.slow_start_initial)
    assert nd.state.cause == ""


def test_a_mark_down_the_tick_missed_is_seen_by_its_counter():
    # HANA lasts until the next health check (check_inter_s): a 5 s tick may only see the counter hanafail rise
    prev = {n: replace(s, gateway_errors_seen=0) for n, s in _prev().items()}
    d = decide_pool(prev, _inputs(n2={"gateway_errors": 1}, n0={"gateway_errors": 0}), P, 100.0)
    nd = d.nodes["n2"]
    assert nd.state.state == QUARANTINED and nd.state.cause == DrainCause.GATEWAY and REFLEX in nd.state.reason
    assert nd.state.gateway_errors_seen == 1 and d.nodes["n0"].state.state == HEALTHY
    states = {n: x.state for n, x in d.nodes.items()}
    d = decide_pool(states, _inputs(n2={"gateway_errors": 1}), P, 101.0)  # no new event: nothing new
    assert d.nodes["n2"].state.state == QUARANTINED and d.nodes["n2"].state.since == 100.0


def test_a_first_sight_or_a_restarted_haproxy_is_no_event():
    d = decide_pool(_prev(), _inputs(n1={"gateway_errors": 7}), P, 100.0)  # never seen: an old count
    assert d.nodes["n1"].state.state == HEALTHY and d.nodes["n1"].state.gateway_errors_seen == 7
    prev = {n: replace(s, gateway_errors_seen=7) for n, s in _prev().items()}
    d = decide_pool(prev, _inputs(n1={"gateway_errors": 0}), P, 100.0)  # HAProxy restarted: counters from 0
    assert d.nodes["n1"].state.state == HEALTHY and d.nodes["n1"].state.gateway_errors_seen == 0


def test_show_stat_hanafail_is_read_per_server():
    from grayguard.controller.haproxy import parse_hanafail
    csv = ("# pxname,svname,qcur,hanafail,status\nb,a,0,2,UP\nb,c,0,,UP\nb,BACKEND,0,,UP\n")
    assert parse_hanafail(csv) == {("b", "a"): 2}
    assert parse_hanafail("Unknown command") == {}


def test_the_cap_still_applies_once_it_is_back_up():
    pol = Policy(ThresholdsConfig(max_ejected_fraction=0.25), RecoveryConfig())  # 4 nodes: cap 1
    prev = {**_prev(), "n0": NodeState(state=QUARANTINED, since=90.0, cause=DrainCause.LATENCY)}
    d = decide_pool(prev, _inputs(n1=GATEWAY_DOWN), pol, 100.0)
    # DOWN anyway, but the cap is spent: a drain would keep it out once its health check puts it back
    assert d.nodes["n1"].state.state == HEALTHY and d.safeguard and "safeguard cap" in d.nodes["n1"].state.reason
    states = {n: nd.state for n, nd in d.nodes.items()}
    d = decide_pool(states, _inputs(), pol, 101.0)  # both are UP in HAProxy now: only one may stay out
    # (n0 was released into slow start the tick n1 went DOWN: the cap counts capacity already gone)
    assert sum(nd.state.state in EJECTED for nd in d.nodes.values()) <= 1 and d.out_of_rotation <= 1


def test_a_pool_wide_failure_marked_down_everywhere_is_not_held_drained():
    """Every server answering 500 is marked DOWN by HAProxy; the controller must not drain them all, or the pool
    stays out of rotation after HAProxy's health checks put it back (found by the benchmark's pool scenario)."""
    everyone = {f"n{i}": GATEWAY_DOWN for i in range(6)}
    d = decide_pool(_prev(6), _inputs(6, **everyone), P, 100.0)
    assert not any(nd.drain for nd in d.nodes.values()) and d.safeguard
    states = {n: nd.state for n, nd in d.nodes.items()}
    d = decide_pool(states, _inputs(6), P, 105.0)  # back UP by their health checks: all in rotation
    assert all(nd.state.state == HEALTHY and nd.weight == 100 for nd in d.nodes.values())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.data(), st.sampled_from([0.0, 0.25, 0.5]))
def test_gateway_drains_never_take_more_than_the_cap_out(n, data, fraction):
    flags = data.draw(st.lists(st.sampled_from(["", "down", "gateway", "gateway-only"]), min_size=n, max_size=n))
    inputs = {}
    for i, f in enumerate(flags):  # "gateway-only": an inconsistent view (not DOWN): the cap must still bind
        inputs[f"n{i}"] = NodeInput(base_weight=100, latency=0.02, request_rate=5.0, down=f in ("down", "gateway"),
                                    gateway_marked_down=f.startswith("gateway"))
    pol = Policy(ThresholdsConfig(max_ejected_fraction=fraction), RecoveryConfig())
    d = decide_pool({}, inputs, pol, 100.0)
    away = {k for k, i in inputs.items() if i.down}
    ours = {k for k, nd in d.nodes.items() if nd.state.state in EJECTED and k not in away}
    assert len(ours) <= max(0, max_ejected(n, fraction) - len(away))
    drained = {k for k, nd in d.nodes.items() if nd.state.state in EJECTED}
    assert len(drained) <= max_ejected(n, fraction)  # what stays out once every health check is green again


# -- with a real HAProxy -----------------------------------------------------------------------------------------

def _post(port: int, body: bytes) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("POST", "/v1/completions", body=body)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def _canary(url: str) -> float | None:
    """A request straight to the node: None unless it answers 200; a fixed TTFT otherwise (sub-millisecond local
    timings are noise, and this test is about who decides, not about latency)."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    try:
        return 0.05 if _post_to(host, int(port)) == 200 else None
    except OSError:
        return None


def _post_to(host: str, port: int) -> int:
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        c.request("POST", "/v1/completions", body=b'{"max_tokens": 1}')
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def test_controller_drains_what_haproxy_marked_down_and_keeps_it_drained_until_canaries_pass(tmp_path):
    from grayguard.localstack.procs import free_port
    backends = [Backend("500"), Backend("ok"), Backend("ok")]
    bad = backends[0]
    # fast checks so the test sees the health check put the server back; a small buffer so a large prompt is
    # not retried and node0's 500 reaches the client (a retried 500 is invisible to observe layer7)
    reflexes = replace(DEFAULT, check_inter_s=0.3, check_downinter_s=1.0, bufsize=16384)
    port = free_port()
    servers = [(f"node{i}", b.addr, 100) for i, b in enumerate(backends)]
    hap = HaproxyProc(tmp_path, haproxy_config(tmp_path / "admin.sock", {"vllm_chat": servers},
                                               frontend_port=port, reflexes=reflexes))
    hap.start()
    try:
        rc = RuntimeClient(hap.endpoint)

        def node0() -> ServerState:
            return next(s for s in rc.show_servers_state("vllm_chat") if s.name == "node0")

        t = [1000.0]
        lat = {b.addr: 0.02 for b in backends}
        prom = FakeProm(lambda q: samples(lat, t[0]) if q == LAT_Q else
                        samples({k: 5.0 for k in lat}, t[0]) if q == RATE_Q else [], [])
        ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [rc], prom, canary=_canary,
                              clock=lambda: t[0])

        def st0() -> NodeState:
            return ctl.states["chat"]["node0"]
        ctl.tick()  # before the errors: every node healthy, HAProxy's counters seen
        assert st0().state == HEALTHY and node0().hanafail == 0

        def marked() -> bool:
            _post(port, b"x" * 32768)
            return node0().marked_down_for_errors
        wait_until(marked, 20, interval_s=0.0, what="HAProxy marking node0 DOWN for errors")
        assert node0().hanafail >= 1
        # its health check (/health answers 200) puts it back UP before the controller's next tick: the HANA
        # status is gone, the counter is not
        wait_until(lambda: node0().op_state == 2, 15, what="node0's health check marking it UP")
        assert not node0().marked_down_for_errors
        t[0] += 5
        ctl.tick()
        assert st0().state == QUARANTINED and st0().cause == DrainCause.GATEWAY and REFLEX in st0().reason
        assert node0().drain
        t[0] += 5
        ctl.tick()  # and it stays drained
        assert st0().state == QUARANTINED and node0().drain
        assert bad.hits > 0
        before = bad.hits
        for _ in range(6):  # drained: no client request reaches it
            assert _post(port, b"hi") == 200
        assert bad.hits == before

        # canaries: failing while it answers 500, then good ones bring it back in slow start
        t[0] += ctl.cfg.recovery.canary_interval_s - 5
        ctl.tick()
        assert st0().state == CANARY
        def canary_round() -> None:  # a round starts (off the tick), its canaries answer, the next tick decides it
            t[0] += ctl.cfg.recovery.canary_interval_s
            tick_settled(ctl)
            t[0] += 1
            ctl.tick()
        canary_round()
        assert st0().state == CANARY and st0().canary_ok == 0 and "failed" in st0().reason and node0().drain
        bad.mode = "ok"
        for _ in range(ctl.cfg.recovery.canary_successes):
            canary_round()
        assert st0().state == SLOW_START
        s = node0()
        assert not s.drain and s.weight == round(100 * ctl.cfg.recovery.slow_start_initial)
    finally:
        hap.stop()
        for b in backends:
            b.close()
