"""A registry-driven pool on real processes: etcd, HAProxy, the simulated fleet, and a controller ticking in a
thread (Prometheus is a fake seam: every node equally fast, so the policy only warms up and slow-starts)."""

from __future__ import annotations

import json
import socketserver
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from grayguard.config import parse_config
from grayguard.controller.cmd_controller import start_discovery
from grayguard.controller.haproxy import RuntimeClient, parse_stat_columns
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.controller.ticker import Periodic
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
from grayguard.localstack.procs import free_port, wait_until
from grayguard.reflexes import DEFAULT
from grayguard.registry import NodeRecord, Registry, RegistryError, node_key
from grayguard.sim.fleet import Fleet, FleetThread
from tests.support.ctl_helpers import OPTIONAL, FakeProm, samples

PREFIX = "/grayguard/v1"
BACKEND = "vllm_chat"
TICK_S = 0.5
LAT_Q = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
RATE_Q = "instance:vllm_request_rate:rate30s"


class Member:
    """One node's registration: a key on its own lease, kept alive by a thread (like exporters/registration.py,
    re-registered when etcd lost the lease); crash() stops the keep-alives, leave() says "leaving" and revokes."""

    def __init__(self, url: str, rec: NodeRecord, ttl: int):
        self.reg = Registry(url, timeout=1.0)
        self.rec, self.ttl = rec, ttl
        self.key = node_key(PREFIX, rec.pool, rec.node)
        self.stop = threading.Event()
        self.lease = self._register()
        self.thread = threading.Thread(target=self._keep, daemon=True, name=f"member-{rec.node}")
        self.thread.start()

    def _register(self) -> int:
        lease = self.reg.grant(self.ttl)
        self.reg.put(self.key, self.rec.to_json(), lease=lease)
        return lease

    def _keep(self) -> None:
        while not self.stop.wait(self.ttl / 4):
            try:
                if self.reg.keep_alive(self.lease) == 0:
                    self.lease = self._register()
            except RegistryError:
                pass  # etcd down: try again at the next heartbeat

    def crash(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def leave(self) -> None:
        self.crash()
        self.reg.put(self.key, self.rec.leaving().to_json(), lease=self.lease)

    def revoke(self) -> None:
        self.crash()
        self.reg.revoke(self.lease)


class UpAgent:
    """An agent-check responder answering "up" (as an exporter does for a healthy node)."""

    def __init__(self):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.sendall(b"up\n")

        class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
            daemon_threads = allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Server:
    name: str
    address: str
    weight: int
    admin: int
    op: int
    status: str
    scur: int

    @property
    def ready(self) -> bool:
        """Taking new traffic: not drained, not in maintenance."""
        return self.admin == 0 and self.weight > 0


class Rig:
    """etcd + fleet + HAProxy; controllers are started and stopped by the test (a restart is a new one)."""

    def __init__(self, tmp: Path, nodes: int, static_agent_port: int | None = None, registry: dict | None = None):
        """static_agent_port: the last node of the fleet is also a static server of the backend, its agent check on
        this port (registry nodes copy it)."""
        self.tmp = tmp
        self.etcd = EtcdProc(tmp / "etcd").start()
        self.fleet = FleetThread(Fleet(nodes, seed=1))
        self.nodes = self.fleet.start()
        static = [] if static_agent_port is None else [("static0", self.nodes[-1].address, 100, static_agent_port)]
        self.frontend = free_port()
        (tmp / "hap").mkdir()
        self.hap = HaproxyProc(tmp / "hap", haproxy_config(tmp / "hap" / "admin.sock", {BACKEND: static},
                                                           balance="roundrobin", frontend_port=self.frontend,
                                                           reflexes=DEFAULT))
        self.hap.start()
        self.rc = RuntimeClient(self.hap.endpoint, 2.0)
        self.offset = 0.0  # added to the controller's clock: a test may jump a minute ahead
        self.registry_cfg = registry or {}
        self.members: dict[str, Member] = {}
        self.ctl: Controller | None = None
        self._stop: threading.Event | None = None
        self._ticker: Periodic | None = None
        self.discovery = None

    # ---- the registry ------------------------------------------------------------------------------------
    def record(self, i: int) -> NodeRecord:
        n = self.nodes[i]
        return NodeRecord(pool="chat", node=n.name, endpoint=n.address, exporter=f"{n.host}:{free_port()}",
                          model="m", ttl_s=2, registered_at=time.time())

    def register(self, i: int, ttl: int = 2) -> Member:
        m = Member(self.etcd.url, self.record(i), ttl)
        self.members[m.rec.node] = m
        return m

    # ---- the controller ------------------------------------------------------------------------------------
    def config(self) -> dict:
        return {"prometheus": {"url": "http://prom.test:9090"}, "haproxy": {"endpoints": [self.hap.endpoint],
                                                                             "timeout_s": 1.0},
                "pools": [{"name": "chat", "backend": BACKEND, "discovery": "registry"}],
                "signals": {f"{k}_query": "" for k in OPTIONAL},
                "thresholds": {"new_node_warmup_s": 2.0},
                "recovery": {"slow_start_step_per_min": 6.0},  # 10 % a second: the ramp is seen in a test
                "registry": {"url": self.etcd.url, "timeout_s": 1.0, "snapshot_file": str(self.tmp / "members.json"),
                             **self.registry_cfg},
                "tick_interval_s": TICK_S, "state_file": None}

    def prom(self, q: str):
        now = time.time()
        addrs = [n.address for n in self.nodes]
        if q == LAT_Q:
            return samples(dict.fromkeys(addrs, 0.02), now)
        if q == RATE_Q:
            return samples(dict.fromkeys(addrs, 5.0), now)
        return []

    def start_controller(self) -> Controller:
        cfg = parse_config(self.config())
        self.ctl = Controller(cfg, FakeProm(self.prom, []), [RuntimeClient(self.hap.endpoint, 1.0)],
                              metrics=ControllerMetrics.create(), clock=lambda: time.time() + self.offset)
        self.discovery = start_discovery(cfg, self.ctl)
        self._stop = threading.Event()
        self._ticker = Periodic("tick", self.ctl.tick, TICK_S, self._stop).start()
        return self.ctl

    def stop_controller(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._ticker.join(10)  # type: ignore[union-attr]
        if self.discovery is not None:
            self.discovery.stop()
        self.ctl = self.discovery = self._stop = self._ticker = None

    def metric(self, name: str, **labels: str) -> float | None:
        return self.ctl.metrics.registry.get_sample_value(name, labels)  # type: ignore[union-attr]

    # ---- HAProxy -----------------------------------------------------------------------------------------------
    def servers(self) -> dict[str, Server]:
        state, stat = self.rc.execute([f"show servers state {BACKEND}", f"show stat {BACKEND} 4 -1"])
        rows = parse_stat_columns(stat, "status", "scur")
        out = {}
        header: list[str] = []
        for ln in state.splitlines()[1:]:
            if ln.startswith("#"):
                header = ln.lstrip("# ").split()
                continue
            f = dict(zip(header, ln.split(), strict=False))
            if not f:
                continue
            row = rows.get((BACKEND, f["srv_name"]), {})
            out[f["srv_name"]] = Server(f["srv_name"], f"{f['srv_addr']}:{f['srv_port']}", int(f["srv_uweight"]),
                                        int(f["srv_admin_state"]), int(f["srv_op_state"]), row.get("status", ""),
                                        int(row.get("scur") or 0))
        return out

    def wait(self, predicate, timeout_s: float, what: str):
        return wait_until(predicate, timeout_s, 0.05, what)

    def long_request(self, max_tokens: int = 400) -> threading.Thread:
        """A streamed completion through HAProxy (max_tokens x 15 ms); the thread ends when it does."""
        body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": True}).encode()

        def run() -> None:
            req = urllib.request.Request(f"http://127.0.0.1:{self.frontend}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.stop_controller()
        for m in self.members.values():
            m.crash()
        self.hap.stop()
        self.fleet.stop()
        self.etcd.stop()
