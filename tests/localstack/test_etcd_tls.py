"""etcd over TLS with client certificates (--client-cert-auth), and a cluster of several endpoints: a real etcd
started by the test with certificates it makes (openssl). With the right CA and client certificate every part
works (the Registry, a watch, the exporter's registration from its --registry.* flags, the controller's discovery
and election from its config); without them etcd refuses, and the refusal is a prompt, clear RegistryError.
An endpoint that cannot be reached is passed over for the next."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from grayguard.config import ConfigError, RegistryConfig, parse_config
from grayguard.controller.cmd_controller import build_leadership
from grayguard.controller.discovery import Discovery
from grayguard.controller.metrics import ControllerMetrics
from grayguard.exporters import cli
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.server import Exporter
from grayguard.localstack.etcd import EtcdProc, EtcdTls
from grayguard.localstack.procs import free_port, wait_until
from grayguard.registry import NodeRecord, Registry, RegistryError, node_key
from grayguard.sim.fleet import FleetThread
from tests.support.stack import require

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    require("etcd", "openssl")
    return EtcdTls.generate(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A CA etcd does not trust, with a client certificate of its own."""
    require("openssl")
    return EtcdTls.generate(tmp_path_factory.mktemp("other-ca"), ca_name="another-ca")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory, certs):
    proc = EtcdProc(tmp_path_factory.mktemp("etcd"), tls=certs).start()
    yield proc
    proc.stop()


def tls_config(certs: EtcdTls, *urls: str, **kw) -> RegistryConfig:
    return RegistryConfig(**{"endpoints": urls, "ca_file": certs.ca_file, "cert_file": certs.client_cert_file,
                             "key_file": certs.client_key_file, **kw})


def refused(cfg: RegistryConfig) -> RegistryError:
    """The error one read gets, checked to come promptly (a refusal, not a hang until some timeout)."""
    reg = Registry.from_config(cfg)
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        reg.get("/k")
    assert time.monotonic() - started < cfg.timeout_s + 0.5
    return e.value


def test_tls_etcd_works_with_the_ca_and_the_client_certificate(etcd, certs):
    assert etcd.url.startswith("https://127.0.0.1:")
    reg = Registry.from_config(tls_config(certs, etcd.url))
    lease = reg.grant(10)
    reg.put("/tls/a", "1", lease=lease)
    assert reg.get("/tls/a").value == "1" and reg.create("/tls/b", "2") and not reg.create("/tls/b", "3")
    entries, rev = reg.get_prefix("/tls/")
    assert set(entries) == {"/tls/a", "/tls/b"}

    stop, seen = threading.Event(), []

    def watch():
        for ev in reg.watch_prefix("/tls/", rev + 1, stop, idle_timeout=5):
            seen.append(ev)
            stop.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    writer = Registry.from_config(tls_config(certs, etcd.url))
    writer.put("/tls/c", "3")
    t.join(10)
    assert [(e.kind, e.key, e.value) for e in seen] == [("put", "/tls/c", "3")]  # the watch stream is TLS too
    assert reg.revoke(lease) and reg.get("/tls/a") is None


def test_tls_etcd_refuses_without_a_client_certificate_or_with_the_wrong_ca(etcd, certs, other):
    no_cert = refused(RegistryConfig(url=etcd.url, ca_file=certs.ca_file, timeout_s=2.0))
    assert no_cert.kind == "unreachable" and "etcd refused the client certificate, or wants one" in str(no_cert)
    wrong_ca = refused(RegistryConfig(url=etcd.url, ca_file=other.ca_file, cert_file=certs.client_cert_file,
                                      key_file=certs.client_key_file))
    assert wrong_ca.kind == "unreachable" and "CERTIFICATE_VERIFY_FAILED" in str(wrong_ca)
    assert "not signed by registry.ca_file" in str(wrong_ca)
    system_cas = refused(RegistryConfig(url=etcd.url, cert_file=certs.client_cert_file,
                                        key_file=certs.client_key_file))  # no ca_file: the system's CAs
    assert "CERTIFICATE_VERIFY_FAILED" in str(system_cas)
    foreign_cert = refused(tls_config(certs, etcd.url, cert_file=other.client_cert_file,
                                      key_file=other.client_key_file))  # a client certificate of another CA
    assert foreign_cert.kind == "unreachable" and "TLS" in str(foreign_cert)
    plain = refused(RegistryConfig(url=etcd.url.replace("https://", "http://")))
    assert plain.kind == "unreachable" and "does etcd serve https:// there?" in str(plain)


