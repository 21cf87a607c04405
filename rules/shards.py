"""Prometheus' functional sharding by pool, and which controller leads which pools.

Past what one Prometheus holds (docs/operations.md, sizing), each of N Prometheus servers scrapes the nodes of some
pools only: every scrape job keeps the targets whose `pool` label hashes to its shard (`hashmod`, Prometheus' own
relabel action), and the controller replicas of that shard list those pools and read that Prometheus
(`prometheus.url`). With `registry.shard_pools` and one `registry.prefix`, a pool is led by a replica that lists it,
so replicas with disjoint pool lists lead exactly their shard's pools, and two replicas listing the same shard share
it (docs/operations.md, "Sharding").

hashmod here is Prometheus' (model/relabel): the MD5 of the source labels' values joined by ";", its last 8 bytes
read as a big-endian unsigned integer, modulo N; tests/controller/test_prom_shard_e2e.py checks it against two real
Prometheus servers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from grayguard.vocab import POOL_LABEL

HASH_LABEL = "__tmp_grayguard_shard"  # a __tmp label: Prometheus drops it after relabelling


def hashmod(value: str, modulus: int) -> int:
    """The shard Prometheus' `hashmod` relabel action gives a label value (one source label, the default separator)."""
    if modulus < 1:
        raise ValueError(f"modulus must be >= 1, got {modulus}")
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus


def assign(pools: Iterable[str], shards: int) -> list[list[str]]:
    """The pools of each shard, in the order given."""
    out: list[list[str]] = [[] for _ in range(shards)]
    for p in pools:
        out[hashmod(p, shards)].append(p)
    return out


def relabel_configs(shard: int, shards: int, label: str = POOL_LABEL) -> list[dict]:
    """The `relabel_configs` that keep a scrape job's targets of one shard (the targets carry the pool label)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in [0, {shards}), got {shard}")
    return [{"source_labels": [label], "modulus": shards, "target_label": HASH_LABEL, "action": "hashmod"},
            {"source_labels": [HASH_LABEL], "regex": str(shard), "action": "keep"}]
