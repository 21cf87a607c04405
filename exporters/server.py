"""The exporter process in one object: its registry, NVML collector, prober, agent check and HTTP server."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from html import escape
from typing import Any

import pynvml
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from grayguard.engines import DEFAULT_ENGINE, profile
from grayguard.exporters import liveness
from grayguard.exporters.agent import Agent
from grayguard.exporters.fastpath import fast_registry
from grayguard.exporters.nvml import NvmlCollector
from grayguard.exporters.podinfo import PodInfoCollector
from grayguard.exporters.prober import ProbeConfig, Prober
from grayguard.exporters.registration import Registrar, RegistrationConfig, api_key_reader
from grayguard.health import Verdict, probe
from grayguard.httpserve import HttpServer, Request, Response, metrics_handler

log = logging.getLogger(__name__)
DEFAULT_PROBE = ProbeConfig()

# the engine as the index page names it (grayguard/engines.py's names are the config's)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "Text Generation Inference", "llamacpp": "llama.cpp server",
                "triton": "Triton Inference Server"}
INDEX_PAGE = """<html><head><title>grayguard exporter</title></head><body>
<h1>grayguard exporter</h1><p>Gray-failure signals of the {engine} at {vllm}: GPU health from NVML and
a one-token micro-probe.</p><p><a href="/metrics">Metrics</a></p>
<p><a href="/metrics/fast">Live fast path</a> (scrape every second)</p>
<p><a href="/healthz">/healthz</a> (its loops alive) <a href="/readyz">/readyz</a> (it has looked at {engine})</p>
</body></html>
"""


class AgentListenError(OSError):
    """The agent check's listen address cannot be bound."""


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

    nvml=None switches the GPU collector off; probe=None switches the prober off. agent=(host, port) answers
    HAProxy's agent check there (exporters/agent.py; off by default here, on by default in the CLI; off without
    the prober). registration registers the node in etcd (exporters/registration.py; off by default). Several
    exporters can run in one process: each has its own registry, threads and ports. clock: the monotonic clock of
    the prober and the registrar, and so of /healthz (exporters/liveness.py). The engine (grayguard/engines.py) is
    the probe's (ProbeConfig.engine), else the registration's: the registration's pre-checks ask the engine the
    probe asks, and the index page names it. ecc_aggregate: also read and serve the lifetime ECC counts.
    """

    def __init__(self, vllm_url: str = "http://127.0.0.1:8000", *, host: str = "127.0.0.1", port: int = 9400,
                 nvml: Any = pynvml, probe: ProbeConfig | None = DEFAULT_PROBE, nvml_read_timeout: float = 1.0,
                 xid_events: bool = True, agent: tuple[str, int] | None = None,
                 registration: RegistrationConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 pod: tuple[str | None, str | None] = (None, None), ecc_aggregate: bool = False):
        self.vllm_url = vllm_url
        self.engine = probe.engine if probe is not None else (registration.engine if registration is not None
                                                               else DEFAULT_ENGINE)
        profile(self.engine)  # KeyError naming the known engines
        if registration is not None and registration.engine != self.engine:
            registration = replace(registration, engine=self.engine)
        self.registry = CollectorRegistry()
        self._host, self._port = host, port
        self.nvml: NvmlCollector | None = None
        if nvml is not None:
            self.nvml = NvmlCollector(nvml=nvml, read_timeout=nvml_read_timeout, xid_events=xid_events,
                                      ecc_aggregate=ecc_aggregate)
            self.registry.register(_Timed(self.nvml, "nvml"))
        else:
            self.registry.register(_NvmlDisabled())
        # pod = (namespace, name): grayguard_node_pod_info, the join of dcgm-exporter's GPUs to this node
        self.registry.register(PodInfoCollector(*pod))
        self.prober = Prober(vllm_url, probe, registry=self.registry, clock=clock) if probe is not None else None
        self.agent: Agent | None = None
        if agent is not None and self.prober is None:
            log.info("agent check off: it answers from the probe, and probing is off")
        elif agent is not None and self.prober is not None:
            cfg = self.prober.config
            self.agent = Agent(self.prober.snapshot, interval=cfg.interval, deadline=cfg.deadline, host=agent[0],
                               port=agent[1], registry=self.registry)
        p = self.prober
        # /metrics/fast: what the controller reads every second, for a 1 s scrape (exporters/fastpath.py)
        self.fast_registry = fast_registry(p.live_collector if p else None, p.state_collector if p else None)
        self.registrar: Registrar | None = None
        if registration is not None:
            self.registrar = Registrar(registration, vllm_url=vllm_url, registry=self.registry,
                                       nvml_snapshot=self.nvml.snapshot if self.nvml is not None else None,
                                       api_key=api_key_reader(registration.api_key_file, registration.api_key_env),
                                       clock=clock)
        self._httpd: HttpServer | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound (port 0 asks the OS for a free one)."""
        if self._httpd is None:
            return self._host, self._port
        return self._httpd.host, self._httpd.port

    @property
    def url(self) -> str:
        """Base URL of the HTTP server, e.g. http://127.0.0.1:9400."""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> Exporter:
        """Bind the listen addresses (OSError if taken; AgentListenError for the agent's), init NVML, probe, serve."""
        # Metrics are collected at scrape time, in the request's thread: NVML reads are bounded by
        # nvml_read_timeout and probe results are cached, so a hung backend never slows a scrape.
        routes = {"GET /metrics": metrics_handler(self.registry, negotiate=True),
                  "GET /metrics/fast": metrics_handler(self.fast_registry, negotiate=True), "GET /": self._index,
                  "GET /healthz": probe(self.health), "GET /readyz": probe(self.ready)}
        self._httpd = HttpServer((self._host, self._port), routes, name="exporter-http", logger=log)
        if self.agent is not None:
            try:
                self.agent.start()
            except OSError as e:
                self._httpd.stop()  # not started yet: only releases the port
                self._httpd = None
                raise AgentListenError(e.errno, f"agent check {self.agent.address[0]}:{self.agent.address[1]}: "
                                                f"{e.strerror or e}") from e
        if self.nvml is not None:
            self.nvml.start()
        if self.prober is not None:
            self.prober.start()
        self._httpd.start()
        log.info("exporter for %s serving on %s/metrics", self.vllm_url, self.url)
        if self.registrar is not None:  # last: registered only once everything it advertises serves
            advertised_host = self.registrar.config.advertise.rpartition(":")[0]
            agent = ""
            if self.agent is not None:  # the agent listens beside the exporter; a wildcard bind is reached there
                host, port = self.agent.address[0], self.agent.address[1]
                agent = f"{advertised_host if host in ('0.0.0.0', '::', '') else host}:{port}"
            self.registrar.start(self.registrar.config.exporter or f"{advertised_host}:{self.address[1]}", agent)
        return self

    def stop(self) -> None:
        """Leave the registry (if registered), stop serving, probing and the XID thread; idempotent."""
        if self.registrar is not None:  # first: HAProxy stops sending while the node still serves
            self.registrar.stop(leave=True)
        if self._httpd is not None:
            self._httpd.stop()
            self._httpd = None
        if self.agent is not None:
            self.agent.stop()
        if self.prober is not None:
            self.prober.stop()
        if self.nvml is not None:
            self.nvml.stop()

    def loops(self) -> list[liveness.Loop]:
        """The loops /healthz and /readyz watch (exporters/liveness.py). Registration does not gate readiness: the
        pod's readiness is whether this exporter has looked at its vLLM and serves what it saw; an etcd outage must not
        turn every pod of the fleet unready at once, and the pre-checks that keep a sick node out of the registry are
        its membership's business, which a sick node that is still scraped has to keep reporting."""
        out = []
        if self.prober is not None:
            limit = liveness.probe_stall_limit_s(self.prober.config)
            out += [liveness.Loop(liveness.PROBE_ROUND, self.prober.rounds, limit),
                    liveness.Loop(liveness.FAST_READ, self.prober.reads, limit)]
        if self.registrar is not None:
            out.append(liveness.Loop(liveness.REGISTRY_ROUND, self.registrar.rounds,
                                     liveness.registry_stall_limit_s(self.registrar.config), gates_readiness=False))
        return out

    def health(self) -> Verdict:
        """/healthz: 503 when one of the loops has stalled."""
        return liveness.health(self.loops())

    def ready(self) -> Verdict:
        """/readyz: 503 until the first probe round and the first fast-path read have completed."""
        return liveness.ready(self.loops())

    def _index(self, _req: Request) -> Response:
        return 200, "text/html; charset=utf-8", INDEX_PAGE.format(
            vllm=escape(self.vllm_url), engine=ENGINE_NAMES.get(self.engine, self.engine)).encode()

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

