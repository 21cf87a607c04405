"""grayguard / GPU health: per node and GPU, what NVML says about clocks, heat, power, PCIe, memory errors, XIDs."""

from __future__ import annotations

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
from grayguard.dashboards.pool import TITLE as POOL_TITLE
from grayguard.dashboards.pool import transitions_expr
from grayguard.dashboards.promql import matchers, node_info, zero_fill
from grayguard.dashboards.promql import series as s
from grayguard.rules.dcgm import CLOCK_EVENT_REASONS, slowdown_bits
from grayguard.rules.render import GPU_DASHBOARD_UID, POOL_DASHBOARD_UID
from grayguard.vocab import GPU_FLAGS

UID = GPU_DASHBOARD_UID
TITLE = "grayguard / GPU health"

G = matchers(pool="~$pool", instance="~$instance", gpu="~$gpu")  # per-GPU exporter series
E = matchers(pool="~$pool", instance="~$instance")  # per-exporter series
L = "{{instance}} GPU {{gpu}}"
BY = "pool, instance, gpu"
# 1 for an exporter without NVML whose node has no GPU from elsewhere, else 0: with rules.gpu_source dcgm the sidecar's
# collector is off (NVML up 0) and the dcgm rules record grayguard_gpu_info for the node's GPUs (docs/dcgm.md)
# rules.gpu_source dcgm: the code of an XID new within the rules' human window, as xid "new (dcgm, value: code)"
DCGM_XID = (f'\nor label_replace(max by ({BY}) (grayguard_gpu_xid_recent{{{G}}}), "xid", "new (dcgm, value: code)", '
            '"", "")')
NVML_DOWN = (f"(1 - grayguard_exporter_nvml_up{{{E}}}) * on (pool, instance) (1 - (group by (pool, instance) "
             f"(grayguard_gpu_info{{{E}}}) or on (pool, instance) (0 * grayguard_exporter_nvml_up{{{E}}})))")
REASONS = f"grayguard_gpu_clock_event_reasons{{{G}}}"  # NVML's clock-event reasons bitmask, one series a GPU
FLAGS = f"grayguard_gpu_flags{{{G}}}"  # the exporter's judgements of a GPU, one bit each (grayguard/vocab.py GPU_FLAGS)
ABSENT = "Absent, not 0, where the GPU or driver does not support the field."

# Back to the Pool overview: from a GPU's series (its instance), from a row of the GPUs table (its node).
NODE_LINK = Link(f"{POOL_TITLE}: this node", POOL_DASHBOARD_UID,
                 (("pool", "${__field.labels.pool}"), ("instance", "${__field.labels.instance}")))
ROW_NODE_LINK = Link(f"{POOL_TITLE}: this node", POOL_DASHBOARD_UID,
                     (("pool", "${__data.fields.pool}"), ("node", "${__value.raw}")))
ROW_GPU_LINK = Link("This node's GPUs", UID, (("pool", "${__data.fields.pool}"), ("instance", "${__value.raw}")))
POOL_LINK = Link(f"{POOL_TITLE}: these pools", POOL_DASHBOARD_UID, raw=("${pool:queryparam}",))


def reason_bit(bit: int) -> str:
    """1 while the reason with NVML's bit `bit` holds a GPU's clocks down, else 0 (decoded from the mask)."""
    return f"floor({REASONS} / {bit}) % 2"


def flag(name: str) -> str:
    """1 while the exporter's judgement `name` (a bit of grayguard_gpu_flags) holds for a GPU, else 0."""
    return f"floor({FLAGS} / {dict(GPU_FLAGS)[name]}) % 2"


# 1 while a reason that explains a slow GPU directly (hardware, thermal, power brake: grayguard/vocab.py) holds its
# clocks down, else 0; sw_power_cap (bit 0x4) is normal at the power limit
SLOWED = "(" + " + ".join(reason_bit(bit) for _, bit in slowdown_bits()) + ") > bool 0"
POWER_CAP = reason_bit(dict(CLOCK_EVENT_REASONS)["sw_power_cap"])


