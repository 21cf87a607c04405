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
    ({"urls": "x"}, None, {}, "registry.urls: unknown field (known: expiry_cap_per_minute, lease_ttl_s, prefix, "
                              "shard_pools, snapshot_file, timeout_s, url)"),
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
    r = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config", str(p), "--check"],
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
