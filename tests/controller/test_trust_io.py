"""Trust, I/O side (issue 12, items 5, 6, 9, 13): every I/O call has an overall deadline, canaries run off the
tick and a hung node's fails one canary timeout after it was sent, the default canary URL of an IPv6 server is well
formed, and in-process durations follow the monotonic clock."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
import urllib.parse

import pytest

from grayguard.config import PrometheusConfig, RecoveryConfig, parse_config
from grayguard.controller.canary import make_canary, node_url
from grayguard.controller.haproxy import HaproxyError, RuntimeClient, ServerState
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.policy import NodeState
from grayguard.promclient import PromError, PrometheusClient, Sample
from tests.support.ctl_helpers import OPTIONAL, PROM, FakeHaproxy, FakeProm, tick_settled


# ---- servers that misbehave on purpose -------------------------------------------------------------------
class HungServer:
    """Accepts TCP connections and never answers (the correlated-incident node: alive, silent)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.conns.append(self.sock.accept()[0])

    def close(self):
        self._stop.set()
        for c in [*self.conns, self.sock]:
            c.close()


class Trickler:
    """Sends `head` at once, then one byte every `every` seconds for `for_s` seconds, then closes."""

    def __init__(self, head: bytes = b"", every: float = 0.5, for_s: float = 6.0, unix: str | None = None):
        if unix:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind(unix)
            self.sock.listen()
            self.endpoint = f"unix:{unix}"
        else:
            self.sock = socket.create_server(("127.0.0.1", 0))
            self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.head, self.every, self.for_s = head, every, for_s
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                conn, _ = self.sock.accept()
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn):
        with contextlib.suppress(OSError), conn:
            conn.settimeout(0.2)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request (or the runtime API batch)
            conn.sendall(self.head)
            end = time.monotonic() + self.for_s
            while time.monotonic() < end and not self._stop.is_set():
                conn.sendall(b"x")
                time.sleep(self.every)

    def close(self):
        self._stop.set()
        self.sock.close()


@pytest.fixture
def hung():
    made = []

    def make():
        made.append(HungServer())
        return made[-1]
    yield make
    for s in made:
        s.close()


# ---- item 9: every I/O call has an overall deadline ------------------------------------------------------
def test_trickling_haproxy_socket_times_out_within_the_deadline():
    with tempfile.TemporaryDirectory() as d:
        srv = Trickler(every=0.5, for_s=6.0, unix=os.path.join(d, "admin.sock"))
        try:
            client = RuntimeClient(srv.endpoint, timeout_s=1.0)
            started = time.monotonic()
            with pytest.raises(HaproxyError) as e:
                client.show_servers_state()
            took = time.monotonic() - started
        finally:
            srv.close()
    assert e.value.kind == "timeout", e.value
    assert took < 1.0 + 0.6, f"held {took:.1f}s with a 1s timeout: the timeout applies per recv, not per call"


def test_trickling_haproxy_tcp_endpoint_times_out_too():
    srv = Trickler(every=0.3, for_s=6.0)
    try:
        started = time.monotonic()
        with pytest.raises(HaproxyError) as e:
            RuntimeClient(srv.endpoint, timeout_s=1.0).backend_algorithms()
        took = time.monotonic() - started
    finally:
        srv.close()
    assert e.value.kind == "timeout" and took < 1.0 + 0.6


def test_real_haproxy_still_answers_under_the_deadline(haproxy_factory):
    hap = haproxy_factory({"be": [("s0", "127.0.0.1:9100", 100)]})
    got = RuntimeClient(hap.endpoint, timeout_s=1.0).show_servers_state("be")
    assert [(s.name, s.weight) for s in got] == [("s0", 100)]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:notaport", "127.0.0.1:70000"])
def test_bad_endpoint_is_a_classified_connect_error(endpoint):
    with pytest.raises(HaproxyError) as e:
        RuntimeClient(endpoint, timeout_s=0.5).show_servers_state()
    assert e.value.kind == "connect"


JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"


def test_trickling_prometheus_body_times_out_within_the_deadline():
    srv = Trickler(head=JSON_HEAD, every=0.2, for_s=6.0)
    try:
        client = PrometheusClient(PrometheusConfig(url=f"http://{srv.endpoint}", timeout_s=1.0))
        started = time.monotonic()
        with pytest.raises(PromError) as e:
            client.query("up")
        took = time.monotonic() - started
    finally:
        srv.close()
    assert e.value.kind == "timeout", e.value
    assert took < 1.0 + 0.6, f"held {took:.1f}s with a 1s timeout: requests' timeout is per read"


