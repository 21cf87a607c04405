"""Steering through an etcd outage and fencing against a paused leader, on real processes: `grayguard controller`
replicas started by the CLI, a real etcd, a real HAProxy 2.6 (and, for the registry pool, the simulated fleet).
Prometheus is a fake HTTP server whose per-node latencies the test sets (node0 10x its peers: a slow node).

1. HAProxy restarted during an etcd outage longer than the lease is back to full membership from the snapshot
   within 2 ticks: the leader cannot renew and the standby cannot lead, and both may put members into a HAProxy
   with no fencing epoch (it restarted). HAProxy restarts 60 s into the outage (OUTAGE_S, the issue's figure);
   past the lease nothing in the mechanism counts time (the leader's lease has ended by its own clock and in
   etcd's terms, the standby cannot be elected, the snapshot does not age out).
2. A node that turns slow during the outage is cut and drained within the usual targets: the leader that held a
   valid lease when etcd went steers on while HAProxy's epoch is its own.
3. No two replicas write in one tick: the leader is SIGSTOPped with its batch in flight (a relay holds the bytes
   until it is continued), the standby takes over and claims HAProxy's epoch, then dies too; the old leader is
   continued and its batch, arriving after the takeover, is never applied (HAProxy closed the connection, idle
   past its `set timeout cli`), and it writes nothing until it is elected again and has claimed a new epoch.
4. A partition (the leader cut off from etcd, the standby not): the leader steers on until the standby, elected
   once the old lease expired in etcd, claims HAProxy; the old leader stops at its first sight of the new epoch and
   writes nothing after; healed, it stands by.
5. The leader killed during the outage: the standby, which can neither reach etcd nor lead, restores a restarted
   HAProxy's membership alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from grayguard.controller.haproxy import ADMF_FDRAIN, CLAIM_WAIT_S, RuntimeClient, epoch_var, parse_var
from grayguard.controller.leader import SCOPE_ALL
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import free_port, start_process, wait_until
from grayguard.registry import DEFAULT_PREFIX
from tests.support.ctl_helpers import LAT_Q, OPTIONAL, RATE_Q, Sampler, servers
from tests.support.registry_rig import BACKEND, Rig
from tests.support.stack import require

pytestmark = pytest.mark.e2e

TTL, TICK = 2, 0.5
OUTAGE_S = 60.0  # test 1: seconds of etcd outage before HAProxy restarts
SLACK = 2.0  # two shared cores: process start-up, etcd's 0.5 s lease sweep
VAR = epoch_var(DEFAULT_PREFIX, SCOPE_ALL)


class FakePrometheus:
    """/api/v1/query over HTTP: the latency and request-rate queries answered from lat (address -> seconds per
    token), fresh (timestamp() is now); every other query is an empty vector."""

    def __init__(self, lat: dict[str, float]):
        self.lat = lat
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("query", [""])[0]
                body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                                 "result": outer.answer(q)}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, q: str) -> list:
        now = time.time()
        inner = q.removeprefix("timestamp(").removesuffix(")")
        got = dict(self.lat) if inner == LAT_Q else dict.fromkeys(self.lat, 5.0) if inner == RATE_Q else {}
        return [{"metric": {"instance": k, "pool": "chat"}, "value": [now, str(now if inner != q else v)]}
                for k, v in got.items()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Relay:
    """A unix-socket relay in front of HAProxy's runtime API for one replica. Armed, it holds the first chunk the
    replica sends that writes a server (its batch), calls on_hold (the test stops the replica there), and forwards
    the chunk once released: the batch arrives late, as after a pause of the writer mid-write."""

    def __init__(self, path: Path, upstream: str):
        self.path, self.upstream = path, upstream.removeprefix("unix:")
        self.armed = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self.on_hold = lambda: None
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(path))
        self.srv.listen(64)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"unix:{self.path}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.srv.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX)
            try:
                up.connect(self.upstream)
            except OSError:
                down.close()
                continue
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_haproxy: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_haproxy and self.armed.is_set() and b"set server" in data:
                    self.armed.clear()
                    self.held.set()
                    self.on_hold()
                    self.release.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        self.release.set()
        self.srv.close()


class TcpRelay:
    """A TCP relay to etcd for one replica: cut() drops its connections and refuses new ones (a partition between
    that replica and etcd, the others still reach it); heal() lets it through again on the same port."""

    def __init__(self, upstream_url: str):
        u = urllib.parse.urlparse(upstream_url)
        self.upstream = (u.hostname, u.port)
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.srv: socket.socket | None = None
        self.heal()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def heal(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        self.srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            if self.srv is not None:
                with contextlib.suppress(OSError):
                    self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it (close alone does not)
                self.srv.close()
                self.srv = None
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.conns.clear()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                down, _ = srv.accept()
            except OSError:
                return
            with self.lock:
                if srv is not self.srv:  # cut meanwhile
                    down.close()
                    return
            try:
                up = socket.create_connection(self.upstream, timeout=2)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            with self.lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)


class Replica:
    """`grayguard controller --id <rid>` as a process, its /metrics and /status on a port of its own."""

    def __init__(self, tmp: Path, rid: str, doc: dict):
        self.id, self.port = rid, free_port()
        doc = {**doc, "listen_address": f"127.0.0.1:{self.port}", "state_file": str(tmp / f"{rid}-state.json"),
               "rules": {**doc.get("rules", {}), "rerender_interval_s": 0}}
        doc["registry"] = {**doc["registry"], "snapshot_file": str(tmp / f"{rid}-members.json")}
        path = tmp / f"{rid}.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.log = tmp / f"{rid}.log"
        self.proc = start_process([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(path),
                                   "--id", rid], self.log)
        self.proc.wait_for(self.status, 30, what=f"{rid} serves /status")

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=2) as r:
            return json.loads(r.read())

    def leads(self) -> bool:
        return self.status()["leadership"]["leads"] == [SCOPE_ALL]

    def epoch(self) -> int | None:
        return self.status()["leadership"].get("epochs", {}).get(SCOPE_ALL)

    def metric(self, name: str) -> float:
        """The sum of every sample of name in its /metrics (0 when there is none)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            text = r.read().decode()
        return sum(float(ln.rpartition(" ")[2]) for ln in text.splitlines()
                   if ln.split("{")[0].split(" ")[0] == name)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stopped(self) -> bool:
        return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

    def close(self) -> None:
        if self.proc.running():
            self.signal(signal.SIGCONT)
        self.proc.stop()


