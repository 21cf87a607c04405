"""NGINX as the gateway, on a real nginx (Debian's 1.22) started by the test: the upstream file NginxGateway writes is
what nginx serves after its graceful reload (traffic follows the weights; a drained server gets none, while a request
already on it finishes), a file `nginx -t` rejects is put back and nginx goes on serving the old one, the start-up
check sees a config that does not include the file, and `grayguard controller --check` refuses a bad gateway
section with exit 2, naming each field."""

import http.server
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from grayguard.config import parse_config
from grayguard.controller.haproxy import Command
from grayguard.controller.nginx import NginxGateway
from grayguard.controller.nginxfile import NginxError
from grayguard.localstack.nginx import NginxProc
from tests.support.stack import require, wait_until

REPO = Path(__file__).resolve().parents[2]


class NamedBackend:
    """An HTTP server on 127.0.0.1 answering its own name; /slow answers after a second."""

    def __init__(self, name):
        me = name

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/slow":
                    time.sleep(1.0)
                body = me.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def rig(tmp_path):
    require("nginx")
    backends = {n: NamedBackend(n) for n in ("a", "b", "c")}
    ngx = NginxProc(tmp_path / "nginx")
    doc = ngx.gateway_doc()
    doc["nginx"]["min_reload_interval_s"] = 0  # every batch at once: this test is about what nginx serves
    cfg = parse_config({"gateway": doc, "state_file": None, "pools": [
        {"name": "chat", "backend": "vllm_chat", "servers": {n: {"address": b.address} for n, b in backends.items()}}]})
    gw = NginxGateway(cfg.gateway.nginx, cfg.pools)
    gw.prepare()
    ngx.start()
    yield ngx, gw, backends
    ngx.stop()
    for b in backends.values():
        b.stop()


def spread(url, n=60):
    """Which backend answered each of n requests through nginx."""
    with requests.Session() as s:
        return Counter(s.get(url, timeout=5).text for _ in range(n))


def test_traffic_follows_the_written_weights_after_the_reload_and_a_drain_stops_new_requests(rig):
    ngx, gw, _ = rig
    assert gw.check() == []  # `nginx -t` passes and the config includes the pool's file
    assert set(spread(ngx.url)) == {"a", "b", "c"}
    pid = ngx.master_pid()

    slow = threading.Thread(target=lambda: got.append(requests.get(ngx.url + "/slow", timeout=10).text))
    got: list[str] = []
    # a request in flight before the drain: nginx's old worker finishes it (graceful reload)
    gw.apply([Command("vllm_chat", "b", "state", "drain"), Command("vllm_chat", "c", "state", "drain")])
    wait_until(lambda: set(spread(ngx.url, 6)) == {"a"}, 10, 0.1, "nginx serving the new file (only a)")
    gw.apply([Command("vllm_chat", "b", "state", "ready"), Command("vllm_chat", "c", "state", "ready")])
    wait_until(lambda: len(set(spread(ngx.url, 9))) == 3, 10, 0.1, "nginx serving all three again")
    slow.start()
    time.sleep(0.2)  # the slow request is on its way (1 s at the backend)
    gw.apply([Command("vllm_chat", "a", "state", "drain"), Command("vllm_chat", "c", "state", "drain")])
    wait_until(lambda: set(spread(ngx.url, 6)) == {"b"}, 10, 0.1, "nginx serving only b")
    slow.join(10)
    assert len(got) == 1 and got[0] in {"a", "b", "c"}  # not cut off by the reload

    # weights: a cut server takes about its share (smooth weighted round robin: exact over a cycle)
    gw.apply([Command("vllm_chat", "a", "state", "ready"), Command("vllm_chat", "a", "weight", 100),
              Command("vllm_chat", "b", "weight", 25)])
    # `nginx -s reload` returns before the new workers serve: the old ones take new requests for a moment
    wait_until(lambda: spread(ngx.url, 25) == {"a": 20, "b": 5}, 10, 0.1, "nginx serving a and b at 100:25")
    seen = spread(ngx.url, 125)
    assert 20 <= seen["b"] <= 30 and seen["a"] + seen["b"] == 125, seen  # 25 of 125 by the weights
    assert ngx.master_pid() == pid  # reloaded, never restarted
    assert gw.reloads == 4


def test_a_file_nginx_rejects_is_put_back_and_nginx_serves_on(rig, tmp_path):
    ngx, gw, backends = rig
    before = gw.path("vllm_chat").read_text()
    doc_pool = {"name": "chat", "backend": "vllm_chat",
                "servers": {**{n: {"address": b.address} for n, b in backends.items()},
                            "d": {"address": "nohost.invalid:80"}}}  # nginx -t: host not found in upstream
    cfg = parse_config({"gateway": ngx.gateway_doc(), "state_file": None, "pools": [doc_pool]})
    gw2 = NginxGateway(cfg.gateway.nginx, cfg.pools)
    with pytest.raises(NginxError) as e:
        gw2.apply([Command("vllm_chat", "a", "weight", 50)])
    assert e.value.kind == "check_failed" and "nohost.invalid" in str(e.value)
    assert gw.path("vllm_chat").read_text() == before and gw2.reloads == 0
    assert set(spread(ngx.url, 9)) == {"a", "b", "c"}  # the old file still serves


def test_the_start_up_check_sees_a_config_that_does_not_include_the_file(rig, tmp_path):
    ngx, _, backends = rig
    cfg = parse_config({"gateway": {**ngx.gateway_doc(), "nginx": {**ngx.gateway_doc()["nginx"],
                                                                   "upstream_dir": str(tmp_path / "elsewhere")}},
                        "state_file": None, "pools": [{"name": "chat", "backend": "vllm_chat", "servers": {
                            n: {"address": b.address} for n, b in backends.items()}}]})
    [problem] = NginxGateway(cfg.gateway.nginx, cfg.pools).check()
    assert "does not include" in problem and "elsewhere/vllm_chat.conf" in problem


def run_check(tmp_path, gateway):
    cfg = tmp_path / "grayguard.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump({"prometheus": {"url": "http://127.0.0.1:9"}, "state_file": None,
                                   "gateway": gateway, "pools": [{"name": "chat", "backend": "vllm_chat",
                                                                  "servers": {"a": {"address": "127.0.0.1:9"}}}]}))
    return subprocess.run([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", str(cfg), "--check"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_check_refuses_a_bad_nginx_section_with_exit_2_naming_each_field(tmp_path):
    require("nginx")
    bad = run_check(tmp_path, {"kind": "nginx", "nginx": {"binary": "no-such-nginx", "conf": str(tmp_path / "none"),
                                                          "upstream_dir": str(tmp_path / "nodir"), "timeout_s": 0}})
    assert bad.returncode == 2, bad.stderr
    assert "gateway.nginx.timeout_s: must be > 0" in bad.stderr
    bad = run_check(tmp_path, {"kind": "nginx", "nginx": {"binary": "no-such-nginx", "conf": str(tmp_path / "none"),
                                                          "upstream_dir": str(tmp_path / "nodir")}})
    assert bad.returncode == 2, bad.stderr
    for field in ("gateway.nginx.binary", "gateway.nginx.conf", "gateway.nginx.upstream_dir"):
        assert field in bad.stderr, bad.stderr
    (tmp_path / "up").mkdir()
    (tmp_path / "nginx.conf").write_text("events {}\n")
    ok = run_check(tmp_path, {"kind": "nginx", "nginx": {"conf": str(tmp_path / "nginx.conf"),
                                                         "upstream_dir": str(tmp_path / "up")}})
    assert ok.returncode == 0 and "NGINX" in ok.stdout, ok.stderr