def test_prometheus_still_answers_a_prompt_server():
    body = b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"a":"b"},"value":[1,"2"]}]}}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    srv = Trickler(head=head + body, every=0.1, for_s=0.0)
    try:
        got = PrometheusClient(PrometheusConfig(url=f"http://{srv.endpoint}", timeout_s=1.0)).query("up")
    finally:
        srv.close()
    assert got == [Sample({"a": "b"}, 2.0, 1.0)]


def test_rules_reload_post_has_an_overall_deadline(tmp_path):
    from grayguard.rules.rerender import RuleRerenderer

    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4096\r\n\r\n"
    srv = Trickler(head=head, every=0.2, for_s=6.0)
    try:
        cfg = parse_config({"prometheus": {"url": PROM, "timeout_s": 1.0}, "haproxy": {"endpoints": ["/x"]},
                            "pools": [{"name": "chat", "backend": "be"}]})
        rr = RuleRerenderer(cfg, out_dir=tmp_path, reload_url=f"http://{srv.endpoint}/-/reload", promtool="")
        started = time.monotonic()
        err = rr.reload()
        took = time.monotonic() - started
    finally:
        srv.close()
    assert err is not None and err.startswith("reload failed")
    assert took < 1.0 + 0.6, f"the reload POST held {took:.1f}s with a 1s timeout"


def test_canary_prober_has_a_deadline(hung):
    srv = hung()
    canary = make_canary(RecoveryConfig(canary_timeout_s=1.0, canary_model="m"))
    started = time.monotonic()
    assert canary(node_url(srv.address)) is None
    assert time.monotonic() - started < 1.0 + 0.6
    assert srv.conns, "the canary never reached the hung node"


# ---- item 6: canaries run off the tick; a hung node's fails canary_timeout_s after it was sent --------------
class Clock:
    """The controller's clock: real time plus what the test has moved it on (a canary's timeout, without waiting)."""

    def __init__(self):
        self.ahead = 0.0

    def __call__(self):
        return time.time() + self.ahead


def _canary_tick_controller(servers_by_pool: dict[str, list[str]], n_canary: int, canary, timeout_s: float,
                            clock=time.time):
    """Two pools; in each the first n_canary servers are in canary (due now), the others healthy with an EMA."""
    now = clock()
    events: list = []
    backends = {f"be_{p}": [(f"{p}{i}", a, 100) for i, a in enumerate(addrs)] for p, addrs in servers_by_pool.items()}
    hap = FakeHaproxy("127.0.0.1:1", backends, events)
    healthy = {p: addrs[n_canary:] for p, addrs in servers_by_pool.items()}

    def answers(q):
        t = time.time()
        out = []
        for p, addrs in healthy.items():
            for a in addrs:
                v = t if q.startswith("timestamp(") else 0.02 if "latency" in q else 5.0
                out.append(Sample({"instance": a, "pool": p}, v, t))
        return out

    doc = {"prometheus": {"url": PROM}, "haproxy": {"endpoints": [hap.endpoint]}, "state_file": None,
           "pools": [{"name": p, "backend": f"be_{p}"} for p in servers_by_pool],
           "signals": {f"{k}_query": "" for k in OPTIONAL},
           "thresholds": {"max_ejected_fraction": 0.5},  # half a pool may be drained: the cap releases none of them
           "recovery": {"canary_timeout_s": timeout_s, "min_quarantine_s": 0, "canary_interval_s": 1}}
    ctl = Controller(parse_config(doc), FakeProm(answers, events), [hap], canary=canary,
                     metrics=ControllerMetrics.create(), clock=clock)
    for p, addrs in servers_by_pool.items():
        ctl.states[p] = {f"{p}{i}": (NodeState("canary", since=now - 100, cause="latency", weight=0)
                                     if i < n_canary else NodeState("healthy", since=now - 1000, ema=0.02,
                                                                    score=0.0, weight=100))
                         for i in range(len(addrs))}
    return ctl


def _failed(ctl, pool, node):
    return ctl.metrics.registry.get_sample_value("grayguard_canaries_total",
                                                 {"pool": pool, "node": node, "result": "failed"})


