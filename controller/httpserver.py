"""The controller's HTTP endpoint: /metrics (its own registry), /status (JSON), /healthz, /readyz (grayguard.health).

/status is a stable, versioned document (grayguard/verdict.py, grayguard/schemas/status.v1.json, docs/api.md): this
is where it gets its `version` and becomes strict JSON (a NaN or an infinity, which no JSON parser must accept, is
null: not measured).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from grayguard.health import Verdict, probe
from grayguard.httpserve import HttpServer, Request, Response, metrics_handler
from grayguard.httpserve import serve as serve_routes
from grayguard.verdict import VERSION

log = logging.getLogger("grayguard.http")
INDEX = (b"grayguard controller: <a href='/metrics'>/metrics</a> <a href='/status'>/status</a> "
         b"<a href='/healthz'>/healthz</a> <a href='/readyz'>/readyz</a>\n")


def status_document(doc: dict) -> str:
    """/status as served: the format's version first, then the controller's document; strict JSON."""
    return json.dumps(_finite({"version": VERSION, **doc}), indent=1, default=str, allow_nan=False)


def _finite(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def serve(address: str, registry: CollectorRegistry, status: Callable[[], dict],
          health: Callable[[], Verdict] | None = None, ready: Callable[[], Verdict] | None = None) -> HttpServer:
    """Start serving in a daemon thread; returns the server (call .stop(), or .shutdown(), to stop). health and
    ready answer /healthz and /readyz (absent: those paths are 404)."""

    def status_json(_req: Request) -> Response:
        return 200, "application/json", status_document(status()).encode()

    routes = {"GET /metrics": metrics_handler(registry), "GET /status": status_json,
              "GET /": lambda _req: (200, "text/html", INDEX)}
    if health is not None:
        routes["GET /healthz"] = probe(health)
    if ready is not None:
        routes["GET /readyz"] = probe(ready)
    return serve_routes(address, routes, name="grayguard-http", logger=log)
