"""Render Prometheus recording and alert rules from the grayguard config (pure: config in, YAML text out)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
import yaml

from grayguard.config import MIN_PEERS, Config, ConfigError
from grayguard.engines import ENGINES, Profile, Read, profile
from grayguard.rules import dcgm
from grayguard.vocab import GPU_FLAG_BITS, GPU_SLOWDOWN_REASONS

TEMPLATES = Path(__file__).parent / "templates"
RECORDING_FILE = "grayguard-recording.rules.yml"
ALERTS_FILE = "grayguard-alerts.rules.yml"
# The Grafana dashboards' uids (grayguard dashboards render): the alerts' dashboard_url opens them, and the
# dashboards take their uids from here, so a link cannot name a dashboard that is not rendered.
POOL_DASHBOARD_UID = "grayguard-pool-overview"
GPU_DASHBOARD_UID = "grayguard-gpu-health"

# Every alert the templates emit: name -> (default severity, default `for:`; None: derived from the config, see
# derived_for). Severity scheme: `page` = a person acts now, day or night; `ticket` = a person looks in working hours.
ALERTS: dict[str, tuple[str, str | None]] = {
    "GrayguardNodeDegraded": ("ticket", "15m"),
    "GrayguardNodeQuarantined": ("page", "5m"),
    "GrayguardSafeguardEngaged": ("page", "2m"),
    "GrayguardControllerDown": ("page", "2m"),
    "GrayguardControllerStale": ("page", "1m"),
    "GrayguardPoolUnprotected": ("ticket", "10m"),
    "GrayguardNodesUncompared": ("ticket", "10m"),
    "GrayguardControllerRegistryDown": ("page", "1m"),
    "GrayguardRegistryMassExpiry": ("page", "0s"),
    "GrayguardRegistryExpiredKept": ("ticket", "2m"),
    "GrayguardNoLeader": ("page", None),  # registry.lease_ttl_s + tick_interval_s: longer than any hand-over
    "GrayguardControllerSteeringWithoutRegistry": ("ticket", "2m"),
    "GrayguardProbeFailing": ("page", "2m"),
    "GrayguardProbeCudaError": ("page", "1m"),
    "GrayguardExporterDown": ("ticket", "5m"),
    "GrayguardNvmlDown": ("ticket", "5m"),
    "GrayguardGpuThrottled": ("ticket", "10m"),
    "GrayguardGpuPcieLinkDegraded": ("ticket", "10m"),
    "GrayguardGpuEccUncorrectable": ("page", "1m"),
    "GrayguardGpuRowRemapFailure": ("page", "1m"),
    "GrayguardGpuRowRemapPending": ("ticket", "15m"),
    "GrayguardGpuXidError": ("page", "1m"),
    "GrayguardGpuLost": ("page", "1m"),
    "GrayguardKvCacheSaturated": ("ticket", "15m"),
    "GrayguardTtftRegression": ("ticket", "15m"),  # one rule per pool with a learned baseline
}


@dataclass(frozen=True)
class Window:
    """One rate window and the rule group that uses it."""

    group: str
    range: str  # Prometheus duration, e.g. 30s
    interval: str | None  # group evaluation interval; None: the global one
    control: bool  # holds the controller's signals and the window-less gauges
    human: bool  # holds the long-window rules (TTFT quantiles)

    @property
    def suffix(self) -> str:
        return f"rate{self.range}"


def windows(cfg: Config) -> list[Window]:
    """The control window and, unless it is the same, the human window."""
    r = cfg.rules
    if r.control_window == r.human_window:
        return [Window("grayguard-control", r.control_window, r.control_interval, True, True)]
    return [Window("grayguard-control", r.control_window, r.control_interval, True, False),
            Window("grayguard-human", r.human_window, r.human_interval, False, True)]


def signal_names(cfg: Config) -> dict[str, str]:
    """The recorded series the controller queries (config `signals`), for this config's control window."""
    w = f"rate{cfg.rules.control_window}"
    return {"latency_query": f"instance:vllm_normalized_latency_seconds_per_token:{w}",
            "request_rate_query": f"instance:vllm_request_rate:{w}"}


def ttft_p99_series(cfg: Config) -> str:
    """The recorded per-pool P99 time to first token over the human window."""
    return f"pool:vllm_time_to_first_token_seconds:p99_rate{cfg.rules.human_window}"


