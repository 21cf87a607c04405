"""A stand-in scrape target for `bench.promcost`: many simulated nodes' vLLM and exporter series on a few ports.

Each port serves one shard of the nodes on three pages, one per job of rules/prometheus.example.yml:
`/metrics` (vLLM), `/exporter/metrics` (the exporter's full page) and `/metrics/fast` (its live fast path).
Every series carries its node's own `pool` and `instance` (the vLLM server's host:port), the labels a real
target gets from its scrape config; Prometheus scrapes these pages with honor_labels, so the stored series
are the production ones, only fewer scrape targets carry them. Only what grayguard reads is served: the vLLM
series of the recording rules (histograms as _sum/_count, with buckets only for the TTFT quantiles), the
exporter's probe, GPU and live gauges that the controller's queries and the alerts read. A node in every
tenth pool is slow (SLOW x latency, its GPU throttled) and every value moves: counters grow with the
requests, latencies and live gauges are noisy.

Two designs of the exporter's pages (DESIGNS): "shipped", and "before", the pages as they were when issue 34
began (the probe's last result one-hot, no GPU flags derived beside the node; bench/before34/README.md). Shipped:
the probe results ok and slow (a failure's series appears at its first count: none at steady state), the GPU's
judgements as one mask (grayguard_gpu_flags), the PCIe maxima as labels of grayguard_gpu_info, the volatile ECC
counts only (the lifetime ones are opt-in), and a fast page of the 9 series the controller reads every second.

Run as `python -m grayguard.bench.promtarget --nodes N --ready-file F [--design before]`: it writes {"ports": [...]}
to F once
it serves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grayguard.httpserve import HttpServer, Request, Response
from grayguard.sim.metrics import FINISHED_REASONS, TTFT_BUCKETS
from grayguard.vocab import GPU_FLAGS, PROBE_ANSWERED, PROBE_RESULTS

POOL_SIZE = 20  # nodes per pool
SLOW_EVERY, SLOW = 10, 4.0  # node 0 of every tenth pool is 4x slower
SHARD_SIZE = 1000  # nodes per port: each port is one scrape target per job
DESIGNS = ("shipped", "before")  # the exporter's pages now, and when issue 34 began
RATE, PROMPT, GEN = 2.0, 1000, 200  # finished req/s, prompt and generated tokens per request
QUEUE_S, PREFILL_S, ITL_S, TTFT_S, PROBE_S = 0.05, 0.0002, 0.03, 0.25, 0.05  # per request, per prompt token, ...
# NVML's clock-event reasons in bit order (0x1 ... 0x100): the exporter serves their mask (one series a GPU); the
# before design served one 0/1 series a reason
CLOCK_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                 "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")
HW_THERMAL_SLOWDOWN = 1 << CLOCK_REASONS.index("hw_thermal_slowdown")  # 0x40
SLOWED_UNDER_LOAD = dict(GPU_FLAGS)["slowed_under_load"]  # the slow node's flag: its busy GPU is throttled
# the exporter's live values (exporters/fastpath.py), all on its full page; the shipped fast page carries FAST_LIVE
# of them, what the controller reads every second (tests/bench/test_promcost.py checks both lists against the
# exporter's pages)
LIVE = ("grayguard_live_itl_seconds", "grayguard_live_ttft_seconds", "grayguard_live_generation_tokens_per_second",
        "grayguard_live_prompt_tokens_per_second", "grayguard_live_requests_running",
        "grayguard_live_requests_waiting", "grayguard_probe_ttft_median_seconds", "grayguard_live_window_seconds",
        "grayguard_live_decode_batch", "grayguard_live_kv_cache_usage_ratio")
FAST_LIVE = ("grayguard_live_itl_seconds", "grayguard_live_ttft_seconds", "grayguard_live_prompt_tokens_per_second",
             "grayguard_probe_ttft_median_seconds", "grayguard_live_decode_batch",
             "grayguard_live_kv_cache_usage_ratio")
BUCKET_KEYS = tuple(f"le{k}" for k in range(len(TTFT_BUCKETS)))
# the exporter's traffic counters (exporters/traffic.py): vLLM's per-request sums less its probes, which the
# stand-in's vLLM does not count, so they move like vLLM's own
TRAFFIC = (("grayguard_traffic_requests_total", "reqs"), ("grayguard_traffic_request_seconds_total", "e2e"),
           ("grayguard_traffic_prompt_tokens_total", "prompt"), ("grayguard_traffic_generation_tokens_total", "gen"))
VLLM_HISTOGRAMS = {"e2e_request_latency_seconds": "e2e", "request_prompt_tokens": "prompt",
                   "request_generation_tokens": "gen", "request_prefill_time_seconds": "prefill",
                   "request_decode_time_seconds": "decode", "request_queue_time_seconds": "queue"}


@dataclass(frozen=True)
class Node:
    """One simulated node: its pool, its vLLM server's address, how much slower than its peers it runs."""

    pool: str
    instance: str
    slow: float  # 1, or SLOW for the sick node


