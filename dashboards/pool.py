"""grayguard / Pool overview: what is slow, since when and right now, what the controller did about it, and what
users see."""

from __future__ import annotations

from grayguard.config import DEGRADE_AT
from grayguard.dashboards import live, membership
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.panels import (
    Link,
    PromAnnotation,
    Q,
    dashboard,
    datasource_variable,
    finish,
    query_variable,
    row,
    single,
    table_of,
    timeline,
    ts,
)
from grayguard.dashboards.promql import matchers, named, node_info, quantile, vllm, zero_fill
from grayguard.dashboards.promql import series as s
from grayguard.engines import profile
from grayguard.rules.render import GPU_DASHBOARD_UID, POOL_DASHBOARD_UID, EngineSeries
from grayguard.vocab import State

UID = POOL_DASHBOARD_UID
TITLE = "grayguard / Pool overview"
GPU_TITLE = "grayguard / GPU health"

# grayguard_node_state as one number per node, (code, state, color): the state timeline shows one row per node.
STATE_CODES = (("0", State.HEALTHY, "green"), ("1", State.SLOW_START, "blue"), ("2", State.DEGRADED, "orange"),
               ("3", State.CANARY, "purple"), ("4", State.QUARANTINED, "red"))

# =~ everywhere: $pool, $node and $instance take one value, several or All
P = matchers(pool="~$pool")  # pool-level series (controller, recording rules)
C = matchers(pool="~$pool", node="~$node")  # the controller's per-node series (node = HAProxy server)
V = matchers(pool="~$pool", instance="~$instance")  # vLLM and exporter series (instance = vLLM address)

# Links from a series (its labels) and from a table cell (its row) to a node here and to its GPUs.
NODE_LINK = Link("This node", UID, (("pool", "${__field.labels.pool}"), ("node", "${__field.labels.node}")))
GPU_LINK = Link(f"{GPU_TITLE}: this node", GPU_DASHBOARD_UID,
                (("pool", "${__field.labels.pool}"), ("instance", "${__field.labels.instance}")))
ROW_NODE_LINK = Link("This node", UID, (("pool", "${__data.fields.pool}"), ("node", "${__value.raw}")))
ROW_GPU_LINK = Link(f"{GPU_TITLE}: this node", GPU_DASHBOARD_UID,
                    (("pool", "${__data.fields.pool}"), ("instance", "${__value.raw}")))
POOL_GPU_LINK = Link(f"{GPU_TITLE}: these pools", GPU_DASHBOARD_UID, raw=("${pool:queryparam}",))

CLIENT_SIDE = ("No client-side series reach Prometheus (the load generator keeps its own records and HAProxy "
               "is not scraped), so the client's view here is the exporters' 1-token probe: a real streaming "
               "request from beside each node, timed to its first token, which also sees requests vLLM never "
               "finishes. vLLM's own histograms (engine-side, finished requests only) are the other lines.")


def out_of_rotation(m: str) -> str:
    """One row per node not healthy, or healthy with a weight cut (KV cache full): pool, node, state, reason and
    the instance of its vLLM series (grayguard_node_info); a node without info keeps its row."""
    reason = f"grayguard_node_reason_info{{{m}"
    rows = (f'max by (pool, node, state, reason) (\n  {reason}, state!="{State.HEALTHY}"}}\n'
            f'  or\n  {reason}, reason!="none"}}\n)')
    return f"{rows}\n* on (pool, node) group_left (instance)\n{node_info(m)}\nor on (pool, node)\n{rows}"


def per_node(expr: str) -> str:
    """An instance-keyed per-node expression labelled with the node's name, kept to $node (promql.named)."""
    return named(expr, C, P)


def to_pool_median(suffix: str) -> str:
    """Each node's normalized latency over its pool's median node (1 = typical), from the recorded control-window
    series, for the pools shown (no sample where the median is absent or 0)."""
    return (f"{s(f'instance:vllm_normalized_latency_seconds_per_token:{suffix}', V)}\n/ on (pool) group_left ()\n"
            f"({s(f'pool:vllm_normalized_latency_seconds_per_token:median_{suffix}', P)} > 0)")