def baseline_query(cfg: Config) -> str:
    """PromQL for the learned per-pool TTFT baseline: the median of the pool's P99 over baseline_window.

    The median of the recorded 5-minute P99s, not the P99 of the whole window: a regression that has
    lasted a few hours must not raise its own threshold.
    """
    return f"quantile_over_time(0.5, {ttft_p99_series(cfg)}[{cfg.rules.baseline_window}])"


def node_labels(cfg: Config) -> list[str]:
    """Labels per-node rules keep: pool, instance and every pool's series_label."""
    out = ["pool", "instance"]
    for p in cfg.pools:
        if p.series_label not in out:
            out.append(p.series_label)
    return out


def clean_baselines(cfg: Config, baselines: Mapping[str, float] | None) -> dict[str, float]:
    """Baselines of configured pools only, finite and positive, rounded to 2 significant digits.

    Rounding keeps a slowly drifting baseline from rewriting the rules (and reloading Prometheus)
    on every re-render; pool names come from the validated config, never from Prometheus.
    """
    out = {}
    for p in cfg.pools:
        v = (baselines or {}).get(p.name)
        # the alert threshold is v * regression_factor: it must stay finite too
        if v is not None and math.isfinite(v) and v > 0 and math.isfinite(v * cfg.rules.regression_factor):
            out[p.name] = float(f"{v:.2g}")
    return out


def _num(x: float) -> str:
    """A float as a short PromQL/YAML literal: 0.25, 2, 1e-05."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def derived_for(cfg: Config, name: str) -> str:
    """The default `for:` of an alert whose ALERTS entry says None, from the config.

    GrayguardNoLeader: a standby leads within registry.lease_ttl_s + one tick of the leader's last renewal
    (docs/architecture.md, "Leader election"), so nobody leading for longer than that is no hand-over.
    """
    if name == "GrayguardNoLeader":
        return f"{math.ceil(cfg.registry.lease_ttl_s + cfg.tick_interval_s)}s"
    raise KeyError(name)


def alert_meta(cfg: Config) -> dict[str, dict[str, str]]:
    """Severity, for and runbook URL per alert, with the config's overrides; unknown names are errors."""
    r = cfg.rules
    for section in ("alert_for", "alert_severity"):
        for name in getattr(r, section):
            if name not in ALERTS:
                raise ConfigError(f"rules.{section}.{name}", f"unknown alert (known: {', '.join(ALERTS)})")
    base = r.runbook_url.split("#")[0]
    return {name: {"severity": r.alert_severity.get(name, sev),
                   "for": r.alert_for.get(name, dur if dur is not None else derived_for(cfg, name)),
                   "runbook_url": f"{base}#{name.lower()}"}
            for name, (sev, dur) in ALERTS.items()}


# What an alert is about, for its links (alert_links): a node (controller series: pool, node), an instance (vLLM and
# exporter series: pool, instance), a GPU (pool, instance, gpu), a pool, or the whole fleet (the controller itself).
KEYS = ("node", "instance", "gpu", "pool", "fleet")

# Go templates of the annotations (Prometheus expands them at each evaluation, `query` reading Prometheus then).
# The node of an instance: grayguard_node_info, whose instance is exported_instance when the controller is scraped
# without honor_labels.
_NODE_OF_INSTANCE = ("max by (node) (grayguard_node_info{pool=%[1]q, instance=%[2]q} "
                     "or grayguard_node_info{pool=%[1]q, exported_instance=%[2]q})")
_REASON_OF_NODE = "max by (state, reason) (grayguard_node_reason_info{pool=%q, node=%q})"
_REASON_OF_INSTANCE = ("max by (state, reason) (grayguard_node_reason_info{pool=%[1]q} * on (pool, node) group_left () "
                       "max by (pool, node) (grayguard_node_info{pool=%[1]q, instance=%[2]q} "
                       "or grayguard_node_info{pool=%[1]q, exported_instance=%[2]q}))")
_BY_INSTANCE = "$labels.pool $labels.instance"
_STATE_REASON = '{{ . | first | label "state" }}: {{ . | first | label "reason" }}'
UNTRACKED = "unknown (the controller does not track this node)"


def _q(promql: str, args: str, then: str, otherwise: str = "") -> str:
    """A Go template that runs promql (a printf format over args) and expands `then` on its answer, if any, else
    `otherwise`."""
    alt = f"{{{{ else }}}}{otherwise}" if otherwise else ""
    return f"{{{{ with query (printf `{promql}` {args}) }}}}{then}{alt}{{{{ end }}}}"


