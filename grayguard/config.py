"""grayguard configuration: one YAML file, validated into frozen dataclasses.

Every error names the field path (``pools[1].backend``) and the problem; the CLI turns a
ConfigError into exit code 2. Defaults live here, next to the field they belong to, and so do the
checks: each section's ``validate(path)`` checks its own fields, Config.validate what spans sections.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from grayguard.redact import redact_url

# HAProxy proxy and server names: letters, digits, '-', '_', '.', ':' (cfgparse's invalid_char()).
# Anything else ('; ', space, newline) could inject runtime-API commands.
HAPROXY_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
PROM_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
DURATION_RE = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_JOB_RE = re.compile(r'^[^"\\\s]+$')  # a Prometheus job name that is safe inside a PromQL string literal
_ALERT_RE = re.compile(r"^Grayguard[A-Za-z0-9]+$")
DISCOVERY_MODES = ("static", "registry")
HAPROXY_WRITERS = ("controller", "actuators")  # who writes HAProxy (haproxy.writer)
# an etcd key prefix: /segments of letters, digits, '-', '_', '.'; no trailing '/' (keys are <prefix>/leader/...)
_PREFIX_RE = re.compile(r"^(/[A-Za-z0-9_.-]+)+$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(duration: str) -> float:
    """A Prometheus duration ("10s", "1m30s") in seconds."""
    return sum(float(n) * _DURATION_UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration))


class ConfigError(ValueError):
    """A config problem, with the path of the offending field."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


def _check(cond: bool, path: str, problem: str) -> None:
    if not cond:
        raise ConfigError(path, problem)


def _show(value: Any, conv: Any = repr) -> str:
    """repr (or str) of a YAML value for a message; never raises (a 5000-digit int, a list nested too deep)."""
    try:
        return conv(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__} too large to show>"


def _is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def _url_problem(value: str) -> str | None:
    """Why value is not a usable http(s) URL with a host (and a valid port), or None."""
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError above 65535 or not a number
    except ValueError as e:
        return f"must be an http:// or https:// URL with a host, got {redact_url(value)!r} ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {redact_url(value)!r}"
    if port == 0:
        return f"port must be in 1..65535, got {redact_url(value)!r}"
    return None


def _check_url(value: str, path: str) -> None:
    problem = _url_problem(value)
    _check(problem is None, path, problem or "")


def _port_ok(port: str, lowest: int = 1) -> bool:
    return port.isdigit() and lowest <= int(port) <= 65535


