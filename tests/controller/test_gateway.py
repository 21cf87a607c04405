"""The gateway seam (controller/gateway.py) and NGINX's upstream files (controller/nginx.py) without a process: the
file's text, the weight mapping, level-triggered writes, failures put back and classified, and the control loop
steering a fake NGINX (every `nginx` run recorded, none executed). Real nginx: tests/controller/test_nginx.py."""

import argparse
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.config import parse_config
from grayguard.controller.gateway import Gateway, GatewayError, build_gateways
from grayguard.controller.haproxy import Command, HaproxyError, RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.nginx import NginxGateway
from grayguard.controller.nginxfile import NginxError, Server, parse_file, render_file
from grayguard.controller.policy import QUARANTINED, SLOW_START
from tests.support.ctl_helpers import OPTIONAL, PROM, FakeProm, samples

LAT_Q = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
RATE_Q = "instance:vllm_request_rate:rate30s"
NODES = {f"node{i}": f"127.0.0.1:{9100 + i}" for i in range(4)}


def nginx_doc(tmp_path, **servers_extra):
    servers = {n: {"address": a, **servers_extra.get(n, {})} for n, a in NODES.items()}
    return {"prometheus": {"url": PROM}, "state_file": None,
            "gateway": {"kind": "nginx", "nginx": {"upstream_dir": str(tmp_path / "up"),
                                                   "conf": str(tmp_path / "nginx.conf")}},
            "pools": [{"name": "chat", "backend": "vllm_chat", "servers": servers}],
            "signals": {f"{k}_query": "" for k in OPTIONAL}}


class FakeNginx:
    """subprocess.run's seam: records every argv; fails the runs named in fail (check_failed: -t, reload_failed:
    -s reload, timeout: any)."""

    def __init__(self):
        self.runs, self.fail = [], set()

    def __call__(self, argv, **kw):
        self.runs.append(argv)
        if "timeout" in self.fail:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])
        failed = ("-t" in argv and "check" in self.fail) or ("reload" in argv and "reload" in self.fail)
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "", "nginx: [emerg] rejected" if failed else "")

    def reloads(self):
        return sum("reload" in a for a in self.runs)


def gateway(tmp_path, **servers_extra):
    cfg = parse_config(nginx_doc(tmp_path, **servers_extra))
    fake = FakeNginx()
    gw = NginxGateway(cfg.gateway.nginx, cfg.pools, run=fake)
    gw.prepare()
    return gw, fake


# ---- the seam ----------------------------------------------------------------------------------------------------
def test_both_gateways_are_the_seam_and_their_errors_are_gateway_errors(tmp_path):
    cfg = parse_config(nginx_doc(tmp_path))
    [gw] = build_gateways(cfg)
    assert isinstance(gw, NginxGateway) and isinstance(gw, Gateway)
    hap = build_gateways(parse_config({"haproxy": {"endpoints": ["unix:/a.sock", "127.0.0.1:9999"]},
                                       "pools": [{"name": "chat", "backend": "vllm_chat"}]}))
    assert [type(h) for h in hap] == [RuntimeClient, RuntimeClient] and all(isinstance(h, Gateway) for h in hap)
    assert issubclass(HaproxyError, GatewayError) and issubclass(NginxError, GatewayError)


# ---- the file ----------------------------------------------------------------------------------------------------
servers_st = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.-]{0,8}", fullmatch=True),
                             st.tuples(st.integers(0, 256), st.booleans()), min_size=1, max_size=6)


@given(servers_st)
def test_the_file_reads_back_what_was_written_and_nginx_never_gets_weight_0(servers):
    written = [Server(n, f"10.0.0.{i}:8000", w, d) for i, (n, (w, d)) in enumerate(sorted(servers.items()))]
    text = render_file("chat", "vllm_chat", reversed(written))
    assert parse_file(text, "f") == {s.node: s for s in written}
    for s, line in zip(written, [ln for ln in text.splitlines() if not ln.startswith("#")], strict=True):
        directive = line.split(";")[0]
        assert directive.endswith(" down") == (s.drain or s.weight == 0)  # NGINX's weight must be >= 1
        assert "weight=0" not in directive


