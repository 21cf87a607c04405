"""grayguard configuration: one YAML file, validated into frozen dataclasses.

Every problem names the field path (``pools[1].backend``) and what is wrong, and all of them are reported at once:
each check records its problem in a Problems and goes on, and one ConfigError holds them all (the CLI prints them,
one a line, and exits 2). Defaults live here, next to the field they belong to, and so do the checks: each section's
``validate(path)`` checks its own fields, Config.validate what spans sections. The JSON Schema is generated from
these dataclasses (grayguard/configschema.py); docs/configuration.md says what is checked where.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from grayguard.engines import DEFAULT_ENGINE, ENGINES
from grayguard.redact import redact_url
from grayguard.vocab import GPU_FLAG_BITS, REMOVED_SERIES, bit_of_mask

# HAProxy proxy and server names: letters, digits, '-', '_', '.', ':' (cfgparse's invalid_char()).
# Anything else ('; ', space, newline) could inject runtime-API commands.
HAPROXY_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
PROM_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
DURATION_RE = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_JOB_RE = re.compile(r'^[^"\\\s]+$')  # a Prometheus job name that is safe inside a PromQL string literal
_ALERT_RE = re.compile(r"^Grayguard[A-Za-z0-9]+$")
DISCOVERY_MODES = ("static", "registry")
HAPROXY_WRITERS = ("controller", "actuators")  # who writes HAProxy (haproxy.writer)
GATEWAY_KINDS = ("haproxy", "nginx")  # what the controller steers (gateway.kind; docs/gateways.md)
# an etcd key prefix: /segments of letters, digits, '-', '_', '.'; no trailing '/' (keys are <prefix>/leader/...)
_PREFIX_RE = re.compile(r"^(/[A-Za-z0-9_.-]+)+$")
# the controller's tick (tick_interval_s), at least and at most: a tick a twentieth of a second keeps the tests' fast
# loops; past a minute a gray failure stays in rotation for minutes
MIN_TICK_S, MAX_TICK_S = 0.05, 60.0
MIN_CONTROL_WINDOW_S = 10.0  # rules.control_window: two of the example's 5 s scrapes (the demo's 10s)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(duration: str) -> float:
    """A Prometheus duration ("10s", "1m30s") in seconds."""
    return sum(float(n) * _DURATION_UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration))


class ConfigError(ValueError):
    """One or more config problems, each with the path of the offending field.

    str() is every problem, one a line, each `path: problem`; path and problem are the first one's. source is the
    file they were found in (None: a document built in code)."""

    def __init__(self, path: str = "", problem: str = "", *, errors: Sequence[tuple[str, str]] = (),
                 source: str | None = None):
        self.errors = tuple(errors) or ((path, problem),)
        self.path, self.problem = self.errors[0]
        self.source = source
        super().__init__("\n".join(_line(*e) for e in self.errors))

    def report(self) -> str:
        """What a command prints: `config error in FILE:` then one line a problem (one line without a file)."""
        if self.source is None and len(self.errors) == 1:
            return f"grayguard: config error: {self}"
        where = f" in {self.source}" if self.source is not None else ""
        return f"grayguard: config error{where}:" + "".join(f"\n  {_line(*e)}" for e in self.errors)


def _line(path: str, problem: str) -> str:
    return f"{path}: {problem}" if path else problem


class Problems:
    """The problems found so far, in the order found, the first one of each field only: a field's later checks
    assume its earlier ones passed (a URL that is not one has no port to check), and so do the checks of fields
    that depend on it (`after`)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self._failed: set[str] = set()

    def add(self, path: str, problem: str) -> None:
        """Record problem at path (unless path already has one; file-level problems, path "", all count)."""
        if path and path in self._failed or (path, problem) in self.items:
            return
        self.items.append((path, problem))
        self._failed.add(path)

    def check(self, cond: bool, path: str, problem: str, after: Iterable[str] = ()) -> bool:
        """Record problem at path unless cond holds; skipped where path, or a field it is checked against, failed."""
        if self.failed(path, *after):
            return False
        if not cond:
            self.add(path, problem)
        return cond

    def failed(self, *paths: str) -> bool:
        """Whether any of paths has a problem."""
        return any(p in self._failed for p in paths)

    def raise_if_any(self, source: str | None = None) -> None:
        """Raise one ConfigError holding every problem, if there is one."""
        if self.items:
            raise ConfigError(errors=self.items, source=source)


def _collects(check: Callable[..., None]) -> Callable[..., None]:
    """A section's validate(*args, problems=None): adds what it finds to problems, or raises them all at once."""

    @functools.wraps(check)
    def validate(self: Any, *args: Any, problems: Problems | None = None) -> None:
        pr = Problems() if problems is None else problems
        check(self, *args, pr)
        if problems is None:
            pr.raise_if_any()

    return validate


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


def _check_url(pr: Problems, value: str, path: str, after: Iterable[str] = ()) -> bool:
    problem = _url_problem(value)
    return pr.check(problem is None, path, problem or "", after)


def _port_ok(port: str, lowest: int = 1) -> bool:
    return port.isdigit() and lowest <= int(port) <= 65535