def probe_failure_ratio(window: str) -> str:
    """Share of each node's probes that failed over window (slow answers are answers; `starting` is not counted):
    0 where every probe answered, no sample where none ran."""
    def rate(result: str) -> str:
        return f"sum by (pool, instance) (rate(grayguard_probe_results_total{{{result}, {V}}}[{window}]))"
    failed, answered = rate('result!~"ok|slow|starting"'), rate('result!="starting"')
    return f"(\n  {failed}\n  or\n  0 * {answered}\n)\n/\n({answered} > 0)"


def state_code(m: str) -> str:
    """grayguard_node_state folded into one value per node (STATE_CODES)."""
    terms = " or ".join(f'grayguard_node_state{{{m}, state="{name}"}} * {code}' for code, name, _ in STATE_CODES)
    return f"sum by (pool, node) ({terms})"


def transitions_expr(m: str) -> str:
    """Transitions in the last minute, per node and from/to state.

    A transition counter's series appears at 1 with its first transition, which changes() cannot see: a
    series absent a minute ago counts as well.
    """
    t = s("grayguard_node_transitions_total", m)
    return (f"sum by (pool, node, from_state, to_state) (\n  changes({t}[1m]) > 0\n"
            f"  or\n  ({t} unless {t} offset 1m)\n)")


def running_selector(cfg: DashboardConfig, m: str) -> str:
    """A selector of the engines' running-requests gauge (vLLM's num_requests_running, or each pool engine's), which
    every node has: the $instance variable lists its instances."""
    v = {"vllm:": "vllm:", "vllm_": "vllm_", "any": "vllm[:_]"}[cfg.vllm_prefix] + "num_requests_running"
    names = ([v] if "vllm" in cfg.engines else []) + [
        sr.name for e in cfg.engines if e != "vllm" for alt in profile(e).running for sr in alt]
    if names == ["vllm:num_requests_running"] or names == ["vllm_num_requests_running"]:
        return f"{names[0]}{{{m}}}"
    return f'{{__name__=~"{"|".join(names)}", {m}}}'


