"""The controller's HTTP endpoint: /metrics (its own registry), /status (JSON), /healthz, /readyz (grayguard.health)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from grayguard.health import Verdict, probe
from grayguard.httpserve import HttpServer, Request, Response, metrics_handler
from grayguard.httpserve import serve as serve_routes

log = logging.getLogger("grayguard.http")
INDEX = (b"grayguard controller: <a href='/metrics'>/metrics</a> <a href='/status'>/status</a> "
         b"<a href='/healthz'>/healthz</a> <a href='/readyz'>/readyz</a>\n")


def serve(address: str, registry: CollectorRegistry, status: Callable[[], dict],
          health: Callable[[], Verdict] | None = None, ready: Callable[[], Verdict] | None = None) -> HttpServer:
    """Start serving in a daemon thread; returns the server (call .stop(), or .shutdown(), to stop). health and
    ready answer /healthz and /readyz (absent: those paths are 404)."""

    def status_json(_req: Request) -> Response:
        return 200, "application/json", json.dumps(status(), indent=1, default=str).encode()

    routes = {"GET /metrics": metrics_handler(registry), "GET /status": status_json,
              "GET /": lambda _req: (200, "text/html", INDEX)}
    if health is not None:
        routes["GET /healthz"] = probe(health)
    if ready is not None:
        routes["GET /readyz"] = probe(ready)
    return serve_routes(address, routes, name="grayguard-http", logger=log)