def _check_finite(section: Any, path: str) -> None:
    """Every float field of a section is finite: .inf or .nan where a number of seconds, a ratio or a
    threshold belongs fails later (a timer that never fires, an interval the scheduler rejects)."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float):
            _check(math.isfinite(v), f"{path}.{f.name}" if path else f.name, f"must be a finite number, got {v}")


@dataclass(frozen=True)
class PrometheusConfig:
    url: str = "http://127.0.0.1:9090"
    timeout_s: float = 5.0
    bearer_token_env: str | None = None  # env var holding a bearer token (Thanos, Mimir, managed Prometheus)
    # file holding a bearer token (a Kubernetes service-account token, vmauth): re-read before every request,
    # so a rotated token is used at once
    bearer_token_file: str | None = None
    basic_auth_user_env: str | None = None
    basic_auth_password_env: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # static extra headers
    headers_env: dict[str, str] = field(default_factory=dict)  # header -> env var, e.g. X-Scope-OrgID
    verify_tls: bool = True
    ca_file: str | None = None  # PEM CA bundle that signs the server's certificate (instead of the system's)
    cert_file: str | None = None  # PEM client certificate (mutual TLS)...
    key_file: str | None = None  # ...and its key (omit when cert_file holds both)

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        _check(_is_url(self.url), f"{path}.url", f"must start with http:// or https://, got {redact_url(self.url)!r}")
        _check_url(self.url, f"{path}.url")
        _check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        _check_finite(self, path)
        _check(not (self.bearer_token_env and self.bearer_token_file), f"{path}.bearer_token_file",
               "set bearer_token_env or bearer_token_file, not both")
        for name in ("bearer_token_file", "ca_file", "cert_file", "key_file"):
            _check(getattr(self, name) != "", f"{path}.{name}", "must be a file path or null")
        _check(self.key_file is None or self.cert_file is not None, f"{path}.key_file", "needs cert_file")
        _check(self.ca_file is None or self.verify_tls, f"{path}.ca_file",
               "verify_tls is false: the CA file would be ignored")


@dataclass(frozen=True)
class HaproxyConfig:
    # Runtime API endpoints: "unix:/path" or "/path" for a socket, "host:port" for TCP. Every endpoint
    # of a gateway tier gets the same weights.
    endpoints: tuple[str, ...] = ("unix:/run/haproxy/admin.sock",)
    timeout_s: float = 2.0
    # Who writes the endpoints. "controller": the leader writes each one itself. "actuators": the endpoints are
    # read-only views (`grayguard actuator --view.listen-address`), the leader publishes each pool's desired
    # state to the registry and the actuator beside each HAProxy applies it to its pod-local admin socket
    # (Kubernetes: the runtime API never leaves the HAProxy pod; docs/operations.md). Needs registry.url and
    # static pools (registry membership writes are not actuated).
    writer: str = "controller"

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        _check(len(self.endpoints) > 0, f"{path}.endpoints", "at least one endpoint is needed")
        for i, ep in enumerate(self.endpoints):
            is_sock = ep.startswith(("unix:", "/"))
            host, _, port = ep.rpartition(":")
            _check(is_sock or bool(host and port.isdigit()), f"{path}.endpoints[{i}]",
                   f"expected unix:/path, /path or host:port, got {ep!r}")
            _check(is_sock or _port_ok(port), f"{path}.endpoints[{i}]", f"port must be in 1..65535, got {ep!r}")
        _check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        _check(self.writer in HAPROXY_WRITERS, f"{path}.writer",
               f"must be {' or '.join(HAPROXY_WRITERS)}, got {_show(self.writer)}")
        _check_finite(self, path)


@dataclass(frozen=True)
class ServerConfig:
    series: str | None = None  # value of the pool's series label; default: the server's address
    peer_group: str | None = None  # compare only with servers of the same group (mixed hardware)
    canary_url: str | None = None  # base URL for canaries; default http://<server address>


@dataclass(frozen=True)
class PoolConfig:
    name: str
    backend: str
    # where the pool's nodes come from: "static" (the HAProxy backend's servers, as configured there) or
    # "registry" (nodes register themselves in registry.url with a lease; needs the registry section)
    discovery: str = "static"
    series_label: str = "instance"  # Prometheus label that identifies a node's series
    servers: dict[str, ServerConfig] = field(default_factory=dict)  # per-server overrides
    # Mixed hardware: take each node's peer group from this label of signals.peer_group_query (e.g. the
    # exporter's GPU model, `name`); a server's own peer_group wins. None: one group per pool.
    peer_group_label: str | None = None
    # Speed coefficient per peer group (latency relative to the pool), for groups too small to score
    # on their own; unset groups of 2+ nodes learn theirs from their fastest member.
    group_speed: dict[str, float] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path (uniqueness across pools is Config's)."""
        _check(bool(HAPROXY_NAME_RE.match(self.name)), f"{path}.name",
               f"{self.name!r} may only hold letters, digits, '-', '_', '.' and ':'")
        _check(bool(HAPROXY_NAME_RE.match(self.backend)), f"{path}.backend",
               f"{self.backend!r} may only hold letters, digits, '-', '_', '.' and ':' "
               "(anything else could inject HAProxy runtime-API commands)")
        _check(self.discovery in DISCOVERY_MODES, f"{path}.discovery",
               f"must be {' or '.join(DISCOVERY_MODES)}, got {_show(self.discovery)}")
        _check(bool(PROM_LABEL_RE.match(self.series_label)), f"{path}.series_label",
               f"{self.series_label!r} is not a Prometheus label name")
        for s, sc in self.servers.items():
            _check(bool(HAPROXY_NAME_RE.match(s)), f"{path}.servers.{s}",
                   "server names may only hold letters, digits, '-', '_', '.' and ':'")
            # checked here, not in the tick: a bad one would raise in every tick, for every pool
            if sc.canary_url is not None and _url_problem(sc.canary_url):
                raise ConfigError(f"{path}.servers.{s}.canary_url", "must be http:// or https:// with a host, got "
                                  f"{redact_url(sc.canary_url)!r} (or omit it for http://<server address>)")
        _check(self.peer_group_label is None or bool(PROM_LABEL_RE.match(self.peer_group_label)),
               f"{path}.peer_group_label", f"{self.peer_group_label!r} is not a Prometheus label name")
        for g, c in self.group_speed.items():
            _check(c > 0, f"{path}.group_speed.{g}", "must be > 0 (latency relative to the pool)")
            _check(math.isfinite(c), f"{path}.group_speed.{g}", f"must be a finite number, got {c}")


@dataclass(frozen=True)
class SignalsConfig:
    # Instant queries returning one sample per node, keyed by the pool's series_label.
    latency_query: str = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
    request_rate_query: str = "instance:vllm_request_rate:rate30s"
    # Optional signals (an empty string switches one off). A failing optional query is counted and
    # treated as absent; only the latency and rate queries hold the whole tick.
    probe_result_query: str = "max by (pool, instance, result) (grayguard_probe_last_result == 1)"
    probe_ttft_query: str = "max by (pool, instance) (grayguard_probe_last_ttft_seconds)"
    probe_failures_query: str = "max by (pool, instance) (grayguard_probe_consecutive_failures)"
    error_ratio_query: str = "instance:vllm_request_errors:ratio_rate30s"
    # the exporter's 1 s fast path first (exporters/fastpath.py), else vLLM's own series at its scrape interval
    kv_cache_query: str = ("max by (pool, instance) (grayguard_live_kv_cache_usage_ratio) "
                           "or instance:vllm_kv_cache_usage_ratio:max")
    # the exporter derives both flags beside the node (a slowdown reason, or a link below its maximum, while the GPU
    # is busy: exporters/gpumetrics.py); before 2026-12-05 these were joins in Prometheus (docs/operations.md)
    gpu_throttled_query: str = "max by (pool, instance) (grayguard_gpu_slowed_under_load)"
    pcie_degraded_query: str = "max by (pool, instance) (grayguard_gpu_pcie_degraded_under_load)"
    gpu_ecc_query: str = (
        "max by (pool, instance) (grayguard_gpu_ecc_errors{error_type=\"uncorrected\",counter_type=\"volatile\"})")
    gpu_xid_query: str = "max by (pool, instance) (increase(grayguard_gpu_xid_errors_total[5m]))"
    peer_group_query: str = "max by (pool, instance, name) (grayguard_gpu_info)"
    # live signals: the exporter's fast path (scraped every second, docs/exporters.md)
    live_itl_query: str = "max by (pool, instance) (grayguard_live_itl_seconds)"
    live_ttft_query: str = "max by (pool, instance) (grayguard_live_ttft_seconds)"
    probe_ttft_median_query: str = "max by (pool, instance) (grayguard_probe_ttft_median_seconds)"
    live_prefill_rate_query: str = "max by (pool, instance) (grayguard_live_prompt_tokens_per_second)"
    live_decode_batch_query: str = "max by (pool, instance) (grayguard_live_decode_batch)"
    # the hardware signals (HARDWARE_SIGNALS: GPU evidence and peer groups) come from the exporter's full page, scraped
    # every 5 s (rules/prometheus.example.yml), and change with it or more slowly: each is read once in this many
    # seconds, the reads spread over the ticks between, its last answer used until the next (a failed read: absent,
    # read again the next tick). 0: every tick. Nothing else is cached: the live signals move every second
    hardware_every_s: float = 5.0

    def validate(self, path: str) -> None:
        """Any string is a query, and an empty one switches an optional signal off; the cadence is a duration."""
        _check(math.isfinite(self.hardware_every_s) and 0 <= self.hardware_every_s <= 300,
               f"{path}.hardware_every_s", f"must be in [0, 300] seconds (0: every tick), got {self.hardware_every_s}")