def alert_links(cfg: Config, key: str) -> list[tuple[str, str]]:
    """The annotations that take the person paged to the node, for an alert about `key` (KEYS): node, reason
    (state: reason code, from grayguard_node_reason_info; UNTRACKED, and no node, when the controller does not track
    the node) and, when rules.grafana_url is set, dashboard_url (the Pool overview at the alert's pool and node) and a
    GPU's gpu_dashboard_url (the GPU dashboard at the GPU)."""
    if key not in KEYS:
        raise KeyError(key)
    out: list[tuple[str, str]] = []
    node_of = _q(_NODE_OF_INSTANCE, _BY_INSTANCE, '{{ . | first | label "node" }}')
    if key == "node":
        out += [("node", "{{ $labels.node }}"),
                ("reason", _q(_REASON_OF_NODE, "$labels.pool $labels.node", _STATE_REASON, UNTRACKED))]
    elif key in ("instance", "gpu"):
        out += [("node", node_of), ("reason", _q(_REASON_OF_INSTANCE, _BY_INSTANCE, _STATE_REASON, UNTRACKED))]
    if cfg.rules.grafana_url is None:
        return out
    base = cfg.rules.grafana_url.rstrip("/")
    pool = "var-pool={{ $labels.pool | urlquery }}"
    instance = "var-instance={{ $labels.instance | urlquery }}"
    query = {"node": f"?{pool}&var-node={{{{ $labels.node | urlquery }}}}",
             "instance": f"?{pool}&{instance}" + _q(_NODE_OF_INSTANCE, _BY_INSTANCE,
                                                   '&var-node={{ . | first | label "node" | urlquery }}'),
             "pool": f"?{pool}", "fleet": ""}
    query["gpu"] = query["instance"]
    out.append(("dashboard_url", f"{base}/d/{POOL_DASHBOARD_UID}{query[key]}"))
    if key == "gpu":
        out.append(("gpu_dashboard_url", f"{base}/d/{GPU_DASHBOARD_UID}?{pool}&{instance}"
                                         "&var-gpu={{ $labels.gpu | urlquery }}"))
    return out


def vllm_selector(prefix: str, name: str, matchers: str = "") -> str:
    """A selector for vLLM series `name` (without prefix) under the configured naming (rules.vllm_prefix)."""
    if prefix == "any":
        return f'{{__name__=~"vllm[:_]{name}"{", " + matchers if matchers else ""}}}'
    return f"{prefix}{name}{{{matchers}}}" if matchers else f"{prefix}{name}"


# The recording rules' engine-dependent inputs (docs/engines.md): for vLLM the series the rules have always read
# (under rules.vllm_prefix), for the other engines the profile's (grayguard/engines.py).
_VLLM_RATES = {"request_seconds": ("e2e_request_latency_seconds_sum", ""),
               "request_prompt_tokens": ("request_prompt_tokens_sum", ""),
               "request_generation_tokens": ("request_generation_tokens_sum", ""),
               "requests": ("e2e_request_latency_seconds_count", ""),
               "errors": ("request_success_total", 'finished_reason="error"'),
               "finished": ("request_success_total", ""),
               "ttft_bucket": ("time_to_first_token_seconds_bucket", "")}
_VLLM_GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting"}


def pool_engines(cfg: Config) -> list[str]:
    """The engines the config's pools run (pools[].engine), in ENGINES order."""
    used = {getattr(p, "engine", "vllm") for p in cfg.pools}
    return [e for e in ENGINES if e in used]


def _selector(name: str, matchers: str) -> str:
    return f"{name}{{{matchers}}}" if matchers else name


def _indent(text: str, n: int) -> str:
    """text with every line indented by n spaces."""
    return "\n".join(" " * n + line for line in text.split("\n"))


def _join(terms: list[str]) -> str:
    """One term as it is; several as `(a or b ...)`: each node has the series of one engine."""
    return terms[0] if len(terms) == 1 else "(" + " or ".join(terms) + ")"


def _read_terms(read: Read, wrap, matchers: str = "") -> list[str]:
    """The PromQL terms of a profile's Read, one per alternative (the first a node has wins: `or`); `matchers` are
    added to every series' own."""
    out = []
    for alt in read:
        parts = []
        for s in alt:
            term = wrap(_selector(s.name, ", ".join(m for m in (s.matchers(), matchers) if m)))
            parts.append(term if s.scale == 1 else f"{term} * {_num(s.scale)}")
        out.append(parts[0] if len(parts) == 1 and alt[0].scale == 1 else "(" + " + ".join(parts) + ")")
    return out


