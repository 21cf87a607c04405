"""The shared HTTP server helper, over real sockets on 127.0.0.1: routing, 404/405, POST bodies, errors, stop."""

from __future__ import annotations

import socket

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter

from grayguard.httpserve import HttpServer, Request, metrics_handler, parse_address, serve


@pytest.fixture
def http():
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment for 127.0.0.1
    yield session
    session.close()


def text(body: str):
    return lambda _req: (200, "text/plain", body.encode())


def test_routes_by_method_and_path_and_strips_the_query(http):
    seen: list[Request] = []

    def status(req: Request):
        seen.append(req)
        return 200, "application/json", b'{"ok": true}'

    with serve("127.0.0.1:0", {"GET /": text("index"), "GET /status": status}) as srv:
        assert http.get(srv.url + "/", timeout=5).text == "index"
        r = http.get(srv.url + "/status?verbose=1", timeout=5)
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert r.headers["Content-Type"] == "application/json"
        assert (seen[0].method, seen[0].path, seen[0].query) == ("GET", "/status", "verbose=1")


def test_unknown_path_is_404_and_wrong_method_is_405(http):
    with serve("127.0.0.1:0", {"GET /metrics": text("m")}) as srv:
        r = http.get(srv.url + "/nope", timeout=5)
        assert r.status_code == 404 and r.text == "not found\n"
        assert http.post(srv.url + "/metrics", data=b"x", timeout=5).status_code == 405


def test_post_body_reaches_a_prefix_route(http):
    got: list[tuple[str, bytes]] = []

    def record(req: Request):
        got.append((req.path, req.body))
        return 200, "text/plain", b""

    with serve(("127.0.0.1", 0), {"POST /*": record, "POST /exact": text("exact")}) as srv:
        assert http.post(srv.url + "/page", json={"alerts": []}, timeout=5).status_code == 200
        assert http.post(srv.url + "/ticket", data=b"", timeout=5).status_code == 200
        assert http.post(srv.url + "/exact", data=b"y", timeout=5).text == "exact"  # exact beats prefix
    assert got == [("/page", b'{"alerts": []}'), ("/ticket", b"")]


def test_a_failing_handler_answers_500_and_the_server_stays_up(http):
    def boom(_req):
        raise ValueError("bug")

    with serve("127.0.0.1:0", {"GET /boom": boom, "GET /ok": text("ok")}) as srv:
        assert http.get(srv.url + "/boom", timeout=5).status_code == 500
        assert http.get(srv.url + "/ok", timeout=5).text == "ok"


@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1:9300", ("127.0.0.1", 9300)),
    ("[::1]:9400", ("::1", 9400)),
    ("[::]:0", ("::", 0)),
    (":9500", ("0.0.0.0", 9500)),
    ("localhost:80", ("localhost", 80)),
])
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "9300", "host:", "host:http", "host:70000", "[::1]"])
def test_bad_address_is_a_value_error(address):
    with pytest.raises(ValueError, match="not a listen address"):
        parse_address(address)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_serves_on_ipv6_loopback(http):
    with serve("[::1]:0", {"GET /": text("six")}) as srv:
        assert srv.host == "::1" and srv.url == f"http://[::1]:{srv.port}"
        assert http.get(srv.url + "/", timeout=5).text == "six"


def test_stop_releases_the_port_and_is_idempotent(http):
    srv = serve("127.0.0.1:0", {"GET /": text("x")})
    port = srv.port
    assert srv.netloc == f"127.0.0.1:{port}"
    assert http.get(srv.url + "/", timeout=5).ok
    srv.stop()
    srv.stop()
    with pytest.raises(requests.ConnectionError):
        http.get(f"http://127.0.0.1:{port}/", timeout=5)
    with socket.socket() as s:  # SO_REUSEADDR passes over TIME_WAIT, never over a live listener
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_malformed_route_is_refused_at_construction():
    with pytest.raises(ValueError, match="metrics"):
        HttpServer("127.0.0.1:0", {"/metrics": text("m")})


def test_a_server_never_started_stops_at_once():
    HttpServer("127.0.0.1:0", {}).stop()


def test_a_taken_port_raises_oserror():
    with serve("127.0.0.1:0", {}) as srv, pytest.raises(OSError):
        HttpServer(("127.0.0.1", srv.port), {})


def test_metrics_handler_text_and_negotiated(http):
    reg = CollectorRegistry()
    Counter("vllm:requests", "Requests", registry=reg).inc()
    routes = {"GET /metrics": metrics_handler(reg), "GET /negotiated": metrics_handler(reg, negotiate=True)}
    om = {"Accept": "application/openmetrics-text; version=1.0.0"}
    with serve("127.0.0.1:0", routes) as srv:
        r = http.get(srv.url + "/metrics", headers=om, timeout=5)
        assert r.headers["Content-Type"].startswith("text/plain")  # Accept ignored: series keep their names
        assert "vllm:requests_total 1.0" in r.text
        r = http.get(srv.url + "/negotiated", headers=om, timeout=5)
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert r.text.endswith("# EOF\n")