def gateway_epoch(rc: RuntimeClient) -> int | None:
    return parse_var(rc.execute([f"get var {VAR}"])[0])


def config(prom: FakePrometheus, endpoint: str, etcd_url: str, pools: list[dict]) -> dict:
    return {"prometheus": {"url": prom.url, "timeout_s": 0.5},
            "haproxy": {"endpoints": [endpoint], "timeout_s": 1.0},
            "pools": pools, "rules": {"control_interval": "15s"}, "thresholds": {"new_node_warmup_s": 2.0},
            "recovery": {"slow_start_step_per_min": 6.0},
            "signals": {f"{k}_query": "" for k in OPTIONAL}, "tick_interval_s": TICK,
            "registry": {"url": etcd_url, "lease_ttl_s": TTL, "timeout_s": 0.5}}


@pytest.fixture
def replicas():
    made: list[Replica] = []
    yield made
    for r in made:
        r.close()


def test_haproxy_restarted_during_an_etcd_outage_gets_its_full_membership_back_from_the_snapshot_within_2_ticks(
        tmp_path, replicas):
    require("etcd", "haproxy")
    rig = Rig(tmp_path / "rig", 4)
    try:
        for i in range(4):
            rig.register(i, ttl=3)
        prom = FakePrometheus({n.address: 0.02 for n in rig.nodes})
        doc = config(prom, rig.hap.endpoint, rig.etcd.url, [{"name": "chat", "backend": BACKEND,
                                                             "discovery": "registry"}])
        a = Replica(tmp_path, "a", doc)
        replicas.append(a)
        wait_until(a.leads, 15, what="a leads")
        b = Replica(tmp_path, "b", doc)
        replicas.append(b)
        names = {n.name for n in rig.nodes}

        def members() -> set[str]:
            return {n for n, s in rig.servers().items() if s.admin == 0}
        wait_until(lambda: members() == names, 15, what="four nodes in HAProxy")
        wait_until(lambda: (tmp_path / "a-members.json").exists() and (tmp_path / "b-members.json").exists(), 10,
                   what="both snapshots written")

        rig.etcd.kill()
        down = time.monotonic()
        wait_until(lambda: a.status()["leadership"]["steering_without_registry"], TTL + TICK + SLACK,
                   what="a's lease ended by its own clock")
        time.sleep(max(TTL, OUTAGE_S - (time.monotonic() - down)))  # HAProxy restarts OUTAGE_S into the outage
        assert not b.leads()
        rig.hap.restart()  # from its config file: the registry backend's dynamic servers are gone
        back = time.monotonic()
        wait_until(lambda: members() == names, 2 * TICK + SLACK, interval_s=0.05,
                   what="the snapshot's members back in the restarted HAProxy")
        took = time.monotonic() - back
        assert took <= 2 * TICK + 1.0, f"membership back {took:.2f}s after HAProxy restarted (2 ticks: {2 * TICK}s)"
        assert gateway_epoch(rig.rc) is None  # no replica could claim it: nobody steers weights until etcd is back
        rig.etcd.start()
        wait_until(lambda: gateway_epoch(rig.rc) is not None, 15, what="the leader claims the restarted HAProxy")
        assert members() == names
    finally:
        for r in replicas:
            r.close()
        replicas.clear()
        rig.close()


