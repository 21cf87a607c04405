"""The exporter process in one object: its registry, NVML collector, prober and HTTP server."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pynvml
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from exporters.nvml import NvmlCollector
from exporters.prober import ProbeConfig, Prober

log = logging.getLogger(__name__)
DEFAULT_PROBE = ProbeConfig()

INDEX_PAGE = """<html><head><title>grayguard exporter</title></head><body>
<h1>grayguard exporter</h1><p>Gray-failure signals of the vLLM at {vllm}: GPU health from NVML and
a one-token micro-probe.</p><p><a href="/metrics">Metrics</a></p></body></html>
"""


class _Timed:
    """Wraps a collector and adds grayguard_exporter_scrape_duration_seconds{collector} after it."""

    def __init__(self, inner: Any, name: str):
        self._inner, self._name = inner, name

    def describe(self) -> list[Metric]:
        return [*self._inner.describe(), self._family()]

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        families = list(self._inner.collect())
        fam = self._family()
        fam.add_metric([self._name], time.perf_counter() - start)
        return iter([*families, fam])

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("grayguard_exporter_scrape_duration_seconds",
                                 "Time this scrape spent in the collector", labels=["collector"])


class _NvmlDisabled:
    """Exports NVML up = 0 when the NVML collector is switched off (--no-collector.nvml)."""

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily("grayguard_exporter_nvml_up", "1 when NVML is initialized, 0 otherwise")]

    def collect(self) -> Iterator[Metric]:
        fam = self.describe()[0]
        fam.add_metric([], 0)
        yield fam


class Exporter:
    """One node's sidecar: `Exporter(vllm_url, port=0, nvml=FakeNvml(...)).start()`, then `.url`, `.stop()`.

    nvml=None switches the GPU collector off; probe=None switches the prober off. Several exporters
    can run in one process: each has its own registry, threads and port.
    """

    def __init__(self, vllm_url: str = "http://127.0.0.1:8000", *, host: str = "127.0.0.1", port: int = 9400,
                 nvml: Any = pynvml, probe: ProbeConfig | None = DEFAULT_PROBE, nvml_read_timeout: float = 1.0,
                 xid_events: bool = True):
        self.vllm_url = vllm_url
        self.registry = CollectorRegistry()
        self._host, self._port = host, port
        self.nvml: NvmlCollector | None = None
        if nvml is not None:
            self.nvml = NvmlCollector(nvml=nvml, read_timeout=nvml_read_timeout, xid_events=xid_events)
            self.registry.register(_Timed(self.nvml, "nvml"))
        else:
            self.registry.register(_NvmlDisabled())
        self.prober = Prober(vllm_url, probe, registry=self.registry) if probe is not None else None
        self._httpd: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound (port 0 asks the OS for a free one)."""
        if self._httpd is None:
            return self._host, self._port
        return self._httpd.server_address[:2]

    @property
    def url(self) -> str:
        """Base URL of the HTTP server, e.g. http://127.0.0.1:9400."""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> Exporter:
        """Bind the listen address (OSError if taken), init NVML, start probing and serving."""
        self._httpd = _make_server(self._host, self._port, self.registry, self.vllm_url)
        if self.nvml is not None:
            self.nvml.start()
        if self.prober is not None:
            self.prober.start()
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                             name=f"exporter-http-{self.address[1]}", daemon=True)
        self._http_thread.start()
        log.info("exporter for %s serving on %s/metrics", self.vllm_url, self.url)
        return self

    def stop(self) -> None:
        """Stop serving, probing and the XID thread; idempotent."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self.prober is not None:
            self.prober.stop()
        if self.nvml is not None:
            self.nvml.stop()

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _make_server(host: str, port: int, registry: CollectorRegistry, vllm_url: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, content_type, encoder(registry))
            elif path == "/":
                self._send(200, "text/html; charset=utf-8", INDEX_PAGE.format(vllm=vllm_url).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = _family_for(host)

    return Server((host, port), Handler)


def _family_for(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
