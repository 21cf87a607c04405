"""etcd with its auth enabled (users, roles, `auth enable`, set up through the gateway's /v3/auth endpoints), over
TLS with client certificates, as production runs it: a real etcd. The right user and password work (every call,
a watch, the election, the exporter's registration from its flags); a wrong password, no user or a key outside
the user's role is a clear RegistryError; a token etcd forgot (it restarted) is renewed without the caller
noticing, with the password file read again."""

from __future__ import annotations

import argparse
import base64
import threading
import time

import pytest
import requests

from grayguard.config import RegistryConfig, parse_config
from grayguard.controller.cmd_controller import build_leadership
from grayguard.controller.metrics import ControllerMetrics
from grayguard.exporters import cli
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.server import Exporter
from grayguard.localstack.etcd import EtcdProc, EtcdTls
from grayguard.localstack.procs import wait_until
from grayguard.registry import Registry, RegistryError, node_key
from grayguard.sim.fleet import FleetThread
from tests.support.stack import require

pytestmark = pytest.mark.e2e
USER, PASSWORD = "grayguard", "gg-Secret-1"
PREFIX = "/gg"  # the user's role may read and write every key under it, nothing else


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Admin:
    """etcd's /v3/auth endpoints, called as etcdctl would (root once auth is on)."""

    def __init__(self, etcd: EtcdProc, tls: EtcdTls):
        self.url, self.s = etcd.url, requests.Session()
        self.s.trust_env = False  # REQUESTS_CA_BUNDLE would override verify
        self.s.verify, self.s.cert = tls.ca_file, (tls.client_cert_file, tls.client_key_file)
        self.token: str | None = None

    def __call__(self, path: str, body: dict) -> dict:
        headers = {"Authorization": self.token} if self.token else {}
        r = self.s.post(f"{self.url}/v3/{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    def login(self) -> None:
        self.token = None  # etcd refuses even a login that carries a token it forgot
        self.token = self("auth/authenticate", {"name": "root", "password": "root-pw"})["token"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    require("etcd", "openssl")
    return EtcdTls.generate(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory, certs):
    proc = EtcdProc(tmp_path_factory.mktemp("etcd"), tls=certs).start()
    admin = Admin(proc, certs)
    admin("auth/user/add", {"name": "root", "password": "root-pw"})
    admin("auth/role/add", {"name": "root"})
    admin("auth/user/grant", {"user": "root", "role": "root"})
    admin("auth/user/add", {"name": USER, "password": PASSWORD})
    admin("auth/role/add", {"name": USER})
    admin("auth/role/grant", {"name": USER, "perm": {"permType": "READWRITE", "key": _b64(PREFIX + "/"),
                                                       "range_end": _b64(PREFIX + "0")}})
    admin("auth/user/grant", {"user": USER, "role": USER})
    admin("auth/enable", {})
    yield proc
    proc.stop()


@pytest.fixture
def password_file(tmp_path):
    p = tmp_path / "etcd-password"
    p.write_text(PASSWORD + "\n")
    return p


def auth_config(etcd: EtcdProc, certs: EtcdTls, **kw) -> RegistryConfig:
    base = {"url": etcd.url, "ca_file": certs.ca_file, "cert_file": certs.client_cert_file,
            "key_file": certs.client_key_file, "username": USER, "timeout_s": 2.0}
    return RegistryConfig(**{**base, **kw})


def refusal(reg: Registry) -> RegistryError:
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        reg.get(PREFIX + "/k")
    assert time.monotonic() - started < reg.timeout + 0.5  # an answer, not a hang
    return e.value


def test_the_right_password_works_for_every_call_and_a_watch(etcd, certs, password_file):
    reg = Registry.from_config(auth_config(etcd, certs, password_file=str(password_file)))
    lease = reg.grant(10)
    reg.put(PREFIX + "/a", "1", lease=lease)
    assert reg.get(PREFIX + "/a").value == "1" and reg.keep_alive(lease) > 0
    assert reg.create(PREFIX + "/b", "2") and reg.delete(PREFIX + "/b")
    _, rev = reg.get_prefix(PREFIX + "/")
    stop, seen = threading.Event(), []

    def watch():
        for ev in reg.watch_prefix(PREFIX + "/", rev + 1, stop, idle_timeout=5):
            seen.append(ev.key)
            stop.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    writer = Registry.from_config(auth_config(etcd, certs, password_env="ETCD_PW"), environ={"ETCD_PW": PASSWORD})
    writer.put(PREFIX + "/c", "3")
    t.join(10)
    assert seen == [PREFIX + "/c"]
    assert reg.revoke(lease) and reg.get(PREFIX + "/a") is None
    outside = Registry.from_config(auth_config(etcd, certs, password_file=str(password_file)))
    with pytest.raises(RegistryError) as e:
        outside.put("/elsewhere", "x")  # the role covers PREFIX only
    assert e.value.kind == "rejected" and "permission denied" in str(e.value)


def test_a_wrong_password_no_user_or_no_password_is_a_clear_refusal(etcd, certs, tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("not-the-password\n")
    wrong = refusal(Registry.from_config(auth_config(etcd, certs, password_file=str(bad))))
    assert wrong.kind == "rejected" and f"etcd user {USER!r} not authenticated" in str(wrong)
    assert "authentication failed, invalid user ID or password" in str(wrong)
    anonymous = refusal(Registry.from_config(auth_config(etcd, certs, username=None)))
    assert anonymous.kind == "rejected" and "user name is empty" in str(anonymous)
    gone = tmp_path / "gone"
    gone.write_text(PASSWORD)
    reg = Registry.from_config(auth_config(etcd, certs, password_file=str(gone)))
    gone.unlink()  # read at each login: a file removed after startup refuses, it does not crash
    missing = refusal(reg)
    assert missing.kind == "rejected" and "no password" in str(missing)


def test_a_token_etcd_forgot_is_renewed_and_the_password_file_read_again(etcd, certs, password_file):
    reg = Registry.from_config(auth_config(etcd, certs, password_file=str(password_file)))
    reg.put(PREFIX + "/t", "1")
    first = reg._gw.session.token
    assert first
    # rotate: the new password in etcd and in the file; etcd restarts (its simple tokens live in memory only)
    admin = Admin(etcd, certs)
    admin.login()
    admin("auth/user/changepw", {"name": USER, "password": "gg-Rotated-2"})
    password_file.write_text("gg-Rotated-2\n")
    try:
        _renewed(etcd, certs, reg, first, password_file)
    finally:
        admin.login()  # the other tests log in with PASSWORD
        admin("auth/user/changepw", {"name": USER, "password": PASSWORD})


def _renewed(etcd: EtcdProc, certs: EtcdTls, reg: Registry, first: str, password_file) -> None:
    etcd.restart()
    stale = requests.post(f"{etcd.url}/v3/kv/range", json={"key": _b64(PREFIX + "/t")}, timeout=5,
                          headers={"Authorization": first}, verify=certs.ca_file,
                          cert=(certs.client_cert_file, certs.client_key_file))
    assert stale.status_code == 401  # etcd rejects the old token: what the client must get over
    assert reg.get(PREFIX + "/t").value == "1" and reg._gw.session.token not in (None, first)
    # a watch opened with a token etcd forgot is canceled by etcd: it logs in again and follows
    _, rev = reg.get_prefix(PREFIX + "/")
    etcd.restart()
    stop, seen = threading.Event(), []

    def watch():
        for ev in reg.watch_prefix(PREFIX + "/", rev + 1, stop, idle_timeout=5):
            seen.append(ev.key)
            stop.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    writer = Registry.from_config(auth_config(etcd, certs, password_file=str(password_file)))
    wait_until(lambda: writer.put(PREFIX + "/w", "1") is None and bool(seen), 10, 0.2, "the watch saw the put")
    stop.set()
    t.join(5)
    assert seen[0] == PREFIX + "/w"


@pytest.fixture
def fleet():
    ft = FleetThread(n=1)
    ft.start()
    yield ft
    ft.stop()


def test_the_exporter_flags_and_the_controller_config_log_in(etcd, certs, password_file, fleet):
    node = fleet.nodes[0]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--registry.url", etcd.url, "--registry.ca-file", certs.ca_file, "--registry.cert-file",
                         certs.client_cert_file, "--registry.key-file", certs.client_key_file, "--registry.user", USER,
                         "--registry.password-file", str(password_file), "--registry.pool", "chat",
                         "--registry.node", node.name, "--registry.advertise", node.address, "--registry.prefix",
                         PREFIX + "/v1", "--registry.heartbeat", "300ms", "--registry.ttl-min", "2s",
                         "--registry.ttl-max", "3s", "--registry.timeout", "1s"])
    assert cli.config_error(args) is None
    no_password = p.parse_args(["--registry.url", etcd.url, "--registry.user", USER, "--registry.pool", "chat",
                                "--registry.node", "n1", "--registry.advertise", "h:1"])
    assert cli.config_error(no_password) == ("--registry.user: needs --registry.password-env or "
                                             "--registry.password-file (the password is never written in the config)")
    cfg = parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}], "state_file": None,
                        "tick_interval_s": 0.5,
                        "registry": {"url": etcd.url, "prefix": PREFIX + "/v1", "lease_ttl_s": 4, "timeout_s": 1.0,
                                     "ca_file": certs.ca_file, "cert_file": certs.client_cert_file,
                                     "key_file": certs.client_key_file, "username": USER,
                                     "password_file": str(password_file)}})
    leadership = build_leadership(cfg, "replica-a", ControllerMetrics.create())
    ex = Exporter(node.url, port=0, nvml=FakeNvml([healthy_h100(0)]), probe=None, xid_events=False,
                  registration=cli.registration_config(args))
    try:
        ex.start()
        reg = Registry.from_config(cfg.registry)
        wait_until(lambda: reg.get(node_key(PREFIX + "/v1", "chat", node.name)) is not None, 15, 0.05,
                   "the exporter registered as the etcd user")
        assert leadership.begin_tick().led == frozenset({"chat"}) and leadership.status()["leads"] == ["all"]
    finally:
        ex.stop()
        leadership.close()
