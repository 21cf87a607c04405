"""The Pool overview's "Live signals (1 s)" row: each node's live fast path (grayguard_live_*), the present.

The exporter beside each node exports vLLM's inter-token latency, TTFT and throughput over the last few seconds
(exporters/fastpath.py, docs/exporters.md "Live fast path"); the controller cuts and quarantines on the live ITL
against the peers' median within seconds, long before the 30 s window of "What is slow, since when" moves.
"""

from __future__ import annotations

from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.panels import Link, Q, ts
from grayguard.dashboards.promql import matchers, named, vllm
from grayguard.rules.render import EngineSeries

TITLE = "Live signals (1 s)"

P = matchers(pool="~$pool")  # the whole pool: its median is over every node, whatever $instance selects
V = matchers(pool="~$pool", instance="~$instance")  # exporter series are labelled instance = the vLLM address
C = matchers(pool="~$pool", node="~$node")  # the nodes $node selects, by their grayguard_node_info

ITL, TTFT = "grayguard_live_itl_seconds", "grayguard_live_ttft_seconds"
PROBE_MEDIAN = "grayguard_probe_ttft_median_seconds"
BATCH = "grayguard_live_decode_batch"
PROMPT = "grayguard_live_prompt_tokens_per_second"
# the engine's own series (the exporter's live running, waiting and generated-token gauges are on its full page only,
# not stored by the example scrape config: issue 34)
RUNNING, WAITING = "running", "waiting"  # EngineSeries.gs signals: vllm:num_requests_running, _waiting, ...
GENERATED = "generation_tokens_total"  # vLLM's counter, as a rate
KV = "grayguard_live_kv_cache_usage_ratio"

ABSENT = ("A gap is no data, not zero: no token produced over the window, the window still filling, or a stuck "
          "prober (docs/exporters.md, \"Live fast path\").")


def per_node(name: str, m: str = V) -> str:
    """One series per node: the fast (/metrics/fast) and full (/metrics) scrapes carry the same value, by job."""
    return f"max by (pool, instance) ({name}{{{m}}})"


def nodes(expr: str) -> str:
    """Per-node series named by the node (HAProxy server) and kept to $node, joined on grayguard_node_info."""
    return named(expr, C, P)


def engine_gauge(cfg: DashboardConfig, signal: str) -> str:
    """The engines' running or waiting requests per node (rules/render.py EngineSeries.gs: vLLM's
    num_requests_running/_waiting, or the pools' engines' own), summed over vLLM's model_name/engine labels."""
    return EngineSeries(cfg.vllm_prefix, cfg.engines, "pool, instance").gs(signal, V)


def generated(cfg: DashboardConfig) -> str:
    """vLLM's generated tokens per second per node."""
    return f"sum by (pool, instance) (rate({vllm(cfg.vllm_prefix, GENERATED, V)}[$__rate_interval]))"


def pool_median(name: str) -> str:
    """The median node of the pool (the nodes with a value now)."""
    return f"quantile by (pool) (0.5, {per_node(name, P)})"


def at_equal_batch(m: str, slope: float) -> str:
    """Each node's live ITL as the controller compares it: at a batch of one, ITL / (1 + slope x (batch - 1))."""
    if slope <= 0:  # thresholds.live_batch_slope 0: raw ITLs
        return per_node(ITL, m)
    return f"{per_node(ITL, m)}\n/ (1 + {float(slope)!r} * clamp_min({per_node(BATCH, m)} - 1, 0))"


def equal_batch(slope: float) -> str:
    """How the ratio panel compares ITLs, for its description."""
    if slope <= 0:
        return ", raw ITLs (live_batch_slope 0)"
    return (f", both at equal decode batch, ITL / (1 + live_batch_slope × (grayguard_live_decode_batch − 1)) with "
            f"live_batch_slope {slope:g}, the controller's prior for the batch slope: a node decoding more sequences "
            "at once is not taken for a slow one. The controller's own comparison (the load model, "
            "docs/architecture.md) also takes out the prompt tokens in its steps and fits the slopes on the pool, so "
            "a node prefilling long prompts sits higher here than it is judged")


def itl_to_pool_median(slope: float) -> str:
    """Each node's live ITL at equal batch over the pool's median node's."""
    return (f"{at_equal_batch(V, slope)}\n/ on (pool) group_left ()\n"
            f"quantile by (pool) (0.5, {at_equal_batch(P, slope)})")


