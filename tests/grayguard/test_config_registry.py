"""The registry section and pools[].discovery: defaults, every check with its field-named message, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grayguard.config import ConfigError, RegistryConfig, parse_config

POOL = {"name": "chat", "backend": "vllm_chat"}


def cfg(registry=None, pool=None, **top):
    doc = {"pools": [{**POOL, **(pool or {})}], **top}
    if registry is not None:
        doc["registry"] = registry
    return parse_config(doc)


def test_defaults_run_alone():
    c = cfg()
    assert c.registry == RegistryConfig() and c.registry.url is None and c.pools[0].discovery == "static"
    assert (c.registry.prefix, c.registry.lease_ttl_s, c.registry.timeout_s) == ("/grayguard/v1", 5, 2.0)
    assert c.registry.snapshot_path("grayguard-state.json") == "grayguard-state.json.members.json"
    assert c.registry.snapshot_path(None) is None
    assert RegistryConfig(snapshot_file="/x.json").snapshot_path("s.json") == "/x.json"
    assert c.registry.expiry_share(0.3) == 0.3 and RegistryConfig(expiry_cap_per_minute=0.1).expiry_share(0.3) == 0.1


def test_a_registry_with_every_field():
    c = cfg({"url": "http://etcd:2379", "prefix": "/gg/prod", "lease_ttl_s": 10, "timeout_s": 1, "snapshot_file": "/s",
             "expiry_cap_per_minute": 0.2, "shard_pools": True}, pool={"discovery": "registry"})
    assert c.registry.shard_pools and c.pools[0].discovery == "registry" and c.registry.timeout_s == 1.0


@pytest.mark.parametrize("registry, pool, top, message", [
    ({"url": "etcd:2379"}, None, {}, "registry.url: must be an http:// or https:// URL with a host, got 'etcd:2379'"),
    ({"prefix": "grayguard"}, None, {}, "registry.prefix: must be /segments of letters, digits, '-', '_' or '.', "
                                        "without a trailing '/', got 'grayguard'"),
    ({"prefix": "/gg/"}, None, {}, "registry.prefix: must be /segments of letters, digits, '-', '_' or '.', "
                                   "without a trailing '/', got '/gg/'"),
    ({"lease_ttl_s": 1}, None, {}, "registry.lease_ttl_s: must be >= 2 (etcd's shortest lease)"),
    ({"lease_ttl_s": 2.5}, None, {}, "registry.lease_ttl_s: expected an integer, got 2.5"),
    ({"timeout_s": 0}, None, {}, "registry.timeout_s: must be > 0"),
    ({"timeout_s": 5}, None, {}, "registry.timeout_s: must be < registry.lease_ttl_s (a renewal must answer before "
                                 "the lease ends)"),
    ({"snapshot_file": ""}, None, {}, "registry.snapshot_file: must be a file path or null"),
    ({"expiry_cap_per_minute": 1.5}, None, {}, "registry.expiry_cap_per_minute: must be in [0, 1] (a share of the "
                                               "pool), or null"),
    ({"shard_pools": "yes"}, None, {}, "registry.shard_pools: expected true or false, got 'yes'"),
    ({"urls": "x"}, None, {}, "registry.urls: unknown field (known: ca_file, cert_file, endpoints, "
                              "expiry_cap_per_minute, key_file, lease_ttl_s, password_env, password_file, prefix, "
                              "shard_pools, snapshot_file, timeout_s, url, username)"),
    (None, {"discovery": "dns"}, {}, "pools[0].discovery: must be static or registry, got 'dns'"),
    (None, {"discovery": "registry"}, {}, "pools[0].discovery: registry needs registry.url (the etcd the nodes "
                                          "register in)"),
    ({"url": "http://e:2379", "lease_ttl_s": 3}, None, {"tick_interval_s": 3},
     "registry.lease_ttl_s: must be > tick_interval_s (3s): the lease is renewed every tick"),
    ({"url": "http://e:2379", "lease_ttl_s": 3, "timeout_s": 1.5}, None, {},
     "registry.lease_ttl_s: must be > registry.timeout_s + haproxy.timeout_s (3.5s): a leader writes HAProxy only "
     "while its lease outlasts the write"),
])
def test_each_check_names_its_field(registry, pool, top, message):
    with pytest.raises(ConfigError) as e:
        cfg(registry, pool, **top)
    assert str(e.value) == message


def test_the_lease_checks_apply_only_with_a_registry():
    assert cfg({"lease_ttl_s": 3}, tick_interval_s=5).registry.url is None


def test_check_exits_2_naming_the_field(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump({"pools": [POOL], "registry": {"url": "http://e:2379", "lease_ttl_s": 1}}))
    r = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(p), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "registry.lease_ttl_s: must be >= 2" in r.stderr


def test_the_example_documents_the_registry_section_with_its_defaults():
    lines = (Path(__file__).resolve().parents[2] / "grayguard.example.yaml").read_text().splitlines()
    start = lines.index("#registry:")
    block = []
    for ln in lines[start:]:
        if not ln.startswith("#"):
            break
        block.append(ln[1:])
    doc = yaml.safe_load("\n".join(block))
    c = cfg(doc["registry"])
    assert c.registry == RegistryConfig(url=doc["registry"]["url"])
    assert set(doc["registry"]) == set(RegistryConfig.__dataclass_fields__)


# --- how to reach etcd: endpoints, TLS, the etcd user -------------------------------------------
HTTPS = {"url": "https://etcd-0:2379"}


def test_endpoints_stand_for_url_and_url_for_one_endpoint():
    c = cfg({"endpoints": ["https://etcd-0:2379", "https://etcd-1:2379"]}, pool={"discovery": "registry"})
    assert c.registry.url == "https://etcd-0:2379"  # "is there a registry" and the logs keep working
    assert c.registry.urls() == ("https://etcd-0:2379", "https://etcd-1:2379")
    assert cfg({"url": "http://e:2379"}).registry.urls() == ("http://e:2379",) and cfg().registry.urls() == ()
    assert cfg({"endpoints": ["https://e:2379/"], "url": "https://e:2379/"}).registry.urls() == ("https://e:2379/",)


def test_tls_and_a_user_with_every_field():
    r = cfg({**HTTPS, "ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/c.key", "username": "grayguard",
             "password_file": "/run/secrets/etcd"}).registry
    assert (r.ca_file, r.cert_file, r.key_file, r.username, r.password_file) == (
        "/ca.pem", "/c.pem", "/c.key", "grayguard", "/run/secrets/etcd")
    assert cfg({**HTTPS, "ca_file": "/ca.pem"}).registry.cert_file is None  # a CA alone: TLS without a client cert
    assert cfg({"url": "http://e:2379", "username": "u", "password_env": "P"}).registry.password_env == "P"


@pytest.mark.parametrize("registry, message", [
    ({"url": "https://a:2379", "endpoints": ["https://b:2379"]},
     "registry.url: set url (one endpoint) or endpoints (several), not both"),
    ({"endpoints": ["https://a:2379", "b:2379"]},
     "registry.endpoints[1]: must be an http:// or https:// URL with a host, got 'b:2379'"),
    ({"endpoints": ["https://a:2379", "https://a:2379"]}, "registry.endpoints: lists an endpoint twice"),
    ({"endpoints": "https://a:2379"}, "registry.endpoints: expected a list, got str"),
    ({"url": "https://a:2379/etcd"}, "registry.url: must be scheme://host:port alone (etcd's gateway is at its "
                                     "root), got 'https://a:2379/etcd'"),
    ({"url": "http://a:2379", "ca_file": "/ca.pem"},
     "registry.url: must be https:// with registry.ca_file set (TLS files are for TLS), got 'http://a:2379'"),
    ({"endpoints": ["https://a:2379", "http://b:2379"], "cert_file": "/c.pem", "key_file": "/c.key"},
     "registry.endpoints[1]: must be https:// with registry.cert_file set (TLS files are for TLS), "
     "got 'http://b:2379'"),
    ({**HTTPS, "cert_file": "/c.pem"}, "registry.cert_file: needs registry.key_file (the client certificate's key)"),
    ({**HTTPS, "key_file": "/c.key"}, "registry.key_file: needs registry.cert_file"),
    ({**HTTPS, "ca_file": ""}, "registry.ca_file: must be a non-empty string or null"),
    ({**HTTPS, "username": "u"}, "registry.username: needs registry.password_env or registry.password_file (the "
                                 "password is never written in the config)"),
    ({**HTTPS, "password_env": "P"}, "registry.password_env: needs registry.username"),
    ({**HTTPS, "password_file": "/p"}, "registry.password_file: needs registry.username"),
    ({**HTTPS, "username": "u", "password_env": "P", "password_file": "/p"},
     "registry.password_file: set password_env or password_file, not both"),
    ({**HTTPS, "password": "hunter2"}, "registry.password: unknown field (known: ca_file, cert_file, endpoints, "
                                       "expiry_cap_per_minute, key_file, lease_ttl_s, password_env, password_file, "
                                       "prefix, shard_pools, snapshot_file, timeout_s, url, username)"),
])
def test_each_connection_check_names_its_field(registry, message):
    with pytest.raises(ConfigError) as e:
        cfg(registry)
    assert str(e.value) == message


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    from grayguard.localstack.etcd import EtcdTls

    return EtcdTls.generate(tmp_path_factory.mktemp("certs"))


def test_preflight_loads_the_files_and_the_password(tls, tmp_path):
    from grayguard.controller.cmd_controller import preflight

    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    good = {**HTTPS, "ca_file": tls.ca_file, "cert_file": tls.client_cert_file, "key_file": tls.client_key_file}
    preflight(cfg({**good, "username": "gg", "password_file": str(pw)}, state_file=None))
    preflight(cfg({**good, "username": "gg", "password_env": "ETCD_PW"}, state_file=None), environ={"ETCD_PW": "x"})
    cases = [
        ({**good, "ca_file": str(tmp_path / "nope.pem")}, {}, "registry.ca_file: cannot load CA file"),
        ({**good, "cert_file": tls.ca_file, "key_file": tls.client_key_file}, {}, "registry.cert_file: cannot load"),
        ({**good, "key_file": str(tmp_path / "nope.key")}, {}, "registry.key_file: cannot load"),
        ({**good, "username": "gg", "password_file": str(tmp_path / "nope")}, {},
         "registry.password_file: cannot read"),
        ({**good, "username": "gg", "password_env": "ETCD_PW"}, {},
         "registry.password_env: environment variable ETCD_PW is not set or empty"),
    ]
    (tmp_path / "empty").write_text("\n")
    cases.append(({**good, "username": "gg", "password_file": str(tmp_path / "empty")}, {},
                  "registry.password_file: " + str(tmp_path / "empty") + " is empty"))
    for registry, env, says in cases:
        with pytest.raises(ConfigError) as e:
            preflight(cfg(registry, state_file=None), environ=env)
        assert str(e.value).startswith(says), (registry, str(e.value))


def test_check_exits_2_naming_a_missing_ca_file(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump({"pools": [POOL], "state_file": None,
                                 "registry": {**HTTPS, "ca_file": str(tmp_path / "ca.pem")}}))
    r = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(p), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "registry.ca_file: cannot load CA file" in r.stderr, r.stderr