@pytest.fixture
def static_stack(tmp_path, haproxy_factory, replicas):
    require("etcd", "haproxy")
    hap = haproxy_factory({"vllm_chat": servers(6)})
    etcd = EtcdProc(tmp_path / "etcd").start()
    lat = {f"127.0.0.1:{9100 + i}": 0.02 for i in range(6)}
    prom = FakePrometheus(lat)
    yield hap, etcd, prom, lat
    for r in replicas:
        r.close()
    replicas.clear()
    prom.close()
    etcd.stop()


def test_a_node_turning_slow_during_an_etcd_outage_is_cut_and_drained_by_the_leader_it_had(static_stack, tmp_path,
                                                                                          replicas):
    hap, etcd, prom, lat = static_stack
    rc = RuntimeClient(hap.endpoint)
    doc = config(prom, hap.endpoint, etcd.url, [{"name": "chat", "backend": "vllm_chat"}])
    a = Replica(tmp_path, "a", doc)
    replicas.append(a)
    wait_until(a.leads, 15, what="a leads")
    b = Replica(tmp_path, "b", doc)
    replicas.append(b)
    wait_until(lambda: gateway_epoch(rc) == a.epoch(), 10, what="a's epoch in HAProxy")

    etcd.kill()
    wait_until(lambda: a.status()["leadership"]["steering_without_registry"], TTL + TICK + SLACK,
               what="a's lease ended by its own clock")
    time.sleep(TICK)
    slow = time.monotonic()
    lat["127.0.0.1:9100"] = 0.2  # node0 10x its peers
    # cut, or drained at once (two samples make one observation here: a 10x sample's evidence over them drains)
    cut = wait_until(lambda: (w := rc.get_weight("vllm_chat", "node0")[0]) < 100 and str(w), 10, interval_s=0.05,
                     what="node0 cut")
    cut_s = time.monotonic() - slow
    wait_until(lambda: next(s for s in rc.show_servers_state("vllm_chat") if s.name == "node0").admin_state
               & ADMF_FDRAIN, 15, interval_s=0.05, what="node0 drained")
    drained_s = time.monotonic() - slow
    assert cut_s <= 5.0 and drained_s <= 10.0, f"cut {cut_s:.1f}s (weight {cut}), drained {drained_s:.1f}s"
    assert a.leads() and not b.leads() and b.metric("grayguard_haproxy_writes_total") == 0
    assert gateway_epoch(rc) == a.epoch()


