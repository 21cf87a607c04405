"""A small threaded HTTP server for grayguard's endpoints: routes map "METHOD /path" to a handler.

Used by the exporter's and the controller's /metrics, the local stack's webhook pager and the tests.
A handler takes a Request and returns (status, content type, body). Requests are logged at debug level
only, a failing handler answers 500, and a client that hangs up is not an error.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

log = logging.getLogger("grayguard.http")

Response = tuple[int, str, bytes]  # (status, content type, body)
NOT_FOUND: Response = (404, "text/plain; charset=utf-8", b"not found\n")
METHOD_NOT_ALLOWED: Response = (405, "text/plain; charset=utf-8", b"method not allowed\n")
ROUTE_KEY = re.compile(r"(GET|POST) /\S*")  # "GET /metrics", "POST /*" (a trailing * matches a prefix)


@dataclass(frozen=True)
class Request:
    """What a handler sees: method, path without the query string, query string, headers, body."""

    method: str
    path: str
    query: str
    headers: Message
    body: bytes = b""


Handler = Callable[[Request], Response]


def parse_address(text: str) -> tuple[str, int]:
    """(host, port) from "host:port", "[::1]:port" or ":port" (all interfaces); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not a listen address: {text!r} (e.g. 127.0.0.1:9400)")
    host = host.strip("[]")
    return host or "0.0.0.0", int(port)


def _route(routes: Mapping[str, Handler], method: str, path: str) -> Handler | Response:
    """The handler for method and path: the exact route, else the longest matching "METHOD /prefix*" route;
    else a 405 response when only another method matches, or a 404."""
    matching = [k for k in routes if _matches(k.split(" ", 1)[1], path)]
    for_method = [k for k in matching if k.startswith(method + " ")]
    if for_method:
        exact = f"{method} {path}"
        return routes[exact if exact in routes else max(for_method, key=len)]
    return METHOD_NOT_ALLOWED if matching else NOT_FOUND


def _matches(pattern: str, path: str) -> bool:
    return path.startswith(pattern[:-1]) if pattern.endswith("*") else path == pattern


class HttpServer(ThreadingHTTPServer):
    """Binds on construction (OSError if taken); start() serves in a daemon thread; stop() is idempotent."""

    daemon_threads = True

    def __init__(self, address: str | tuple[str, int], routes: Mapping[str, Handler], *, name: str = "http",
                 logger: logging.Logger = log):
        bad = [k for k in routes if not ROUTE_KEY.fullmatch(k)]
        if bad:
            raise ValueError(f"routes must look like 'GET /path' or 'POST /prefix*', got {bad}")
        host, port = parse_address(address) if isinstance(address, str) else address
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.routes, self.name, self.log = dict(routes), name, logger
        self._thread: threading.Thread | None = None
        self._closed = False
        super().__init__((host, port), _RequestHandler)

    @property
    def host(self) -> str:
        return str(self.server_address[0])

    @property
    def port(self) -> int:
        """The port actually bound (port 0 asks the OS for a free one)."""
        return int(self.server_address[1])

    @property
    def netloc(self) -> str:
        """host:port as a URL or a Prometheus target has it ([::1]:port for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:9400."""
        return f"http://{self.netloc}"

    def start(self) -> HttpServer:
        """Serve in a daemon thread (once); returns self."""
        if self._thread is None:
            # A short poll interval: stop() returns within a tenth of a second.
            self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                            name=f"{self.name}-{self.port}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5)
            self._thread = None
        if not self._closed:
            self._closed = True
            self.server_close()

    def handle_error(self, request: object, client_address: object) -> None:
        # socketserver prints a traceback to stderr by default; a broken connection is routine here.
        self.log.debug("%s: error serving %s", self.name, client_address, exc_info=True)

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _RequestHandler(BaseHTTPRequestHandler):
    server: HttpServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch(b"")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    def _dispatch(self, body: bytes) -> None:
        path, _, query = self.path.partition("?")
        found = _route(self.server.routes, self.command, path)
        if callable(found):
            try:
                found = found(Request(self.command, path, query, self.headers, body))
            except Exception:  # a bug in one handler answers 500 and leaves the server up
                self.server.log.exception("%s: %s %s failed", self.server.name, self.command, path)
                found = (500, "text/plain; charset=utf-8", b"internal error\n")
        status, content_type, payload = found
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, fmt: str, *args: object) -> None:
        self.server.log.debug("%s %s", self.address_string(), fmt % args)


def serve(address: str | tuple[str, int], routes: Mapping[str, Handler], *, name: str = "http",
          logger: logging.Logger = log) -> HttpServer:
    """Bind address and serve routes in a daemon thread; stop() (or shutdown()) ends it."""
    return HttpServer(address, routes, name=name, logger=logger).start()


def metrics_handler(registry: CollectorRegistry, *, negotiate: bool = False) -> Handler:
    """GET /metrics for registry, collected at scrape time: the text format, or what Accept asks with negotiate.

    Without negotiate the answer is always text: asked for OpenMetrics, prometheus_client rewrites `vllm:`
    names to `vllm_`, and vLLM-shaped series must keep their real names.
    """
    def handler(req: Request) -> Response:
        if negotiate:
            encoder, content_type = choose_encoder(req.headers.get("Accept", ""))
            return 200, content_type, encoder(registry)
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
    return handler
