"""The live fast path's series, and /metrics/fast: the few series Prometheus scrapes every second.

The full /metrics (NVML, histograms, counters, and every live value) keeps its usual scrape interval; /metrics/fast
carries only what the controller reads every second (FAST_SERIES: five live values of exporters/live.py, the probe
TTFT median, the probe's last result, the time that probe was sent and the failure streak), nine samples, so a 1 s
scrape of it costs little
(docs/exporters.md, "Live fast path"). The other live values (tokens generated per second, running and waiting
requests, the window) and the agent's verdict are on the full page only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from grayguard.exporters.live import LiveSignals

# the live collector's gauges /metrics/fast carries (the controller reads them every second)
FAST_LIVE_SERIES = ("grayguard_live_itl_seconds", "grayguard_live_ttft_seconds",
                    "grayguard_live_prompt_tokens_per_second", "grayguard_live_decode_batch",
                    "grayguard_live_kv_cache_usage_ratio", "grayguard_probe_ttft_median_seconds")
# the prober's gauges /metrics/fast carries besides them
FAST_PROBE_SERIES = ("grayguard_probe_last_result", "grayguard_probe_last_sent_timestamp_seconds",
                     "grayguard_probe_consecutive_failures")
#: every series of /metrics/fast
FAST_SERIES = FAST_LIVE_SERIES + FAST_PROBE_SERIES


class LiveCollector:
    """Exports a node's live values; each gauge is absent while its value is unknown (absent is not zero)."""

    def __init__(self, source: Callable[[], LiveSignals]):
        self._source = source

    def describe(self) -> list[Metric]:
        return [fam for fam, _ in self._families(LiveSignals())]

    def collect(self) -> Iterator[Metric]:
        pairs = self._families(self._source())
        for fam, value in pairs:
            if value is not None:
                fam.add_metric([], value)
        return iter([fam for fam, _ in pairs])

    @staticmethod
    def _families(s: LiveSignals) -> list[tuple[GaugeMetricFamily, float | None]]:
        g = GaugeMetricFamily
        return [
            (g("grayguard_live_itl_seconds", "Mean inter-token latency of vLLM over the live window: delta of "
               "the histogram's sum over delta of its count"), s.itl),
            (g("grayguard_live_ttft_seconds", "Mean time to first token of the first tokens vLLM produced over "
               "the live window"), s.ttft),
            (g("grayguard_live_generation_tokens_per_second", "Tokens vLLM generated per second over the live "
               "window"), s.tokens_per_second),
            (g("grayguard_live_prompt_tokens_per_second", "Prompt tokens vLLM prefilled per second over the live "
               "window"), s.prompt_tokens_per_second),
            (g("grayguard_live_requests_running", "vLLM's running requests at its newest reading"), s.running),
            (g("grayguard_live_requests_waiting", "vLLM's waiting requests at its newest reading"), s.waiting),
            (g("grayguard_live_kv_cache_usage_ratio", "vLLM's KV-cache usage (0-1) at its newest reading, the "
               "fullest engine's"), s.kv_usage),
            (g("grayguard_live_decode_batch", "Mean number of sequences decoding over the live window: delta of the "
               "ITL histogram's sum over the window (the batch size the live ITL was measured at)"), s.decode_batch),
            (g("grayguard_probe_ttft_median_seconds", "Median TTFT of the last 5 answered probes within twice the "
               "live window (at least 3)"), s.probe_ttft_median),
            (g("grayguard_live_window_seconds", "Seconds between the two vLLM readings the live values are taken "
               "over"), s.span),
        ]


class Only:
    """Wraps a collector and yields only its families with the given names (for the fast registry)."""

    def __init__(self, inner: Any, names: Collection[str]):
        self._inner, self._names = inner, frozenset(names)

    def describe(self) -> list[Metric]:
        return [fam for fam in self._inner.describe() if fam.name in self._names]

    def collect(self) -> Iterator[Metric]:
        return iter([fam for fam in self._inner.collect() if fam.name in self._names])


def fast_registry(live: Any | None, probe_state: Any | None) -> CollectorRegistry:
    """The registry behind /metrics/fast: FAST_SERIES of the live collector and of the probe's state; a part that
    is off (None) is left out."""
    r = CollectorRegistry()
    if live is not None:
        r.register(Only(live, FAST_LIVE_SERIES))
    if probe_state is not None:
        r.register(Only(probe_state, FAST_PROBE_SERIES))
    return r