def panels(cfg: DashboardConfig, links: list[Link] | None = None) -> list:
    """The row's panels, in layout order (12 + 12, 8 + 8 + 8, 12 + 12 columns); links: data links on every
    series (to the node, to its GPUs)."""
    lk = list(links or [])
    return [
        ts("Live inter-token latency per node",
           "Mean gap between two tokens of a stream over the last live window (about 5 s), per node "
           "(grayguard_live_itl_seconds: Δ sum / Δ count of vLLM's inter-token latency histogram, read by the "
           "exporter every second). A throttled or degraded GPU shows here within seconds, while the 30 s "
           "normalized latency above still averages the past. Dashed: the pool's median node. " + ABSENT,
           [Q(nodes(per_node(ITL)), "{{node}}"), Q(pool_median(ITL), "{{pool}} median")], "s", dashed=" median$",
           legend_table=True, links=lk),
        ts("Live ITL vs pool median",
           "Each node's live inter-token latency (grayguard_live_itl_seconds) over the pool's median node's (1 = "
           f"typical){equal_batch(cfg.live_batch_slope)}: the signal the controller acts on within seconds. Dashed: "
           f"live_cut_ratio ({cfg.live_cut_ratio:g}x), where one tick cuts the node's weight in a quiet pool, and "
           f"live_drift ({cfg.live_drift:g}x), below which a node gathers no evidence. The controller weighs the "
           "evidence of the last ticks in the pool's noise (the ticks of one live window count once): a smaller gap "
           "held longer is cut too, and evidence of quarantine_score "
           f"({cfg.quarantine_score:g}) noise widths over at least one window drains the node when the probes agree. "
           "The controller divides by the median of the node's peers (the node "
           "left out, within its peer group), so in a small pool its ratio reads a little higher than this "
           "one. " + ABSENT,
           [Q(nodes(itl_to_pool_median(cfg.live_batch_slope)), "{{node}}")], "suffix:x",
           steps=[(cfg.live_drift, "yellow"), (cfg.live_cut_ratio, "orange")], legend_table=True, links=lk),
        ts("Live TTFT per node",
           "Mean time to first token of the requests that got their first token over the live window "
           "(grayguard_live_ttft_seconds), queueing included: a node whose queue grows shows it here first. "
           "Dashed: the pool's median node. A gap: no request got a first token in the window.",
           [Q(nodes(per_node(TTFT)), "{{node}}"), Q(pool_median(TTFT), "{{pool}} median")], "s", w=8,
           dashed=" median$", links=lk),
        ts("Probe TTFT median per node",
           "Median time to first token of the exporter's last 5 answered 1-token probes (ok or slow) of the last "
           "two live windows (grayguard_probe_ttft_median_seconds): the client's view from beside the node. A "
           f"live-ITL quarantine needs it at least live_probe_confirm ({cfg.live_probe_confirm:g}x) times the "
           "peers' median; without that agreement the live signal only cuts. Dashed: the pool's median node. "
           "A gap: fewer than 3 answers (a node that stops answering loses it).",
           [Q(nodes(per_node(PROBE_MEDIAN)), "{{node}}"), Q(pool_median(PROBE_MEDIAN), "{{pool}} median")], "s", w=8,
           dashed=" median$", links=lk),
        ts("Running / waiting requests per node",
           "vLLM's running batch (solid) and its waiting queue (dashed) at its last scrape (vLLM's own "
           f"{vllm(cfg.vllm_prefix, 'num_requests_running')} and {vllm(cfg.vllm_prefix, 'num_requests_waiting')}, "
           "or the pool's engine's). Waiting above 0: the node is full, its TTFT grows with the queue; a slow node "
           "also holds its requests longer, so it runs more of them at once.",
           [Q(nodes(engine_gauge(cfg, RUNNING)), "{{node}} running"),
            Q(nodes(engine_gauge(cfg, WAITING)), "{{node}} waiting")], "short",
           w=8, lo=0, dashed=" waiting$", links=lk),
        ts("Decode batch per node",
           "Mean number of sequences decoding over the live window (grayguard_live_decode_batch: Δ ITL sum / Δt, "
           "every decoding sequence adds one second of inter-token gaps per second). The batch the live ITL was "
           "measured at: a larger batch makes every step, and so the ITL, slower. A node slower than its peers "
           "at the same batch is sick; one slower with a much larger batch is loaded (it was sent more), "
           "which is why the ratio above compares ITLs at equal batch. "
           "Absent with the live ITL.",
           [Q(nodes(per_node(BATCH)), "{{node}}")], "suffix: seq", lo=0, legend_table=True, links=lk),
        ts("Live tokens per second per node",
           "Tokens generated (solid: vLLM's "
           f"{vllm(cfg.vllm_prefix, GENERATED)} as a rate over Grafana's interval) and prompt tokens prefilled "
           "(dashed: over the live window, grayguard_live_prompt_tokens_per_second) per second. Generated 0 "
           "with requests running: no decode progress (a hang, or only prefills). Prompt tokens share the decode "
           "steps and make them longer: the controller compares each node's live latencies with what its peers "
           "predict at its own decode batch and prompt tokens per step (the load model, docs/architecture.md), "
           "so a node prefilling a tenant's long prompts is loaded, not slow.",
           [Q(nodes(generated(cfg)), "{{node}} generated"), Q(nodes(per_node(PROMPT)), "{{node}} prompt")],
           "suffix: tok/s", lo=0, dashed=" prompt$", legend_table=True, links=lk),
        ts("KV-cache usage per node",
           "vLLM's KV-cache usage at the exporter's newest reading (grayguard_live_kv_cache_usage_ratio, 0-1). At "
           f"kv_saturated ({cfg.kv_saturated:.0%}, red) the node gets no new traffic until it drains (load). A node "
           f"at least kv_outlier_min ({cfg.kv_outlier_min:.0%}, orange) full and kv_outlier_ratio "
           f"({cfg.kv_outlier_ratio:g}x) times its peers' median for 5 ticks in a row (one observation of the "
           "live window) is quarantined: it fills its cache with a fraction of its peers' traffic (less room: GPU "
           "memory taken, a KV budget that shrank), and its requests wait for a slot. Dashed: the pool's median node.",
           [Q(nodes(per_node(KV)), "{{node}}"), Q(pool_median(KV), "{{pool}} median")], "percentunit", lo=0,
           dashed=" median$", steps=[(cfg.kv_outlier_min, "orange"), (cfg.kv_saturated, "red")],
           legend_table=True, links=lk),
    ]
