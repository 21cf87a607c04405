"""Two Prometheus shards, two controller replicas: Prometheus' own functional sharding by pool, end to end.

Four pools of four nodes, each pool's series served by a scrape target of its own (the benchmark's stand-in pages,
bench/promtarget.py: vLLM, the exporter's full page and its fast path; node0 of every pool 4x slower, its GPU
throttled). Two real Prometheus servers scrape the same targets with the relabel_configs `grayguard rules shards`
prints (hashmod of the pool label, keep one shard), each evaluating the shipped rules. Two controller replicas share
one real etcd (registry.shard_pools, one prefix) and one real HAProxy; each lists the pools of one shard and reads
that shard's Prometheus. Shown:
- each Prometheus holds the series of its shard's pools only, the pools rules/shards.py assigns it (Prometheus'
  hashmod computed the same way here);
- each replica leads exactly the pools it lists;
- every pool's slow node is drained in HAProxy and no other node is, each pool by the replica reading the
  Prometheus that holds its series.
"""

from __future__ import annotations

import threading
import time

import pytest

from grayguard.bench import promtarget
from grayguard.config import parse_config
from grayguard.controller.cmd_controller import build_leadership, run_loop
from grayguard.controller.haproxy import RuntimeClient
from grayguard.controller.loop import Controller
from grayguard.controller.metrics import ControllerMetrics
from grayguard.httpserve import HttpServer
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import wait_until
from grayguard.localstack.services import prometheus_config, start_prometheus
from grayguard.promclient import PrometheusClient
from grayguard.rules import shards
from grayguard.rules.render import render_all
from tests.support.ctl_helpers import servers
from tests.support.stack import require

pytestmark = pytest.mark.e2e

SHARDS, NODES, TICK = 2, 4, 1.0
# two pools of each shard, the first names Prometheus' hashmod puts there (p0..p9: both shards have two)
POOLS = [p for k in range(SHARDS) for p in shards.assign([f"p{i}" for i in range(10)], SHARDS)[k][:2]]
SPLIT = shards.assign(POOLS, SHARDS)
BASE_PORT = 19400  # the nodes' addresses (HAProxy's servers, the series' instance label); nothing listens there
JOBS = {"vllm": "/metrics", "grayguard-exporter": "/exporter/metrics", "grayguard-exporter-fast": "/metrics/fast"}
RULES = {"control_window": "10s", "control_interval": "1s", "human_interval": None}


def address(pool: int, node: int) -> str:
    return f"127.0.0.1:{BASE_PORT + 10 * pool + node}"


def shard_config(k: int, prom_url: str, hap_endpoint: str, etcd_url: str, rules_dir) -> dict:
    return {
        "prometheus": {"url": prom_url, "timeout_s": 2},
        "haproxy": {"endpoints": [hap_endpoint], "timeout_s": 1.0},
        "pools": [{"name": p, "backend": f"vllm_{p}"} for p in SPLIT[k]],
        "signals": {"latency_query": "instance:vllm_normalized_latency_seconds_per_token:rate10s",
                    "request_rate_query": "instance:vllm_request_rate:rate10s"},
        "rules": {**RULES, "output_dir": str(rules_dir)}, "state_file": None, "tick_interval_s": TICK,
        "registry": {"url": etcd_url, "lease_ttl_s": 3, "timeout_s": 1.0, "shard_pools": True}}


@pytest.fixture
def fleet():
    """One stand-in target per pool (its three pages), node0 of each 4x slower; stopped after."""
    targets = {}
    for i, p in enumerate(POOLS):
        nodes = [promtarget.Node(p, address(i, j), promtarget.SLOW if j == 0 else 1.0) for j in range(NODES)]
        targets[p] = HttpServer(("127.0.0.1", 0), promtarget.shard_routes(nodes, seed=7 * i + 1),
                                name=f"target-{p}").start()
    yield {p: f"127.0.0.1:{s.port}" for p, s in targets.items()}
    for s in targets.values():
        s.stop()


