"""The node's traffic counters: vLLM's finished requests less the exporter's own probes (exporters/synthetic.py).

Four counters on /metrics (not /metrics/fast), which the recording rules read in place of vLLM's per-request
histograms when they exist (docs/rules.md): the same sums, without the probes. Absent until the exporter has a
usable reading of vLLM's /metrics, and while it has none within the live window (absent is not zero: the rules
then read vLLM's own series, probes included). For an engine that counts no tokens (Triton) only the requests and
their seconds are exported: the rules read them as seconds per request (docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from grayguard.exporters.synthetic import Traffic

SERIES = (  # (name without _total, help, Tally field)
    ("grayguard_traffic_requests", "Requests vLLM finished (its e2e latency histogram's count), less the exporter's "
     "own probes", "requests"),
    ("grayguard_traffic_request_seconds", "Sum of their e2e latency in seconds (vLLM's histogram sum), less the "
     "probes'", "seconds"),
    ("grayguard_traffic_prompt_tokens", "Sum of their prompt tokens (vLLM's request_prompt_tokens sum), less the "
     "probes'", "prompt_tokens"),
    ("grayguard_traffic_generation_tokens", "Sum of their generated tokens (vLLM's request_generation_tokens sum), "
     "less the probes'", "generation_tokens"),
)

TOKENLESS = ("requests", "seconds")  # what is exported for an engine that counts no tokens


class TrafficCollector:
    """Exports the traffic counters of one node; none while they are unknown."""

    def __init__(self, source: Callable[[], Traffic | None]):
        self._source = source

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        t = self._source()
        if t is None:
            return iter(())
        fams = self._families()
        for fam, (_, _, field) in zip(fams, SERIES, strict=True):
            fam.add_metric([], getattr(t.total, field))
        return iter(fams if t.tokens else [f for f, (_, _, field) in zip(fams, SERIES, strict=True)
                                           if field in TOKENLESS])

    @staticmethod
    def _families() -> list[CounterMetricFamily]:
        return [CounterMetricFamily(name, doc) for name, doc, _ in SERIES]
