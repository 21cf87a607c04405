"""Test harness for real Prometheus / Alertmanager / webhook stacks (rules e2e and whole-system tests).

Everything binds to 127.0.0.1 on free ports, lives in a temp dir and is stopped at the end of its
`with` block (and at interpreter exit, as a last resort). Usage:

    require("prometheus", "alertmanager")                     # pytest.fail with an install hint
    with WebhookReceiver() as hook, serve_registry(metrics.registry) as ctl, \\
         start_alertmanager(alertmanager_config(EXAMPLE_AM, hook)) as am, \\
         start_prometheus(prometheus_config([static_job("grayguard-controller", [ctl.target])],
                                            alertmanager_urls=[am.url]), rule_files) as prom:
        hook.wait_for(lambda h: h.alerts("/page"))
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from grayguard.httpserve import HttpServer, metrics_handler
from grayguard.localstack.procs import BinaryMissing, find_binary, free_port, wait_until
from grayguard.localstack.services import (
    Alertmanager,
    Notification,
    Prometheus,
    WebhookReceiver,
    prometheus_config,
    retarget_alertmanager_config,
    start_alertmanager,
    start_prometheus,
    static_job,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_AM = REPO / "rules" / "alertmanager.example.yml"

__all__ = [
    "EXAMPLE_AM", "Alertmanager", "MetricsServer", "Notification", "Prometheus", "WebhookReceiver",
    "alertmanager_config", "free_port", "prometheus_config", "require", "serve_registry", "start_alertmanager",
    "start_prometheus", "static_job", "wait_until",
]

_ALIASES = {"alertmanager": ("alertmanager", "prometheus-alertmanager")}


def require(*binaries: str) -> None:
    """Fail the test (with the apt-get hint) when a binary is missing: `make test` installs them, so a
    missing one is a broken set-up, never a reason to pass silently."""
    for b in binaries:
        try:
            find_binary(*_ALIASES.get(b, (b,)))
        except BinaryMissing as e:
            pytest.fail(str(e))


class MetricsServer(HttpServer):
    """A prometheus_client registry served at /metrics on 127.0.0.1, always in the text format.

    Always text: asked for OpenMetrics (as Prometheus 2.x asks), prometheus_client rewrites `vllm:` names
    to `vllm_` (see rules.vllm_prefix), and vLLM-shaped test series must keep their real names.
    """

    def __init__(self, registry: CollectorRegistry, port: int = 0):
        super().__init__(("127.0.0.1", port), {"GET /metrics": metrics_handler(registry)}, name="metrics")
        self.start()

    @property
    def target(self) -> str:
        """host:port for a Prometheus static_config."""
        return self.netloc


def serve_registry(registry: CollectorRegistry) -> MetricsServer:
    """Serve registry's /metrics on a free port."""
    return MetricsServer(registry)


def alertmanager_config(example: Path | str | dict, hook: WebhookReceiver, *, group_wait: str = "1s",
                        group_interval: str = "1s", repeat_interval: str = "1h") -> dict:
    """The example Alertmanager config with every receiver posting to hook at /<receiver name>, fast timers."""
    cfg = example if isinstance(example, dict) else yaml.safe_load(Path(example).read_text())
    return retarget_alertmanager_config(cfg, lambda name: hook.url(f"/{name}"), group_wait=group_wait,
                                        group_interval=group_interval, repeat_interval=repeat_interval)