def _check_finite(pr: Problems, section: Any, path: str) -> None:
    """Every float field of a section is finite: .inf or .nan where a number of seconds, a ratio or a
    threshold belongs fails later (a timer that never fires, an interval the scheduler rejects)."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float):
            pr.check(math.isfinite(v), f"{path}.{f.name}" if path else f.name, f"must be a finite number, got {v}")


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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        pr.check(_is_url(self.url), f"{path}.url",
                 f"must start with http:// or https://, got {redact_url(self.url)!r}")
        _check_url(pr, self.url, f"{path}.url")
        pr.check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        _check_finite(pr, self, path)
        pr.check(not (self.bearer_token_env and self.bearer_token_file), f"{path}.bearer_token_file",
                 "set bearer_token_env or bearer_token_file, not both")
        for name in ("bearer_token_file", "ca_file", "cert_file", "key_file"):
            pr.check(getattr(self, name) != "", f"{path}.{name}", "must be a file path or null")
        pr.check(self.key_file is None or self.cert_file is not None, f"{path}.key_file", "needs cert_file")
        pr.check(self.ca_file is None or self.verify_tls, f"{path}.ca_file",
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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        pr.check(len(self.endpoints) > 0, f"{path}.endpoints", "at least one endpoint is needed")
        for i, ep in enumerate(self.endpoints):
            is_sock = ep.startswith(("unix:", "/"))
            host, _, port = ep.rpartition(":")
            pr.check(is_sock or bool(host and port.isdigit()), f"{path}.endpoints[{i}]",
                     f"expected unix:/path, /path or host:port, got {ep!r}")
            pr.check(is_sock or _port_ok(port), f"{path}.endpoints[{i}]", f"port must be in 1..65535, got {ep!r}")
        pr.check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        pr.check(self.writer in HAPROXY_WRITERS, f"{path}.writer",
                 f"must be {' or '.join(HAPROXY_WRITERS)}, got {_show(self.writer)}")
        _check_finite(pr, self, path)


@dataclass(frozen=True)
class NginxConfig:
    # One file per pool, <upstream_dir>/<backend>.conf, holding its `server` lines, which grayguard writes; the
    # NGINX config includes it inside `upstream <backend> { ... }` (docs/gateways.md)
    upstream_dir: str = "/etc/nginx/grayguard"
    conf: str = "/etc/nginx/nginx.conf"  # the main config: `nginx -t -c <conf>` checks it before every reload
    binary: str = "nginx"  # runs `nginx -t` and `nginx -s reload` (graceful: old workers finish their requests)
    prefix: str | None = None  # nginx -p <prefix>; null: the binary's own
    timeout_s: float = 10.0  # each of `nginx -t` and `nginx -s reload`
    # A batch that only adds traffic (raised weights, returns to ready: a slow-start ramp) waits this long after the
    # pool's last reload; cuts and drains never wait. Each reload leaves the old workers serving their streams and
    # closes their idle client connections: a ramp of one reload a tick would pile them up (docs/gateways.md)
    min_reload_interval_s: float = 5.0

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        for name in ("upstream_dir", "conf", "binary"):
            pr.check(bool(getattr(self, name)), f"{path}.{name}", "must not be empty")
        pr.check(self.prefix is None or bool(self.prefix), f"{path}.prefix", "must not be empty (null: nginx's own)")
        pr.check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        pr.check(self.min_reload_interval_s >= 0, f"{path}.min_reload_interval_s", "must be >= 0")
        _check_finite(pr, self, path)


@dataclass(frozen=True)
class GatewayConfig:
    # What the controller steers: "haproxy" (its runtime API, the haproxy section) or "nginx" (a rendered upstream
    # file per pool and a graceful reload; pools[].servers then name every server with its address)
    kind: str = "haproxy"
    nginx: NginxConfig = field(default_factory=NginxConfig)

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        pr.check(self.kind in GATEWAY_KINDS, f"{path}.kind",
                 f"must be {' or '.join(GATEWAY_KINDS)}, got {_show(self.kind)}")
        self.nginx.validate(f"{path}.nginx", problems=pr)


@dataclass(frozen=True)
class ServerConfig:
    series: str | None = None  # value of the pool's series label; default: the server's address
    peer_group: str | None = None  # compare only with servers of the same group (mixed hardware)
    canary_url: str | None = None  # base URL for canaries; default http://<server address>
    address: str | None = None  # gateway.kind nginx only: the server's host:port (HAProxy's config has its own)
    weight: int | None = None  # gateway.kind nginx only: its full weight, 1..256; null: 100


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
    # The inference engine the pool's nodes run (grayguard/engines.py, docs/engines.md): which of its own series
    # the recording rules fall back to where the exporter's grayguard_traffic_* are absent
    engine: str = DEFAULT_ENGINE

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Raise ConfigError naming the first bad field under path (uniqueness across pools is Config's)."""
        pr.check(bool(HAPROXY_NAME_RE.match(self.name)), f"{path}.name",
                 f"{self.name!r} may only hold letters, digits, '-', '_', '.' and ':'")
        pr.check(bool(HAPROXY_NAME_RE.match(self.backend)), f"{path}.backend",
                 f"{self.backend!r} may only hold letters, digits, '-', '_', '.' and ':' "
                 "(anything else could inject HAProxy runtime-API commands)")
        pr.check(self.discovery in DISCOVERY_MODES, f"{path}.discovery",
                 f"must be {' or '.join(DISCOVERY_MODES)}, got {_show(self.discovery)}")
        pr.check(bool(PROM_LABEL_RE.match(self.series_label)), f"{path}.series_label",
                 f"{self.series_label!r} is not a Prometheus label name")
        for s, sc in self.servers.items():
            pr.check(bool(HAPROXY_NAME_RE.match(s)), f"{path}.servers.{s}",
                     "server names may only hold letters, digits, '-', '_', '.' and ':'")
            # checked here, not in the tick: a bad one would raise in every tick, for every pool
            if sc.canary_url is not None and _url_problem(sc.canary_url):
                pr.add(f"{path}.servers.{s}.canary_url", "must be http:// or https:// with a host, got "
                       f"{redact_url(sc.canary_url)!r} (or omit it for http://<server address>)")
        pr.check(self.peer_group_label is None or bool(PROM_LABEL_RE.match(self.peer_group_label)),
                 f"{path}.peer_group_label", f"{self.peer_group_label!r} is not a Prometheus label name")
        for g, c in self.group_speed.items():
            pr.check(c > 0, f"{path}.group_speed.{g}", "must be > 0 (latency relative to the pool)")
            pr.check(math.isfinite(c), f"{path}.group_speed.{g}", f"must be a finite number, got {c}")
        pr.check(self.engine in ENGINES, f"{path}.engine", f"must be one of {', '.join(ENGINES)}, got "
                 f"{_show(self.engine)}")


