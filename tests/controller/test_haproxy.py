import socket
import threading

import pytest
import responses

from grayguard.controller.haproxy import Command, HaproxyError, RuntimeClient, UnsafeNameError, check_name
from grayguard.controller.statefile import StateFile
from tests.support.ctl_helpers import make_controller, prom_answers, servers

ADDRS = [f"127.0.0.1:{9100 + i}" for i in range(4)]
SICK = {a: (0.2 if a.endswith("9100") else 0.02) for a in ADDRS}


def weights(client, backend="vllm_chat"):
    return {s.name: (s.weight, s.drain) for s in client.show_servers_state(backend)}


def tick(ctl, lat=SICK):
    with responses.RequestsMock() as rsps:
        prom_answers(rsps, lat, now=ctl.clock())
        return ctl.tick()


def test_weights_and_states_applied_then_second_tick_writes_nothing(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    r = tick(ctl)
    c = RuntimeClient(hap.endpoint)
    assert weights(c)["node0"][0] < 100 and not weights(c)["node0"][1]
    assert r.changes and all(ch.command.server == "node0" for _, ch in r.changes)
    for _ in range(2):  # sustained: quarantined (drained, weight 0)
        t[0] += 5
        tick(ctl)
    assert weights(c)["node0"] == (0, True)
    assert c.get_weight("vllm_chat", "node0") == (0, 100)
    assert {n: w for n, w in weights(c).items() if n != "node0"} == {f"node{i}": (100, False) for i in (1, 2, 3)}
    t[0] += 5
    r = tick(ctl)
    assert r.changes == []  # converged: nothing written


def test_restarted_haproxy_is_repaired(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0])
    for _ in range(3):
        tick(ctl)
        t[0] += 5
    c = RuntimeClient(hap.endpoint)
    assert weights(c)["node0"] == (0, True)
    hap.restart()  # runtime weights are lost on restart
    assert weights(c)["node0"] == (100, False)
    r = tick(ctl)
    assert weights(c)["node0"] == (0, True)
    assert len(r.changes) == 2


def test_all_haproxies_of_a_tier_get_the_same_weights(haproxy_factory):
    a = haproxy_factory({"vllm_chat": servers(4)})
    b = haproxy_factory({"vllm_chat": servers(4)})
    ctl = make_controller([a.endpoint, b.endpoint])
    tick(ctl)
    assert weights(RuntimeClient(a.endpoint)) == weights(RuntimeClient(b.endpoint))
    assert weights(RuntimeClient(b.endpoint))["node0"][0] < 100


@pytest.mark.parametrize("name", ["node0;shutdown sessions", "node0 weight 0", "node0\nset", "", "a/b"])
def test_unsafe_names_refused_before_anything_is_sent(name):
    # a listener that records whether anything connected: nothing may
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    client = RuntimeClient(f"127.0.0.1:{port}")
    with pytest.raises(UnsafeNameError):
        client.apply([Command("vllm_chat", "node1", "weight", 50), Command("vllm_chat", name, "weight", 0)])
    with pytest.raises(UnsafeNameError):
        check_name(name)
    with pytest.raises(socket.timeout):
        srv.accept()
    srv.close()


def test_unknown_server_is_reported(haproxy_factory, caplog):
    hap = haproxy_factory({"vllm_chat": servers(3)})
    c = RuntimeClient(hap.endpoint)
    res = c.apply([Command("vllm_chat", "ghost", "weight", 10), Command("vllm_chat", "node1", "weight", 10)])
    assert [(r.ok, r.kind) for r in res] == [(False, "no_such_server"), (True, "")]
    ctl = make_controller([hap.endpoint], extra={"pools": [{"name": "chat", "backend": "vllm_chat",
                                                           "servers": {"ghost": {"peer_group": "x"}}}]})
    tick(ctl)
    assert "configured server 'ghost' is not in HAProxy backend" in caplog.text
    with pytest.raises(HaproxyError) as e:
        c.get_weight("vllm_chat", "ghost")
    assert e.value.kind == "no_such_server"


def test_static_algorithm_is_reported_at_startup(haproxy_factory):
    from grayguard.controller.cmd_controller import startup_checks
    hap = haproxy_factory({"vllm_chat": servers(3)}, balance="static-rr")
    ctl = make_controller([hap.endpoint])
    problems = startup_checks(ctl)
    assert any("static-rr" in p for p in problems)
    res = RuntimeClient(hap.endpoint).apply([Command("vllm_chat", "node0", "weight", 50)])
    assert res[0].kind == "static_algorithm"