def test_the_first_endpoint_dead_the_second_answers_and_is_kept(etcd, certs):
    dead = f"https://127.0.0.1:{free_port()}"  # nothing listens: the connection is refused
    reg = Registry.from_config(tls_config(certs, dead, etcd.url, timeout_s=1.0))
    assert reg.url == dead
    reg.put("/multi/a", "1")
    assert reg.url == etcd.url and reg.get("/multi/a").value == "1"  # later calls stay with the one that answered
    lease = reg.grant(5)
    assert reg.keep_alive(lease) > 0 and reg.revoke(lease)
    _, rev = reg.get_prefix("/multi/")
    other = Registry.from_config(tls_config(certs, dead, etcd.url))  # a watch starts at the dead one too
    stop, seen = threading.Event(), []

    def watch():
        for ev in other.watch_prefix("/multi/", rev + 1, stop, idle_timeout=5):
            seen.append(ev.key)
            stop.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    wait_until(lambda: other.url == etcd.url, 5, 0.02, "the watch's session passed the dead endpoint")
    reg.put("/multi/b", "2")
    t.join(10)
    assert seen == ["/multi/b"]


def test_a_silent_endpoint_leaves_time_for_the_next(etcd, certs):
    """An endpoint that accepts no connection (a full backlog: a host that drops packets) takes a share of the
    call's deadline, not all of it: the next endpoint still answers within timeout_s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        fillers = []
        for _ in range(8):  # fill the backlog: further connects hang in SYN_SENT
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(silent.getsockname())
            fillers.append(s)
        try:
            reg = Registry.from_config(tls_config(certs, f"https://127.0.0.1:{silent.getsockname()[1]}", etcd.url,
                                                  timeout_s=1.5))
            started = time.monotonic()
            reg.put("/silent/a", "1")
            assert time.monotonic() - started < 1.5 and reg.url == etcd.url
        finally:
            for s in fillers:
                s.close()


class Mute:
    """A member that accepts connections and reads requests but never answers (cut off from its quorum)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never answered

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_member_that_never_answers_a_read_moves_on_a_write_is_not_sent_twice(tmp_path):
    etcd = EtcdProc(tmp_path / "etcd").start()
    mute = Mute()
    try:
        reader = Registry.from_config(RegistryConfig(endpoints=(mute.url, etcd.url), timeout_s=1.0))
        started = time.monotonic()
        assert reader.get("/mute/a") is None and reader.url == etcd.url  # its share of the deadline, then the next
        assert time.monotonic() - started < 1.0
        writer = Registry.from_config(RegistryConfig(endpoints=(mute.url, etcd.url), timeout_s=1.0))
        with pytest.raises(RegistryError) as e:
            writer.put("/mute/a", "1")  # sent to the mute member: it may have been applied, so not sent again
        assert e.value.kind == "timeout" and reader.get("/mute/a") is None
        assert writer.url == etcd.url  # but the next call starts at the next member
        writer.put("/mute/a", "1")
        assert reader.get("/mute/a").value == "1"
    finally:
        mute.close()
        etcd.stop()


def test_every_endpoint_dead_is_unreachable_naming_them_all(certs):
    dead = [f"https://127.0.0.1:{free_port()}" for _ in range(2)]
    e = refused(tls_config(certs, *dead, timeout_s=1.0))
    assert e.kind == "unreachable" and all(d in str(e) for d in dead)


# --- the processes' own paths: exporter flags, controller config, actuator CLI ------------------------------
@pytest.fixture
def fleet():
    ft = FleetThread(n=1)
    ft.start()
    yield ft
    ft.stop()