class EngineSeries:
    """The engine-dependent parts of the recording rules for the config's engines (pool_engines).

    For vLLM alone each renders exactly the expression the rules read before engine profiles existed; with other
    engines the vLLM term comes first and each engine that has the signal adds its own (`or`). A signal none of the
    config's engines has reads vLLM's name: absent on their pages, so absent in the rule (absent is not zero).
    """

    def __init__(self, vllm_prefix: str, engines: Sequence[str], by: str):
        self.prefix, self.engines, self.by = vllm_prefix, list(engines), by

    @classmethod
    def for_config(cls, cfg: Config) -> EngineSeries:
        """The recording rules' series: the config's engines, summed by node_labels."""
        return cls(cfg.rules.vllm_prefix, pool_engines(cfg), ", ".join(node_labels(cfg)))

    def _v(self, name: str, matchers: str = "") -> str:
        return vllm_selector(self.prefix, name, matchers)

    def _profiles(self) -> list[Profile]:
        return [profile(e) for e in self.engines if e != "vllm"]

    def rs(self, signal: str, window: str, by: str | None = None, matchers: str = "") -> str:
        """`sum by (by) (rate(<series>[window]))` of a counter signal, for every engine that has it."""
        by = self.by if by is None else by
        rate = lambda sel: f"sum by ({by}) (rate({sel}[{window}]))"  # noqa: E731
        name, vm = _VLLM_RATES[signal]
        vllm = rate(self._v(name, ", ".join(m for m in (vm, matchers) if m)))
        terms = [vllm] if "vllm" in self.engines else []
        for p in self._profiles():
            if signal == "ttft_bucket":
                terms += [rate(_selector(p.ttft_bucket, matchers))] if p.ttft_bucket else []
            else:
                terms += _read_terms(getattr(p, signal), rate, matchers)
        return _join(terms or [vllm])

    def request_rate(self, window: str, matchers: str = "", canary_matchers: str = "") -> str:
        """Finished requests per second a node, probes and canaries left out; 0 (not absent) for an idle node.

        The exporter's grayguard_traffic_requests_total (its probes left out) where it has one, else the engine's
        own count, less the controller's canaries. The canary counter's `instance` is exported_instance when the
        controller is scraped without honor_labels, so it takes only `canary_matchers` (the pool's)."""
        def rate(sel: str) -> str:
            return f"sum by ({self.by}) (rate({sel}[{window}]))"
        requests = (f"(\n    {rate(_selector('grayguard_traffic_requests_total', matchers))}\n  or\n    "
                    f"{self.rs('requests', window, matchers=matchers)}\n)")
        canaries = (f"sum by (pool, instance) (\n  label_replace(rate("
                    f"{_selector('grayguard_canary_requests_total', canary_matchers)}[{window}]),\n"
                    f'                "instance", "$1", "exported_instance", "(.+)")\n)')
        return (f"clamp_min(\n    (\n{_indent(requests, 8)}\n      - on (pool, instance) group_left ()\n"
                f"{_indent(canaries, 8)}\n    )\n  or\n{_indent(requests, 4)},\n  0\n)")

    def error_ratio(self, window: str, matchers: str = "") -> str:
        """Share of finished requests that ended in an error; no sample where the engine does not count errors or
        no request finished (absent is not zero)."""
        return (f"{self.rs('errors', window, matchers=matchers)}\n/\n"
                f"({self.rs('finished', window, matchers=matchers)} > 0)")

    def per_request(self, window: str) -> str:
        """The normalized latency of the engines that count no tokens (Triton, Profile.per_request): seconds per
        finished request, from the exporter's tokens-less traffic counters (probes left out), else the engine's
        own; only on the nodes that have the engine's request counter. "" when no engine of the config is one."""
        by = self.by
        rate = lambda sel: f"sum by ({by}) (rate({sel}[{window}]))"  # noqa: E731
        out = []
        for p in self._profiles():
            if not p.per_request:
                continue
            seconds = "\n      or\n        ".join([rate("grayguard_traffic_request_seconds_total"),
                                                    *_read_terms(p.request_seconds, rate)])
            requests = "\n          or\n            ".join([rate("grayguard_traffic_requests_total"),
                                                            *_read_terms(p.requests, rate)])
            marker = " or ".join(f"sum by ({by}) ({_selector(s.name, s.matchers())})"
                                 for alt in p.requests for s in alt)
            out.append(f"(\n    (\n        {seconds}\n    )\n    /\n    (\n        (\n            {requests}\n"
                       f"        )\n      > 0\n    )\n  and on ({by})\n    {marker}\n)")
        return "\nor\n".join(out)

    def gs(self, signal: str, matchers: str = "") -> str:
        """`sum by (by) (<gauge>)` of running or waiting, for every engine that has it; `matchers` are added to every
        series' own. The alerts' under_load() reads the running requests through it (no recorded series since issue
        34), as do the dashboards and the runbook."""
        total = lambda sel: f"sum by ({self.by}) ({sel})"  # noqa: E731
        vllm = total(self._v(_VLLM_GAUGES[signal], matchers))
        terms = [vllm] if "vllm" in self.engines else []
        for p in self._profiles():
            terms += _read_terms(getattr(p, signal), total, matchers)
        return _join(terms or [vllm])

    def kv(self) -> str:
        """KV-cache usage 0-1, the fullest label set, for every engine that says it."""
        biggest = lambda sel: f"max by ({self.by}) ({sel})"  # noqa: E731
        vllm = biggest(f'{self._v("kv_cache_usage_perc")} or {self._v("gpu_cache_usage_perc")}')
        terms = [vllm] if "vllm" in self.engines else []
        for p in self._profiles():
            terms += _read_terms(p.kv_usage, biggest)
            if p.kv_ratio is not None:
                part, whole = p.kv_ratio.part, p.kv_ratio.whole
                terms.append(f"(sum by ({self.by}) ({_selector(part.name, part.matchers())}) / "
                             f"(sum by ({self.by}) ({_selector(whole.name, whole.matchers())}) > 0))")
        return _join(terms or [vllm])


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    # << >> and <% %> because the alert descriptions carry Go templates ({{ $labels.pool }}).
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
        variable_start_string="<<", variable_end_string=">>", block_start_string="<%",
        block_end_string="%>", comment_start_string="<#", comment_end_string="#>",
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda s: json.dumps(str(s), ensure_ascii=False)  # a YAML double-quoted scalar
    env.filters["num"] = _num
    return env


