"""The controller and the agent check agree: a server its exporter's agent marked DOWN (garbage text, a CUDA error,
a hang) is quarantined with the reflex named; agents never take more than the safeguard cap out of a pool: the
controller disables the excess agents, and re-arms them once their probe is healthy, it drains them, or there is room.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import RecoveryConfig, ThresholdsConfig
from grayguard.controller.haproxy import (
    CHK_ST_CONFIGURED,
    CHK_ST_ENABLED,
    Command,
    RuntimeClient,
    ServerState,
    parse_servers_state,
)
from grayguard.controller.plan import plan_backend
from grayguard.controller.policy import (
    EJECTED,
    HEALTHY,
    QUARANTINED,
    NodeInput,
    NodeState,
    Policy,
    decide_pool,
    max_ejected,
)
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import free_port, wait_until
from grayguard.reflexes import DEFAULT, backend_lines
from grayguard.vocab import DrainCause
from tests.localstack.test_reflexes import Backend
from tests.support.ctl_helpers import LAT_Q, RATE_Q, FakeProm, fake_controller, samples

P = Policy()
AGENT = "agent check marked it DOWN"
AGENT_DOWN = {"down": True, "agent_down": True, "probe_result": "bad_response"}
HEADER = ("# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
          "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
          "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord")
ON = 0x10 | CHK_ST_CONFIGURED | CHK_ST_ENABLED  # an agent check, configured and enabled (22)
OFF = 0x10 | CHK_ST_CONFIGURED  # configured, disabled by `disable agent` (18)


def _inputs(n=4, **kw) -> dict[str, NodeInput]:
    out = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result="ok") for i in range(n)}
    for name, fields in kw.items():
        out[name] = replace(out[name], **fields)
    return out


def _prev(n=4) -> dict[str, NodeState]:
    return {f"n{i}": NodeState(since=0.0, ema=0.02) for i in range(n)}


def _states(d) -> dict[str, NodeState]:
    return {n: nd.state for n, nd in d.nodes.items()}


# -- reading HAProxy ------------------------------------------------------------------------------------------------

def test_agent_state_and_agent_down_are_read_from_haproxy():
    def one(op: int, agent: int, status: str | None) -> ServerState:
        line = f"3 b 1 a 127.0.0.1 {op} 0 100 100 1 15 3 4 6 {agent} 0 0 - 8000 -"
        return replace(parse_servers_state(f"1\n{HEADER}\n{line}\n")[0], status=status)
    down = one(0, ON, "DOWN (agent)")
    assert down.agent_down and not down.agent_off and not down.marked_down_for_errors
    assert not one(0, ON, "DOWN").agent_down  # its health check, not its agent
    assert not one(2, ON, "UP").agent_down
    assert one(2, OFF, "UP").agent_off and not one(2, ON, "UP").agent_off
    assert not one(2, 0, "UP").agent_off  # no agent configured: nothing to re-arm


# -- the pure core --------------------------------------------------------------------------------------------------

def test_a_server_its_agent_marked_down_is_quarantined_with_the_reflex_named():
    d = decide_pool(_prev(), _inputs(n1=AGENT_DOWN), P, 100.0)
    nd = d.nodes["n1"]
    assert nd.state.state == QUARANTINED and nd.drain and nd.state.cause == DrainCause.GATEWAY
    assert AGENT in nd.state.reason and "bad_response" in nd.state.reason
    assert d.agent_off == frozenset() and all(d.nodes[n].state.state == HEALTHY for n in ("n0", "n2", "n3"))


def test_agents_past_the_cap_are_released_and_the_rest_quarantined():
    """A probe prompt whose first token is half a UTF-8 character, or a bad model everywhere: every agent says
    down. HAProxy would empty the pool; the controller keeps at most the cap out."""
    pol = Policy(ThresholdsConfig(max_ejected_fraction=0.25), RecoveryConfig())  # 4 nodes: cap 1
    everyone = {f"n{i}": AGENT_DOWN for i in range(4)}
    d = decide_pool(_prev(), _inputs(**everyone), pol, 100.0)
    assert d.agent_off == {"n0", "n1", "n2"} and d.out_of_rotation == 1
    assert all("agent check disabled" in d.nodes[n].state.reason for n in d.agent_off)
    assert not any(nd.drain for nd in d.nodes.values())  # nothing drained yet: n3 is DOWN, the cap is spent
    # next tick: the released three are UP by their health checks (agent off), n3 is still DOWN (agent)
    released = {n: {"agent_off": True, "probe_result": "bad_response"} for n in d.agent_off}
    d = decide_pool(_states(d), _inputs(**released, n3=AGENT_DOWN), pol, 105.0)
    assert d.agent_off == {"n0", "n1", "n2"}  # kept released: their probe still fails and the pool has no room
    assert d.nodes["n3"].state.state == QUARANTINED and d.nodes["n3"].drain
    assert sum(nd.state.state in EJECTED for nd in d.nodes.values()) == 1
    # a released node whose probe is healthy again is re-armed (its agent says up now)
    d = decide_pool(_states(d), _inputs(n0={"agent_off": True}, n1=released["n1"], n2=released["n2"],
                                        n3={"probe_result": "bad_response"}), pol, 110.0)
    assert d.agent_off == {"n1", "n2"}


def test_a_released_agent_is_re_armed_when_there_is_room():
    pol = Policy(ThresholdsConfig(max_ejected_fraction=0.25), RecoveryConfig())
    d = decide_pool(_prev(), _inputs(n1={"agent_off": True, "probe_result": "bad_response"}), pol, 100.0)
    assert d.agent_off == frozenset()  # room for one: its agent may take it out again, within the cap


def test_an_operator_maint_node_is_left_alone():
    d = decide_pool(_prev(), _inputs(n1={"hold": True, "agent_off": True, "probe_result": "bad_response"},
                                     n2=AGENT_DOWN, n3=AGENT_DOWN), P, 100.0)
    assert "n1" not in d.agent_off


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10), st.data(), st.sampled_from([0.0, 0.25, 0.5]))
def test_agents_never_take_more_than_the_cap_out(n, data, fraction):
    """Whatever the agents, health checks and the operator do, once the controller's agent writes are applied at
    most the cap is out of rotation (an operator's MAINT and a health-check DOWN are not the controller's to undo)."""
    flags = data.draw(st.lists(st.sampled_from(["", "agent", "agent-off", "down", "maint"]), min_size=n, max_size=n))
    inputs = {f"n{i}": NodeInput(base_weight=100, latency=0.02, request_rate=5.0, probe_result="bad_response",
                                 down=f in ("agent", "down"), agent_down=f == "agent", agent_off=f == "agent-off",
                                 hold=f == "maint") for i, f in enumerate(flags)}
    pol = Policy(ThresholdsConfig(max_ejected_fraction=fraction), RecoveryConfig())
    d = decide_pool({}, inputs, pol, 100.0)
    cap = max_ejected(n, fraction)
    forced = sum(1 for i in inputs.values() if i.hold or (i.down and not i.agent_down))
    out_after = forced + sum(1 for k, i in inputs.items() if i.agent_down and k not in d.agent_off) \
        + sum(1 for k, nd in d.nodes.items() if nd.state.state in EJECTED and not inputs[k].down and not inputs[k].hold)
    assert out_after <= max(cap, forced)
    assert all(inputs[k].agent_down or inputs[k].agent_off for k in d.agent_off)  # only agents are released


# -- plan: the runtime API writes -----------------------------------------------------------------------------------

def _server(name: str, agent: int | None) -> ServerState:
    return ServerState("be", name, "127.0.0.1:1", 100, 100, 0, 2, agent_state=agent)


def test_plan_disables_and_re_enables_agents_level_triggered():
    d = decide_pool(_prev(3), _inputs(3), P, 100.0)
    actual = {"n0": _server("n0", ON), "n1": _server("n1", OFF), "n2": _server("n2", None)}
    ch = plan_backend("chat", "be", d.nodes, actual, agent_off={"n0", "n2"})
    cmds = [c.command.render() for c in ch]
    # n0 disabled; n1 (off, not wanted off) re-enabled; n2 has no agent configured: nothing
    assert cmds == ["disable agent be/n0", "enable agent be/n1"]
    converged = {"n0": _server("n0", OFF), "n1": _server("n1", ON), "n2": _server("n2", None)}
    assert plan_backend("chat", "be", d.nodes, converged, agent_off={"n0", "n2"}) == []
    assert Command("be", "n0", "agent", "disable").render() == "disable agent be/n0"


def test_the_shipped_backend_has_an_agent_check():
    line = next(ln for ln in backend_lines() if ln.startswith("default-server"))
    assert f"agent-check agent-port {DEFAULT.agent_port} agent-inter 500ms" in line


# -- with a real HAProxy ----------------------------------------------------------------------------------------

class StandInAgent:
    """A TCP agent answering one fixed line per connection (the exporter's agent is tested in tests/exporters)."""

    def __init__(self, answer: str = "up"):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c, contextlib.suppress(OSError):
                c.sendall((self.answer + "\n").encode())

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_real_haproxy_agent_down_is_quarantined_and_agents_past_the_cap_are_disabled(tmp_path):
    backends = [Backend("ok") for _ in range(4)]
    agents = [StandInAgent() for _ in range(4)]
    reflexes = replace(DEFAULT, agent_inter_s=0.2, check_inter_s=0.3)
    port = free_port()
    servers = [(f"node{i}", b.addr, 100, a.port) for i, (b, a) in enumerate(zip(backends, agents, strict=True))]
    hap = HaproxyProc(tmp_path, haproxy_config(tmp_path / "admin.sock", {"vllm_chat": servers},
                                               frontend_port=port, reflexes=reflexes))
    hap.start()
    try:
        rc = RuntimeClient(hap.endpoint)

        def srv(name: str) -> ServerState:
            return next(s for s in rc.show_servers_state("vllm_chat") if s.name == name)

        t = [1000.0]
        lat = {b.addr: 0.02 for b in backends}
        prom = FakeProm(lambda q: samples(lat, t[0]) if q == LAT_Q else
                        samples({k: 5.0 for k in lat}, t[0]) if q == RATE_Q else [], [])
        ctl = fake_controller([{"name": "chat", "backend": "vllm_chat"}], [rc], prom, canary=lambda url: None,
                              clock=lambda: t[0], extra={"thresholds": {"max_ejected_fraction": 0.25}})  # cap 1
        wait_until(lambda: all(srv(f"node{i}").op_state == 2 for i in range(4)), 10, what="every server UP")
        ctl.tick()
        assert all(s.state == HEALTHY for s in ctl.states["chat"].values())

        agents[1].answer = "down #probe bad_response: garbage text"
        wait_until(lambda: srv("node1").agent_down, 10, what="node1 DOWN (agent)")
        t[0] += 5
        ctl.tick()
        st1 = ctl.states["chat"]["node1"]
        assert st1.state == QUARANTINED and st1.cause == DrainCause.GATEWAY and AGENT in st1.reason
        assert "(probe bad_response: garbage text)" in st1.reason  # the agent's own words, from last_agt
        assert srv("node1").drain

        # the agent says up again: HAProxy puts it UP, the controller keeps it drained until canaries pass
        agents[1].answer = "up"
        wait_until(lambda: srv("node1").op_state == 2, 10, what="node1 UP again")
        t[0] += 5
        ctl.tick()
        assert ctl.states["chat"]["node1"].state == QUARANTINED and srv("node1").drain

        # every other agent says down at once: with node1 drained the cap (1) is spent, so their agents are
        # disabled and HAProxy follows their health checks: they stay in rotation
        for a in (agents[0], agents[2], agents[3]):
            a.answer = "down #probe bad_response: garbage text"
        wait_until(lambda: all(srv(f"node{i}").agent_down for i in (0, 2, 3)), 10, what="three DOWN (agent)")
        t[0] += 5
        ctl.tick()
        wait_until(lambda: all(srv(f"node{i}").op_state == 2 for i in (0, 2, 3)), 10,
                   what="the released servers UP by their health checks")
        assert all(srv(f"node{i}").agent_off for i in (0, 2, 3)) and not srv("node1").agent_off
        t[0] += 5
        ctl.tick()  # converged: nothing flaps back
        assert all(srv(f"node{i}").agent_off and srv(f"node{i}").op_state == 2 for i in (0, 2, 3))
        assert sum(s.state in EJECTED for s in ctl.states["chat"].values()) == 1
    finally:
        hap.stop()
        for b in backends:
            b.close()
        for a in agents:
            a.close()


def test_the_agents_words_are_read_from_last_agt():
    from grayguard.controller.haproxy import agent_answer
    assert agent_answer("via agent : down (hang: no token in 2.0s (3 other requests in the engine))") == \
        "hang: no token in 2.0s (3 other requests in the engine)"
    assert agent_answer("via agent : up") == "up"
    assert agent_answer("") is None and agent_answer(None) is None
    assert agent_answer("via agent : down (x\x1b[31my)") == "x[31my"  # printable only