@pytest.mark.parametrize("line", [
    "server 127.0.0.1:9 weight=5;",  # no grayguard comment: hand-written
    "server 127.0.0.1:9 weight=5;  # grayguard node=a weight=7",  # the directive and the comment disagree
    "server 127.0.0.1:9 weight=5;  # grayguard node=a weight=5 drain",  # drained but not down
    "server 127.0.0.1:9 weight=300;  # grayguard node=a weight=300",
    "server 127.0.0.1:9 max_fails=0 weight=5;  # grayguard node=a weight=5",
])
def test_a_line_grayguard_would_not_write_is_refused_naming_the_file_and_line(line):
    with pytest.raises(NginxError) as e:
        parse_file(f"# header\n{line}\n", "/etc/nginx/grayguard/vllm_chat.conf")
    assert e.value.kind == "bad_file" and "vllm_chat.conf:2" in str(e.value)


def test_servers_come_from_the_config_at_their_full_weight(tmp_path):
    gw, fake = gateway(tmp_path, node1={"weight": 50})
    got = {s.name: (s.address, s.weight, s.initial_weight, s.drain, s.down) for s in gw.show_servers_state()}
    assert got == {n: (a, 50 if n == "node1" else 100, 50 if n == "node1" else 100, False, False)
                   for n, a in NODES.items()}
    assert fake.runs == []  # prepare writes the files; NGINX is not running yet: no reload


def test_a_configured_server_the_file_lacks_reads_drained_at_weight_0(tmp_path):
    gw, _ = gateway(tmp_path)
    path = gw.path("vllm_chat")
    path.write_text("\n".join(ln for ln in path.read_text().splitlines() if "node=node3 " not in ln) + "\n")
    s = {s.name: s for s in gw.show_servers_state("vllm_chat")}["node3"]
    assert (s.weight, s.drain) == (0, True)  # it gets no traffic through NGINX: so it reads


def test_a_missing_file_or_unknown_backend_is_a_classified_error(tmp_path):
    gw, _ = gateway(tmp_path)
    gw.path("vllm_chat").unlink()
    with pytest.raises(NginxError) as e:
        gw.show_servers_state()
    assert e.value.kind == "no_file"
    with pytest.raises(NginxError) as e:
        gw.show_servers_state("other")
    assert e.value.kind == "no_such_backend"


# ---- writes ------------------------------------------------------------------------------------------------------
def test_a_batch_writes_once_checks_then_reloads_and_the_same_batch_again_does_nothing(tmp_path):
    gw, fake = gateway(tmp_path)
    batch = [Command("vllm_chat", "node1", "state", "drain"), Command("vllm_chat", "node1", "weight", 0),
             Command("vllm_chat", "node2", "weight", 40)]
    assert all(r.ok for r in gw.apply(batch))
    assert [a[-2:] for a in fake.runs] == [["-t", "-q"], ["-s", "reload"]]
    assert fake.runs[0][:5] == ["nginx", "-e", "stderr", "-c", str(tmp_path / "nginx.conf")]
    got = {s.name: (s.weight, s.drain) for s in gw.show_servers_state()}
    assert got == {"node0": (100, False), "node1": (0, True), "node2": (40, False), "node3": (100, False)}
    text = gw.path("vllm_chat").read_text()
    assert "server 127.0.0.1:9101 down;" in text and "server 127.0.0.1:9102 weight=40;" in text
    assert all(r.ok for r in gw.apply(batch))  # level-triggered: the same state again writes nothing
    assert len(fake.runs) == 2 and gw.reloads == 1


@pytest.mark.parametrize("fail,kind", [("check", "check_failed"), ("reload", "reload_failed"), ("timeout", "timeout")])
def test_a_rejected_file_is_put_back_and_the_error_classified(tmp_path, fail, kind):
    gw, fake = gateway(tmp_path)
    before = gw.path("vllm_chat").read_text()
    fake.fail.add(fail)
    with pytest.raises(NginxError) as e:
        gw.apply([Command("vllm_chat", "node1", "weight", 10)])
    assert e.value.kind == kind
    assert gw.path("vllm_chat").read_text() == before and gw.reloads == 0
    assert not list(gw.path("vllm_chat").parent.glob(".*"))  # no temp file left behind
    fake.fail.clear()  # the next tick plans the same write again: it goes through
    assert gw.apply([Command("vllm_chat", "node1", "weight", 10)])[0].ok and gw.reloads == 1


