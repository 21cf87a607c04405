"""The controller's HTTP endpoint: /metrics (its own registry) and /status (JSON)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("grayguard.http")


def serve(address: str, registry: CollectorRegistry, status: Callable[[], dict]) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; returns the server (call .shutdown() to stop)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?")[0]
            if path == "/metrics":
                body, ctype = generate_latest(registry), CONTENT_TYPE_LATEST
            elif path == "/status":
                body, ctype = json.dumps(status(), indent=1, default=str).encode(), "application/json"
            elif path == "/":
                body = b"grayguard controller: <a href='/metrics'>/metrics</a> <a href='/status'>/status</a>\n"
                ctype = "text/html"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    host, _, port = address.rpartition(":")
    srv = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="grayguard-http", daemon=True).start()
    return srv