def test_unreachable_haproxy_holds_and_counts(tmp_path):
    ctl = make_controller([f"unix:{tmp_path}/nope.sock"])
    r = ctl.tick()
    assert r.held == "no HAProxy endpoint answered"
    assert ctl.metrics.registry.get_sample_value(
        "grayguard_haproxy_errors_total", {"endpoint": f"unix:{tmp_path}/nope.sock", "kind": "connect"}) == 1


def test_state_survives_restart_and_dry_run_writes_nothing(haproxy_factory, tmp_path):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    sf = tmp_path / "state.json"
    t = [1000.0]
    ctl = make_controller([hap.endpoint], clock=lambda: t[0], state_file=StateFile(sf))
    for _ in range(3):
        tick(ctl)
        t[0] += 5
    assert '"quarantined"' in sf.read_text()
    c = RuntimeClient(hap.endpoint)
    hap.restart()
    dry = make_controller([hap.endpoint], clock=lambda: t[0], state_file=StateFile(sf), dry_run=True)
    r = tick(dry)
    assert len(r.changes) == 2 and weights(c)["node0"] == (100, False)  # planned, not written
    again = make_controller([hap.endpoint], clock=lambda: t[0], state_file=StateFile(sf))
    assert again.states["chat"]["node0"].state == "quarantined"
    tick(again)
    assert weights(c)["node0"] == (0, True)


def test_one_batch_of_1000_weight_changes(haproxy_factory):
    hap = haproxy_factory({"big": [(f"n{i}", f"127.0.0.1:{20000 + i}", 100) for i in range(1000)]})
    c = RuntimeClient(hap.endpoint)
    res = c.apply([Command("big", f"n{i}", "weight", i % 256) for i in range(1000)])
    assert all(r.ok for r in res) and len(res) == 1000
    got = {s.name: s.weight for s in c.show_servers_state("big")}
    assert got == {f"n{i}": i % 256 for i in range(1000)}


def test_concurrent_readers_do_not_interfere(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    c = RuntimeClient(hap.endpoint)
    errs = []

    def read():
        try:
            for _ in range(20):
                assert len(c.show_servers_state("vllm_chat")) == 4
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=read) for _ in range(4)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert errs == []


def test_example_gateway_config_is_valid(tmp_path):
    import subprocess
    from pathlib import Path
    text = Path("haproxy/haproxy.example.cfg").read_text()
    text = text.replace("/run/haproxy/admin.sock", str(tmp_path / "admin.sock"))
    text = text.replace("/var/lib/haproxy/server-state", str(tmp_path / "state"))
    (tmp_path / "h.cfg").write_text(text)
    p = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_backends_of_a_sharded_replica_read_as_the_whole_table_shows_them(haproxy_factory):
    """show_backends_state (a replica leading part of the pools, controller/readscope.py): the servers of the
    backends asked for, as the whole table has them (states, weights, hanafail, status); a backend HAProxy lacks
    left out as the whole table leaves it out; nothing asked, nothing sent."""
    # "2": a backend named like another proxy's id ("a" is proxy 2): `show stat 2` must be the backend's own rows
    hap = haproxy_factory({"a": servers(3), "b": servers(2, base_port=9200), "c": servers(4, base_port=9300),
                           "2": servers(1, base_port=9400)})
    c = RuntimeClient(hap.endpoint)
    c.apply([Command("b", "node1", "weight", 7), Command("c", "node0", "state", "drain")])
    whole = c.show_servers_state()
    assert all(s.status for s in whole)  # the stat columns are there to compare
    got = c.show_backends_state(["c", "missing", "b", "2"])
    assert sorted(got, key=lambda s: (s.backend, s.name)) == sorted(
        (s for s in whole if s.backend in ("b", "c", "2")), key=lambda s: (s.backend, s.name))
    assert {(s.backend, s.name): (s.weight, s.drain) for s in got}[("b", "node1")] == (7, False)
    assert {(s.backend, s.name): s.drain for s in got}[("c", "node0")]
    assert c.show_backends_state([]) == []
    with pytest.raises(UnsafeNameError):
        c.show_backends_state(["b", "x;y"])