def test_commands_nginx_cannot_take_are_refused_one_by_one_and_the_rest_applies(tmp_path):
    gw, fake = gateway(tmp_path)
    res = gw.apply([Command("vllm_chat", "ghost", "weight", 10), Command("vllm_chat", "node0", "agent", "disable"),
                    Command("vllm_chat", "node0", "state", "maint"), Command("vllm_chat", "node0", "weight", 30)])
    assert [(r.ok, r.kind) for r in res] == [(False, "no_such_server"), (False, "unsupported"),
                                             (False, "unsupported"), (True, "")]
    assert {s.name: s.weight for s in gw.show_servers_state()}["node0"] == 30 and fake.reloads() == 1


def test_a_server_no_longer_configured_leaves_the_file_at_the_next_write(tmp_path):
    gw, _ = gateway(tmp_path)
    doc = nginx_doc(tmp_path)
    del doc["pools"][0]["servers"]["node3"]
    cfg = parse_config(doc)
    gw2 = NginxGateway(cfg.gateway.nginx, cfg.pools, run=FakeNginx())
    assert "node=node3 " in gw2.path("vllm_chat").read_text()
    gw2.apply([Command("vllm_chat", "node0", "weight", 50)])
    assert "node=node3 " not in gw2.path("vllm_chat").read_text()


# ---- the loop ----------------------------------------------------------------------------------------------------
def controller(tmp_path, answers, clock):
    cfg = parse_config({**nginx_doc(tmp_path), "rules": {"control_interval": "15s"}})
    fake = FakeNginx()
    gw = NginxGateway(cfg.gateway.nginx, cfg.pools, run=fake)
    gw.prepare()
    return Controller(cfg, FakeProm(answers, []), [gw], metrics=ControllerMetrics.create(), clock=clock), gw, fake


def test_the_loop_cuts_a_slow_node_in_the_file_and_a_converged_tick_writes_nothing(tmp_path):
    now = [1000.0]
    lat = {a: 0.02 for a in NODES.values()}

    def answers(q):
        if q == LAT_Q:
            return samples(lat, now[0])
        return samples({a: 5.0 for a in NODES.values()}, now[0]) if q == RATE_Q else []

    ctl, gw, fake = controller(tmp_path, answers, lambda: now[0])
    for _ in range(3):
        r = ctl.tick()
        now[0] += 1
        assert not r.errors and not r.changes
    assert fake.runs == []
    lat[NODES["node2"]] = 0.4  # 20x its peers
    seen = [(100, False)]
    for _ in range(40):
        ctl.tick()
        now[0] += 1
        w = {s.name: (s.weight, s.drain) for s in gw.show_servers_state()}["node2"]
        if seen[-1] != w:
            seen.append(w)
        if w[1]:
            break
    assert seen[-1] == (0, True) and fake.reloads() == len(seen) - 1, seen  # one reload per change, no other
    assert "server 127.0.0.1:9102 down;" in gw.path("vllm_chat").read_text()
    m = ctl.metrics.registry
    assert m.get_sample_value("grayguard_haproxy_writes_total", {"endpoint": gw.endpoint, "kind": "state"}) == 1


def test_a_fresh_controller_does_not_undo_what_the_file_says_another_controller_decided(tmp_path):
    """A restart mid-incident (no state file) or a second controller: the upstream file is the gateway's state, so a
    drained node and a cut weight are seeded from it as from HAProxy's servers state
    (tests/controller/test_trust_decisions.py), and nothing is put back at full weight on the first ticks. (Four
    nodes: the cap keeps one out of rotation; a second one out would be released by the cap, as on HAProxy.)"""
    now = [1000.0]
    healthy = {a: 0.02 for n, a in NODES.items() if n != "node0"}  # the drained node: no traffic
    ctl_a, gw, fake = controller(tmp_path, lambda q: [], lambda: now[0])
    # what controller A left behind: node0 drained, node1 cut to 40
    left = {"node0": (100, True), "node1": (40, False), "node2": (100, False), "node3": (100, False)}
    gw.write(ctl_a.cfg.pools[0], [Server(n, NODES[n], w, d) for n, (w, d) in left.items()])
    reloads = fake.reloads()

    def answers(q):
        return samples(healthy if q == LAT_Q else {a: 5.0 for a in healthy}, now[0]) if q in (LAT_Q, RATE_Q) else []

    b = Controller(ctl_a.cfg, FakeProm(answers, []), [gw], metrics=ControllerMetrics.create(), clock=lambda: now[0])
    for _ in range(3):
        b.tick()
        now[0] += 1
        got = {s.name: (s.weight, s.drain) for s in gw.show_servers_state()}
        assert got["node0"][1], "the fresh controller readied a drained node"
        assert got["node1"][0] < 100, "a cut weight must not come back to full weight at once"
        assert got["node2"] == got["node3"] == (100, False)
    states = b.states["chat"]
    assert states["node0"].state == QUARANTINED and states["node1"].state == SLOW_START
    assert fake.reloads() - reloads <= 1  # at most node1's ramp step: nothing undone