def test_the_exporter_registers_and_the_controller_discovers_and_elects_over_tls(etcd, certs, fleet):
    node = fleet.nodes[0]
    dead = f"https://127.0.0.1:{free_port()}"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--registry.url", dead, "--registry.url", etcd.url, "--registry.ca-file", certs.ca_file,
                         "--registry.cert-file", certs.client_cert_file, "--registry.key-file", certs.client_key_file,
                         "--registry.pool", "chat", "--registry.node", node.name, "--registry.advertise",
                         node.address, "--registry.prefix", "/tlsgg", "--registry.heartbeat", "300ms",
                         "--registry.ttl-min", "2s", "--registry.ttl-max", "3s", "--registry.timeout", "1s"])
    assert cli.config_error(args) is None
    cfg = parse_config({"pools": [{"name": "chat", "backend": "vllm_chat", "discovery": "registry"}],
                        "state_file": None, "tick_interval_s": 0.5,
                        "registry": {"endpoints": [dead, etcd.url], "prefix": "/tlsgg", "lease_ttl_s": 4,
                                     "timeout_s": 1.0, "ca_file": certs.ca_file, "cert_file": certs.client_cert_file,
                                     "key_file": certs.client_key_file}})
    disc = Discovery(Registry.from_config(cfg.registry), "/tlsgg", ["chat"], None, CollectorRegistry()).start()
    metrics = ControllerMetrics.create()
    leadership = build_leadership(cfg, "replica-a", metrics)
    ex = Exporter(node.url, port=0, nvml=FakeNvml([healthy_h100(0)]), probe=None, xid_events=False,
                  registration=cli.registration_config(args))
    try:
        ex.start()
        reg = Registry.from_config(cfg.registry)
        key = node_key("/tlsgg", "chat", node.name)
        wait_until(lambda: reg.get(key) is not None, 15, 0.05, "the exporter registered over TLS")
        assert NodeRecord.from_json(reg.get(key).value).endpoint == node.address
        assert disc.wait_synced(5)
        wait_until(lambda: node.name in (disc.view("chat").nodes if disc.view("chat") else {}), 10, 0.05,
                   "discovery saw the node over TLS")
        assert leadership.begin_tick().led == frozenset({"chat"})  # the election's transactions, over TLS
        assert leadership.status()["leads"] == ["all"] and leadership.store.url == etcd.url
    finally:
        ex.stop()
        disc.stop()
        leadership.close()


def test_the_actuator_flags_reach_tls_etcd_and_a_bad_one_is_named(etcd, certs, tmp_path):
    base = [sys.executable, "-m", "grayguard.cli", "actuator", "--haproxy.socket", f"unix:{tmp_path}/none.sock",
            "--once", "--registry.timeout", "1s"]
    tls = ["--registry.url", etcd.url, "--registry.ca-file", certs.ca_file]
    bad = subprocess.run([*base, *tls, "--registry.cert-file", certs.client_cert_file], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--registry.cert-file: needs --registry.key-file" in bad.stderr, bad.stderr
    missing = subprocess.run([*base, *tls, "--registry.cert-file", str(tmp_path / "no.pem"), "--registry.key-file",
                              certs.client_key_file], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--registry.cert-file: cannot load the client certificate" in missing.stderr
    no_cert = subprocess.run([*base, *tls], capture_output=True, text=True, timeout=60)
    assert no_cert.returncode == 1 and "registry" in no_cert.stdout and "wants one" in no_cert.stdout, no_cert.stdout
    ok = subprocess.run([*base, *tls, "--registry.cert-file", certs.client_cert_file, "--registry.key-file",
                         certs.client_key_file], capture_output=True, text=True, timeout=60)
    # etcd answered over TLS: the round went on to this HAProxy's socket (absent here), not a registry error
    assert ok.returncode == 1 and "HAProxy" in ok.stdout and "registry" not in ok.stdout.split("HAProxy")[0], ok.stdout


def test_flags_that_would_send_tls_files_over_http_are_named():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    from grayguard.etcdconn import settings_from_flags

    args = p.parse_args(["--registry.url", "http://e:2379", "--registry.ca-file", "/ca.pem"])
    with pytest.raises(ConfigError) as e:
        settings_from_flags(args)
    assert str(e.value) == ("--registry.url: must be https:// with --registry.ca-file set (TLS files are for TLS), "
                            "got 'http://e:2379'")