def _context(cfg: Config) -> dict:
    ws, es = windows(cfg), EngineSeries.for_config(cfg)
    return {"cfg": cfg, "r": cfg.rules, "windows": ws, "control": ws[0], "human": ws[-1],
            "by": ", ".join(node_labels(cfg)), "omega": _num(cfg.rules.omega), "min_peers": MIN_PEERS,
            "slowdown": "|".join(GPU_SLOWDOWN_REASONS), "links": functools.partial(alert_links, cfg),
            "slowdown_bits": dcgm.slowdown_bits(), "gpu_flags": GPU_FLAG_BITS,
            "v": lambda name, matchers="": vllm_selector(cfg.rules.vllm_prefix, name, matchers),
            "engines": pool_engines(cfg), "rs": es.rs, "gs": es.gs, "kv": es.kv,
            "per_request": es.per_request, "request_rate": es.request_rate, "error_ratio": es.error_ratio}


DCGM_TEMPLATE = "dcgm.rules.yml.j2"  # rules.gpu_source: dcgm (rules/dcgm.py, docs/dcgm.md)


def render_recording(cfg: Config, template: str = "recording.rules.yml.j2") -> str:
    """The recording rules file for cfg; with rules.gpu_source dcgm, dcgm-exporter's group appended."""
    text = _env().get_template(template).render(**_context(cfg))
    return text + render_dcgm(cfg) if cfg.rules.gpu_source == "dcgm" else text


def render_dcgm(cfg: Config) -> str:
    """dcgm-exporter's recording group, the items of a `groups:` list (render_recording appends it)."""
    return _env().get_template(DCGM_TEMPLATE).render(**_context(cfg), **dcgm.context())


def render_alerts(cfg: Config, baselines: Mapping[str, float] | None = None,
                  template: str = "alerts.rules.yml.j2") -> str:
    """The alert rules file for cfg; baselines (pool -> learned P99 TTFT seconds) add regression alerts."""
    learned = clean_baselines(cfg, baselines)
    regressions = [{"pool": p, "baseline": _num(v)} for p, v in sorted(learned.items())]
    return _env().get_template(template).render(
        meta=alert_meta(cfg), regressions=regressions, factor=_num(cfg.rules.regression_factor),
        ttft_p99=ttft_p99_series(cfg), **_context(cfg))


def recording_rule_names(cfg: Config) -> list[str]:
    """Every series the recording rules of cfg record."""
    doc = yaml.safe_load(render_recording(cfg))
    return [r["record"] for g in doc["groups"] for r in g["rules"]]


def render_all(cfg: Config, baselines: Mapping[str, float] | None = None) -> dict[str, str]:
    """Every rule file: file name -> content."""
    return {RECORDING_FILE: render_recording(cfg), ALERTS_FILE: render_alerts(cfg, baselines)}