def gpu_ts(*args, **kwargs):
    """A per-GPU time series panel whose series link to their node on the Pool overview."""
    return ts(*args, links=[NODE_LINK], **kwargs)


def gpus_by_node(gpus: str) -> str:
    """The GPU identity series with the node (HAProxy server) each one serves, from grayguard_node_info; a GPU
    whose instance the controller does not track keeps its row."""
    return (f"{gpus}\n* on (pool, instance) group_left (node)\n{node_info(matchers(pool='~$pool'))}\n"
            f"or on (pool, instance, gpu)\n{gpus}")


def _vs_max(name: str, max_name: str, tag: str = "max") -> list[Q]:
    """A per-GPU series and its reference (drawn dashed: legend starts with `tag`)."""
    return [Q(s(name, G), L), Q(s(max_name, G), f"{tag} {L}")]


def build(cfg: DashboardConfig) -> dict:
    """The GPU health dashboard as Grafana JSON."""
    gpus = f"max by ({BY}) (grayguard_gpu_info{{{G}}})"
    d = dashboard(UID, TITLE, "Per node and GPU, NVML's evidence for a slow node: clocks below their maximum and "
                  "why, heat, power against its limit, PCIe links trained below their maximum and replaying, memory "
                  "errors, XIDs. Read it under load: an idle GPU legitimately drops clocks and PCIe generation. "
                  "Rendered by `grayguard dashboards render`.", cfg.refresh, cfg.time_from,
                  siblings=[(POOL_TITLE, POOL_DASHBOARD_UID)])
    d = (d.with_variable(datasource_variable())
         .with_variable(query_variable("pool", "Pool", "label_values(grayguard_gpu_info, pool)",
                                       "grayguard pools (the exporters' pool label).", multi=True))
         .with_variable(query_variable("instance", "Instance",
                                       'label_values(grayguard_gpu_info{pool=~"$pool"}, instance)',
                                       "vLLM addresses: the exporter beside each one.", multi=True))
         .with_variable(query_variable("gpu", "GPU",
                                       'label_values(grayguard_gpu_info{pool=~"$pool", instance=~"$instance"}, gpu)',
                                       "NVML GPU index.", multi=True)))

    d = d.with_row(row("Now"))
    for p in (
        single("GPUs", "GPUs the exporters report.", [Q(f"count(grayguard_gpu_info{{{G}}})", "GPUs")], w=3,
               base="blue"),
        single("NVML down", "Exporters without NVML: their GPU signals are unavailable, not healthy. With "
               "rules.gpu_source dcgm (the sidecar's NVML off): nodes no dcgm-exporter GPU is joined to.",
               [Q(f"sum({NVML_DOWN})", "down")], w=3, steps=[(1, "red")]),
        single("GPUs lost", "NVML reports the GPU lost or needing a reset (fallen off the bus, XID 79).",
               [Q(f"sum({flag('lost')})", "lost")], w=3, steps=[(1, "red")]),
        single("Slowed down", "GPUs held down by a hardware, thermal or power-brake clock-event reason now.",
               [Q(f"sum(max by ({BY}) ({SLOWED}))", "GPUs")], w=3, steps=[(1, "red")]),
        single("PCIe below max", "GPUs whose link trained below its maximum generation or width (judge under "
               "load: an idle GPU may downshift), the exporter's pcie_below_max bit of grayguard_gpu_flags.",
               [Q(f"sum({flag('pcie_below_max')})", "GPUs")], w=3, steps=[(1, "orange")]),
        single("XID events", "XID critical errors the exporters saw since they started.",
               [Q(zero_fill(f"sum(grayguard_gpu_xid_errors_total{{{G}}})", f"count(grayguard_gpu_info{{{G}}})"),
                  "XIDs")], w=3, steps=[(1, "red")]),
        single("Uncorrected ECC", "Volatile uncorrected ECC errors (since the last driver load). " + ABSENT,
               [Q(f'sum(grayguard_gpu_ecc_errors{{{G}, error_type="uncorrected", counter_type="volatile"}})',
                  "errors")], w=3, steps=[(1, "red")]),
        single("Row remap pending / failed", "Rows waiting for a GPU reset, and failed remaps (needs service).",
               [Q(f"sum({flag('row_remap_pending')})", "pending"),
                Q(f"sum({flag('row_remap_failure')})", "failed")], w=3, steps=[(1, "orange")]),
    ):
        d = d.with_panel(p)

    d = d.with_row(row("Clocks"))
    d = d.with_panel(gpu_ts("SM clock / max", "Current SM clock over its maximum. Far below 1 under load is "
                        "throttling: the main mechanism of a thermally or power-limited slow node.",
                        [Q(f"{s('grayguard_gpu_sm_clock_hertz', G)} / {s('grayguard_gpu_sm_clock_max_hertz', G)}", L)],
                        "percentunit", lo=0, hi=1, legend_table=True))
    d = d.with_panel(gpu_ts("Memory clock / max", "Current memory clock over its maximum.",
                        [Q(f"{s('grayguard_gpu_memory_clock_hertz', G)} / "
                           f"{s('grayguard_gpu_memory_clock_max_hertz', G)}", L)],
                        "percentunit", lo=0, hi=1, legend_table=True))
    d = d.with_panel(timeline(
        "Clocks held down", "Per GPU: slowdown = a hardware, thermal or power-brake clock-event reason "
        "(cooling, failed fan, PSU); power cap = sw_power_cap, normal at the power limit.",
        [Q(f"max by ({BY}) (2 * ({SLOWED}) > 0 or {POWER_CAP})", L)],
        [("0", "ok", "green"), ("1", "power cap", "yellow"), ("2", "slowdown", "red")], w=12))
    d = d.with_panel(ts("GPUs per clock-event reason", "How many GPUs each reason holds down (gpu_idle is normal "
                        "when idle, sw_power_cap at the power limit), decoded from NVML's mask "
                        "(grayguard_gpu_clock_event_reasons, one bit a reason: docs/metrics.md).",
                        [Q(f"sum({reason_bit(bit)})", reason) for reason, bit in CLOCK_EVENT_REASONS],
                        "none", lo=0, stacked=True, step_line=True))

    d = d.with_row(row("Heat and power"))
    d = d.with_panel(gpu_ts("Temperature", "GPU core temperature; dashed: HBM (memory) temperature. " + ABSENT,
                        [Q(s("grayguard_gpu_temperature_celsius", G), L),
                         Q(s("grayguard_gpu_memory_temperature_celsius", G), f"HBM {L}")],
                        "celsius", dashed="^HBM ", legend_table=True))
    d = d.with_panel(gpu_ts("Power vs limit", "Power draw; dashed: the enforced limit. A busy GPU drawing far less "
                        "than its peers does less work; a limit lowered on one node caps its clocks.",
                        _vs_max("grayguard_gpu_power_watts", "grayguard_gpu_power_limit_watts", "limit"), "watt",
                        dashed="^limit ", legend_table=True))

    d = d.with_row(row("PCIe"))
    d = d.with_panel(gpu_ts("PCIe link generation", "Current generation (grayguard_gpu_pcie_link_generation). "
                        "The maximum of GPU and slot is the GPUs table's pcie_max_generation (a label of "
                        "grayguard_gpu_info); \"PCIe below max\" counts the links below it. Gen1 on a Gen5 GPU cuts "
                        "host-GPU bandwidth ~16x.",
                        [Q(s("grayguard_gpu_pcie_link_generation", G), L)], "none", w=8, lo=0, step_line=True))
    d = d.with_panel(gpu_ts("PCIe link width", "Current lanes (grayguard_gpu_pcie_link_width); the maximum is the "
                        "GPUs table's pcie_max_width (a label of grayguard_gpu_info).",
                        [Q(s("grayguard_gpu_pcie_link_width", G), L)], "none", w=8, lo=0, step_line=True))
    d = d.with_panel(gpu_ts("PCIe replays", "Link-level retransmissions per second: a marginal link (riser, cable, "
                        "slot) that retries instead of failing.",
                        [Q(f"rate(grayguard_gpu_pcie_replay_total{{{G}}}[$__rate_interval])", L)], "ops", w=8,
                        lo=0))

    d = d.with_row(row("Memory errors, XIDs, lost GPUs"))
    d = d.with_panel(gpu_ts("ECC errors", "ECC error counts (volatile: since the last driver load; aggregate: "
                        "lifetime, only with the exporter's --collector.ecc-aggregate). " + ABSENT,
                        [Q(s("grayguard_gpu_ecc_errors", G), f"{L} {{{{error_type}}}} "
                                     "{{counter_type}}")], "none", w=6, lo=0, step_line=True))
    d = d.with_panel(gpu_ts("Row remapping", "Rows remapped by cause, and remaps pending a reset or failed. " + ABSENT,
                        [Q(s("grayguard_gpu_remapped_rows", G), f"{L} {{{{cause}}}}"),
                         Q(flag("row_remap_pending"), f"{L} pending"),
                         Q(flag("row_remap_failure"), f"{L} failed")], "none", w=6, lo=0,
                        step_line=True))
    d = d.with_panel(gpu_ts("XID events", "XID critical errors seen per GPU and code since the exporter started (a "
                        "step up is an event). 0: none seen on a GPU the exporter reports. With rules.gpu_source "
                        "dcgm the counts stay 0 (dcgm-exporter keeps the last XID's code, no count): a new XID "
                        "shows as its code for one rules.human_window.",
                        [Q(zero_fill(f"max by ({BY}, xid) (grayguard_gpu_xid_errors_total{{{G}}})", gpus, "xid",
                                     on=BY) + DCGM_XID, f"{L} xid {{{{xid}}}}")], "none", w=6, lo=0,
                        step_line=True))
    d = d.with_panel(timeline(
        "GPU lost / NVML down", "LOST: NVML answers GpuIsLost/ResetRequired or the GPU left the bus. NVML down: "
        "the exporter has no NVML, so its GPUs show nothing (unknown, not healthy).",
        [Q(flag("lost"), L), Q(NVML_DOWN, "{{instance}} NVML")],
        [("0", "ok", "green"), ("1", "LOST / DOWN", "red")], w=6))

    d = d.with_row(row("Utilization and memory"))
    d = d.with_panel(gpu_ts("GPU utilization", "Fraction of the sample period a kernel ran. High with low token "
                        "throughput: busy but slow (throttled, or a spinning hang).",
                        [Q(s("grayguard_gpu_utilization_ratio", G), L)], "percentunit", lo=0, hi=1,
                        legend_table=True))
    d = d.with_panel(gpu_ts("Device memory used", "Device memory in use over its size.",
                        [Q(f"{s('grayguard_gpu_memory_used_bytes', G)} / {s('grayguard_gpu_memory_total_bytes', G)}",
                           L)], "percentunit", lo=0, hi=1, legend_table=True))
    d = d.with_panel(table_of(
        "GPUs", "Identity: model, bus id and driver per GPU, and the node (HAProxy server) it serves "
        "(grayguard_node_info; none: the controller does not track its instance). A node on a different driver is "
        "a classic odd one out. Click a node for it on the Pool overview, an instance for its GPUs alone.",
        [Q(gpus_by_node(s("grayguard_gpu_info", G)), instant=True)], h=8, hide=("Time", "Value", "__name__", "job"),
        order=("pool", "node", "instance", "gpu"), cell_links={"node": [ROW_NODE_LINK], "instance": [ROW_GPU_LINK]},
        panel_links=[POOL_LINK]))

    return finish(d, [
        PromAnnotation("Controller transitions", transitions_expr('pool=~"$pool"'), "orange",
                       "{{node}}: {{from_state}} → {{to_state}}", "pool,node,from_state,to_state"),
        PromAnnotation("GPU alerts", 'ALERTS{alertstate="firing", alertname=~"GrayguardGpu.+|GrayguardNvmlDown"}',
                       "red", "{{alertname}}", "severity,pool,instance,gpu"),
    ])