def fleet(n: int) -> list[Node]:
    """n nodes in pools of POOL_SIZE; node 0 of every SLOW_EVERY-th pool is slow."""
    return [Node(f"pool{i // POOL_SIZE}", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000",
                 SLOW if (i // POOL_SIZE) % SLOW_EVERY == 0 and i % POOL_SIZE == 0 else 1.0) for i in range(n)]


def _cdf(slow: float) -> list[float]:
    """Share of requests with TTFT <= each bucket bound: lognormal around TTFT_S x slow, sigma 0.5."""
    return [0.5 * (1 + math.erf(math.log(le / (TTFT_S * slow)) / (0.5 * math.sqrt(2)))) for le in TTFT_BUCKETS]


# name, type, series: (name suffix, extra labels (or a function of the node giving them), value key)
Family = tuple[str, str, list[tuple[str, "str | Callable[[Node], str]", str]]]


def vllm_families() -> list[Family]:
    """vLLM's series the recording rules read (labels model_name and engine besides pool and instance)."""
    fams: list[Family] = [(f"vllm:{name}", "histogram", [("_sum", "", key), ("_count", "", "reqs")])
                          for name, key in VLLM_HISTOGRAMS.items()]
    buckets = [("_bucket", f',le="{le}"', key) for key, le in zip(BUCKET_KEYS, TTFT_BUCKETS, strict=True)]
    fams.append(("vllm:time_to_first_token_seconds", "histogram",
                 [*buckets, ("_bucket", ',le="+Inf"', "reqs"), ("_sum", "", "ttft"), ("_count", "", "reqs")]))
    fams.append(("vllm:request_success_total", "counter",
                 [("", f',finished_reason="{r}"', r if r in ("stop", "length") else "zero") for r in FINISHED_REASONS]))
    fams += [(f"vllm:{g}", "gauge", [("", "", g)])
             for g in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")]
    return fams


def _verdict(n: Node) -> str:
    """The node's last probe result: slow on a slow node."""
    return "slow" if n.slow > 1 else "ok"


def _results(design: str) -> Family:
    # the probe results counter: ok and slow from the start, a failure's series from its first count (none at
    # steady state); before, all eight from the start at 0
    results = [r for r in PROBE_RESULTS if design == "before" or r in PROBE_ANSWERED]
    return ("grayguard_probe_results_total", "counter", [("", f',result="{r}"', f"probes_{r}") for r in results])


def _verdicts(design: str) -> list[Family]:
    # the exporter's one series of the last result, labelled with it (a label per node: a callable); before, one
    # series a result, 1 for the last one
    last = ([("", lambda n: f',result="{_verdict(n)}"', "one")] if design == "shipped" else
            [("", f',result="{r}"', f"last_{r}") for r in PROBE_RESULTS])
    sent = [] if design == "before" else [("grayguard_probe_last_sent_timestamp_seconds", "gauge",
                                            [("", "", "probe_sent")])]
    return [("grayguard_probe_last_result", "gauge", last), *sent,
            ("grayguard_probe_consecutive_failures", "gauge", [("", "", "zero")])]


def _gauges(names: tuple[str, ...], labels: str = "", prefix: str = "") -> list[Family]:
    return [(prefix + n, "gauge", [("", labels, n)]) for n in names]


def _clock_reasons(design: str, gpu: str) -> Family:
    # NVML's clock-event reasons: the mask, one series a GPU; before, one 0/1 series a reason (nine a GPU)
    if design == "before":
        return ("grayguard_gpu_clock_event_reason_active", "gauge",
                [("", f'{gpu},reason="{r}"', f"reason_{r}") for r in CLOCK_REASONS])
    return ("grayguard_gpu_clock_event_reasons", "gauge", [("", gpu, "reasons")])


def _gpu_families(design: str, gpu: str) -> list[Family]:
    # the GPU series grayguard reads. Before: the PCIe maxima, lost and the row remaps as 0/1 series of their own,
    # the lifetime ECC counts too. Shipped: the maxima as labels of the info series, the judgements as one mask.
    info = f'{gpu},name="NVIDIA H100 80GB HBM3",pci_bus_id="00000000:18:00.0",driver_version="550.54.15"'
    if design == "before":
        ecc = [("", f'{gpu},error_type="{t}",counter_type="{c}"', "zero")
               for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate")]
        return [("grayguard_gpu_info", "gauge", [("", info, "one")]), _clock_reasons(design, gpu),
                *_gauges(("utilization_ratio", "pcie_link_generation", "pcie_link_max_generation", "pcie_link_width",
                          "pcie_link_max_width", "lost", "row_remap_pending", "row_remap_failure"), gpu,
                         "grayguard_gpu_"),
                ("grayguard_gpu_ecc_errors", "gauge", ecc)]
    ecc = [("", f'{gpu},error_type="{t}",counter_type="volatile"', "zero") for t in ("corrected", "uncorrected")]
    return [("grayguard_gpu_info", "gauge", [("", f'{info},pcie_max_generation="5",pcie_max_width="16"', "one")]),
            _clock_reasons(design, gpu),
            *_gauges(("utilization_ratio", "pcie_link_generation", "pcie_link_width"), gpu, "grayguard_gpu_"),
            ("grayguard_gpu_flags", "gauge", [("", gpu, "flags")]),
            ("grayguard_gpu_ecc_errors", "gauge", ecc)]


def exporter_families(design: str = "shipped") -> list[Family]:
    """The exporter's full page (it carries every live gauge too, and the agent's verdict when shipped): probe
    series, the GPU series grayguard reads, the traffic counters."""
    gpu = ',gpu="0",uuid="GPU-0"'  # one GPU per node
    agent = [] if design == "before" else [("grayguard_agent_down", "gauge", [("", "", "zero")])]
    return [_results(design), *_verdicts(design), ("grayguard_probe_last_ttft_seconds", "gauge", [("", "", "probe")]),
            *_gauges(LIVE), *agent, ("grayguard_exporter_nvml_up", "gauge", [("", "", "one")]),
            *_gpu_families(design, gpu),
            *[(name, "counter", [("", "", key)]) for name, key in TRAFFIC]]


def fast_families(design: str = "shipped") -> list[Family]:
    """The fast path: the live values the controller reads and the probe's verdicts; before, every live value and
    the agent's verdict too."""
    if design == "before":
        return [*_gauges(LIVE), *_verdicts(design), ("grayguard_agent_down", "gauge", [("", "", "zero")])]
    return [*_gauges(FAST_LIVE), *_verdicts(design)]


def static_values(n: Node) -> dict[str, float]:
    """A node's values that never change: baked into its page's text once."""
    verdict = _verdict(n)
    out = {"zero": 0, "one": 1, "pcie_link_generation": 5, "pcie_link_max_generation": 5, "pcie_link_width": 16,
           "pcie_link_max_width": 16, "lost": 0, "row_remap_pending": 0, "row_remap_failure": 0}
    out.update({f"probes_{r}": 0 for r in PROBE_RESULTS if r != verdict})
    out.update({f"last_{r}": int(r == verdict) for r in PROBE_RESULTS})  # the one-hot last result (before)
    out.update({f"reason_{r}": int(n.slow > 1 and r == "hw_thermal_slowdown") for r in CLOCK_REASONS})
    out["reasons"] = HW_THERMAL_SLOWDOWN if n.slow > 1 else 0  # the mask: the slow node's GPU is throttled
    out["flags"] = SLOWED_UNDER_LOAD if n.slow > 1 else 0  # the exporter's mask: a slowdown reason on a busy GPU
    return out


def traffic(n: Node, acc: dict, dt: float, g) -> dict[str, float]:
    """vLLM's counters advanced by dt seconds of traffic (a noisy latency factor per interval) and its gauges."""
    reqs = max(0.0, RATE / n.slow ** 0.5 * dt * (1 + 0.1 * g()))
    lat = n.slow * math.exp(0.1 * g())  # this interval's latency factor: noisy, 4x on the slow node
    for key, per_req in (("prompt", PROMPT), ("gen", GEN), ("queue", QUEUE_S * lat), ("ttft", TTFT_S * lat),
                         ("prefill", PREFILL_S * PROMPT * lat), ("decode", ITL_S * GEN * lat), ("n", 1)):
        acc[key] = acc.get(key, 0.0) + reqs * per_req
    total = int(acc["n"])
    out = {key: acc[key] for key in ("prompt", "gen", "queue", "ttft", "prefill", "decode")}
    out["e2e"] = acc["queue"] + acc["prefill"] + acc["decode"]
    out.update({"reqs": total, "stop": int(total * 0.7), "length": total - int(total * 0.7),
                "kv_cache_usage_perc": min(1.0, max(0.0, 0.5 + 0.1 * g())),
                "num_requests_running": max(0, round(16 + 2 * g())),
                "num_requests_waiting": max(0, round(1 + g()))})
    out.update(zip(BUCKET_KEYS, [int(total * c) for c in acc["cdf"]], strict=True))
    return out


def live(n: Node, acc: dict, dt: float, g) -> dict[str, float]:
    """The exporter's live gauges: noisy, the slow node's latencies SLOW x; and when its last probe was sent (one a
    second)."""
    running, itl = max(0, round(16 + 2 * g())), ITL_S * n.slow * math.exp(0.15 * g())
    out = dict(zip(LIVE, (itl, TTFT_S * n.slow * math.exp(0.2 * g()), running / itl,
                          RATE * PROMPT * math.exp(0.2 * g()), running, max(0, round(1 + g())),
                          PROBE_S * n.slow * math.exp(0.1 * g()), 5.0 + 0.02 * g(), running,
                          min(1.0, max(0.0, 0.5 + 0.1 * g()))), strict=True))
    out["probe_sent"] = float(math.floor(time.time()))
    return out


def exporter(n: Node, acc: dict, dt: float, g) -> dict[str, float]:
    """The exporter's full page: the live gauges, the probe counter (one a second), last TTFT, utilization, the
    traffic counters."""
    acc["probes"] = acc.get("probes", 0.0) + dt
    served = traffic(n, acc, dt, g)
    out = live(n, acc, dt, g)
    out.update({key: served[key] for _, key in TRAFFIC})
    out.update({f"probes_{'slow' if n.slow > 1 else 'ok'}": int(acc["probes"]),
                "probe": PROBE_S * n.slow * math.exp(0.2 * g()),
                "utilization_ratio": min(1.0, 0.9 + 0.03 * g())})
    return out


class Page:
    """One exposition page of a shard: a format string built once, filled with each scrape's values."""

    def __init__(self, nodes: list[Node], families: list[Family], dynamic, extra_labels: str = "", seed: int = 0):
        rnd = random.Random(seed)
        # standard normal noise from a table: a fresh gauss() per value would cost more than the page
        self.noise = itertools.cycle([rnd.gauss(0, 1) for _ in range(4099)]).__next__
        self.nodes, self.dynamic, self.lock = nodes, dynamic, threading.Lock()
        self.acc: list[dict] = [{"n": 0.0, "cdf": _cdf(n.slow)} for n in nodes]
        parts, self.order, fixed_values = [], [], [static_values(n) for n in nodes]
        for name, kind, series in families:
            parts.append(f"# HELP {name} grayguard benchmark stand-in\n# TYPE {name} {kind}\n")
            for i, (n, fixed) in enumerate(zip(nodes, fixed_values, strict=True)):
                labels = f'{extra_labels}pool="{n.pool}",instance="{n.instance}"'
                for suffix, extra, key in series:
                    value = "%r" if key not in fixed else repr(fixed[key])
                    parts.append(f"{name}{suffix}{{{labels}{extra(n) if callable(extra) else extra}}} {value}\n")
                    if key not in fixed:
                        self.order.append((i, key))
        self.template = "".join(parts)
        self.last = time.monotonic()

    def render(self) -> bytes:
        """The page now: every node's values advanced by the time since the last scrape."""
        with self.lock:
            now = time.monotonic()
            dt, self.last = now - self.last, now
            values = [self.dynamic(n, acc, dt, self.noise) for n, acc in zip(self.nodes, self.acc, strict=True)]
            return (self.template % tuple([values[i][k] for i, k in self.order])).encode()


def pages(design: str = "shipped") -> dict[str, tuple[str, list[Family]]]:
    """Prometheus job -> (the path that serves it, its families)."""
    if design not in DESIGNS:
        raise ValueError(f"design {design!r} is none of {DESIGNS}")
    return {"vllm": ("/metrics", vllm_families()),
            "grayguard-exporter": ("/exporter/metrics", exporter_families(design)),
            "grayguard-exporter-fast": ("/metrics/fast", fast_families(design))}


def shard_routes(nodes: list[Node], seed: int, design: str = "shipped") -> dict:
    """The three pages of one shard as HttpServer routes."""
    dynamic = {"vllm": (traffic, 'engine="0",model_name="bench",'), "grayguard-exporter": (exporter, ""),
               "grayguard-exporter-fast": (live, "")}

    def handler(page: Page):
        def handle(_req: Request) -> Response:
            return 200, "text/plain; version=0.0.4; charset=utf-8", page.render()
        return handle
    return {f"GET {path}": handler(Page(nodes, fams, dynamic[job][0], dynamic[job][1], seed + k))
            for k, (job, (path, fams)) in enumerate(pages(design).items())}


def series_per_node(design: str = "shipped") -> dict[str, int]:
    """Series each page carries per node (job name -> count)."""
    return {job: sum(len(series) for _, _, series in fams) for job, (_, fams) in pages(design).items()}


def serve_fleet(n: int, shard_size: int = SHARD_SIZE, seed: int = 1, design: str = "shipped") -> list[HttpServer]:
    """Start one server per shard on 127.0.0.1 (ports chosen by the OS); stop() each when done."""
    nodes = fleet(n)
    return [HttpServer(("127.0.0.1", 0), shard_routes(nodes[k:k + shard_size], seed + 3 * k, design),
                       name="promtarget").start() for k in range(0, n, shard_size)]


def main() -> None:
    """Serve until SIGTERM (bench/promcost.py starts and stops it)."""
    p = argparse.ArgumentParser(description="serve N simulated nodes' series for the Prometheus cost benchmark")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--shard-size", type=int, default=SHARD_SIZE)
    p.add_argument("--ready-file", required=True, help="where to write {\"ports\": [...]} once serving")
    p.add_argument("--design", choices=DESIGNS, default="shipped",
                   help="the exporter's pages as shipped, or as they were when issue 34 began (bench/before34)")
    args = p.parse_args()
    servers = serve_fleet(args.nodes, args.shard_size, design=args.design)
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps({"ports": [s.port for s in servers]}))
    os.replace(tmp, args.ready_file)  # whole or absent: the runner never reads half a file
    threading.Event().wait()  # serve until SIGTERM


if __name__ == "__main__":
    main()