def test_a_leader_stopped_mid_write_never_writes_after_the_standby_took_over(static_stack, tmp_path, replicas):
    hap, etcd, prom, lat = static_stack
    rc = RuntimeClient(hap.endpoint)
    relay = Relay(tmp_path / "relay.sock", hap.endpoint)
    perturb = RuntimeClient(hap.endpoint)
    perturber = Sampler(lambda: perturb.execute(["set server vllm_chat/node5 weight 77"]), 0.2)
    watcher = Sampler(lambda: rc.get_weight("vllm_chat", "node5")[0], 0.02)
    try:
        a = Replica(tmp_path, "a", config(prom, relay.endpoint, etcd.url, [{"name": "chat", "backend": "vllm_chat"}]))
        replicas.append(a)
        wait_until(a.leads, 15, what="a leads")
        first = wait_until(lambda: (e := a.epoch()) and gateway_epoch(rc) == e and e, 10, what="a's epoch in HAProxy")
        b = Replica(tmp_path, "b", config(prom, hap.endpoint, etcd.url, [{"name": "chat", "backend": "vllm_chat"}]))
        replicas.append(b)
        wait_until(lambda: b.status()["leadership"]["leaders"].get(SCOPE_ALL) == "a", 10, what="b sees a lead")

        relay.on_hold = lambda: (a.signal(signal.SIGSTOP), wait_until(a.stopped, 5, 0.01, "a stopped"))
        relay.armed.set()  # a's next batch (node5 back to 100) is held, a stopped with it in flight
        wait_until(relay.held.is_set, 10, interval_s=0.01, what="a stopped mid-write")
        held = time.monotonic()
        wait_until(b.leads, TTL + TICK + SLACK + 5, what="b leads")
        wait_until(lambda: gateway_epoch(rc) == b.epoch(), 5, what="b's epoch in HAProxy")
        wait_until(lambda: any(w == 100 for t, w in list(watcher.rows) if t > held + CLAIM_WAIT_S), 10,
                   what="b repairs node5")
        assert b.epoch() != first

        b.signal(signal.SIGKILL)  # nobody repairs node5 now; b's lease runs out
        wait_until(lambda: etcd_leader(etcd) is None, TTL + SLACK + 2, what="b's lease expired")
        wait_until(lambda: rc.get_weight("vllm_chat", "node5")[0] == 77, 2, what="node5 perturbed again")
        cont = time.monotonic()
        relay.release.set()  # the batch a sent before it stopped arrives now
        a.signal(signal.SIGCONT)
        time.sleep(CLAIM_WAIT_S)  # a new term of a's claims HAProxy first and writes only this long after
        late = [(round(t - cont, 3), w) for t, w in list(watcher.rows) if cont <= t < cont + CLAIM_WAIT_S - 0.1]
        assert late and all(w == 77 for _, w in late), f"a wrote after b had taken over: {late}"
        wait_until(a.leads, TTL + TICK + SLACK + 5, what="a elected again")
        wait_until(lambda: gateway_epoch(rc) == a.epoch() != first, 5, what="a's new epoch in HAProxy")
        assert "batch not applied" in a.log.read_text()  # the held batch: its connection gone
    finally:
        perturber.close()
        watcher.close()
        relay.close()


