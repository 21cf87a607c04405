"""The controller's own metrics, in their own registry (never the global one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grayguard.vocab import STATES as STATES  # the values of grayguard_node_state's `state` label (re-exported)


@dataclass
class ControllerMetrics:
    """Every series the controller exports; construct one per Controller (tests get a fresh one)."""

    registry: CollectorRegistry
    node_state: Gauge
    node_score: Gauge
    node_latency_ema: Gauge
    node_peer_median: Gauge
    node_weight: Gauge
    node_base_weight: Gauge
    node_factor: Gauge
    node_reason: Gauge
    node_info: Gauge
    node_shadow_factor: Gauge
    node_shadow_quarantine: Gauge
    transitions: Counter
    shadow_findings: Counter
    pool_nodes: Gauge
    pool_ejected: Gauge
    pool_max_ejected: Gauge
    pool_safeguard: Gauge
    pool_nodes_with_data: Gauge
    pool_nodes_without_data: Gauge
    pool_nodes_uncompared: Gauge
    tick_duration: Histogram
    ticks: Counter
    last_success: Gauge
    prometheus_errors: Counter
    haproxy_errors: Counter
    haproxy_writes: Counter
    canaries: Counter
    canaries_in_flight: Gauge
    canary_requests: Counter
    data_stale: Gauge
    static_backend: Gauge
    state_save_errors: Counter
    rules_reload_errors: Counter
    controller_leader: Gauge
    led_pools: Gauge
    leader_changes: Counter
    registry_errors: Counter
    steering_without_registry: Gauge
    fence_refusals: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControllerMetrics:
        """Register every metric in registry (a new one when None)."""
        r = registry or CollectorRegistry()
        node = ["pool", "node"]
        return cls(
            registry=r,
            node_state=Gauge("grayguard_node_state", "1 for the node's current state, 0 for the others",
                             node + ["state"], registry=r),
            node_score=Gauge("grayguard_node_score",
                             "Peer score: robust z of log latency against the node's peers (absent: unscored)",
                             node, registry=r),
            node_latency_ema=Gauge("grayguard_node_latency_ema_seconds_per_token",
                                   "The node's last 30 s-window normalized latency the controller counted "
                                   "(the name is kept: no EMA)", node, registry=r),
            node_peer_median=Gauge("grayguard_node_peer_median_seconds_per_token",
                                   "Median normalized latency of the node's peers (node excluded)",
                                   node, registry=r),
            node_weight=Gauge("grayguard_node_weight", "Weight the controller wants in HAProxy (0-256)",
                              node, registry=r),
            node_base_weight=Gauge("grayguard_node_base_weight", "The server's configured HAProxy weight",
                                   node, registry=r),
            node_factor=Gauge("grayguard_node_weight_factor",
                              "Weight factor (0-1) a signal applies to the node", node + ["signal"],
                              registry=r),
            node_reason=Gauge("grayguard_node_reason_info",
                              "The signals that put the node in its state, a stable set such as latency,probe "
                              "(value 1; the full text is in /status and the logs)",
                              node + ["state", "reason"], registry=r),
            node_shadow_factor=Gauge("grayguard_node_shadow_weight_factor",
                                     "The weight factor (0-1) a detector in shadow mode asks for the node (absent: it "
                                     "asks for no cut); nothing applies it (config detectors.<name>.enforce: false)",
                                     node + ["detector"], registry=r),
            node_shadow_quarantine=Gauge("grayguard_node_shadow_quarantine",
                                         "1 while a detector in shadow mode asks for the node's quarantine (absent: it "
                                         "does not); nothing drains it", node + ["detector"], registry=r),
            node_info=Gauge("grayguard_node_info", "Links a node (HAProxy server) to its Prometheus series (value 1)",
                            node + ["backend", "instance"], registry=r),
            transitions=Counter("grayguard_node_transitions", "State transitions",
                                node + ["from_state", "to_state"], registry=r),
            shadow_findings=Counter("grayguard_shadow_findings",
                                    "Findings a detector in shadow mode began (a cut or a quarantine it asked for a "
                                    "node, counted when it begins), by detector and what it asked (cut, quarantine)",
                                    ["pool", "detector", "asks"], registry=r),
            pool_nodes=Gauge("grayguard_pool_nodes", "Servers in the pool's backend", ["pool"], registry=r),
            pool_ejected=Gauge("grayguard_pool_ejected_nodes", "Nodes drained (quarantined or canary)",
                               ["pool"], registry=r),
            pool_max_ejected=Gauge("grayguard_pool_max_ejected_nodes",
                                   "Most nodes the safeguard lets the controller drain", ["pool"], registry=r),
            pool_safeguard=Gauge("grayguard_pool_safeguard_engaged",
                                 "1 when an outlier stays degraded only because the ejection cap binds",
                                 ["pool"], registry=r),
            pool_nodes_with_data=Gauge("grayguard_pool_nodes_with_data",
                                       "Nodes the controller can score this tick: one fresh latency series of the "
                                       "pool and enough requests (below 3 nodes with data: unprotected)",
                                       ["pool"], registry=r),
            pool_nodes_without_data=Gauge("grayguard_pool_nodes_without_data",
                                          "Nodes without usable data by reason: conflict (two series), stale "
                                          "(older than stale_after_s), unmatched (no series names the server), "
                                          "idle (no latency or no requests in the window)", ["pool", "reason"],
                                          registry=r),
            pool_nodes_uncompared=Gauge("grayguard_pool_nodes_uncompared",
                                        "Nodes in rotation with latency data that no peer comparison scores: their "
                                        "peer group has fewer than 3 nodes with data and pools[].group_speed gives "
                                        "it no speed, so a slow one is not seen by the latency detectors",
                                        ["pool"], registry=r),
            tick_duration=Histogram("grayguard_tick_duration_seconds", "Duration of a control tick",
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                    registry=r),
            ticks=Counter("grayguard_ticks", "Control ticks by result (ok, held, error, skipped)",
                          ["result"], registry=r),
            last_success=Gauge("grayguard_last_successful_tick_timestamp_seconds",
                               "Unix time of the last tick that observed fresh data and reconciled",
                               registry=r),
            prometheus_errors=Counter("grayguard_prometheus_errors",
                                      "Prometheus query failures by kind", ["kind"], registry=r),
            haproxy_errors=Counter("grayguard_haproxy_errors", "HAProxy runtime API failures",
                                   ["endpoint", "kind"], registry=r),
            haproxy_writes=Counter("grayguard_haproxy_writes", "Runtime API set commands sent",
                                   ["endpoint", "kind"], registry=r),
            canaries=Counter("grayguard_canaries", "Canary requests by result (good, bad, error)",
                             ["pool", "node", "result"], registry=r),
            canaries_in_flight=Gauge("grayguard_canaries_in_flight",
                                     "Canary requests running or waiting for a worker, as the last tick saw them "
                                     "(off the tick; a hung engine's until its request returns)", registry=r),
            # the recording rules take these out of the node's request rate (vLLM counts each canary as a request)
            canary_requests=Counter("grayguard_canary_requests",
                                    "Canary requests sent to a node (drained, or a reference peer), by the series "
                                    "keys of the node (instance)", node + ["instance"], registry=r),
            data_stale=Gauge("grayguard_data_stale", "1 while the controller holds weights for lack of data",
                             registry=r),
            static_backend=Gauge("grayguard_backend_static_algorithm",
                                 "1 when the backend's balance algorithm only takes weights 0 or 100 %",
                                 ["pool", "backend"], registry=r),
            state_save_errors=Counter("grayguard_state_save_errors",
                                      "State file writes that failed (the tick goes on; retried next tick)",
                                      registry=r),
            rules_reload_errors=Counter("grayguard_rules_reload_errors",
                                        "Failed reloads after re-rendered alert rules, by kind (connect, http; "
                                        "not_found: no reload endpoint there, never retried)", ["kind"], registry=r),
            controller_leader=Gauge("grayguard_controller_leader",
                                    "1 while this replica leads (holds a leader key; also with a lease it cannot "
                                    "confirm, see ..._steering_without_registry), 0 while it stands by "
                                    "(registry.url set only)", ["id"], registry=r),
            led_pools=Gauge("grayguard_controller_led_pools", "Pools this replica leads (registry.url set only)",
                            ["id"], registry=r),
            leader_changes=Counter("grayguard_controller_leader_changes",
                                   "Times this replica took or lost the leadership of a scope", registry=r),
            registry_errors=Counter("grayguard_controller_registry_errors",
                                    "Failed registry (etcd) calls of the election by operation (lease, read, campaign, "
                                    "publish, load, resign) and kind", ["op", "kind"], registry=r),
            steering_without_registry=Gauge(
                "grayguard_controller_steering_without_registry",
                "1 while this replica leads with a lease it cannot confirm (etcd unreachable): it steers only the "
                "HAProxies whose fencing epoch is still its own (registry.url set only)", ["id"], registry=r),
            fence_refusals=Counter(
                "grayguard_controller_fence_refusals",
                "HAProxy batches not sent because the HAProxy's fencing epoch was not this replica's while its lease "
                "was unconfirmed, by endpoint and what HAProxy had (other_epoch: another replica claimed it; "
                "no_epoch: it restarted)", ["endpoint", "seen"], registry=r),
        )

    def canary_sent(self, pool: str, node: str, keys: Iterable[str]) -> None:
        """Count one canary request sent to a node (the drained one or a reference peer), once under each of its
        series keys (controller/decide.py: series_keys): the recording rules subtract the one that names its vLLM
        series' `instance` from its request rate, and a key that names none joins nothing."""
        for key in keys:
            self.canary_requests.labels(pool, node, key).inc()

    def forget_pool(self, pool: str) -> None:
        """Remove every series of one pool (this replica no longer leads it: the leader's series are the truth)."""
        self._forget(lambda labels: labels.get("pool") == pool)

    def forget_node(self, pool: str, node: str) -> None:
        """Remove every series of one node, whatever the metric (the controller no longer tracks the node: its
        state series must go, or its page would never resolve)."""
        self._forget(lambda labels: labels.get("pool") == pool and labels.get("node") == node)

    def _forget(self, match: Callable[[dict[str, str]], bool]) -> None:
        for metric in (getattr(self, f.name) for f in dataclasses.fields(self)):
            if not isinstance(metric, Gauge | Counter):
                continue
            children = set()
            for family in metric.collect():
                for s in family.samples:  # a child's labels, in the metric's label order (counters: _total, _created)
                    if s.labels and match(s.labels):
                        children.add(tuple(s.labels.values()))
            for values in children:
                metric.remove(*values)