# the optional signals read once in signals.hardware_every_s, not every tick (controller/loop.py read_optional)
HARDWARE_SIGNALS = ("gpu_throttled", "pcie_degraded", "gpu_ecc", "gpu_xid", "peer_group")


# the score, in noise widths, from which a cut's weight falls (2^-(score-2), controller/scoring.py); a canary scored
# below it is good, and probes that agree let evidence of it cut in a pool noisier than min_spread (controller/live.py).
# Two noise widths: the scale of the score, not a tuned threshold (it was thresholds.degrade_score, which the weight
# curve never read)
DEGRADE_AT = 2.0

# nodes with data in a scoring group, the node included, before anyone in it is scored: the node and two peers, the
# fewest whose leave-one-out median is not one other node's value (it was thresholds.min_peers, which accepted only
# this or more; a pool's few peers are already in its score through their spread, scoring.Noise)
MIN_PEERS = 3


@dataclass(frozen=True)
class ThresholdsConfig:
    quarantine_score: float = 3.5  # evidence, in noise widths over at least one observation, that drains the node
    min_spread: float = 0.1  # floor of the peer spread (log units): quiet pools do not amplify noise
    # the per-request variability (coefficient of variation) of the latency per weighted token: the 30 s window's
    # value is a mean over the requests that finished in it, noisy by about this / sqrt(their count), and that
    # noise joins the peers' spread in the node's score (a node finishing 30 requests: +/-18 %); 0: not counted
    window_noise_cv: float = 1.0
    max_ejected_fraction: float = 0.3  # at most this share of a pool drained (at least one in pools of 3+; 0: never)
    # req/s of finished requests below which a node's latency is not trusted (~3 in a 30 s window). Keep it
    # low: a badly slowed node finishes few requests (the probes cover a node that finishes none).
    min_request_rate: float = 0.1
    # the weight factor of a cut whose finding does not measure how slow the node is (slow probes, errors)
    cut_factor: float = 0.3
    # probes (the exporter's 1-token micro-probe)
    # slow probes in a row that cut (one spike is noise; more where the peers' probes are slow too), failed probes in a
    # row that quarantine (a CUDA error: one)
    probe_consecutive: int = 2
    # good probes in a row that end a slow-probe cut, and the latency cut of a node without data (its probes below
    # live_cut_ratio x its peers')
    probe_ok_to_clear: int = 3
    # errors: the share of finished requests that ended in an error, over the control window (one value a sample)
    error_ratio: float = 0.01  # above it the weight is cut by cut_factor
    circuit_error_ratio: float = 0.5  # at or above it the node's circuit opens: drained, half-open (canaries)
    # KV-cache saturation: load, not sickness (no quarantine, no page)
    kv_saturated: float = 0.95  # usage at which the node gets no new traffic...
    kv_drained: float = 0.85  # ...until it falls below this
    # a KV cache at least kv_outlier_min full and kv_outlier_ratio times its peers' usage at a like share of traffic,
    # held for one observation (the live window's 5 ticks): less room for it (GPU memory taken by something else, a
    # KV budget that shrank), so requests queue for a slot: quarantined (controller/signals.py: kv_outlier; 0: off)
    kv_outlier_ratio: float = 4.0
    kv_outlier_min: float = 0.3
    # live signals (controller/live.py): the exporter's live ITL at the node's load against its peers', judged by one
    # sequential test over the ticks: the evidence that it sits above live_drift x the peers', in noise widths
    live_cut_ratio: float = 1.5  # cuts at the evidence of one tick at this ratio in a pool as quiet as min_spread
    live_drift: float = 1.1  # the allowance: a node at or below this ratio gathers no evidence
    # a latency quarantine (live ITL or 30 s window) needs the node's probe TTFT median at least this many times its
    # peers' (the probes are noisier, so they only confirm: without them a latency signal cuts but does not drain);
    # a probe, or a canary, this much slower than its peers' is a slow one
    live_probe_confirm: float = 1.2
    # the load model's prior for the batch slope (controller/loadmodel.py): a decode step with more sequences takes
    # longer, each sequence beyond the first this share of a batch-1 step (fitted to published vLLM measurements of
    # 8B-class models, sim/calibrate.py: 0.028 on H100, 0.034 on A100). A pool with uneven batches fits its own
    # slope; a small or evenly loaded one keeps this. 0 leaves the batch out of the model
    live_batch_slope: float = 0.028
    # membership
    new_node_warmup_s: float = 30.0  # a node that joins a running pool holds slow_start_initial this long
    forget_after_s: float = 300.0  # a node gone from HAProxy is forgotten after this (its state is kept)

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        p = f"{path}."
        _check(self.quarantine_score >= DEGRADE_AT, p + "quarantine_score",
               "must be >= 2 (the score, in noise widths, from which a cut's weight falls)")
        _check(self.min_spread > 0, p + "min_spread", "must be > 0")
        _check(self.window_noise_cv >= 0, p + "window_noise_cv", "must be >= 0 (0: not counted)")
        _check(0 <= self.max_ejected_fraction <= 1, p + "max_ejected_fraction", "must be in [0, 1]")
        _check(self.min_request_rate >= 0, p + "min_request_rate", "must be >= 0")
        for name in ("live_cut_ratio", "live_drift", "live_probe_confirm"):
            _check(getattr(self, name) >= 1, p + name, "must be >= 1 (a multiple of the peer median)")
        _check(self.live_cut_ratio > self.live_drift, p + "live_cut_ratio", f"must be > {p}live_drift")
        _check(0 <= self.live_batch_slope <= 1, p + "live_batch_slope", "must be in [0, 1] (a share of a batch-1 step)")
        _check(0 < self.cut_factor <= 1, p + "cut_factor", "must be in (0, 1]")
        for name in ("probe_consecutive", "probe_ok_to_clear"):
            _check(getattr(self, name) >= 1, p + name, "must be >= 1")
        _check(0 < self.error_ratio < self.circuit_error_ratio <= 1, p + "circuit_error_ratio",
               f"must be in ({p}error_ratio, 1]")
        _check(0 < self.kv_drained < self.kv_saturated <= 1, p + "kv_drained", f"must be in (0, {p}kv_saturated)")
        _check(self.kv_outlier_ratio == 0 or self.kv_outlier_ratio > 1, p + "kv_outlier_ratio",
               "must be > 1 (times the peers' usage), or 0 (off)")
        _check(0 < self.kv_outlier_min <= 1, p + "kv_outlier_min", "must be in (0, 1]")
        _check(self.new_node_warmup_s >= 0, p + "new_node_warmup_s", "must be >= 0")
        _check(self.forget_after_s >= 0, p + "forget_after_s", "must be >= 0")
        _check_finite(self, path)