def test_a_leader_partitioned_from_etcd_steers_until_the_standby_elected_claims_haproxy_then_writes_nothing(
        static_stack, tmp_path, replicas):
    hap, etcd, prom, lat = static_stack
    rc = RuntimeClient(hap.endpoint)
    path = TcpRelay(etcd.url)  # a's only way to etcd
    b_path = TcpRelay(etcd.url)  # b's: cut too, until a was seen steering without its lease (below)
    perturb = RuntimeClient(hap.endpoint)
    perturber = Sampler(lambda: perturb.execute(["set server vllm_chat/node5 weight 77"]), 0.2)
    try:
        pools = [{"name": "chat", "backend": "vllm_chat"}]
        a = Replica(tmp_path, "a", config(prom, hap.endpoint, path.url, pools))
        replicas.append(a)
        wait_until(a.leads, 15, what="a leads")
        first = wait_until(lambda: (e := a.epoch()) and gateway_epoch(rc) == e and e, 10, what="a's epoch in HAProxy")
        b = Replica(tmp_path, "b", config(prom, hap.endpoint, b_path.url, pools))
        replicas.append(b)
        wait_until(lambda: b.status()["leadership"]["leaders"].get(SCOPE_ALL) == "a", 10, what="b sees a lead")

        def unconfirmed_and_writes() -> tuple[bool, float] | None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                return a.status()["leadership"]["steering_without_registry"], a.metric("grayguard_haproxy_writes_total")
            return None

        # b is kept from etcd too until a was seen writing with its lease unconfirmed: left to race, b's election
        # (a's lease expiry, etcd's sweep, b's next tick) can come before a's next tick on two loaded cores (CI saw
        # it), which says nothing about whether a steers meanwhile. Then b reaches etcd and is elected.
        b_path.cut()
        path.cut()
        cut = time.monotonic()
        watch_a = Sampler(unconfirmed_and_writes, 0.05)  # sampled all along: a status poll can come back late

        def wrote_unconfirmed() -> bool:
            unconfirmed = [r[1] for _, r in list(watch_a.rows) if r and r[0]]
            return len(unconfirmed) > 1 and max(unconfirmed) > unconfirmed[0]

        try:
            wait_until(lambda: any(r and r[0] for _, r in list(watch_a.rows)), TTL + TICK + SLACK,
                       what="a's lease unconfirmed")
            wait_until(wrote_unconfirmed, 5 * TICK + SLACK, what="a steers with its lease unconfirmed")
            b_path.heal()
            wait_until(b.leads, TTL + TICK + SLACK + 5, what="b elected after a's lease expired in etcd")
            wait_until(lambda: gateway_epoch(rc) == b.epoch(), 5, interval_s=0.02, what="b claims HAProxy")
        finally:
            watch_a.close()
        claimed = time.monotonic()
        assert claimed - cut >= TTL * 0.9  # not before a's lease could have ended
        wait_until(lambda: not a.leads(), CLAIM_WAIT_S + 2 * TICK + SLACK, what="a stops at the sight of b's epoch")
        done = a.metric("grayguard_haproxy_writes_total")
        wait_until(lambda: b.metric("grayguard_haproxy_writes_total") >= 3, 10, what="b steers")
        time.sleep(3 * TICK)
        assert a.metric("grayguard_haproxy_writes_total") == done, "a wrote after b had claimed HAProxy"
        assert gateway_epoch(rc) == b.epoch() != first
        assert "another replica was elected and claimed it" in a.log.read_text()

        path.heal()  # a reaches etcd again: its lease is gone there, it stands by
        wait_until(lambda: a.status()["leadership"]["leaders"].get(SCOPE_ALL) == "b", 15, what="a sees b lead")
        assert b.leads() and not a.leads() and a.metric("grayguard_haproxy_writes_total") == done
    finally:
        perturber.close()
        path.cut()
        b_path.cut()


def test_a_standby_alone_restores_a_restarted_haproxy_when_the_leader_died_during_the_outage(tmp_path, replicas):
    require("etcd", "haproxy")
    rig = Rig(tmp_path / "rig", 3)
    try:
        for i in range(3):
            rig.register(i, ttl=3)
        prom = FakePrometheus({n.address: 0.02 for n in rig.nodes})
        doc = config(prom, rig.hap.endpoint, rig.etcd.url, [{"name": "chat", "backend": BACKEND,
                                                             "discovery": "registry"}])
        a = Replica(tmp_path, "a", doc)
        replicas.append(a)
        wait_until(a.leads, 15, what="a leads")
        b = Replica(tmp_path, "b", doc)
        replicas.append(b)
        names = {n.name for n in rig.nodes}
        wait_until(lambda: {n for n, s in rig.servers().items() if s.admin == 0} == names, 15, what="three nodes")
        wait_until(lambda: (tmp_path / "b-members.json").exists(), 10, what="b's snapshot written")
        rig.etcd.kill()
        a.signal(signal.SIGKILL)  # the leader dies during the outage: nobody can be elected
        time.sleep(TTL + TICK)
        rig.hap.restart()
        back = time.monotonic()
        wait_until(lambda: {n for n, s in rig.servers().items() if s.admin == 0} == names, 2 * TICK + SLACK,
                   interval_s=0.05, what="b puts the snapshot's members back")
        assert time.monotonic() - back <= 2 * TICK + 1.0
        assert not b.leads()
    finally:
        for r in replicas:
            r.close()
        replicas.clear()
        rig.close()


def etcd_leader(etcd: EtcdProc) -> str | None:
    from grayguard.controller.leader import leader_key
    from grayguard.controller.leader_store import ElectionStore

    e = ElectionStore(etcd.url, timeout=1.0).get(leader_key(DEFAULT_PREFIX, SCOPE_ALL))
    return e.value if e else None