@dataclass(frozen=True)
class SignalsConfig:
    # Instant queries returning one sample per node, keyed by the pool's series_label.
    latency_query: str = "instance:vllm_normalized_latency_seconds_per_token:rate30s"
    request_rate_query: str = "instance:vllm_request_rate:rate30s"
    # Optional signals (an empty string switches one off). A failing optional query is counted and
    # treated as absent; only the latency and rate queries hold the whole tick.
    # one series a node, labelled with its last probe's result; its value the time that probe was sent (its identity:
    # a probe read on several ticks counts once), or 1 where the exporter does not say (before 2026-12-07)
    probe_result_query: str = (
        "max by (pool, instance, result) ((grayguard_probe_last_result == 1) * ignoring (result) group_left "
        "grayguard_probe_last_sent_timestamp_seconds or grayguard_probe_last_result == 1)")
    probe_ttft_query: str = "max by (pool, instance) (grayguard_probe_last_ttft_seconds)"
    probe_failures_query: str = "max by (pool, instance) (grayguard_probe_consecutive_failures)"
    error_ratio_query: str = "instance:vllm_request_errors:ratio_rate30s"
    # the exporter's 1 s fast path first (exporters/fastpath.py), else vLLM's own series at its scrape interval
    kv_cache_query: str = ("max by (pool, instance) (grayguard_live_kv_cache_usage_ratio) "
                           "or instance:vllm_kv_cache_usage_ratio:max")
    # the exporter derives both flags beside the node (a slowdown reason, or a link below its maximum, while the GPU
    # is busy: exporters/gpumetrics.py), bits of its mask grayguard_gpu_flags (grayguard/vocab.py GPU_FLAGS); before
    # 2026-12-05 these were joins in Prometheus (docs/operations.md), until issue 34 0/1 series of their own
    gpu_throttled_query: str = (
        f"max by (pool, instance) ({bit_of_mask('grayguard_gpu_flags', GPU_FLAG_BITS['slowed_under_load'])})")
    pcie_degraded_query: str = (
        f"max by (pool, instance) ({bit_of_mask('grayguard_gpu_flags', GPU_FLAG_BITS['pcie_degraded_under_load'])})")
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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Any string is a query, and an empty one switches an optional signal off; the cadence is a duration."""
        pr.check(math.isfinite(self.hardware_every_s) and 0 <= self.hardware_every_s <= 300,
                 f"{path}.hardware_every_s",
                 f"must be in [0, 300] seconds (0: every tick), got {self.hardware_every_s}")


# the optional signals read once in signals.hardware_every_s, not every tick (controller/loop.py read_optional)
HARDWARE_SIGNALS = ("gpu_throttled", "pcie_degraded", "gpu_ecc", "gpu_xid", "peer_group")


# the score, in noise widths, from which a cut's weight falls (2^-(score-2), controller/scoring.py); a canary scored
# below it is good, and a second witness lets evidence of it cut in a pool noisier than min_spread (controller/live.py).
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
    # the variability (coefficient of variation) of one observation a node's value is a mean of: the 30 s window's
    # is a mean over the requests that finished in it, the live ITL over the token gaps of the live window (decode
    # batch x 5 s over the ITL), each noisy by about this / sqrt(their count), and that noise joins the peers' spread
    # in the node's score (a node finishing 30 requests: +/-18 %; three token gaps: +/-58 %); 0: not counted
    window_noise_cv: float = 1.0
    max_ejected_fraction: float = 0.3  # at most this share of a pool drained (one in pools of 3+, never all; 0: never)
    # the weight factor of a cut whose finding does not measure how slow the node is (slow probes, errors)
    cut_factor: float = 0.3
    # probes (the exporter's 1-token micro-probe)
    # slow probes in a row that cut (one spike is noise; more where the peers' probes are slow too), failed probes in a
    # row that quarantine (more where the peers' probes fail too, none when all do; a CUDA error: one)
    probe_consecutive: int = 2
    # good probes in a row that end a slow-probe cut
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
    # a latency quarantine (live ITL or 30 s window) needs a second witness: GPU evidence, or the node's probe TTFT
    # median at least this many times its peers' in a pool as quiet as min_spread (as many noise widths in a noisier
    # one; the probes are noisier, so they only confirm: without them a latency signal cuts but does not drain); a
    # probe this much slower than its peers' is a slow one
    live_probe_confirm: float = 1.2
    # the load model's prior for the batch slope (controller/loadmodel.py): a decode step with more sequences takes
    # longer, each sequence beyond the first this share of a batch-1 step (fitted to published vLLM measurements of
    # 8B-class models, sim/calibrate.py: 0.028 on H100, 0.034 on A100). A pool with uneven batches fits its own
    # slope; a small or evenly loaded one keeps this. 0 leaves the batch out of the model
    live_batch_slope: float = 0.028
    # membership
    new_node_warmup_s: float = 30.0  # a node that joins a running pool holds slow_start_initial this long
    forget_after_s: float = 300.0  # a node gone from HAProxy is forgotten after this (its state is kept)

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        p = f"{path}."
        pr.check(self.quarantine_score >= DEGRADE_AT, p + "quarantine_score",
                 "must be >= 2 (the score, in noise widths, from which a cut's weight falls)")
        pr.check(self.min_spread > 0, p + "min_spread", "must be > 0")
        pr.check(self.window_noise_cv >= 0, p + "window_noise_cv", "must be >= 0 (0: not counted)")
        pr.check(0 <= self.max_ejected_fraction <= 1, p + "max_ejected_fraction", "must be in [0, 1]")
        for name in ("live_cut_ratio", "live_drift", "live_probe_confirm"):
            pr.check(getattr(self, name) >= 1, p + name, "must be >= 1 (a multiple of the peer median)")
        pr.check(self.live_cut_ratio > self.live_drift, p + "live_cut_ratio", f"must be > {p}live_drift",
                 after=[p + "live_drift"])
        pr.check(0 <= self.live_batch_slope <= 1, p + "live_batch_slope",
                 "must be in [0, 1] (a share of a batch-1 step)")
        pr.check(0 < self.cut_factor <= 1, p + "cut_factor", "must be in (0, 1]")
        for name in ("probe_consecutive", "probe_ok_to_clear"):
            pr.check(getattr(self, name) >= 1, p + name, "must be >= 1")
        pr.check(0 < self.error_ratio < self.circuit_error_ratio <= 1, p + "circuit_error_ratio",
                 f"must be in ({p}error_ratio, 1]", after=[p + "error_ratio"])
        pr.check(0 < self.kv_drained < self.kv_saturated <= 1, p + "kv_drained", f"must be in (0, {p}kv_saturated)",
                 after=[p + "kv_saturated"])
        pr.check(self.kv_outlier_ratio == 0 or self.kv_outlier_ratio > 1, p + "kv_outlier_ratio",
                 "must be > 1 (times the peers' usage), or 0 (off)")
        pr.check(0 < self.kv_outlier_min <= 1, p + "kv_outlier_min", "must be in (0, 1]")
        pr.check(self.new_node_warmup_s >= 0, p + "new_node_warmup_s", "must be >= 0")
        pr.check(self.forget_after_s >= 0, p + "forget_after_s", "must be >= 0")
        _check_finite(pr, self, path)


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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        p = f"{path}."
        pr.check(self.min_quarantine_s >= 0, p + "min_quarantine_s", "must be >= 0")
        pr.check(self.canary_interval_s > 0, p + "canary_interval_s", "must be > 0")
        pr.check(self.canary_successes >= 1, p + "canary_successes", "must be >= 1")
        pr.check(self.canary_timeout_s > 0, p + "canary_timeout_s", "must be > 0")
        pr.check(0 < self.slow_start_initial <= 1, p + "slow_start_initial", "must be in (0, 1]")
        pr.check(self.slow_start_step_per_min > 0, p + "slow_start_step_per_min", "must be > 0")
        _check_finite(pr, self, path)


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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Nothing beyond the types: every detector may be enforced or shadowed."""