def build(cfg: DashboardConfig) -> dict:
    """The Pool overview dashboard as Grafana JSON."""
    ctl, hum, px = cfg.control, cfg.human, cfg.vllm_prefix
    # per node over the human window, computed here for the pools shown (the rules record no such per-node series)
    engine = EngineSeries(px, cfg.engines, "pool, instance")
    J = matchers(job=cfg.controller_job)
    ticking = f"sum(rate(grayguard_ticks_total{{{J}}}[$__rate_interval]))"
    d = dashboard(UID, TITLE, "Per pool: which nodes are out of rotation now and why, which node is slow against "
                  "its peers, since when (30 s window) and right now (live signals, 1 s), what the controller did "
                  "about it (state, weight, drains under the cap), what users see, and whether the controller itself "
                  "is healthy. Rendered by `grayguard dashboards render`.", cfg.refresh, cfg.time_from,
                  siblings=[(GPU_TITLE, GPU_DASHBOARD_UID)])
    d = (d.with_variable(datasource_variable())
         .with_variable(query_variable("pool", "Pool", "label_values(grayguard_pool_nodes, pool)",
                                       "grayguard pools (one HAProxy backend each).", multi=True))
         .with_variable(query_variable("node", "Node", f'label_values(grayguard_node_state{{{P}}}, node)',
                                       "HAProxy server names, as the controller and the alerts name nodes. The vLLM, "
                                       "probe and live panels follow it too, through grayguard_node_info.",
                                       multi=True))
         .with_variable(query_variable("instance", "Instance",
                                       f"label_values({running_selector(cfg, P)}, instance)",
                                       "vLLM addresses, as vLLM and exporter series label them: narrows the vLLM, "
                                       "probe and live panels further (the GPU dashboard's links set it).",
                                       multi=True)))

    d = d.with_row(row("Pool now"))
    d = d.with_panel(table_of(
        "Nodes out of rotation now", "Every node of the pools shown that is not healthy, whatever $node selects: "
        "drained (quarantined, canary: weight 0), cut (degraded), coming back (slow_start), or healthy with no new "
        "traffic (reason kv_cache: its KV cache is full). reason: the signals in force (latency, probe, errors, "
        "live, kv_cache), the drain's cause, or recovery (grayguard_node_reason_info; the full text is in the "
        "controller's /status). instance: the node's vLLM address (grayguard_node_info). Click a node to see it "
        "on every panel, an instance for its GPUs. Empty: every node is healthy.",
        [Q(out_of_rotation(P), instant=True)], w=24, h=6, hide=("Time", "Value"),
        order=("pool", "node", "state", "reason", "instance"),
        cell_links={"node": [ROW_NODE_LINK], "instance": [ROW_GPU_LINK]}, panel_links=[POOL_GPU_LINK]))
    for p in (
        single("Nodes", "Servers in the pools' HAProxy backends.", [Q(f"sum({s('grayguard_pool_nodes', P)})",
                                                                    "nodes")]),
        single("Not healthy", "Nodes in any state but healthy (degraded, quarantined, canary, slow start).",
               [Q(f'sum(grayguard_node_state{{{P}, state!="{State.HEALTHY}"}})', "not healthy")],
               steps=[(1, "orange")]),
        single("Drained / cap", "Nodes drained (quarantined or canary) and the most the safeguard allows (summed "
               "over the pools shown).",
               [Q(f"sum({s('grayguard_pool_ejected_nodes', P)})", "drained"),
                Q(f"sum({s('grayguard_pool_max_ejected_nodes', P)})", "cap")], base="blue"),
        single("Safeguard", "ENGAGED: in one of the pools shown, an outlier stays degraded only because the ejection "
               "cap binds; several nodes are slow at once, which is systemic (load, a bad deploy), not one sick node.",
               [Q(f"max({s('grayguard_pool_safeguard_engaged', P)})", "safeguard")], steps=[(1, "red")],
               mapping=[("0", "off", "green"), ("1", "ENGAGED", "red")]),
        single("Last successful tick", "Seconds since the controller last observed fresh data and reconciled.",
               [Q(f"time() - max(grayguard_last_successful_tick_timestamp_seconds{{{J}}})", "age")], "s",
               steps=[(cfg.controller_stale_s, "red")]),
        single("Data", "HOLDING: the controller holds every weight because Prometheus data is missing or stale.",
               [Q(f"max(grayguard_data_stale{{{J}}})", "stale")], steps=[(1, "red")],
               mapping=[("0", "fresh", "green"), ("1", "HOLDING", "red")]),
    ):
        d = d.with_panel(p)

    d = d.with_row(row("What is slow, since when"))
    d = d.with_panel(ts(
        "Normalized latency per node vs pool median",
        f"Seconds per token, Σ e2e latency / (ω·prompt + generated tokens), over {cfg.control_window} "
        "(the controller's input); seconds per request on a Triton pool, whose engine counts no tokens "
        "(docs/engines.md). Dashed: the pool's median node.",
        [Q(per_node(s(f"instance:vllm_normalized_latency_seconds_per_token:{ctl}", V)), "{{node}}"),
         Q(s(f"pool:vllm_normalized_latency_seconds_per_token:median_{ctl}", P), "{{pool}} median")],
        "s", dashed=" median$", legend_table=True, links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Slowdown vs pool median",
        f"How many times slower than the pool's median node (1 = typical), over {cfg.control_window}. Yellow: "
        f"live_drift ({cfg.live_drift:g}x), below which a node gathers no evidence; orange: live_cut_ratio "
        f"({cfg.live_cut_ratio:g}x), where one new sample cuts in a pool as quiet as min_spread (a few samples "
        "above the yellow line cut too: the sequential test adds them up).",
        [Q(per_node(to_pool_median(ctl)), "{{node}}")],
        "suffix:x", steps=[(cfg.live_drift, "yellow"), (cfg.live_cut_ratio, "orange")], legend_table=True,
        links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Peer score",
        "Each node's log latency over its peers' median, in noise widths (grayguard_node_score: the pool's learned "
        "noise, widened by the node's own window's sampling noise). A cut node's weight falls as 2^-(score-2) from "
        f"{DEGRADE_AT:g}; the evidence that drains is the score above the allowance, {cfg.quarantine_score:g} "
        "over at least one window, with the probes agreeing. A gap: the node is not scored (no data, too few peers).",
        [Q(s("grayguard_node_score", C), "{{node}}")], "none",
        steps=[(DEGRADE_AT, "orange"), (cfg.quarantine_score, "red")], legend_table=True, links=[NODE_LINK]))
    d = d.with_panel(ts(
        "Slowdown vs peers (controller)",
        "The controller's last window sample of each node over the median of its peers (the node excluded): the "
        f"ratio its sequential test judges (yellow: live_drift {cfg.live_drift:g}x; orange: live_cut_ratio "
        f"{cfg.live_cut_ratio:g}x).",
        [Q(f"{s('grayguard_node_latency_ema_seconds_per_token', C)}\n/\n"
           f"{s('grayguard_node_peer_median_seconds_per_token', C)}", "{{node}}")],
        "suffix:x", steps=[(cfg.live_drift, "yellow"), (cfg.live_cut_ratio, "orange")], legend_table=True,
        links=[NODE_LINK]))
    d = d.with_panel(timeline(
        "Node state", "The controller's state per node (grayguard_node_state); the transitions are also "
        "annotations on every panel.", [Q(state_code(C), "{{node}}")], STATE_CODES, links=[NODE_LINK]))
    d = d.with_panel(ts(
        "HAProxy weight per node", "The weight the controller wants for each server (0 = drained). Dashed: the "
        "servers' configured base weight.",
        [Q(s("grayguard_node_weight", C), "{{node}}"), Q(f"max(grayguard_node_base_weight{{{C}}})", "base weight")],
        "none", lo=0, dashed="^base weight$", step_line=True, links=[NODE_LINK]))
    d = d.with_panel(ts(
        "Weight factor per signal", "What each signal does to a node's weight (1 = nothing): latency (the peer "
        "score), probe, errors, live (the live ITL), kv_cache. The weight is the base weight times their product "
        "(at least 1 while one cuts it, so that the node stays measured), or 0 when drained.",
        [Q(s("grayguard_node_weight_factor", C), "{{node}} {{signal}}")], "percentunit", lo=0, hi=1,
        step_line=True, links=[NODE_LINK]))
    d = d.with_panel(ts(
        "Detectors in shadow mode: what they ask for", "A detector set to detectors.<name>.enforce: false runs "
        "and changes nothing: the weight factor it asks for a node (absent: none) and, at 0, a quarantine it asks "
        "for. Judge it here against what happened before you enforce it (docs/operations.md).",
        [Q(s("grayguard_node_shadow_weight_factor", C), "{{node}} {{detector}} cut"),
         Q(f"0 * {s('grayguard_node_shadow_quarantine', C)}", "{{node}} {{detector}} quarantine")],
        "percentunit", lo=0, hi=1, step_line=True))
    ej = s("grayguard_pool_ejected_nodes", P)
    d = d.with_panel(ts(
        "Drained share of the pool vs cap", "Nodes drained over nodes in the pool, against the safeguard's cap "
        "(dashed): at the cap, further hot nodes stay degraded and the safeguard engages.",
        [Q(f"{ej} / ({s('grayguard_pool_nodes', P)} > 0)", "{{pool}} drained"),
         Q(f"{s('grayguard_pool_max_ejected_nodes', P)} / ({s('grayguard_pool_nodes', P)} > 0)", "{{pool}} cap")],
        "percentunit", lo=0, hi=1, dashed=" cap$", step_line=True))

    d = d.with_row(row(live.TITLE))
    for p in live.panels(cfg, [NODE_LINK, GPU_LINK]):
        d = d.with_panel(p)

    d = d.with_row(row("What users see"))
    ttft, itl = vllm(px, "time_to_first_token_seconds_bucket", V), vllm(px, "inter_token_latency_seconds_bucket", V)
    probe = s("grayguard_probe_ttft_seconds_bucket", V)
    d = d.with_panel(ts(
        "TTFT P50 / P99 (pool)", "Time to first token, per pool. " + CLIENT_SIDE,
        [Q(quantile(0.5, ttft, "pool"), "{{pool}} vLLM P50"), Q(quantile(0.99, ttft, "pool"), "{{pool}} vLLM P99"),
         Q(quantile(0.5, probe, "pool"), "{{pool}} probe P50"), Q(quantile(0.99, probe, "pool"), "{{pool}} probe P99")],
        "s", dashed=" probe P"))
    d = d.with_panel(ts(
        "Inter-token latency P50 / P99 (pool)", "Time between tokens of a stream, per engine step, per pool "
        "(vLLM's inter_token_latency_seconds; the 1-token probe has no second token). " + CLIENT_SIDE,
        [Q(quantile(0.5, itl, "pool"), "{{pool}} vLLM P50"), Q(quantile(0.99, itl, "pool"), "{{pool}} vLLM P99")],
        "s"))
    d = d.with_panel(ts(
        "TTFT P99 per node (vLLM)", "vLLM's time to first token per node: a slow node's queue shows here first.",
        [Q(per_node(quantile(0.99, ttft, "pool, instance")), "{{node}}")], "s", legend_table=True,
        links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Inter-token latency P99 per node (vLLM)", "vLLM's inter-token latency per node: decode slowness "
        "(throttled clocks, memory-bound work).",
        [Q(per_node(quantile(0.99, itl, "pool, instance")), "{{node}}")], "s", legend_table=True,
        links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Request rate", f"Finished requests per second per node over {cfg.human_window}; dashed: the pool.",
        [Q(per_node(engine.request_rate(cfg.human_window, V, P)), "{{node}}"),
         Q(s(f"pool:vllm_request_rate:{hum}", P), "pool {{pool}}")], "reqps", dashed="^pool ", legend_table=True,
        links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Error ratio", f"Share of finished requests that ended in an error, per node over {cfg.human_window}. "
        "No sample: no finished requests in the window.",
        [Q(per_node(engine.error_ratio(cfg.human_window, V)), "{{node}}")], "percentunit", lo=0,
        legend_table=True, links=[NODE_LINK, GPU_LINK]))

    d = d.with_row(row("Probe (a 1-token request from each node's exporter)"))
    d = d.with_panel(ts(
        "Probe TTFT P50 / P99 per node", "Time to first token of ok and slow probes (failed probes are counted in "
        "the results). " + CLIENT_SIDE,
        [Q(per_node(quantile(0.99, probe, "pool, instance")), "{{node}} P99"),
         Q(per_node(quantile(0.5, probe, "pool, instance")), "{{node}} P50")], "s", w=6, dashed=" P50$",
        links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Probe results", "Probes per second by result: ok, slow (a good answer over the threshold), and the "
        "failures timeout, connect_error, http_error, cuda_error, bad_response.",
        [Q(f"sum by (result) (rate(grayguard_probe_results_total{{{V}}}[$__rate_interval]))", "{{result}}")],
        "reqps", w=6, stacked=True, bars=True))
    d = d.with_panel(ts(
        "Probe failure ratio", f"Share of probes that failed per node over {cfg.human_window} (slow answers are "
        "answers).", [Q(per_node(probe_failure_ratio(cfg.human_window)), "{{node}}")],
        "percentunit", w=6, lo=0, links=[NODE_LINK, GPU_LINK]))
    d = d.with_panel(ts(
        "Consecutive probe failures", f"Failures in a row per node; dashed: {cfg.probe_failures}, where "
        "GrayguardProbeFailing pages.",
        [Q(per_node(f"max by (pool, instance) ({s('grayguard_probe_consecutive_failures', V)})"), "{{node}}")],
        "none", w=6, lo=0, steps=[(cfg.probe_failures, "red")], step_line=True, links=[NODE_LINK, GPU_LINK]))

    d = d.with_row(row("Controller health"))
    tick = f"grayguard_tick_duration_seconds_bucket{{{J}}}"
    d = d.with_panel(ts(
        "Tick duration P50 / P99", f"Duration of a control tick; dashed: the tick interval ({cfg.tick_interval_s:g} "
        "s), beyond which the next tick is skipped.",
        [Q(quantile(0.5, tick), "P50"), Q(quantile(0.99, tick), "P99")], "s", w=6,
        steps=[(cfg.tick_interval_s, "red")]))
    d = d.with_panel(ts(
        "Ticks by result", "ok: reconciled; held: weights held for lack of fresh data; error: the tick failed; "
        "skipped: the previous tick was still running.",
        [Q(f"sum by (result) (rate(grayguard_ticks_total{{{J}}}[$__rate_interval]))", "{{result}}")], "ops", w=6,
        stacked=True))
    d = d.with_panel(ts(
        "Seconds since last successful tick", f"Dashed: {cfg.controller_stale_s:g} s, where "
        "GrayguardControllerStale pages.",
        [Q(f"time() - grayguard_last_successful_tick_timestamp_seconds{{{J}}}", "age")], "s", w=6, lo=0,
        steps=[(cfg.controller_stale_s, "red")]))
    d = d.with_panel(ts(
        "Controller errors", "Failed Prometheus queries by kind and failed HAProxy runtime API calls by endpoint "
        "and kind, per second. 0 while the controller ticks without errors; no data: the controller is not scraped.",
        [Q(zero_fill(f"sum by (kind) (rate(grayguard_prometheus_errors_total{{{J}}}[$__rate_interval]))", ticking,
                     "kind"), "prometheus {{kind}}"),
         Q(zero_fill(f"sum by (endpoint, kind) (rate(grayguard_haproxy_errors_total{{{J}}}[$__rate_interval]))",
                     ticking, "kind"), "haproxy {{endpoint}} {{kind}}")], "ops", w=6, lo=0))
    d = d.with_panel(ts(
        "HAProxy writes", "Runtime API set commands per second (a converged system sends none).",
        [Q(zero_fill(f"sum by (endpoint, kind) (rate(grayguard_haproxy_writes_total{{{J}}}[$__rate_interval]))",
                     ticking, "kind"), "{{endpoint}} {{kind}}")], "ops", lo=0))
    d = d.with_panel(ts(
        "Canaries", "Canary requests to drained nodes per second, by node and result. 0: no node is being "
        "probed back.",
        [Q(zero_fill(f"sum by (node, result) (rate(grayguard_canaries_total{{{P}}}[$__rate_interval]))",
                     ticking, "result"), "{{node}} {{result}}")], "ops", lo=0))

    d = d.with_row(row(membership.TITLE))
    for p in membership.panels(cfg):
        d = d.with_panel(p)

    return finish(d, [
        PromAnnotation("Controller transitions", transitions_expr(P), "orange",
                       "{{node}}: {{from_state}} → {{to_state}}", "pool,node,from_state,to_state"),
        PromAnnotation("grayguard alerts", 'ALERTS{alertstate="firing", alertname=~"Grayguard.+"}', "red",
                       "{{alertname}}", "severity,pool,node,instance"),
    ])