@dataclass(frozen=True)
class RecoveryConfig:
    min_quarantine_s: float = 20.0  # drained this long before canaries start
    canary_interval_s: float = 10.0
    canary_successes: int = 3  # good canaries in a row to leave quarantine
    canary_timeout_s: float = 5.0
    canary_model: str | None = None  # default: discovered from /v1/models
    canary_api_key_env: str | None = None
    slow_start_initial: float = 0.1  # share of base weight when slow start begins
    slow_start_step_per_min: float = 0.2  # share of base weight added per minute

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        p = f"{path}."
        _check(self.min_quarantine_s >= 0, p + "min_quarantine_s", "must be >= 0")
        _check(self.canary_interval_s > 0, p + "canary_interval_s", "must be > 0")
        _check(self.canary_successes >= 1, p + "canary_successes", "must be >= 1")
        _check(self.canary_timeout_s > 0, p + "canary_timeout_s", "must be > 0")
        _check(0 < self.slow_start_initial <= 1, p + "slow_start_initial", "must be in (0, 1]")
        _check(self.slow_start_step_per_min > 0, p + "slow_start_step_per_min", "must be > 0")
        _check_finite(self, path)


@dataclass(frozen=True)
class DetectorConfig:
    """One detector's mode (detectors.<name>)."""

    enforce: bool = True  # false: shadow mode: its findings are logged and exported, and move no weight or state


@dataclass(frozen=True)
class DetectorsConfig:
    """The detectors whose findings the decision acts on, each by name (grayguard.vocab.Detector).

    A detector in shadow mode (`enforce: false`) runs as it would, its memory (counters, CUSUM) included, and what it
    asks for (a weight factor, a quarantine) is logged and exported (`grayguard_node_shadow_*`); no weight, state or
    drain follows from it. A new detector, or a changed one, is tried on production traffic before it acts (Envoy's
    outlier detection has `enforcing_*` percentages for the same). HAProxy's own reflexes (the error limit, the agent
    check) act in HAProxy, and KV saturation is load, not a finding: neither is a detector here."""

    latency: DetectorConfig = field(default_factory=DetectorConfig)  # the 30 s window's outlier
    live: DetectorConfig = field(default_factory=DetectorConfig)  # the live ITL (fast test and CUSUM)
    probe: DetectorConfig = field(default_factory=DetectorConfig)  # slow and failed probes (a CUDA error included)
    errors: DetectorConfig = field(default_factory=DetectorConfig)  # the error share and the error circuit
    kv_outlier: DetectorConfig = field(default_factory=DetectorConfig)  # a KV cache far fuller than its peers'

    def shadow(self) -> frozenset[str]:
        """The names of the detectors in shadow mode."""
        return frozenset(f.name for f in dataclasses.fields(self) if not getattr(self, f.name).enforce)

    def validate(self, path: str) -> None:
        """Nothing beyond the types: every detector may be enforced or shadowed."""