# rules.gpu_source: the sidecar's NVML collector, or dcgm-exporter's series through recording rules (docs/dcgm.md)
GPU_SOURCES = ("exporter", "dcgm")
# the signals whose default reads another series when rules.gpu_source is dcgm (follow_gpu_source): dcgm-exporter's
# XID field is the last XID's code, not a counter, so the rules record the XIDs new within the window instead
DCGM_SIGNALS = {"gpu_xid_query": "max by (pool, instance) (grayguard_gpu_xid_recent)"}


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
    # Where the GPU evidence comes from (docs/dcgm.md): "exporter" (the sidecar's NVML collector) or "dcgm" (NVIDIA's
    # dcgm-exporter: recording rules map its series to the same grayguard_gpu_* series, joined to nodes by the pod
    # dcgm-exporter labels a GPU with and the sidecar's grayguard_node_pod_info; run the sidecar with
    # --no-collector.nvml)
    gpu_source: str = "exporter"

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        p = f"{path}."
        pr.check(self.gpu_source in GPU_SOURCES, p + "gpu_source",
                 f"must be one of {', '.join(GPU_SOURCES)}, got {self.gpu_source!r}")
        pr.check(0 < self.omega <= 1, p + "omega", "must be in (0, 1]")
        for name in ("control_window", "human_window", "baseline_window"):
            pr.check(bool(DURATION_RE.match(getattr(self, name))), p + name,
                     "must be a Prometheus duration such as 30s, 5m or 1d")
        if DURATION_RE.match(self.control_window):
            cw = duration_seconds(self.control_window)
            pr.check(cw >= MIN_CONTROL_WINDOW_S, p + "control_window",
                     f"must be at least {MIN_CONTROL_WINDOW_S:g}s, got {self.control_window}: the rate() behind the "
                     "controller's signals needs two of the engine's scrapes in the window (every 5 s in "
                     "rules/prometheus.example.yml; 30s shipped)")
        pr.check(self.regression_factor > 1, p + "regression_factor", "must be > 1")
        pr.check(0 < self.kv_saturation_ratio <= 1, p + "kv_saturation_ratio", "must be in (0, 1]")
        pr.check(self.rerender_interval_s >= 0, p + "rerender_interval_s", "must be >= 0")
        pr.check(self.control_interval is None or bool(DURATION_RE.match(self.control_interval)),
                 p + "control_interval",
                 "must be a Prometheus duration such as 5s, or null for the global evaluation_interval")
        pr.check(self.human_interval is None or bool(DURATION_RE.match(self.human_interval)),
                 p + "human_interval",
                 "must be a Prometheus duration such as 1m, or null for the global evaluation_interval")
        pr.check(_is_url(self.runbook_url), p + "runbook_url",
                 f"must start with http:// or https://, got {self.runbook_url!r}")
        for name in ("controller_job", "exporter_job"):  # pasted into PromQL string literals
            pr.check(bool(_JOB_RE.match(getattr(self, name))), p + name,
                     "must be a non-empty job name without quotes, backslashes or spaces")
        pr.check(self.controller_stale_s > 0, p + "controller_stale_s", "must be > 0")
        pr.check(self.probe_failures >= 1, p + "probe_failures", "must be >= 1")
        pr.check(0 < self.load_gpu_utilization <= 1, p + "load_gpu_utilization", "must be in (0, 1]")
        pr.check(self.reload_url in (None, "", "none") or _is_url(self.reload_url), p + "reload_url",
                 "must start with http:// or https://, or be null")
        if self.reload_url not in (None, "", "none"):
            _check_url(pr, self.reload_url, p + "reload_url")
        _check_url(pr, self.runbook_url, p + "runbook_url")
        if self.grafana_url is not None:
            pr.check(_is_url(self.grafana_url), p + "grafana_url",
                     f"must start with http:// or https://, or be null, got {self.grafana_url!r}")
            _check_url(pr, self.grafana_url, p + "grafana_url")
        pr.check(not re.search(r"[\s\x00-\x1f\x7f]", self.runbook_url), p + "runbook_url",
                 f"must be a URL without spaces or control characters (percent-encode them), got {self.runbook_url!r}")
        _check_finite(pr, self, path)
        for alert, dur in self.alert_for.items():
            pr.check(bool(_ALERT_RE.match(alert)), f"{p}alert_for.{alert}", "not an alert name")
            pr.check(bool(DURATION_RE.match(dur)), f"{p}alert_for.{alert}", "must be a duration such as 0s or 10m")
        for alert, sev in self.alert_severity.items():
            pr.check(bool(_ALERT_RE.match(alert)), f"{p}alert_severity.{alert}", "not an alert name")
            pr.check(sev in ("page", "ticket"), f"{p}alert_severity.{alert}", f"must be page or ticket, got {sev!r}")
        pr.check(self.vllm_prefix in ("vllm:", "vllm_", "any"), p + "vllm_prefix",
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

    @_collects
    def validate(self, path: str, pr: Problems) -> None:
        """Check every field under path (ConfigError names each bad one)."""
        p = f"{path}."
        self.validate_connection(path, problems=pr)
        pr.check(bool(_PREFIX_RE.match(self.prefix)), p + "prefix",
                 f"must be /segments of letters, digits, '-', '_' or '.', without a trailing '/', got {self.prefix!r}")
        pr.check(self.lease_ttl_s >= 2, p + "lease_ttl_s", "must be >= 2 (etcd's shortest lease)")
        pr.check(self.timeout_s > 0, p + "timeout_s", "must be > 0")
        pr.check(self.timeout_s < self.lease_ttl_s, p + "timeout_s",
                 f"must be < {p}lease_ttl_s (a renewal must answer before the lease ends)", after=[p + "lease_ttl_s"])
        pr.check(self.snapshot_file != "", p + "snapshot_file", "must be a file path or null")
        pr.check(self.expiry_cap_per_minute is None or 0 <= self.expiry_cap_per_minute <= 1,
                 p + "expiry_cap_per_minute", "must be in [0, 1] (a share of the pool), or null")
        _check_finite(pr, self, path)

    @_collects
    def validate_connection(self, path: str, pr: Problems) -> None:
        """The fields that say how to reach etcd (endpoints, TLS, user); what the files hold is checked at startup
        (grayguard/etcdconn.py's settings, the controller's preflight)."""
        p = f"{path}."
        pr.check(not self.endpoints or self.url == self.endpoints[0], p + "url",
                 "set url (one endpoint) or endpoints (several), not both")
        named = [(f"{p}endpoints[{i}]", e) for i, e in enumerate(self.endpoints)] or [(p + "url", self.url)]
        tls = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n) is not None]
        for where, url in named:
            if url is None:
                continue
            _check_url(pr, url, where)
            pr.check(urlsplit(url).path in ("", "/") and not urlsplit(url).query, where,
                     f"must be scheme://host:port alone (etcd's gateway is at its root), got {redact_url(url)!r}")
            if tls:
                pr.check(url.startswith("https://"), where,
                         f"must be https:// with {p}{tls[0]} set (TLS files are for TLS), got {redact_url(url)!r}")
        pr.check(len(set(self.endpoints)) == len(self.endpoints), p + "endpoints", "lists an endpoint twice")
        for name in ("ca_file", "cert_file", "key_file", "username", "password_env", "password_file"):
            pr.check(getattr(self, name) != "", p + name, "must be a non-empty string or null")
        pr.check(self.cert_file is None or self.key_file is not None, p + "cert_file",
                 f"needs {p}key_file (the client certificate's key)")
        pr.check(self.key_file is None or self.cert_file is not None, p + "key_file", f"needs {p}cert_file")
        pr.check(not (self.password_env and self.password_file), p + "password_file",
                 "set password_env or password_file, not both")
        for name in ("password_env", "password_file"):
            pr.check(getattr(self, name) is None or self.username is not None, p + name, f"needs {p}username")
        pr.check(self.username is None or bool(self.password_env or self.password_file), p + "username",
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
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
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

    @_collects
    def validate(self, pr: Problems) -> None:
        """Validate every section, then this level's fields and what spans sections; ConfigError holds every problem."""
        # Sections first, in this order, then the top level: the order of the problems is stable.
        self.prometheus.validate("prometheus", problems=pr)
        self.haproxy.validate("haproxy", problems=pr)
        self.signals.validate("signals", problems=pr)
        self.thresholds.validate("thresholds", problems=pr)
        self.recovery.validate("recovery", problems=pr)
        self.detectors.validate("detectors", problems=pr)
        self.rules.validate("rules", problems=pr)
        self.registry.validate("registry", problems=pr)
        self.gateway.validate("gateway", problems=pr)
        pr.check(self.tick_interval_s >= MIN_TICK_S, "tick_interval_s",
                 f"must be at least {MIN_TICK_S:g} (s), got {self.tick_interval_s:g}: each tick queries Prometheus and "
                 "HAProxy, and the fast path they read moves once a second (1 shipped)")
        pr.check(self.tick_interval_s <= MAX_TICK_S, "tick_interval_s",
                 f"must be at most {MAX_TICK_S:g} (s), got {self.tick_interval_s:g}: a slower tick leaves a gray "
                 "failure in rotation for minutes, and the stall limit of /healthz grows with it (1 shipped)")
        pr.check(self.stale_after_s > 0, "stale_after_s", "must be > 0")
        _check_finite(pr, self, "")
        host, _, port = self.listen_address.rpartition(":")
        pr.check(bool(host) and port.isdigit(), "listen_address", f"expected host:port, got {self.listen_address!r}")
        pr.check(_port_ok(port, lowest=0), "listen_address", f"port must be in 0..65535, got {self.listen_address!r}")
        pr.check(len(self.pools) > 0, "pools", "at least one pool is needed")
        seen_names: set[str] = set()
        seen_backends: set[str] = set()
        for i, p in enumerate(self.pools):
            p.validate(f"pools[{i}]", problems=pr)
            # Each pool owns a backend: two pools writing one backend's weights would fight every tick.
            pr.check(p.name not in seen_names, f"pools[{i}].name", f"duplicate pool name {p.name!r}")
            pr.check(p.backend not in seen_backends, f"pools[{i}].backend",
                     f"backend {p.backend!r} is already driven by another pool")
            seen_names.add(p.name)
            seen_backends.add(p.backend)
            pr.check(p.discovery != "registry" or self.registry.url is not None, f"pools[{i}].discovery",
                     "registry needs registry.url (the etcd the nodes register in)")
            pr.check(p.discovery != "registry" or self.haproxy.writer == "controller", f"pools[{i}].discovery",
                     "registry needs haproxy.writer: controller (the actuators apply weights and drains, not "
                     "membership)")
        pr.check(self.haproxy.writer == "controller" or self.registry.url is not None, "haproxy.writer",
                 "actuators needs registry.url (the leader publishes the desired state there)")
        self._validate_lease(pr)
        self._validate_gateway_servers(pr)

    def _validate_gateway_servers(self, pr: Problems) -> None:
        """NGINX has no runtime API to list a pool's servers: the config names each with its address (and HAProxy
        alone has fencing, registry membership and actuators); with HAProxy its own config has them."""
        nginx = self.gateway.kind == "nginx"
        if nginx:
            pr.check(self.registry.url is None, "gateway.kind", "nginx runs without registry.url: one controller "
                     "writes the upstream files (NGINX keeps no fencing epoch and no dynamic servers)")
        for i, p in enumerate(self.pools):
            pr.check(not nginx or bool(p.servers), f"pools[{i}].servers",
                     "gateway.kind nginx needs the pool's servers, each with its address")
            for s, sc in p.servers.items():
                where = f"pools[{i}].servers.{s}"
                if not nginx:
                    for name in ("address", "weight"):
                        pr.check(getattr(sc, name) is None, f"{where}.{name}",
                                 "only with gateway.kind: nginx (HAProxy's own config has its servers)")
                    continue
                host, _, port = (sc.address or "").rpartition(":")
                pr.check(bool(host) and _port_ok(port) and not any(c in (sc.address or "") for c in " ;{}#\n"),
                         f"{where}.address", f"expected host:port, got {_show(sc.address)}")
                pr.check(sc.weight is None or 1 <= sc.weight <= 256, f"{where}.weight",
                         f"must be in 1..256, got {_show(sc.weight)}")

    def _validate_lease(self, pr: Problems) -> None:
        """With a registry, the leader's lease must outlast what a tick does between two renewals."""
        if self.registry.url is None:
            return
        ttl = self.registry.lease_ttl_s
        pr.check(self.tick_interval_s < ttl, "registry.lease_ttl_s",
                 f"must be > tick_interval_s ({self.tick_interval_s:g}s): the lease is renewed every tick",
                 after=["tick_interval_s"])
        # a confirmed lease must leave room for one registry call and one HAProxy batch before it could end
        need = self.registry.timeout_s + self.haproxy.timeout_s
        pr.check(ttl > need, "registry.lease_ttl_s", f"must be > registry.timeout_s + haproxy.timeout_s ({need:g}s): "
                 "a leader writes HAProxy only while its lease outlasts the write",
                 after=["registry.timeout_s", "haproxy.timeout_s"])


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


_BAD = object()  # what _convert returns for a value it recorded a problem for


def _placeholder(tp: Any) -> Any:
    """A value of type tp that stands in for a missing or bad required one, so that the rest is still checked (the
    field's problem is recorded, so no check reads it)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _placeholder(hints[f.name]) for f in dataclasses.fields(tp)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})
    return {tuple: (), dict: {}}.get(origin) if origin else tp()


def _convert(tp: Any, value: Any, path: str, pr: Problems) -> Any:
    """Convert a YAML value to the annotated type; a bad one is recorded in pr (naming path) and gives _BAD."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, pr)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, pr)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            pr.add(path, f"expected a list, got {type(value).__name__}")
            return _BAD
        items = [_convert(args[0], v, f"{path}[{i}]", pr) for i, v in enumerate(value)]
        return tuple(_placeholder(args[0]) if v is _BAD else v for v in items)  # the indexes stay the paths
    if origin is dict:
        if not isinstance(value, dict):
            pr.add(path, f"expected a mapping, got {type(value).__name__}")
            return _BAD
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                pr.add(path, f"keys must be strings, got {_show(k)}")
                continue
            v = _convert(args[1], {} if v is None and dataclasses.is_dataclass(args[1]) else v, f"{path}.{k}", pr)
            if v is not _BAD:
                out[k] = v
        return out
    problem = _scalar_problem(tp, value)
    if problem:
        pr.add(path, problem)
        return _BAD
    return float(value) if tp is float else value


def _scalar_problem(tp: Any, value: Any) -> str | None:
    """Why value is not a tp (bool, int, float or str), or None."""
    if tp is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {_show(value)}"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else \
            f"expected an integer, got {_show(value)}"
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"expected a number, got {_show(value)}"
        try:
            float(value)
        except OverflowError:  # an int beyond ~1.8e308 (YAML's own floats overflow to .inf instead)
            return "number out of range (beyond 1.8e308)"
        return None
    if tp is str:
        return None if isinstance(value, str) else f"expected a string, got {_show(value)}"
    return f"unsupported type {_type_name(tp)}"  # pragma: no cover


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
    "thresholds.live_veto_ratio": "the 30 s window is judged on its own, a thin one by its own sampling noise "
                                  "(window_noise_cv), and its drain takes a second witness: no live veto since "
                                  "2026-12-06; ignored",
    "thresholds.live_prefill_gate": "the load model compares each node's live latencies with what its peers predict "
                                    "at its own decode batch and prompt tokens (docs/architecture.md); ignored",
    **{f"thresholds.{k}": "replaced by probe_consecutive (slow probes in a row that cut, failed probes in a row that "
                          "quarantine); ignored" for k in ("probe_slow_consecutive", "probe_failures_to_quarantine")},
    "thresholds.recover_ticks": "a latency cut holds until the node has a value of its own, which the calm test "
                                "judges (absent is not zero: a cut node keeps weight 1 and is measured); ignored",
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
    "thresholds.min_request_rate": "a node's 30 s window is scored whatever its request count: a thin window's "
                                   "sampling noise (window_noise_cv) widens its score and discounts it in its group's "
                                   "speed; ignored",
    "thresholds.min_degraded_weight": "a cut node keeps at least weight 1 (HAProxy's least weight that still serves), "
                                      "so that it stays measured; ignored",
}


