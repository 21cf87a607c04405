"""The Kubernetes gateway's HAProxy fills its server slots from the fleet's DNS SRV records, and the controller sees
the pods in them: the shipped haproxy.cfg, with the environment the manifests give it, run by the real haproxy
against a DNS server that answers as the cluster DNS does for the fleet's headless Service (tests/support/
dnsserver.py), pods on loopback addresses (127.0.0.2, .3, ...). It protects: the SRV name the config builds, the
resolver options HAProxy 2.6 takes, each pod's address and name in its slot, a scale-up filling the next slot, a
scale-down putting the removed pod's slot in MAINT after the shipped `hold obsolete`, and the controller reading
the slots (RuntimeClient.show_servers_state) as nodes with the pods' addresses, the empty ones held (MAINT).

Measured with the shipped resolvers section (HAProxy 2.6.12): HAProxy asks every second (`timeout resolve`, 1 s by
default), so a new pod fills its slot within about a second; a removed pod's slot goes to MAINT about 30 s after
its record left the answer (`hold obsolete 30s`), and keeps the pod's address until then."""

from __future__ import annotations

import http.server
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from grayguard.config import parse_config
from grayguard.controller.decide import node_inputs, pool_data, series_keys
from grayguard.controller.haproxy import RuntimeClient, ServerState
from grayguard.controller.plan import tier_view
from grayguard.localstack.haproxy import HaproxyProc
from grayguard.localstack.procs import free_port, wait_until
from grayguard.promclient import Sample
from tests.deploy.test_kubernetes import K8S, container_env, kustomize, one, settings
from tests.support.dnsserver import TYPE_SRV, DnsServer, Pod
from tests.support.stack import require

pytestmark = pytest.mark.e2e

OVERLAY = K8S / "overlays" / "production"  # as shipped: 4 replicas of vllm-chat in grayguard
CONTROLLER_CONFIG = K8S / "base" / "controller" / "grayguard.yaml"


