"""Prometheus' answers to the controller's queries for N simulated nodes, served over its HTTP API.

`bench/ticklocal.py` measures the controller's own work in a tick at scale: a real HAProxy and the real
Controller, with this in Prometheus' place. On the project's 2 cores a real Prometheus does not keep up with
10,000 nodes' series (docs/benchmarks.md, "Whole tick at scale"), so the whole tick there measures Prometheus;
this serves what it would answer: for every query of the controller's config (and `timestamp()` of the window's
two), a vector with one series per node labelled with its `pool` and `instance` (and `result`, and `__name__`
where the query is a bare series name, as Prometheus writes them), the values of the stand-in fleet of
bench/promtarget.py (a 4x slow node with its GPU throttled in every tenth pool, every value noisy). The
window's values change every control interval (5 s: the recording rules' evaluation) and carry that time as
their `timestamp()`; the live ones change every second. Each answer is stamped with the time it is served.
Bodies are built in advance (8 variants of each) and only their times are filled in per request, so the
server's own CPU stays small next to the controller's.

Run as `python -m grayguard.bench.answers --config CFG --nodes N --ready-file F`: it writes {"port": P} to F once it
serves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from grayguard.bench.promtarget import Node, fleet
from grayguard.config import Config, duration_seconds, load_config
from grayguard.controller import readscope
from grayguard.httpserve import HttpServer, Request, Response

VARIANTS = 8  # bodies built per query; the one served follows the clock
NOW, DATA = b"@NOW@", b"@DATA@"  # placeholders: the evaluation time, the window's data time
BARE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # a query that is a series name: Prometheus keeps __name__
JSON = "application/json"

# signal -> its value for a node (n: the node, z: a standard normal draw); absent: not answered (empty vector)
VALUES: dict[str, Callable[[Node, float], float]] = {
    "latency": lambda n, z: 0.02 * n.slow * (1 + 0.05 * z),  # normalized latency, s per weighted token
    "rate": lambda n, z: 2.0 * (1 + 0.05 * z),
    # only each node's current class is answered; the shipped query's value is when that probe was sent (1 where
    # the exporter does not say: the same work for the controller and the same bytes within a digit)
    "probe_result": lambda n, z: 1.0,
    "probe_ttft": lambda n, z: 0.05 * n.slow * (1 + 0.1 * z),
    "probe_failures": lambda n, z: 0.0,
    "error_ratio": lambda n, z: 0.0,
    "kv_cache": lambda n, z: 0.3 + 0.02 * z,
    "gpu_throttled": lambda n, z: 1.0 if n.slow > 1 else 0.0,
    "pcie_degraded": lambda n, z: 0.0,
    "gpu_ecc": lambda n, z: 0.0,
    "gpu_xid": lambda n, z: 0.0,
    "live_itl": lambda n, z: 0.03 * n.slow * (1 + 0.05 * z),
    "live_ttft": lambda n, z: 0.25 * n.slow * (1 + 0.1 * z),
    "probe_ttft_median": lambda n, z: 0.05 * n.slow * (1 + 0.05 * z),
    "live_prefill_rate": lambda n, z: 2000.0 * (1 + 0.05 * z),
    "live_decode_batch": lambda n, z: 8.0 * (1 + 0.05 * z),
}
WINDOW = ("latency", "rate")  # recorded by the control group: they change once a control interval


def queries(cfg: Config) -> dict[str, str]:
    """promql -> the signal it answers (latency, rate, latency_timestamp, live_itl, ...), as the controller asks."""
    sig = cfg.signals
    out = {sig.latency_query: "latency", sig.request_rate_query: "rate",
           f"timestamp({sig.latency_query})": "latency_timestamp",
           f"timestamp({sig.request_rate_query})": "rate_timestamp"}
    for name in VALUES:
        q = getattr(sig, f"{name}_query", "")
        if q and name not in WINDOW:
            out[q] = name
    return out


def body(promql: str, signal: str, nodes: list[Node], rnd: random.Random) -> bytes:
    """One answer with the times left as placeholders."""
    stamp = signal.endswith("_timestamp")
    value = VALUES[signal.removesuffix("_timestamp")]
    name = {"__name__": promql} if BARE.fullmatch(promql) else {}
    result = []
    for n in nodes:
        labels = {**name, "pool": n.pool, "instance": n.instance}
        if signal == "probe_result":
            labels["result"] = "ok"
        v = "@DATA@" if stamp else repr(value(n, rnd.gauss(0, 1)))
        result.append({"metric": labels, "value": ["@NOW@", v]})
    doc = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
    return doc.replace('"@NOW@"', "@NOW@").encode()


def led_pools(pools: list[str], share: float) -> list[str]:
    """The pools a replica leading `share` of them leads in the benchmarks: the first ones in config order."""
    return pools[:round(share * len(pools))]


def routes(cfg: Config, nodes: list[Node], seed: int = 1, led: list[str] | None = None) -> dict:
    """GET (and POST) /api/v1/query and /-/ready as HttpServer routes. led: the pools a replica leads, whose
    queries are scoped (controller/readscope.py): those are answered with the led pools' series only."""
    rnd = random.Random(seed)
    signal = queries(cfg)
    if led is not None:  # as Prometheus evaluates the wrapper: the led pools' series (the stand-ins all have a pool)
        signal = {readscope.scoped(q, led): s for q, s in signal.items()}
        keep = set(led)
        nodes = [n for n in nodes if n.pool in keep]
    bodies = {q: [body(readscope.unscoped(q), s, nodes, rnd) for _ in range(VARIANTS)] for q, s in signal.items()}
    every = duration_seconds(cfg.rules.control_interval)
    empty = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()

    def query(req: Request) -> Response:
        form = req.body.decode() if req.method == "POST" else req.query  # a long query comes as a POST form
        q = urllib.parse.parse_qs(form).get("query", [""])[0]
        now = time.time()
        evaluated = math.floor(now / every) * every  # the control group's last evaluation
        if q not in bodies:
            return 200, JSON, empty
        k = int(evaluated if signal[q] in WINDOW else now) % VARIANTS
        out = bodies[q][k].replace(NOW, repr(now).encode())
        return 200, JSON, out.replace(DATA, repr(evaluated).encode()) if DATA in out else out

    return {"GET /api/v1/query": query, "POST /api/v1/query": query,
            "GET /-/ready": lambda _r: (200, "text/plain", b"ready\n")}


def main() -> None:
    p = argparse.ArgumentParser(description="serve Prometheus' answers to the controller's queries for N nodes")
    p.add_argument("--config", required=True, help="the controller's config (its queries are answered)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ready-file", required=True, help='where to write {"port": P} once serving')
    p.add_argument("--lead-share", type=float, default=None,
                   help="answer the queries of a replica leading this share of the pools (scoped, led_pools)")
    args = p.parse_args()
    cfg = load_config(args.config)
    led = None if args.lead_share is None else led_pools([pl.name for pl in cfg.pools], args.lead_share)
    server = HttpServer(("127.0.0.1", 0), routes(cfg, fleet(args.nodes), led=led), name="answers").start()
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps({"port": server.port}))
    os.replace(tmp, args.ready_file)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
