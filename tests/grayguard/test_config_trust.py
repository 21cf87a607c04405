"""Issue 12, items 5 and 11: a config that `grayguard controller --check` accepts does not fail later.

Each case below passed --check before (and then raised in every tick, broke the rule file, or crashed at
startup); now --check exits 2 and names the field.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from grayguard.cli import main
from grayguard.config import ConfigError, parse_config
from grayguard.rules.render import ALERTS_FILE, render_all
from grayguard.rules.rerender import check_rule_files
from tests.support.stack import require

BASE = {"prometheus": {"url": "http://127.0.0.1:9090"}, "haproxy": {"endpoints": ["/run/haproxy.sock"]},
        "pools": [{"name": "chat", "backend": "vllm_chat"}], "state_file": None}


def with_override(section: str, override: dict) -> dict:
    d = yaml.safe_load(yaml.safe_dump(BASE))
    if section == "":
        d.update(override)
    elif section == "pool0":
        d["pools"][0].update(override)
    else:
        d.setdefault(section, {}).update(override)
    return d


def check(tmp_path, doc: dict, capsys) -> tuple[int, str]:
    f = tmp_path / "grayguard.yaml"
    f.write_text(yaml.safe_dump(doc))
    rc = main(["controller", "--config.file", str(f), "--check"])
    # the file's problems under its name, one a line; the environment's (preflight) on one line
    return rc, capsys.readouterr().err.replace(f"config error in {f}:\n  ", "config error: ")


INF = float("inf")
CASES = [
    # timeouts: negative, or infinite where a finite number of seconds is needed
    ("haproxy", {"timeout_s": -1}, "haproxy.timeout_s"),
    ("haproxy", {"timeout_s": INF}, "haproxy.timeout_s"),
    ("prometheus", {"timeout_s": INF}, "prometheus.timeout_s"),
    ("recovery", {"canary_timeout_s": INF}, "recovery.canary_timeout_s"),
    ("", {"tick_interval_s": INF}, "tick_interval_s"),
    ("rules", {"rerender_interval_s": INF}, "rules.rerender_interval_s"),
    # ports above 65535
    ("", {"listen_address": "127.0.0.1:70000"}, "listen_address"),
    ("haproxy", {"endpoints": ["127.0.0.1:99999"]}, "haproxy.endpoints[0]"),
    ("prometheus", {"url": "http://127.0.0.1:99999"}, "prometheus.url"),
    ("rules", {"reload_url": "http://127.0.0.1:99999/-/reload"}, "rules.reload_url"),
    # non-finite group_speed
    ("pool0", {"group_speed": {"h100": INF}}, "pools[0].group_speed.h100"),
    # canary_url without a scheme or host (item 5: it raised in every tick, for every pool)
    ("pool0", {"servers": {"node1": {"canary_url": "node1:8000"}}}, "pools[0].servers.node1.canary_url"),
    ("pool0", {"servers": {"node1": {"canary_url": "http://"}}}, "pools[0].servers.node1.canary_url"),
    ("pool0", {"servers": {"node1": {"canary_url": "ftp://node1:8000"}}}, "pools[0].servers.node1.canary_url"),
    # a runbook_url that is not one URL (": " broke the rendered rule file)
    ("rules", {"runbook_url": "https://wiki.example/Runbook: GPU"}, "rules.runbook_url"),
    # environment variables named but not set (the Prometheus client raised only at startup)
    ("prometheus", {"headers_env": {"X-Scope-OrgID": "GRAYGUARD_TEST_UNSET_TENANT"}},
     "prometheus.headers_env.X-Scope-OrgID"),
    ("prometheus", {"bearer_token_env": "GRAYGUARD_TEST_UNSET_TOKEN"}, "prometheus.bearer_token_env"),
]


@pytest.mark.parametrize("section, override, field", CASES, ids=[c[2] + "=" + repr(c[1])[:40] for c in CASES])
def test_check_exits_2_naming_the_field(tmp_path, capsys, monkeypatch, section, override, field):
    monkeypatch.delenv("GRAYGUARD_TEST_UNSET_TENANT", raising=False)
    monkeypatch.delenv("GRAYGUARD_TEST_UNSET_TOKEN", raising=False)
    rc, err = check(tmp_path, with_override(section, override), capsys)
    assert rc == 2, f"--check accepted {field}={override!r}"
    assert f"config error: {field}: " in err


def test_the_same_configs_without_the_fault_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAYGUARD_TEST_TENANT", "t1")
    ok = with_override("prometheus", {"headers_env": {"X-Scope-OrgID": "GRAYGUARD_TEST_TENANT"}, "timeout_s": 2})
    ok["pools"][0]["servers"] = {"node1": {"canary_url": "https://node1.example:8443/"}}
    ok["pools"][0]["group_speed"] = {"h100": 0.5}
    ok["listen_address"] = "[::1]:65535"
    ok["haproxy"] = {"endpoints": ["127.0.0.1:65535", "unix:/run/haproxy.sock"], "timeout_s": 0.5}
    ok["rules"] = {"runbook_url": "https://wiki.example/Runbook:GPU#top", "reload_url": "none"}
    rc, err = check(tmp_path, ok, capsys)
    assert (rc, err) == (0, "")


def test_canary_url_message_names_the_fix():
    with pytest.raises(ConfigError) as e:
        parse_config(with_override("pool0", {"servers": {"n1": {"canary_url": "10.0.0.1:8000"}}}))
    assert e.value.path == "pools[0].servers.n1.canary_url"
    assert "must be http:// or https:// with a host" in e.value.problem and "'10.0.0.1:8000'" in e.value.problem


def test_check_runs_as_a_command(tmp_path):
    f = tmp_path / "grayguard.yaml"
    f.write_text(yaml.safe_dump(with_override("pool0", {"servers": {"node1": {"canary_url": "node1:8000"}}})))
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(f), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pools[0].servers.node1.canary_url" in p.stderr
    assert "Traceback" not in p.stderr


def test_listen_address_override_is_checked(tmp_path, capsys):
    f = tmp_path / "grayguard.yaml"
    f.write_text(yaml.safe_dump(BASE))
    assert main(["controller", "--config.file", str(f), "--web.listen-address", "127.0.0.1:99999", "--check"]) == 2
    assert "--web.listen-address" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["https://wiki.example/Runbook: GPU", "https://wiki.example/a #b: c",
                                 "https://wiki.example/x:", 'https://wiki.example/"quoted"'])
def test_runbook_url_is_quoted_in_the_rule_file(url):
    # Rendering alone must be safe, whatever the value (a config built in code skips the URL check).
    cfg = parse_config(BASE)
    cfg = dataclasses.replace(cfg, rules=dataclasses.replace(cfg.rules, runbook_url=url))
    doc = yaml.safe_load(render_all(cfg, {})[ALERTS_FILE])
    links = {r["annotations"]["runbook_url"] for g in doc["groups"] for r in g["rules"] if "alert" in r}
    base = url.split("#")[0]
    assert links and all(link.startswith(base + "#grayguard") for link in links)


def test_quoted_runbook_url_passes_promtool(tmp_path):
    require("promtool")
    cfg = parse_config(BASE)
    cfg = dataclasses.replace(cfg, rules=dataclasses.replace(cfg.rules, runbook_url="https://wiki.example/a: b"))
    f = tmp_path / ALERTS_FILE
    f.write_text(render_all(cfg, {})[ALERTS_FILE])
    check_rule_files([f], "promtool")  # raises RuleFileError when promtool rejects the file
