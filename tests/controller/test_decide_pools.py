"""decide.by_pool / pool_samples: each pool matches its own series and the unlabelled ones instead of scanning the
whole fleet's answers (pools x nodes at scale: bench/wholetick.py measured 80 s a pass at 10,000 nodes). The
answers are the same as on the whole answers: pool_data, signal_maps and node_inputs, on random fleets with
series of other pools, unlabelled series, duplicates (conflicts), timestamps missing or stale."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import PoolConfig
from grayguard.controller import decide
from grayguard.controller.haproxy import ServerState
from grayguard.promclient import Sample

POOLS = ("us", "eu", "ap")
NODES = 4


def _labels(pool: str | None, i: int, extra: int) -> dict[str, str]:
    lab = {"instance": f"10.0.{POOLS.index(pool) if pool else 9}.{i}:8000" if extra < 2 else f"10.0.0.{i}:8000"}
    if pool is not None:
        lab["pool"] = pool
    if extra == 1:
        lab["replica"] = "b"  # a second series for the same key: a conflict
    return lab


SERIES = st.tuples(st.sampled_from((*POOLS, None)), st.integers(0, NODES - 1), st.integers(0, 3),
                   st.floats(0.001, 1.0), st.floats(0, 300))


def _answers(rows, name: str, result: bool = False) -> list[Sample]:
    out = []
    for pool, i, extra, v, _age in rows:
        lab = _labels(pool, i, extra)
        if result:
            lab["result"] = "ok" if v < 0.5 else "slow"
        out.append(Sample(lab, v, 1000.0))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(SERIES, max_size=30), st.lists(SERIES, max_size=30), st.lists(SERIES, max_size=30),
       st.booleans())
def test_each_pool_decides_on_its_own_series_as_on_the_whole_answers(lat_rows, rate_rows, opt_rows, stamped):
    samples = {"latency": _answers(lat_rows, "latency"), "rate": _answers(rate_rows, "rate")}
    if stamped:  # timestamp() of each series: its own labels, the data's time as the value
        for name, rows in (("latency", lat_rows), ("rate", rate_rows)):
            samples[f"{name}_timestamp"] = [Sample(s.labels, 1000.0 - age, 1000.0)
                                            for s, (*_, age) in zip(samples[name], rows, strict=True)]
    optional = {"live_itl": _answers(opt_rows, "live_itl"), "probe_result": _answers(opt_rows, "p", result=True),
                "kv_cache": _answers(opt_rows[::-1], "kv")}
    grouped, grouped_opt = decide.by_pool(samples), decide.by_pool(optional)
    for k, pool in enumerate(POOLS):
        cfg = PoolConfig(name=pool, backend=f"b_{pool}")
        srv = {f"n{i}": ServerState(cfg.backend, f"n{i}", f"10.0.{k}.{i}:8000" if i % 2 else f"10.0.0.{i}:8000",
                                    100, 100, 0, 2) for i in range(NODES)}
        own, own_opt = decide.pool_samples(grouped, pool), decide.pool_samples(grouped_opt, pool)
        whole = decide.pool_data(cfg, srv, samples, max_age_s=60)
        assert decide.pool_data(cfg, srv, own, max_age_s=60) == whole
        assert decide.signal_maps(cfg, srv, own_opt) == decide.signal_maps(cfg, srv, optional)
        assert decide.node_inputs(cfg, srv, own, own_opt, {}, whole) == \
            decide.node_inputs(cfg, srv, samples, optional, {}, whole)
        assert all(s.labels.get("pool") in (pool, None) for seq in own.values() for s in seq)