def test_six_hung_nodes_never_hold_the_tick_and_fail_one_canary_timeout_after_they_were_sent(hung):
    timeout_s = 5.0
    pools = {"a": [hung() for _ in range(6)], "b": [hung() for _ in range(6)]}  # 3 hung in canary per pool
    clock = Clock()
    ctl = _canary_tick_controller({p: [s.address for s in srvs] for p, srvs in pools.items()}, 3,
                                  make_canary(RecoveryConfig(canary_timeout_s=timeout_s, canary_model="m")),
                                  timeout_s, clock)
    try:
        started = time.monotonic()
        result = ctl.tick()
        took = time.monotonic() - started
        assert result.held is None, result.held
        # the rounds run off the tick: it returns long before a single canary could time out
        assert took < timeout_s, f"the tick took {took:.1f}s with 6 hung nodes: it waited on their canaries"
        drained = [s for srvs in pools.values() for s in srvs[:3]]
        deadline = time.monotonic() + timeout_s
        while not all(s.conns for s in drained) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s.conns for s in drained), "every hung node in canary got its canary, all at once"
        assert all(_failed(ctl, p, f"{p}{i}") is None for p in pools for i in range(3))  # in flight: not decided
        clock.ahead = timeout_s  # one canary timeout after they were sent, whatever the engines do
        started = time.monotonic()
        result = ctl.tick()
        assert time.monotonic() - started < timeout_s and result.held is None
        for p in pools:
            for i in range(3):  # every canary failed, and is counted as failed, once
                assert _failed(ctl, p, f"{p}{i}") == 1
                assert ctl.states[p][f"{p}{i}"].state == "canary" and ctl.states[p][f"{p}{i}"].canary_ok == 0
    finally:
        ctl.close(0.0)


def test_a_canary_that_never_returns_cannot_hold_the_tick():
    release = threading.Event()
    entered = threading.Event()
    calls = []

    def stuck(url):  # ignores every deadline: only the controller's own timeout can bound it
        calls.append(url)
        if url.endswith(":9100"):
            entered.set()
            release.wait(30)
            return None
        return 0.1

    clock = Clock()
    ctl = _canary_tick_controller({"a": [f"127.0.0.1:{9100 + i}" for i in range(4)]}, 1, stuck, 0.5, clock)
    try:
        ticks = []
        for k in range(3):  # three ticks while its canary is blocked: each one completes
            done = threading.Event()
            threading.Thread(target=lambda d=done: (ticks.append(ctl.tick()), d.set()), daemon=True).start()
            assert done.wait(5.0), f"tick {k + 1} waited on a canary that never returns"
            assert entered.wait(5.0)
            assert _failed(ctl, "a", "a0") is None and ctl.states["a"]["a0"].state == "canary"
        assert calls.count("http://127.0.0.1:9100") == 1  # its round is in flight: not sent again
        clock.ahead = 0.5  # its timeout, measured from when it was sent
        ctl.tick()
        assert _failed(ctl, "a", "a0") == 1
    finally:
        release.set()
        ctl.close(0.0)


def test_a_canary_that_raises_is_a_failed_canary_not_a_failed_tick():
    def broken(url):
        raise ValueError(f"no scheme in {url}")

    ctl = _canary_tick_controller({"a": [f"127.0.0.1:{9100 + i}" for i in range(4)]}, 1, broken, 0.5)
    result = tick_settled(ctl)
    assert result.held is None and "a" in result.decisions
    result = ctl.tick()
    assert result.held is None and "a" in result.decisions
    assert _failed(ctl, "a", "a0") == 1


