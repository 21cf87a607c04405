"""Issue 12, item 12: Prometheus over mutual TLS and a bearer token file, and no secret in logs, hold
reasons, /status or /metrics.

A real HTTPS server (Python's ssl) that requires a client certificate signed by the test CA stands in for
Prometheus (or vmauth in front of it); the certificates are made by the `openssl` command for each run.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grayguard.cli import main
from grayguard.config import ConfigError, PrometheusConfig, parse_config
from grayguard.controller.cmd_controller import print_plan
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.httpserver import serve
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.localstack.procs import free_port
from grayguard.promclient import PromError, PrometheusClient
from grayguard.redact import redact, redact_url
from grayguard.rules.rerender import RuleRerenderer
from tests.support.ctl_helpers import servers

VECTOR = {"status": "success", "data": {"resultType": "vector", "result": [
    {"metric": {"instance": "a:1"}, "value": [1700000000, "0.5"]}]}}
SECRET = "s3cr3t-Pa55"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_cert(d: Path, name: str, ca: str, ext: str) -> None:
    """name.key + name.crt signed by ca (ca.key/ca.crt in d), with the given v3 extensions."""
    (d / f"{name}.ext").write_text(ext)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", f"/CN={name}",
            "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a client certificate of another CA."""
    if not shutil.which("openssl"):
        pytest.fail("the openssl command is needed to make the test certificates (apt-get install openssl)")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                "-days", "2", "-subj", f"/CN=grayguard test {ca}", cwd=d)
    make_cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    make_cert(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    make_cert(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    (d / "client-combined.pem").write_text((d / "client.crt").read_text() + (d / "client.key").read_text())
    return d


class FakeProm:
    """An HTTPS Prometheus that demands a client certificate from the test CA; records each request's headers."""

    def __init__(self, pki: Path):
        self.seen: list[dict] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append(dict(self.headers))
                body = json.dumps(VECTOR).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
        ctx.load_verify_locations(pki / "ca.crt")
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no client certificate, no request
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        self.srv.socket = ctx.wrap_socket(self.srv.socket, server_side=True)
        self.srv.handle_error = lambda *a: None  # a refused handshake is the point of some tests
        self.url = f"https://127.0.0.1:{self.srv.server_address[1]}"
        self.thread = threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def prom(pki):
    p = FakeProm(pki)
    yield p
    p.close()


def tls_cfg(prom: FakeProm, pki: Path, **kw) -> PrometheusConfig:
    args = {"url": prom.url, "timeout_s": 3.0, "ca_file": str(pki / "ca.crt"),
            "cert_file": str(pki / "client.crt"), "key_file": str(pki / "client.key"), **kw}
    return parse_config({"prometheus": args, "pools": [{"name": "chat", "backend": "b"}]}).prometheus


# ---- mutual TLS ---------------------------------------------------------------------------------------------
def test_mtls_query_works(prom, pki):
    got = PrometheusClient(tls_cfg(prom, pki)).query("up")
    assert [s.value for s in got] == [0.5] and len(prom.seen) == 1


def test_cert_file_holding_the_key_too(prom, pki):
    cfg = tls_cfg(prom, pki, cert_file=str(pki / "client-combined.pem"), key_file=None)
    assert len(PrometheusClient(cfg).query("up")) == 1


def test_missing_client_certificate_is_refused(prom, pki):
    client = PrometheusClient(tls_cfg(prom, pki, cert_file=None, key_file=None))
    with pytest.raises(PromError) as e:
        client.query("up")
    assert e.value.kind == "connect" and prom.seen == []


def test_client_certificate_of_another_ca_is_refused(prom, pki):
    client = PrometheusClient(tls_cfg(prom, pki, cert_file=str(pki / "rogue.crt"), key_file=str(pki / "rogue.key")))
    with pytest.raises(PromError) as e:
        client.query("up")
    assert e.value.kind == "connect" and prom.seen == []


def test_server_not_trusted_without_the_ca_file(prom, pki):
    client = PrometheusClient(tls_cfg(prom, pki, ca_file=None))
    with pytest.raises(PromError) as e:
        client.query("up")
    assert e.value.kind == "connect" and "CERTIFICATE_VERIFY_FAILED" in str(e.value)


@pytest.mark.parametrize("override, field", [
    ({"ca_file": "/nonexistent/ca.crt"}, "prometheus.ca_file"),
    ({"cert_file": "/nonexistent/client.crt"}, "prometheus.cert_file"),
    ({"key_file": "/nonexistent/client.key"}, "prometheus.key_file"),
    ({"key_file": "rogue.key"}, "prometheus.cert_file"),  # a key that does not match the certificate
    ({"cert_file": None}, "prometheus.key_file"),  # a key without a certificate
    ({"verify_tls": False}, "prometheus.ca_file"),  # a CA file that would be ignored
    ({"bearer_token_file": "/nonexistent/token"}, "prometheus.bearer_token_file"),
])
def test_tls_and_token_files_are_checked_by_check(prom, pki, tmp_path, capsys, override, field):
    override = {k: str(pki / v) if isinstance(v, str) and not v.startswith("/") else v for k, v in override.items()}
    args = {"url": prom.url, "ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "client.crt"),
            "key_file": str(pki / "client.key"), **override}
    f = tmp_path / "grayguard.yaml"
    f.write_text(json.dumps({"prometheus": args, "pools": [{"name": "chat", "backend": "b"}], "state_file": None}))
    assert main(["controller", "--config.file", str(f), "--check"]) == 2
    err = capsys.readouterr().err  # the file's problems under its name; the environment's (preflight) on one line
    assert f"config error in {f}:\n  {field}: " in err or f"config error: {field}: " in err


# ---- bearer token file --------------------------------------------------------------------------------------
def test_bearer_token_file_is_read_before_every_query(prom, pki, tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("first-token\n")
    client = PrometheusClient(tls_cfg(prom, pki, bearer_token_file=str(token)))
    client.query("up")
    token.write_text("rotated-token")  # a Kubernetes projected token, rotated under the running controller
    client.query("up")
    assert [h["Authorization"] for h in prom.seen] == ["Bearer first-token", "Bearer rotated-token"]
    token.unlink()  # gone for a moment: the last token is kept, and said once
    with caplog.at_level(logging.WARNING):
        client.query("up")
        client.query("up")
    assert [h["Authorization"] for h in prom.seen[2:]] == ["Bearer rotated-token"] * 2
    warnings = [r for r in caplog.records if "bearer_token_file" in r.getMessage()]
    assert len(warnings) == 1 and "rotated-token" not in caplog.text


def test_bearer_token_env_and_file_are_exclusive(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_config({"prometheus": {"bearer_token_env": "T", "bearer_token_file": str(tmp_path / "t")},
                      "pools": [{"name": "chat", "backend": "b"}]})
    assert e.value.path == "prometheus.bearer_token_file"


def test_empty_token_file_is_a_config_error(tmp_path):
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ConfigError) as e:
        PrometheusClient(PrometheusConfig(url="http://127.0.0.1:9", bearer_token_file=str(tmp_path / "t")))
    assert e.value.path == "prometheus.bearer_token_file" and "empty" in e.value.problem


# ---- no secret anywhere -------------------------------------------------------------------------------------
def test_redact():
    assert redact_url(f"http://admin:{SECRET}@prom:9090/x") == "http://***@prom:9090/x"
    assert redact("at https://u:p@ss@h/x and http://h/a@b") == "at https://***@h/x and http://h/a@b"
    assert redact("no url, a@b") == "no url, a@b" and redact_url(None) is None
    assert redact_url(f"admin:{SECRET}@prom:9090/x") == "***@prom:9090/x"  # a malformed URL quoted in an error


def test_password_in_the_url_never_shows(haproxy_factory, caplog, capsys):
    hap = haproxy_factory({"vllm_chat": servers(3)})
    port = free_port()  # nothing listens: the tick holds, and says why
    cfg = parse_config({"prometheus": {"url": f"http://admin:{SECRET}@127.0.0.1:{port}", "timeout_s": 1},
                        "haproxy": {"endpoints": [hap.endpoint]}, "pools": [{"name": "chat", "backend": "vllm_chat"}],
                        "state_file": None})
    ctl = Controller(cfg, PrometheusClient(cfg.prometheus), [RuntimeClient(hap.endpoint, 1.0)],
                     metrics=ControllerMetrics.create())
    with caplog.at_level(logging.DEBUG):
        result = ctl.tick()
    assert result.held and f"http://***@127.0.0.1:{port}" in result.held, result.held
    print_plan(result)
    srv = serve("127.0.0.1:0", ctl.metrics.registry, ctl.status)
    try:
        status = urllib.request.urlopen(f"{srv.url}/status", timeout=5).read().decode()
        metrics = urllib.request.urlopen(f"{srv.url}/metrics", timeout=5).read().decode()
    finally:
        srv.stop()
    shown = {"hold reason": result.held, "errors": repr(result.errors), "logs": caplog.text,
             "printed plan": capsys.readouterr().out, "/status": status, "/metrics": metrics}
    assert {k for k, v in shown.items() if SECRET in v} == set()


def test_config_errors_do_not_show_the_password():
    bad = [{"prometheus": {"url": f"ftp://admin:{SECRET}@prom:9090"}},
           {"prometheus": {"url": f"http://admin:{SECRET}@prom:99999"}},
           {"pools": [{"name": "chat", "backend": "b", "servers": {"n1": {"canary_url": f"u:{SECRET}@n1:8000"}}}]},
           {"pools": [{"name": "chat", "backend": "b",
                       "servers": {"n1": {"canary_url": f"ftp://u:{SECRET}@n1:8000"}}}]}]
    for doc in bad:
        with pytest.raises(ConfigError) as e:
            parse_config({"pools": [{"name": "chat", "backend": "b"}], **doc})
        assert SECRET not in str(e.value), str(e.value)


def test_rule_reload_errors_do_not_show_the_password(tmp_path):
    port = free_port()
    cfg = parse_config({"prometheus": {"url": f"http://admin:{SECRET}@127.0.0.1:{port}", "timeout_s": 1},
                        "pools": [{"name": "chat", "backend": "b"}], "rules": {"output_dir": str(tmp_path)}})
    rr = RuleRerenderer(cfg, promtool="")
    res = rr.rerender()  # the baseline query fails: nobody listens
    assert res.error and SECRET not in res.error and "***@" in res.error
    err = rr.reload()
    assert err and SECRET not in err