def test_the_loop_counts_an_nginx_error_and_holds_without_a_file(tmp_path):
    ctl, gw, _ = controller(tmp_path, lambda q: [], lambda: 1000.0)
    gw.path("vllm_chat").unlink()
    r = ctl.tick()
    assert r.held == "the nginx gateway did not answer" and any("missing" in e for e in r.errors)
    assert ctl.metrics.registry.get_sample_value("grayguard_haproxy_errors_total",
                                                 {"endpoint": gw.endpoint, "kind": "no_file"}) == 1


def test_a_raise_waits_for_the_reload_interval_and_a_cut_never_does(tmp_path):
    now = [100.0]
    cfg = parse_config(nginx_doc(tmp_path))
    fake = FakeNginx()
    gw = NginxGateway(cfg.gateway.nginx, cfg.pools, run=fake, clock=lambda: now[0])
    gw.prepare()
    assert cfg.gateway.nginx.min_reload_interval_s == 5.0
    assert gw.apply([Command("vllm_chat", "node1", "weight", 10)])[0].ok  # a cut: at once
    now[0] += 1
    r = gw.apply([Command("vllm_chat", "node1", "weight", 30), Command("vllm_chat", "ghost", "weight", 1)])
    assert [(x.ok, x.kind) for x in r] == [(False, "deferred"), (False, "no_such_server")]
    assert "deferred 4.0s" in r[0].reply and fake.reloads() == 1  # a ramp's step waits: nothing written
    assert gw.apply([Command("vllm_chat", "node2", "weight", 50)])[0].ok and fake.reloads() == 2  # a cut: at once
    now[0] += 5
    assert gw.apply([Command("vllm_chat", "node1", "weight", 30)])[0].ok and fake.reloads() == 3
    assert {s.name: s.weight for s in gw.show_servers_state()} == {"node0": 100, "node1": 30, "node2": 50,
                                                                    "node3": 100}


def test_the_loop_counts_a_deferred_change_as_neither_a_write_nor_an_error(tmp_path):
    now = [1000.0]
    ctl, gw, fake = controller(tmp_path, lambda q: samples({a: 0.02 for a in NODES.values()}, now[0])
                               if q in (LAT_Q, RATE_Q) else [], lambda: now[0])
    gw.clock = lambda: now[0]
    gw.write(ctl.cfg.pools[0], [Server(n, a, 60 if n == "node1" else 100, False) for n, a in NODES.items()])
    assert not ctl.tick().changes  # node1 at 60 of 100 with no state: seeded in slow start at 60 %
    now[0] += 30  # its ramp raises it (20 % a minute) ...
    gw._reloaded_at["vllm_chat"] = now[0]  # ... right after a reload
    r = ctl.tick()
    assert r.changes and not r.failed and not r.errors, (r.changes, r.errors)
    m = ctl.metrics.registry
    assert m.get_sample_value("grayguard_haproxy_writes_total", {"endpoint": gw.endpoint, "kind": "weight"}) is None
    assert {s.name: s.weight for s in gw.show_servers_state()}["node1"] == 60


def test_the_demo_takes_gateway_nginx_and_its_membership_scenario_refuses_it(capsys):
    from grayguard.demo import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.options_from_args(p.parse_args(["--gateway", "nginx"])).gateway == "nginx"
    assert cli.options_from_args(p.parse_args([])).gateway == "haproxy"
    assert cli.run(p.parse_args(["--scenario", "membership", "--gateway", "nginx"])) == 2
    assert "--gateway: the membership scenario needs HAProxy" in capsys.readouterr().err