def _build(cls: Any, data: Any, path: str, pr: Problems) -> Any:
    """A cls from a YAML mapping: every unknown field, bad value and missing required field is recorded in pr; a
    bad value leaves its default (a required one: a placeholder), so that the other fields are still checked."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        pr.add(path, f"expected a mapping, got {type(data).__name__}")
        return _BAD
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
    for k in unknown:
        key = _show(k, str)
        pr.add(f"{path}.{key}" if path else key, f"unknown field (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        raw = data.get(name, _BAD)
        if name.endswith("_s") and isinstance(raw, str):  # a duration in seconds, written as one: 5s, 1m30s, 500ms
            raw = _seconds(raw, hints[name], sub, pr)
        value = _convert(hints[name], raw, sub, pr) if raw is not _BAD else _BAD
        if name not in data and required:
            pr.add(sub, "required field is missing")
        if value is not _BAD:
            kwargs[name] = value
        elif required:
            kwargs[name] = _placeholder(hints[name])
    return cls(**kwargs)


def _seconds(text: str, tp: Any, path: str, pr: Problems) -> Any:
    """A `_s` field given as a Prometheus duration (docs/configuration.md, "Units"): its seconds, a number of the
    field's type (a whole one for an int field such as lease_ttl_s); _BAD, recorded, for anything else."""
    if not DURATION_RE.match(text):
        pr.add(path, f"expected a number of seconds or a duration such as 5s, 1m or 500ms, got {_show(text)}")
        return _BAD
    seconds = duration_seconds(text)
    if int in typing.get_args(tp) or tp is int:
        if seconds != int(seconds):
            pr.add(path, f"must be whole seconds, got {_show(text)}")
            return _BAD
        return int(seconds)
    return seconds


