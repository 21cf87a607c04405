"""The floor of what grayguard costs a Prometheus: the stand-in nodes scraped at the shipped jobs and intervals, with
no rule and no query. `python -m grayguard.bench.ingestfloor --nodes 10000` prints Prometheus' CPU, samples appended per
second, head series and resident memory over a window after a warm-up (docs/benchmarks.md, issue 34's 10,000-node
floor). What the rules and the controller's reads add is `grayguard bench-controller`'s Prometheus cost."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from grayguard.bench import promcost
from grayguard.bench.promwindow import prom_metrics, total
from grayguard.localstack.procs import free_port
from grayguard.localstack.services import start_prometheus


def measure(nodes: int, warmup_s: float = 25.0, seconds: float = 30.0, progress=print) -> dict[str, float]:
    """Start the stand-in and a rule-less Prometheus, wait warmup_s, measure over seconds; always stop both."""
    with tempfile.TemporaryDirectory(prefix="grayguard-ingestfloor-") as d:
        wd = Path(d)
        with promcost.stand_in(nodes, wd, progress) as (_target, ports):
            prom = start_prometheus(promcost.prometheus_setup(ports), [], workdir=wd / "prometheus", port=free_port())
            try:
                progress(f"{nodes} nodes: warming up for {warmup_s:g} s, then measuring for {seconds:g} s")
                time.sleep(warmup_s)
                m0, t0 = prom_metrics(prom), time.monotonic()
                time.sleep(seconds)
                m1, span = prom_metrics(prom), time.monotonic() - t0
            finally:
                prom.stop()

    def rate(name: str) -> float:
        return (total(m1, name) - total(m0, name)) / span
    return {"cores": rate("process_cpu_seconds_total"),
            "samples_per_s": rate("prometheus_tsdb_head_samples_appended_total"),
            "head_series": total(m1, "prometheus_tsdb_head_series"),
            "rss_bytes": total(m1, "process_resident_memory_bytes")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=10000, help="simulated nodes (pools of 20; default %(default)s)")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window after the warm-up")
    args = p.parse_args()
    r = measure(args.nodes, seconds=args.seconds)
    print(f"{args.nodes} nodes scraped, no rule, no query: Prometheus {r['cores']:.2f} cores, "
          f"{r['samples_per_s']:,.0f} samples/s, {r['head_series']:,.0f} head series, "
          f"{r['rss_bytes'] / 2**20:,.0f} MiB resident")


if __name__ == "__main__":
    main()
