"""The sidecar's pod, as a series: dcgm-exporter labels a GPU with the pod that holds it, and this series names the
node's pod, so the rules join dcgm-exporter's GPUs to grayguard's nodes (rules.gpu_source: dcgm, docs/dcgm.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

NAME = "grayguard_node_pod_info"
# the downward API's variables (deploy/kubernetes/components/exporter-sidecar): the flags' defaults
POD_ENV = "POD_NAME"
NAMESPACE_ENV = "POD_NAMESPACE"


class PodInfoCollector:
    """grayguard_node_pod_info{namespace, pod} = 1; nothing when either is unknown (absent is not zero).

    The labels are dcgm-exporter's own (`namespace`, `pod`). Scraped without honor_labels by a job whose target
    labels already name the pod (a PodMonitor), Prometheus keeps the target's as `pod`: the same pod, this one."""

    def __init__(self, namespace: str | None, pod: str | None):
        self.namespace = namespace or ""
        self.pod = pod or ""

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(NAME, "The Kubernetes pod this exporter and its vLLM run in (value 1): joins "
                                 "dcgm-exporter's GPUs, labelled with their pod, to this node",
                                 labels=["namespace", "pod"])

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        if not (self.namespace and self.pod):
            return
        fam = self._family()
        fam.add_metric([self.namespace, self.pod], 1)
        yield fam