@dataclass(frozen=True)
class RulesConfig:
    omega: float = 0.25  # prompt-token weight in normalized latency: T / (omega*prompt + completion)
    control_window: str = "30s"  # rate window for the controller's signals
    human_window: str = "5m"  # rate window for dashboards and alerts
    output_dir: str = "rules"  # where rendered rule files are written
    rerender_interval_s: float = 300.0  # the controller re-renders alert rules this often (0: never)
    baseline_window: str = "1d"  # history for per-pool learned thresholds
    regression_factor: float = 2.0  # alert when P99 TTFT exceeds this multiple of the pool's baseline
    kv_saturation_ratio: float = 0.95
    promtool: str = "promtool"
    # Evaluation interval of the control rule group (the controller's signals); null: Prometheus' global
    # evaluation_interval (1m by default, far too slow for a 5 s control tick).
    control_interval: str | None = "5s"
    # Evaluation interval of the human group (the human_window's rules: dashboards, alerts, the learned baseline):
    # off the hot path, the most expensive group (a TTFT quantile a node), read by people and by alerts that wait
    # minutes; null: the global evaluation_interval. 1m halves nothing a person sees at a 5m window
    human_interval: str | None = "1m"
    runbook_url: str = "https://github.com/grayguard/grayguard/blob/main/docs/runbook.md"  # alerts link here
    # Grafana's base URL as the people paged open it (http://grafana.example:3000): alerts carry a dashboard_url
    # annotation to the pool dashboard there, at the node; null: alerts carry no dashboard link
    grafana_url: str | None = None
    controller_job: str = "grayguard-controller"  # Prometheus job that scrapes the controller
    exporter_job: str = "grayguard-exporter"  # Prometheus job that scrapes the node exporters
    controller_stale_s: float = 120.0  # page when the last successful tick is older than this
    probe_failures: int = 3  # consecutive failed probes that page
    load_gpu_utilization: float = 0.5  # a GPU counts as under load above this utilization (0-1)
    # POST target after writing rules; null: <prometheus.url>/-/reload; "" or none: no reload (Mimir, Thanos,
    # or a sidecar that reloads by itself: their /-/reload does not exist)
    reload_url: str | None = None
    alert_for: dict[str, str] = field(default_factory=dict)  # per-alert `for:` overrides, e.g. {X: 10m}
    alert_severity: dict[str, str] = field(default_factory=dict)  # per-alert severity: page or ticket
    # How vLLM's series are named in Prometheus: "vllm:" (text format), "vllm_" (scraped as OpenMetrics
    # from a prometheus_client that escapes ':', e.g. by Prometheus < 2.49), or "any" (matches both).
    vllm_prefix: str = "vllm:"

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        p = f"{path}."
        _check(0 < self.omega <= 1, p + "omega", "must be in (0, 1]")
        for name in ("control_window", "human_window", "baseline_window"):
            _check(bool(DURATION_RE.match(getattr(self, name))), p + name,
                   "must be a Prometheus duration such as 30s, 5m or 1d")
        _check(self.regression_factor > 1, p + "regression_factor", "must be > 1")
        _check(0 < self.kv_saturation_ratio <= 1, p + "kv_saturation_ratio", "must be in (0, 1]")
        _check(self.rerender_interval_s >= 0, p + "rerender_interval_s", "must be >= 0")
        _check(self.control_interval is None or bool(DURATION_RE.match(self.control_interval)),
               p + "control_interval",
               "must be a Prometheus duration such as 5s, or null for the global evaluation_interval")
        _check(self.human_interval is None or bool(DURATION_RE.match(self.human_interval)),
               p + "human_interval",
               "must be a Prometheus duration such as 1m, or null for the global evaluation_interval")
        _check(_is_url(self.runbook_url), p + "runbook_url",
               f"must start with http:// or https://, got {self.runbook_url!r}")
        for name in ("controller_job", "exporter_job"):  # pasted into PromQL string literals
            _check(bool(_JOB_RE.match(getattr(self, name))), p + name,
                   "must be a non-empty job name without quotes, backslashes or spaces")
        _check(self.controller_stale_s > 0, p + "controller_stale_s", "must be > 0")
        _check(self.probe_failures >= 1, p + "probe_failures", "must be >= 1")
        _check(0 < self.load_gpu_utilization <= 1, p + "load_gpu_utilization", "must be in (0, 1]")
        _check(self.reload_url in (None, "", "none") or _is_url(self.reload_url), p + "reload_url",
               "must start with http:// or https://, or be null")
        if self.reload_url not in (None, "", "none"):
            _check_url(self.reload_url, p + "reload_url")
        _check_url(self.runbook_url, p + "runbook_url")
        if self.grafana_url is not None:
            _check(_is_url(self.grafana_url), p + "grafana_url",
                   f"must start with http:// or https://, or be null, got {self.grafana_url!r}")
            _check_url(self.grafana_url, p + "grafana_url")
        _check(not re.search(r"[\s\x00-\x1f\x7f]", self.runbook_url), p + "runbook_url",
               f"must be a URL without spaces or control characters (percent-encode them), got {self.runbook_url!r}")
        _check_finite(self, path)
        for alert, dur in self.alert_for.items():
            _check(bool(_ALERT_RE.match(alert)), f"{p}alert_for.{alert}", "not an alert name")
            _check(bool(DURATION_RE.match(dur)), f"{p}alert_for.{alert}", "must be a duration such as 0s or 10m")
        for alert, sev in self.alert_severity.items():
            _check(bool(_ALERT_RE.match(alert)), f"{p}alert_severity.{alert}", "not an alert name")
            _check(sev in ("page", "ticket"), f"{p}alert_severity.{alert}", f"must be page or ticket, got {sev!r}")
        _check(self.vllm_prefix in ("vllm:", "vllm_", "any"), p + "vllm_prefix",
               f"must be 'vllm:', 'vllm_' or 'any', got {self.vllm_prefix!r}")