def test_two_prometheus_shards_each_read_by_the_replica_leading_its_pools(tmp_path, fleet, haproxy_factory):
    require("prometheus", "haproxy", "etcd")
    hap = haproxy_factory({f"vllm_{p}": servers(NODES, base_port=BASE_PORT + 10 * i) for i, p in enumerate(POOLS)})
    etcd = EtcdProc(tmp_path / "etcd").start()
    proms, replicas, stop = [], [], threading.Event()
    try:
        for k in range(SHARDS):
            rules_dir = tmp_path / f"rules{k}"
            rules_dir.mkdir()
            cfg_k = parse_config(shard_config(k, "http://127.0.0.1:9", hap.endpoint, etcd.url, rules_dir))
            for name, text in render_all(cfg_k).items():
                (rules_dir / name).write_text(text)
            # every job sees every pool's target; the shard's relabel_configs keep its own pools' targets
            jobs = [{"job_name": job, "honor_labels": True, "metrics_path": path,
                     "static_configs": [{"targets": [t], "labels": {"pool": p}} for p, t in fleet.items()],
                     "relabel_configs": shards.relabel_configs(k, SHARDS)} for job, path in JOBS.items()]
            proms.append(start_prometheus(prometheus_config(jobs, interval="1s"), sorted(rules_dir.glob("*.yml")),
                                          workdir=tmp_path / f"prom{k}"))
            cfg = parse_config(shard_config(k, proms[k].url, hap.endpoint, etcd.url, rules_dir))
            metrics = ControllerMetrics.create()
            ctl = Controller(cfg, PrometheusClient(cfg.prometheus), [RuntimeClient(hap.endpoint, 1.0)],
                             metrics=metrics, leadership=build_leadership(cfg, f"replica{k}", metrics))
            replicas.append(ctl)
            threading.Thread(target=run_loop, args=(ctl, TICK, stop), daemon=True).start()

        # each Prometheus holds its shard's pools only: Prometheus' hashmod is rules/shards.py's
        def held(k: int) -> set[str]:
            return {r["metric"].get("pool") for r in proms[k].query("count by (pool) (grayguard_live_itl_seconds)")}
        wait_until(lambda: all(held(k) == set(SPLIT[k]) for k in range(SHARDS)), 60, 0.5,
                   f"each Prometheus holding its shard's pools {SPLIT}")
        for k in range(SHARDS):
            assert held(k) == set(SPLIT[k])

        view = RuntimeClient(hap.endpoint)

        def drained() -> dict[str, set[str]]:
            out: dict[str, set[str]] = {}
            for s in view.show_servers_state():
                if s.drain or s.weight == 0:
                    out.setdefault(s.backend.removeprefix("vllm_"), set()).add(s.name)
            return out
        try:
            wait_until(lambda: drained() == {p: {"node0"} for p in POOLS}, 120, 0.5,
                       "every pool's slow node drained, and no other")
        except TimeoutError as e:
            raise AssertionError(f"{e}: drained {drained()}; leads "
                                 f"{[ctl.leadership.status()['leads'] for ctl in replicas]}") from None

        def each_leads_its_own_from_its_data() -> bool:
            # each replica leads its shard's pools, decided from its own Prometheus' data (every node has some)
            return all(set(ctl.leadership.status()["leads"]) == set(SPLIT[k]) and
                       all(ctl.metrics.pool_nodes_with_data.labels(p)._value.get() == NODES for p in SPLIT[k])
                       for k, ctl in enumerate(replicas))
        wait_until(each_leads_its_own_from_its_data, 30, 0.5, "each replica leading its shard's pools, with data")
        time.sleep(3 * TICK)  # and it holds
        assert drained() == {p: {"node0"} for p in POOLS}
    finally:
        stop.set()
        for p in proms:
            p.stop()
        etcd.stop()