class PodServer:
    """A stand-in vLLM pod on one loopback address: every GET (/health too) answers 200, naming the pod."""

    def __init__(self, address: str, port: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("X-Pod", address)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.closed = False
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop answering (the pod is gone); idempotent."""
        if not self.closed:
            self.closed = True
            self.server.shutdown()
            self.server.server_close()


def local_config(shipped: str, dns_port: int, sock: Path) -> tuple[str, int]:
    """The shipped config with only where it listens and whom it asks changed: the resolvers' `parse-resolv-conf`
    (the pod's /etc/resolv.conf, the cluster DNS) becomes a nameserver line for the test's DNS server, the two
    binds free localhost ports, the admin socket a path in the test's directory. Everything else is as shipped.
    Returns the text and the client frontend's port."""
    front = free_port()
    subs = [(r"^(\s*)parse-resolv-conf$", rf"\1nameserver test 127.0.0.1:{dns_port}"),
            (r"bind :8000$", f"bind 127.0.0.1:{front}"), (r"bind :8404$", f"bind 127.0.0.1:{free_port()}"),
            (r"stats socket /run/haproxy/admin.sock ", f"stats socket {sock} ")]
    for pattern, new in subs:
        shipped, n = re.subn(pattern, new, shipped, flags=re.M)
        assert n == 1, f"{pattern}: {n} matches in the shipped haproxy.cfg"
    return shipped, front


def seconds(cfg: str, pattern: str) -> float:
    m = re.search(pattern, cfg, re.M)
    assert m, f"{pattern}: not in the shipped haproxy.cfg"
    return float(m.group(1))


def served_by(front: int) -> tuple[str, str]:
    """(slot, pod address) of one request through the gateway's client frontend."""
    with urllib.request.urlopen(f"http://127.0.0.1:{front}/v1/models", timeout=5) as r:
        return r.headers["X-Served-By"], r.headers["X-Pod"]


@pytest.fixture
def pods():
    """pods(address, port) -> a started PodServer, closed after the test."""
    started = []

    def make(address: str, port: int) -> PodServer:
        started.append(PodServer(address, port))
        return started[-1]

    yield make
    for p in started:
        p.close()


def test_the_gateway_fills_its_slots_from_srv_records_and_the_controller_sees_the_pods(tmp_path, monkeypatch, pods):
    require("haproxy")
    objs = kustomize(OVERLAY)
    cfg_text = one(objs, "ConfigMap", "grayguard-gateway-haproxy")["data"]["haproxy.cfg"]
    assert cfg_text == (K8S / "base" / "gateway" / "haproxy.cfg").read_text()
    env = container_env(objs, one(objs, "StatefulSet", "grayguard-gateway"), "haproxy")
    for k, v in env.items():  # HAProxy expands them in the server-template line, as the pod's environment
        monkeypatch.setenv(k, v)
    s = settings(objs)
    fleet, ns, slots = s["fleet.name"], s["fleet.namespace"], int(s["fleet.replicas"])
    assert slots >= 4, "the test scales 2 -> 3 -> 2 pods and wants an empty slot throughout"
    (pool,) = parse_config(yaml.safe_load(CONTROLLER_CONFIG.read_text())).pools  # the controller's, on Kubernetes
    backend = pool.backend
    srv_name = f"_http._tcp.{fleet}.{ns}.svc.{env['CLUSTER_DOMAIN']}"  # the headless Service's port `http`
    hold_obsolete = seconds(cfg_text, r"^\s*hold obsolete (\d+)s$")

    port = free_port("127.0.0.2")  # every pod listens on the one port, as vLLM's 8000 on each pod IP
    fleet_pods = [Pod(f"{fleet}-{i}.{fleet}.{ns}.svc.{env['CLUSTER_DOMAIN']}", port, f"127.0.0.{i + 2}")
                  for i in range(3)]
    servers = {p.address: pods(p.address, port) for p in fleet_pods}
    names = [f"{fleet}-slot{i}" for i in range(1, slots + 1)]

    with DnsServer(srv_name, fleet_pods[:2]) as dns:
        text, front = local_config(cfg_text, dns.port, tmp_path / "admin.sock")
        hap = HaproxyProc(tmp_path, text)
        hap.start()
        try:
            client = RuntimeClient(hap.endpoint)  # how the controller reads an HAProxy (controller/loop.py)

            def view() -> dict[str, ServerState]:
                return {x.name: x for x in client.show_servers_state() if x.backend == backend}

            def filled(n: int):
                """The view once slots 1..n hold the first n pods and are UP, and every other slot is in MAINT."""
                v = view()
                want = {names[i]: (f"{p.address}:{port}", p.target) for i, p in enumerate(fleet_pods[:n])}
                got = {k: (x.address, x.fqdn) for k, x in v.items() if not x.maint}
                return v if got == want and all(v[k].status == "UP" for k in want) else None

            def until(predicate, timeout_s: float, what: str):
                """wait_until, failing with what HAProxy asked the DNS server, its slots and its log."""
                try:
                    return wait_until(predicate, timeout_s=timeout_s, interval_s=0.1, what=what)
                except TimeoutError as e:
                    slots = [(x.name, x.address, x.fqdn, x.status) for x in view().values()]
                    raise AssertionError(f"{e}\nasked: {sorted(set(dns.asked))}\nslots: {slots}\n"
                                         f"{hap.proc.log_tail() if hap.proc else ''}") from None

            # the first pods fill the first slots, each with its address and, in srv_fqdn, its DNS name
            t0 = time.monotonic()
            v = until(lambda: filled(2), 15, "slots 1-2 UP with pods 0-1")
            fill_s = time.monotonic() - t0
            assert list(v) == names
            assert (srv_name, TYPE_SRV) in dns.asked
            for k in names[2:]:  # no pod: in MAINT (resolution), no address
                assert v[k].maint and v[k].address.startswith("-") and v[k].fqdn is None, v[k]
            # traffic through the client frontend reaches both pods, each slot's its own pod's
            want = {(names[0], "127.0.0.2"), (names[1], "127.0.0.3")}
            seen: set[tuple[str, str]] = set()
            until(lambda: seen.update(served_by(front) for _ in range(10)) or seen >= want, 10,
                  "traffic through the gateway to both pods")
            assert seen == want

            # a scale-up: the new SRV record fills the next slot
            dns.set_pods(fleet_pods)
            t0 = time.monotonic()
            until(lambda: filled(3), 15, "slot 3 UP with pod 2")
            up_s = time.monotonic() - t0

            # a scale-down (a StatefulSet removes its highest ordinal): the pod goes, its record leaves the answer;
            # the slot keeps it until `hold obsolete` has passed, then goes to MAINT
            dns.set_pods(fleet_pods[:2])
            servers[fleet_pods[2].address].close()
            t0 = time.monotonic()
            v = until(lambda: filled(2), hold_obsolete + 15, "slot 3 back in MAINT")
            down_s = time.monotonic() - t0
            print(f"filled {fill_s:.1f}s after the start, scale-up {up_s:.1f}s, scale-down {down_s:.1f}s "
                  f"(hold obsolete {hold_obsolete:g}s)")
            assert down_s >= hold_obsolete - 3, f"slot 3 left {down_s:.1f}s after its record: not the shipped hold"
            assert v[names[2]].maint and v[names[2]].fqdn is None

            # the controller's view: every slot a node; the pods' at their addresses, matched to the series the
            # PodMonitor labels instance=<pod IP>:<port>; the empty slots held (MAINT: the policy leaves them alone)
            nodes = tier_view([view()])
            assert nodes is not None and list(nodes) == names
            assert [(k, x.address, x.maint) for k, x in nodes.items()] == \
                [(names[0], f"127.0.0.2:{port}", False), (names[1], f"127.0.0.3:{port}", False)] + \
                [(k, "-:0", True) for k in names[2:]]  # HAProxy's "-" address, port 0: no pod
            assert series_keys(pool, nodes[names[0]]) == (f"{fleet_pods[0].target}:{port}", f"127.0.0.2:{port}")
            now = time.time()
            samples = {q: [Sample({pool.series_label: f"{p.address}:{port}"}, 0.05, now) for p in fleet_pods[:2]]
                       for q in ("latency", "rate")}
            data = pool_data(pool, nodes, samples)
            assert set(data.latency) == set(names[:2])
            assert set(data.without) == set(names[2:]) and set(data.without.values()) == {"unmatched"}
            held = {k: i.hold for k, i in node_inputs(pool, nodes, samples, {}, {}, data=data).items()}
            assert held == {k: k not in names[:2] for k in names}
        finally:
            hap.stop()