@dataclass(frozen=True)
class RegistryConfig:
    """etcd as the membership registry and the replicas' meeting point (docs/architecture.md, "Leader election")."""

    # etcd's v3 HTTP gateway, e.g. http://etcd-0:2379; null: no registry, the controller runs alone (no
    # election, static pools only)
    url: str | None = None
    # several members of the cluster instead of url, tried in order: a call that cannot reach one (refused, TLS
    # handshake failed, no connection, or for a read no answer, within its share of timeout_s) goes on to the
    # next, and later calls stay with the one that answered; url is then the first of them
    endpoints: tuple[str, ...] = ()
    # TLS (https:// endpoints only): the PEM CA bundle that signs etcd's server certificate (null: the system's)
    ca_file: str | None = None
    cert_file: str | None = None  # PEM client certificate, for etcd's --client-cert-auth (needs key_file)...
    key_file: str | None = None  # ...and its key (not encrypted)
    # etcd user (etcd's auth: `etcdctl auth enable`); null: etcd without auth. Its password is never written
    # here: password_env names the environment variable holding it, or password_file a file (re-read at each
    # authentication, so a rotated password is used at once)
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    prefix: str = "/grayguard/v1"  # every key lives under it: <prefix>/leader/<scope>, <prefix>/state/<pool>, ...
    # the leader's lease (whole seconds, etcd's unit; at least 2, etcd's own floor): a leader that cannot
    # renew it for this long stops writing, and a standby takes over within lease_ttl_s + one tick
    lease_ttl_s: int = 5
    timeout_s: float = 2.0  # overall deadline of one registry call
    # membership snapshot (the last registry view, used while etcd is unreachable); null: next to the state
    # file (<state_file>.members.json), or none without a state file
    snapshot_file: str | None = None
    # share of a pool's registered nodes whose registration may expire per minute; the expiries beyond it are
    # held (a partition looks like mass death); null: thresholds.max_ejected_fraction, the pool's ejection cap
    expiry_cap_per_minute: float | None = None
    # elect one leader per pool instead of one for all: pools are spread evenly over the live replicas, and a
    # dead replica's pools are taken over by the others
    shard_pools: bool = False

    def __post_init__(self) -> None:
        # url stays the one test of "is there a registry" (and the name in logs): with endpoints, their first
        if self.url is None and self.endpoints:
            object.__setattr__(self, "url", self.endpoints[0])

    def urls(self) -> tuple[str, ...]:
        """The endpoints to try, in order (url alone when endpoints is empty; none without a registry)."""
        return self.endpoints or ((self.url,) if self.url is not None else ())

    def validate(self, path: str) -> None:
        """Raise ConfigError naming the first bad field under path."""
        p = f"{path}."
        self.validate_connection(path)
        _check(bool(_PREFIX_RE.match(self.prefix)), p + "prefix",
               f"must be /segments of letters, digits, '-', '_' or '.', without a trailing '/', got {self.prefix!r}")
        _check(self.lease_ttl_s >= 2, p + "lease_ttl_s", "must be >= 2 (etcd's shortest lease)")
        _check(self.timeout_s > 0, p + "timeout_s", "must be > 0")
        _check(self.timeout_s < self.lease_ttl_s, p + "timeout_s",
               f"must be < {p}lease_ttl_s (a renewal must answer before the lease ends)")
        _check(self.snapshot_file != "", p + "snapshot_file", "must be a file path or null")
        _check(self.expiry_cap_per_minute is None or 0 <= self.expiry_cap_per_minute <= 1,
               p + "expiry_cap_per_minute", "must be in [0, 1] (a share of the pool), or null")
        _check_finite(self, path)

    def validate_connection(self, path: str) -> None:
        """The fields that say how to reach etcd (endpoints, TLS, user); what the files hold is checked at startup
        (grayguard/etcdconn.py's settings, the controller's preflight)."""
        p = f"{path}."
        _check(not self.endpoints or self.url == self.endpoints[0], p + "url",
               "set url (one endpoint) or endpoints (several), not both")
        named = [(f"{p}endpoints[{i}]", e) for i, e in enumerate(self.endpoints)] or [(p + "url", self.url)]
        tls = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n) is not None]
        for where, url in named:
            if url is None:
                continue
            _check_url(url, where)
            _check(urlsplit(url).path in ("", "/") and not urlsplit(url).query, where,
                   f"must be scheme://host:port alone (etcd's gateway is at its root), got {redact_url(url)!r}")
            if tls:
                _check(url.startswith("https://"), where,
                       f"must be https:// with {p}{tls[0]} set (TLS files are for TLS), got {redact_url(url)!r}")
        _check(len(set(self.endpoints)) == len(self.endpoints), p + "endpoints", "lists an endpoint twice")
        for name in ("ca_file", "cert_file", "key_file", "username", "password_env", "password_file"):
            _check(getattr(self, name) != "", p + name, "must be a non-empty string or null")
        _check(self.cert_file is None or self.key_file is not None, p + "cert_file",
               f"needs {p}key_file (the client certificate's key)")
        _check(self.key_file is None or self.cert_file is not None, p + "key_file", f"needs {p}cert_file")
        _check(not (self.password_env and self.password_file), p + "password_file",
               "set password_env or password_file, not both")
        for name in ("password_env", "password_file"):
            _check(getattr(self, name) is None or self.username is not None, p + name, f"needs {p}username")
        _check(self.username is None or bool(self.password_env or self.password_file), p + "username",
               f"needs {p}password_env or {p}password_file (the password is never written in the config)")

    def snapshot_path(self, state_file: str | None) -> str | None:
        """Where the membership snapshot lives: snapshot_file, else next to the state file, else nowhere."""
        if self.snapshot_file is not None:
            return self.snapshot_file
        return f"{state_file}.members.json" if state_file else None

    def expiry_share(self, max_ejected_fraction: float) -> float:
        """The share of a pool whose registrations may expire per minute (default: the pool's ejection cap)."""
        return max_ejected_fraction if self.expiry_cap_per_minute is None else self.expiry_cap_per_minute