# A recorded series with a window: level:metric:[op_]rate<window>, as rules/render.py names them
# (instance:vllm_request_rate:rate30s, instance:vllm_request_errors:ratio_rate30s).
_WINDOWED_SERIES_RE = re.compile(
    r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*:(?:[a-zA-Z0-9]+_)?rate((?:[0-9]+(?:ms|s|m|h|d|w|y))+)\b")


def follow_control_window(signals: SignalsConfig, control_window: str, given: Iterable[str] = ()) -> SignalsConfig:
    """signals with every query not in given reading the recorded series of control_window, not of the default
    window (30s): a config that sets rules.control_window alone gets the signals its rules record."""
    default_window = RulesConfig.control_window
    if control_window == default_window or not DURATION_RE.match(control_window):
        return signals
    given = set(given)

    def rewindow(m: re.Match[str]) -> str:
        text = m.group(0)
        return text[: m.start(1) - m.start(0)] + control_window if m.group(1) == default_window else text

    changes = {f.name: _WINDOWED_SERIES_RE.sub(rewindow, getattr(signals, f.name))
               for f in dataclasses.fields(SignalsConfig)
               if f.name not in given and isinstance(getattr(signals, f.name), str)}
    return dataclasses.replace(signals, **changes)


def follow_gpu_source(signals: SignalsConfig, gpu_source: str, given: Iterable[str] = ()) -> SignalsConfig:
    """signals with every query of DCGM_SIGNALS not in given reading the dcgm rules' series when gpu_source is dcgm
    (the other GPU signals read grayguard_gpu_* series, which those rules record under the exporter's names)."""
    if gpu_source != "dcgm":
        return signals
    given = set(given)
    return dataclasses.replace(signals, **{k: q for k, q in DCGM_SIGNALS.items() if k not in given})


def check_signal_windows(cfg: Config, pr: Problems) -> None:
    """Every recorded series a signal reads is of rules.control_window: the rules record no other, so a signal of
    another window would be absent and the controller would hold every weight."""
    cw = cfg.rules.control_window
    for f in dataclasses.fields(SignalsConfig):
        query = getattr(cfg.signals, f.name)
        if not isinstance(query, str):
            continue
        for m in _WINDOWED_SERIES_RE.finditer(query):
            if m.group(1) != cw:
                pr.check(False, f"signals.{f.name}",
                         f"reads {m.group(0)}, a {m.group(1)} window, but rules.control_window is {cw}: the rules "
                         f"record rate{cw} series, so this signal would be absent and every weight held (read "
                         f"the rate{cw} series, or set rules.control_window: {m.group(1)})",
                         after=["rules.control_window"])
                break


_SERIES_NAME_RE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def check_signal_series(cfg: Config, pr: Problems) -> None:
    """No signal reads a series grayguard no longer exports or records (grayguard.vocab.REMOVED_SERIES): it would be
    absent, so the signal would hold every weight or give no GPU evidence, silently."""
    for f in dataclasses.fields(SignalsConfig):
        query = getattr(cfg.signals, f.name)
        if not isinstance(query, str):
            continue
        for name in dict.fromkeys(n for n in _SERIES_NAME_RE.findall(query) if n in REMOVED_SERIES):
            pr.check(False, f"signals.{f.name}",
                     f"reads {name}, which grayguard no longer exports or records, so this signal would be absent: "
                     f"read {REMOVED_SERIES[name]} instead (CHANGELOG.md)")


def _parse(data: Any, pr: Problems, series: bool = True) -> Config | None:
    """A Config from a parsed document, every problem recorded in pr (None: the document is no mapping). series:
    check that the signals read series grayguard still serves (check_signal_series)."""
    if data is not None and not isinstance(data, dict):
        pr.add("", f"expected a mapping of sections, got {type(data).__name__}")
        return None
    cfg = _build(Config, data, "", pr)
    signals = (data or {}).get("signals")
    given = [k for k in signals if isinstance(k, str)] if isinstance(signals, dict) else ()
    cfg = dataclasses.replace(cfg, signals=follow_control_window(cfg.signals, cfg.rules.control_window, given))
    cfg = dataclasses.replace(cfg, signals=follow_gpu_source(cfg.signals, cfg.rules.gpu_source, given))
    cfg.validate(problems=pr)
    check_signal_windows(cfg, pr)
    if series:
        check_signal_series(cfg, pr)
    return cfg


def parse_config(data: Any, *, series: bool = True) -> Config:
    """Validate a parsed YAML document into a Config; ConfigError holds every problem. series: as load_config's."""
    pr = Problems()
    cfg = _parse(data, pr, series)
    pr.raise_if_any()
    assert cfg is not None
    return cfg


def load_config(path: str | os.PathLike[str], *, promql: bool = False, series: bool = True) -> Config:
    """Read and validate a YAML config file; ConfigError holds every problem, duplicate keys included, and names the
    file. promql: also parse the signals' queries with promtool (rules.promtool), where it is installed. series:
    refuse signals that read a series grayguard no longer serves (False for a config that only replays recorded
    inputs: a recorded run's config names the series of its day, which no query reads again)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("", f"cannot read config {p}: {e.strerror or e}", source=str(p)) from e
    except UnicodeDecodeError as e:
        raise ConfigError("", f"cannot read config {p}: not UTF-8 text ({e.reason} at byte {e.start})",
                          source=str(p)) from e
    pr = Problems()
    data = read_yaml(text, str(p), pr)
    cfg = _parse(data, pr, series)
    if promql and cfg is not None:
        from grayguard.promqlcheck import check_queries

        check_queries(cfg, pr)
    pr.raise_if_any(source=str(p))
    assert cfg is not None
    return cfg


def read_yaml(text: str, name: str, pr: Problems) -> Any:
    """The YAML document in text (from the file name); a key given twice in one mapping, at any depth, is recorded
    in pr (PyYAML keeps the last silently: a second `thresholds:` block would replace the first). A document that is
    not YAML raises ConfigError naming the file and line."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        loader.name = name  # marks say the file, not "<unicode string>"
        node = loader.get_single_node()
        if node is None:
            return None
        _find_duplicates(node, "", pr, set())
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        raise ConfigError("", f"{name} is not valid YAML: {_yaml_problem(e)}", source=name) from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (the file is read whole first)
        raise ConfigError("", f"{name} is not valid YAML: character #x{e.character:04x} at position {e.position}: "
                              f"{e.reason}", source=name) from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"{name} is not valid YAML: {e}", source=name) from None
    except ValueError as e:  # a scalar PyYAML cannot construct: an int of 4300+ digits, a date like 2024-02-30
        raise ConfigError("", f"{name} is not valid YAML: {e}", source=name) from None
    except RecursionError:
        raise ConfigError("", f"{name} is not valid YAML: nested too deeply", source=name) from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    """One line: the problem, its line and column, and what was being read (from where)."""
    mark = e.problem_mark or e.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    context = ""
    if e.context:
        cm = e.context_mark
        since = f" from line {cm.line + 1}, column {cm.column + 1}" if cm and cm is not mark else ""
        context = f" ({e.context}{since})"
    return f"{e.problem or e.context}{where}{context}"


def _find_duplicates(node: yaml.Node, path: str, pr: Problems, seen: set[int]) -> None:
    """Record every mapping key given twice under node (merge keys `<<` may be overridden, as YAML allows)."""
    if id(node) in seen:  # an alias to a node already walked (or to an ancestor: a recursive document)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            here = path
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                here = f"{path}.{key.value}" if path else key.value
                first = lines.setdefault((key.tag, key.value), key.start_mark.line + 1)
                if first != key.start_mark.line + 1:
                    pr.add(here, f"given twice (lines {first} and {key.start_mark.line + 1}): YAML would keep the "
                                 "second silently; merge them into one")
            _find_duplicates(value, here, pr, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _find_duplicates(item, f"{path}[{i}]", pr, seen)