# ---- item 5 (second half): the default canary URL of an IPv6 server ---------------------------------------
@pytest.mark.parametrize("address, url", [
    ("10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("::1:8000", "http://[::1]:8000"),
    ("[::1]:8000", "http://[::1]:8000"),
    ("2001:db8::7:8000", "http://[2001:db8::7]:8000"),
    ("fe80::1%eth0:8000", "http://[fe80::1%25eth0]:8000"),
    ("node1.example:8000", "http://node1.example:8000"),
    ("node1", "http://node1"),
])
def test_default_canary_url_brackets_ipv6(address, url):
    assert node_url(address) == url
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname and (parts.port == 8000 or ":" not in address)


def test_default_canary_url_of_a_real_ipv6_haproxy_server(haproxy_factory):
    """Whatever form `show servers state` gives the address in, the canary URL is http://[v6]:port."""
    hap = haproxy_factory({"be": [("v6", "[::1]:8000", 100), ("v4", "127.0.0.1:8001", 100)]})
    servers = {s.name: s for s in RuntimeClient(hap.endpoint).show_servers_state("be")}
    cfg = parse_config({"prometheus": {"url": PROM}, "haproxy": {"endpoints": [hap.endpoint]},
                        "pools": [{"name": "p", "backend": "be", "servers": {"v4": {"canary_url": "http://x:1"}}}]})
    ctl = Controller(cfg, None, [], metrics=ControllerMetrics.create())  # type: ignore[arg-type]
    url = ctl.canary_url(cfg.pools[0], servers["v6"])
    assert url == "http://[::1]:8000"
    parts = urllib.parse.urlsplit(url)
    assert (parts.hostname, parts.port) == ("::1", 8000)
    assert ctl.canary_url(cfg.pools[0], servers["v4"]) == "http://x:1"  # configured canary_url wins
    bare = ServerState("be", "v6", "::1:8000", 100, 100, 0, 2)  # an address parsed without brackets
    assert ctl.canary_url(cfg.pools[0], bare) == "http://[::1]:8000"


# ---- item 13: durations follow the monotonic clock ----------------------------------------------------------
class FakeTime:
    """A wall clock that an operator can step, and a monotonic clock that only moves forward."""

    def __init__(self):
        self.wall0 = time.time()
        self.wall_offset = 0.0
        self.mono = 1000.0

    def time(self):
        return self.wall0 + (self.mono - 1000.0) + self.wall_offset

    def monotonic(self):
        return self.mono


def test_steady_clock_ignores_wall_clock_steps(caplog):
    from grayguard.controller.clock import SteadyClock

    ft = FakeTime()
    clock = SteadyClock(wall=ft.time, mono=ft.monotonic)
    t0 = clock()
    assert t0 == pytest.approx(ft.time())  # a Unix time: persisted times stay wall-clock
    ft.wall_offset += 3600  # +1 h step
    ft.mono += 10
    assert clock() - t0 == pytest.approx(10)
    ft.wall_offset -= 7200  # then -2 h: an hour behind where it started
    ft.mono += 10
    assert clock() - t0 == pytest.approx(20)
    assert clock.offset() == pytest.approx(-3600)
    assert "wall clock moved" in caplog.text


def test_controller_default_clock_keeps_slow_start_on_monotonic_time(monkeypatch):
    """+1 h on the wall clock must not end a slow start at once; -1 h must not freeze it for an hour."""
    ft, prometheus_clock = FakeTime(), time.time  # Prometheus' own clock is not stepped with ours
    monkeypatch.setattr(time, "time", ft.time)
    monkeypatch.setattr(time, "monotonic", ft.monotonic)
    events: list = []
    addrs = [f"10.0.0.{i}:8000" for i in range(4)]
    hap = FakeHaproxy("127.0.0.1:1", {"be": [(f"n{i}", a, 100) for i, a in enumerate(addrs)]}, events)

    def answers(q):
        t = prometheus_clock()
        return [Sample({"instance": a, "pool": "p"}, t if q.startswith("timestamp(") else
                       0.02 if "latency" in q else 5.0, t) for a in addrs]

    doc = {"prometheus": {"url": PROM}, "haproxy": {"endpoints": [hap.endpoint]}, "state_file": None,
           "pools": [{"name": "p", "backend": "be"}], "signals": {f"{k}_query": "" for k in OPTIONAL},
           "recovery": {"slow_start_initial": 0.1, "slow_start_step_per_min": 0.2}}
    ctl = Controller(parse_config(doc), FakeProm(answers, events), [hap], metrics=ControllerMetrics.create())
    now = ctl.clock()
    ctl.states["p"] = {f"n{i}": NodeState("healthy", since=now - 1000, ema=0.02, score=0.0, weight=100)
                       for i in range(4)}
    ctl.states["p"]["n0"] = NodeState("slow_start", since=now, weight=10, ema=0.02, score=0.0)

    def weight():
        r = ctl.tick()
        assert r.held is None, r.held
        return r.decisions["p"].nodes["n0"].weight, ctl.states["p"]["n0"].state

    def on_ramp(minutes):  # base 100 x (slow_start_initial + slow_start_step_per_min x minutes), rounded up
        w, state = weight()
        return state == "slow_start" and abs(w - 100 * (0.1 + 0.2 * minutes)) <= 1

    assert on_ramp(0)
    ft.wall_offset += 3600  # +1 h step while 1 minute really passes
    ft.mono += 60
    assert on_ramp(1), "a +1 h wall-clock step ended the slow start (or the ramp did not follow real time)"
    ft.wall_offset -= 3600 * 2  # -2 h step while another minute passes
    ft.mono += 60
    assert on_ramp(2), "a -1 h wall-clock step froze the slow start (or the ramp did not follow real time)"