@dataclass(frozen=True)
class Config:
    pools: tuple[PoolConfig, ...]
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    haproxy: HaproxyConfig = field(default_factory=HaproxyConfig)
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    thresholds: ThresholdsConfig = field(default_factory=ThresholdsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    tick_interval_s: float = 1.0  # the live signals move every second; the 30 s window once per rule evaluation
    stale_after_s: float = 60.0  # older Prometheus data holds every weight as it is
    state_file: str | None = "grayguard-state.json"
    listen_address: str = "127.0.0.1:9300"  # the controller's /metrics and /status

    def pool(self, name: str) -> PoolConfig:
        """The pool called name."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def validate(self) -> None:
        """Validate every section, then this level's fields and what spans pools; raise the first ConfigError."""
        # Sections first, in this order, then the top level: which error a config with several gets is stable.
        self.prometheus.validate("prometheus")
        self.haproxy.validate("haproxy")
        self.signals.validate("signals")
        self.thresholds.validate("thresholds")
        self.recovery.validate("recovery")
        self.detectors.validate("detectors")
        self.rules.validate("rules")
        self.registry.validate("registry")
        _check(self.tick_interval_s > 0, "tick_interval_s", "must be > 0")
        _check(self.stale_after_s > 0, "stale_after_s", "must be > 0")
        _check_finite(self, "")
        host, _, port = self.listen_address.rpartition(":")
        _check(bool(host) and port.isdigit(), "listen_address", f"expected host:port, got {self.listen_address!r}")
        _check(_port_ok(port, lowest=0), "listen_address", f"port must be in 0..65535, got {self.listen_address!r}")
        _check(len(self.pools) > 0, "pools", "at least one pool is needed")
        seen_names: set[str] = set()
        seen_backends: set[str] = set()
        for i, p in enumerate(self.pools):
            p.validate(f"pools[{i}]")
            # Each pool owns a backend: two pools writing one backend's weights would fight every tick.
            _check(p.name not in seen_names, f"pools[{i}].name", f"duplicate pool name {p.name!r}")
            _check(p.backend not in seen_backends, f"pools[{i}].backend",
                   f"backend {p.backend!r} is already driven by another pool")
            seen_names.add(p.name)
            seen_backends.add(p.backend)
            _check(p.discovery != "registry" or self.registry.url is not None, f"pools[{i}].discovery",
                   "registry needs registry.url (the etcd the nodes register in)")
            _check(p.discovery != "registry" or self.haproxy.writer == "controller", f"pools[{i}].discovery",
                   "registry needs haproxy.writer: controller (the actuators apply weights and drains, not "
                   "membership)")
        _check(self.haproxy.writer == "controller" or self.registry.url is not None, "haproxy.writer",
               "actuators needs registry.url (the leader publishes the desired state there)")
        self._validate_lease()

    def _validate_lease(self) -> None:
        """With a registry, the leader's lease must outlast what a tick does between two renewals."""
        if self.registry.url is None:
            return
        ttl = self.registry.lease_ttl_s
        _check(self.tick_interval_s < ttl, "registry.lease_ttl_s",
               f"must be > tick_interval_s ({self.tick_interval_s:g}s): the lease is renewed every tick")
        # a confirmed lease must leave room for one registry call and one HAProxy batch before it could end
        need = self.registry.timeout_s + self.haproxy.timeout_s
        _check(ttl > need, "registry.lease_ttl_s", f"must be > registry.timeout_s + haproxy.timeout_s ({need:g}s): "
               "a leader writes HAProxy only while its lease outlasts the write")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming path."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(path, f"keys must be strings, got {_show(k)}")
            out[k] = _convert(args[1], {} if v is None and dataclasses.is_dataclass(args[1]) else v,
                              f"{path}.{k}")
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {_show(value)}")
        try:
            return float(value)
        except OverflowError:  # an int beyond ~1.8e308 (YAML's own floats overflow to .inf instead)
            raise ConfigError(path, "number out of range (beyond 1.8e308)") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_show(value)}")
        return value
    raise ConfigError(path, f"unsupported type {_type_name(tp)}")  # pragma: no cover


# Fields a release removed: a config that still sets one loads, with a warning that says what replaced it, for one
# release; then the field is unknown like any other.
_ONE_TEST = ("one sequential test judges the live ITL (controller/live.py, docs/architecture.md): it cuts at the "
             "evidence of one tick at live_cut_ratio, asks for a quarantine at quarantine_score noise widths, and a "
             "calm tick ends a cut; ignored")
_ONE_WINDOW_TEST = ("the 30 s window is judged by the live ITL's sequential test, on each new sample "
                    "(controller/live.py, docs/architecture.md): no EMA, no sustain count, no hysteresis, no gap of "
                    "its own; ignored")
REMOVED_FIELDS = {
    **{f"thresholds.{k}": _ONE_TEST for k in ("live_confirm_ticks", "live_quarantine_ratio", "live_sustain_ticks",
                                              "live_cusum_cut", "live_cusum_quarantine", "live_calm_ratio")},
    **{f"thresholds.{k}": _ONE_WINDOW_TEST for k in ("ema_alpha", "sustain_ticks", "evidence_sustain_ticks",
                                                     "hysteresis", "min_relative_gap")},
    "thresholds.live_veto_ratio": "the 30 s window is not acted on while the live signals are within live_drift of "
                                  "the peers' (the same allowance); ignored",
    "thresholds.live_prefill_gate": "the load model compares each node's live latencies with what its peers predict "
                                    "at its own decode batch and prompt tokens (docs/architecture.md); ignored",
    **{f"thresholds.{k}": "replaced by probe_consecutive (slow probes in a row that cut, failed probes in a row that "
                          "quarantine); ignored" for k in ("probe_slow_consecutive", "probe_failures_to_quarantine")},
    "thresholds.recover_ticks": "a cut node without data is released after probe_ok_to_clear probes like its peers' "
                                "(the count that ends a slow-probe cut); ignored",
    **{f"thresholds.{k}": "replaced by cut_factor (the cut of a finding that does not measure the node's speed: "
                          "slow probes, errors); ignored" for k in ("probe_slow_factor", "error_factor")},
    **{f"thresholds.{k}": "the error share is a rate over the control window, judged on each new sample: a tick "
                          "count only counted the same sample again; ignored"
       for k in ("error_ticks", "circuit_ticks")},
    "thresholds.kv_outlier_ticks": "a KV outlier is held for one observation of the live window (5 ticks), as every "
                                   "live finding; kv_outlier_ratio: 0 turns it off; ignored",
    "thresholds.degrade_score": "a cut's weight falls as 2^-(score-2) from 2 noise widths (controller/scoring.py: "
                                "DEGRADE_AT; the weight curve never read this field), a canary below it is good; "
                                "ignored",
    "thresholds.probe_slow_ratio": "a probe is slow when the exporter says so and it is live_probe_confirm x its "
                                   "peers'; one the exporter calls ok is left to the live signals; ignored",
    "thresholds.min_peers": "a scoring group needs 3 nodes with data, the node and two peers (grayguard.config: "
                            "MIN_PEERS, the least the field accepted); ignored",
    "thresholds.min_degraded_weight": "a cut node keeps at least weight 1 (HAProxy's least weight that still serves), "
                                      "so that it stays measured; ignored",
}


def _build(cls: Any, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {type(data).__name__}")
    removed = [k for k in data if isinstance(k, str) and f"{path}.{k}" in REMOVED_FIELDS]
    for k in removed:
        logging.getLogger("grayguard.config").warning("%s.%s was removed: %s", path, k, REMOVED_FIELDS[f"{path}.{k}"])
    if removed:
        data = {k: v for k, v in data.items() if k not in removed}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    try:
        unknown = sorted(unknown)
    except TypeError:  # YAML keys of mixed types (1, null, "x"): strings first, the others by their text
        unknown = sorted(unknown, key=lambda k: (not isinstance(k, str), _show(k, str)))
    if unknown:
        key = _show(unknown[0], str)
        where = f"{path}.{key}" if path else key
        raise ConfigError(where, f"unknown field (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, "required field is missing")
    return cls(**kwargs)


def parse_config(data: Any) -> Config:
    """Validate a parsed YAML document into a Config."""
    cfg = _build(Config, data, "")
    cfg.validate()
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file; raise ConfigError on any problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("", f"cannot read config {p}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError("", f"cannot read config {p}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{p} is not valid YAML: {e}") from e
    except ValueError as e:  # a scalar PyYAML cannot construct: an int of 4300+ digits, a date like 2024-02-30
        raise ConfigError("", f"{p} is not valid YAML: {e}") from e
    except RecursionError as e:
        raise ConfigError("", f"{p} is not valid YAML: nested too deeply") from e
    return parse_config(data)
