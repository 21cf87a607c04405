"""decide's observe side (own_series, node_series, _ident, pool_data, signal_maps, node_inputs, decide_tick) gives
exactly what the plain version it replaced gave: a tick builds the inputs of every node of every pool from every
query, so it was made cheaper (one sample per key instead of a list, timestamp identities built in C, each pool's
series keys once per tick); the plain version is kept here as the reference.

Random fleets exercise what a shortcut could get wrong: hostname servers (two keys, or one when the hostname is
the address), IPv6 addresses, pools[].servers.<n>.series overrides (two servers on one key), series of another
pool or without a pool label, two series for one key, timestamp() samples missing, stale, NaN, duplicated or
carrying a metric name, NaN and Inf values, probe_result's one-hot filter, the peer_group label, a custom
series_label. Results are compared by repr: values, NaN included, and the order of every dict."""

from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from grayguard.config import PoolConfig, ServerConfig
from grayguard.controller import decide
from grayguard.controller.haproxy import ServerState
from grayguard.controller.policy import NodeInput
from grayguard.controller.scoring import usable
from grayguard.promclient import Sample, finite

NODES = 5
KINDS = ("plain", "fqdn", "fqdn_is_address", "ipv6", "override", "override_group")


# ---- the reference: the plain version, as it was ------------------------------------------------------------
def _ref_ident(labels):
    return frozenset((k, v) for k, v in labels.items() if k != "__name__")


def _ref_own_series(pool, samples):
    out = {}
    for s in samples:
        key = s.labels.get(pool.series_label)
        if key is not None and s.labels.get(decide.POOL_LABEL, pool.name) == pool.name:
            out.setdefault(key, []).append(s)
    return out


def _ref_matched(by_key, keys):
    return [s for k in keys for s in by_key.get(k, ())]


def _ref_keys(pool, servers):
    return {n: tuple(dict.fromkeys(decide.series_keys(pool, srv))) for n, srv in servers.items()}


def _ref_pool_data(pool, servers, samples, max_age_s=math.inf):
    vals = {"latency": {}, "rate": {}}
    without = {}
    latency_at = {}
    keys = _ref_keys(pool, servers)
    for name in ("latency", "rate"):
        by_key = _ref_own_series(pool, samples.get(name, ()))
        ts = samples.get(f"{name}_timestamp")
        ages = None if ts is None else {_ref_ident(s.labels): s.timestamp - s.value for s in ts}
        stamps = {} if ts is None else {_ref_ident(s.labels): s.value for s in ts}
        for n in servers:
            got = _ref_matched(by_key, keys[n])
            if len(got) > 1:
                without[n] = "conflict"
            elif got and without.get(n) != "conflict":
                age = 0.0 if ages is None else ages.get(_ref_ident(got[0].labels))
                if age is None or not age <= max_age_s:
                    without[n] = "stale"
                else:
                    vals[name][n] = got[0].value
                    at = stamps.get(_ref_ident(got[0].labels))
                    if name == "latency" and at is not None and math.isfinite(at):
                        latency_at[n] = at
    with_data = []
    for n in servers:
        if n in without:
            vals["latency"].pop(n, None)
            vals["rate"].pop(n, None)
        elif n not in vals["latency"] and n not in vals["rate"]:
            without[n] = "unmatched"
        elif usable(vals["latency"].get(n)) and vals["rate"].get(n, math.inf) > 0:
            with_data.append(n)
        else:
            without[n] = "idle"
    fresh = set(vals["latency"]) | set(vals["rate"])
    held = None
    if servers and not fresh:
        what = {"stale": f"stale: data older than {max_age_s:g}s or of unknown age", "conflict": "conflict: two "
                "series for one node", "unmatched": "unmatched: no series of the pool names the server"}
        counts = {r: sum(1 for v in without.values() if v == r) for r in what}
        held = "no node has fresh data (" + "; ".join(f"{c} {what[r]}" for r, c in counts.items() if c) + ")"
    latency_at = {n: a for n, a in latency_at.items() if n in vals["latency"]}
    return decide.PoolData(vals["latency"], vals["rate"], tuple(with_data), dict(sorted(without.items())), held,
                           latency_at)


def _ref_signal_maps(pool, servers, optional):
    out = {}
    keys = _ref_keys(pool, servers)
    for name in decide.OPTIONAL:
        samples = optional.get(name, [])
        if name == "probe_result":  # 1, or the send time of the probe shown (2026-12-07)
            samples = [s for s in samples if s.value == 1 or 1 < s.value < math.inf]
        if name == "peer_group" and not pool.peer_group_label:
            samples = []
        by_key = _ref_own_series(pool, samples)
        out[name] = {}
        if name == "probe_result":
            out["probe_at"] = {}
        for n in servers:
            got = _ref_matched(by_key, keys[n])
            if len(got) == 1:
                v = got[0]
                out[name][n] = (v.labels.get("result") if name == "probe_result" else
                                v.labels.get(pool.peer_group_label or "") if name == "peer_group" else v.value)
                if name == "probe_result" and v.value > 1:
                    out["probe_at"][n] = v.value
    return out


def _flag(v):
    return None if v is None or v != v else v > 0


def _int(v):
    return None if v is None or not math.isfinite(v) else int(v)


def _ref_node_inputs(pool, servers, samples, optional, canaries, data):
    sig = _ref_signal_maps(pool, servers, optional)
    inputs = {}
    for n, s in servers.items():
        o = pool.servers.get(n)
        inputs[n] = NodeInput(
            base_weight=s.initial_weight, latency=data.latency.get(n), latency_at=data.latency_at.get(n),
            request_rate=data.rate.get(n),
            peer_group=(o.peer_group if o and o.peer_group else sig["peer_group"].get(n)),
            canary=canaries.get(n), hold=s.maint, down=s.down, gateway_marked_down=s.marked_down_for_errors,
            gateway_errors=s.hanafail, agent_down=s.agent_down, agent_off=s.agent_off,
            agent_why=s.agent_text if s.agent_down else None,
            haproxy_weight=s.weight, haproxy_drain=s.drain,
            probe_result=sig["probe_result"].get(n), probe_ttft=finite(sig["probe_ttft"].get(n)),
            probe_failures=_int(sig["probe_failures"].get(n)), probe_at=sig["probe_at"].get(n),
            error_ratio=finite(sig["error_ratio"].get(n)), kv_cache_usage=finite(sig["kv_cache"].get(n)),
            gpu_throttled=_flag(sig["gpu_throttled"].get(n)), pcie_degraded=_flag(sig["pcie_degraded"].get(n)),
            gpu_ecc_uncorrectable=_flag(sig["gpu_ecc"].get(n)), gpu_xid=_flag(sig["gpu_xid"].get(n)),
            live_itl=finite(sig["live_itl"].get(n)), live_ttft=finite(sig["live_ttft"].get(n)),
            probe_ttft_median=finite(sig["probe_ttft_median"].get(n)),
            live_prefill_rate=finite(sig["live_prefill_rate"].get(n)),
            live_decode_batch=finite(sig["live_decode_batch"].get(n)))
    return inputs


# ---- random fleets ------------------------------------------------------------------------------------------
def _key(kind: str, i: int) -> str:
    """The series label value a node of this kind and index is known by (the first of its keys)."""
    return {"address": f"10.0.0.{i}:8000", "fqdn": f"h{i}.example:8000", "ipv6": f"[fd00::{i}]:8000",
            "series": f"gpu-{i}"}[kind]


def _fleet(kinds: list[tuple[str, int]], series_label: str, peer_group_label: str | None):
    """Pool "us": node i of kind k; an override names series gpu-<j> (two servers may share one)."""
    servers, overrides = {}, {}
    for i, (kind, j) in enumerate(kinds):
        n = f"n{i}"
        addr, fqdn = f"10.0.0.{i}:8000", None
        if kind == "fqdn":
            fqdn = f"h{i}.example"
        elif kind == "fqdn_is_address":
            fqdn = f"10.0.0.{i}"  # its two keys are one
        elif kind == "ipv6":
            addr = f"[fd00::{i}]:8000"
        elif kind == "override":
            overrides[n] = ServerConfig(series=f"gpu-{j}")
        elif kind == "override_group":
            overrides[n] = ServerConfig(peer_group=f"g{j}")
        servers[n] = ServerState("b_us", n, addr, 100 + i, 100, 8 if i == 3 else 0, 2 - (i == 4), fqdn,
                                 hanafail=i, agent_text="down (hang)")
    pool = PoolConfig(name="us", backend="b_us", series_label=series_label, servers=overrides,
                      peer_group_label=peer_group_label)
    return pool, servers


VALUES = st.one_of(st.sampled_from((0.0, 1.0, 2.0, math.nan, math.inf, -math.inf)), st.floats(0.001, 1.0))
ROW = st.fixed_dictionaries({
    "kind": st.sampled_from(("address", "fqdn", "ipv6", "series")), "i": st.integers(0, NODES),
    "pool": st.sampled_from(("us", "us", "eu", None)), "replica": st.integers(0, 3), "value": VALUES,
    "named": st.booleans(), "other_label": st.integers(0, 7),
    # its timestamp() sample: fresh, stale, NaN, missing, twice (the last one counts), or with the metric name
    "ts": st.sampled_from(("fresh", "fresh", "stale", "nan", "missing", "twice", "named")),
    "result": st.sampled_from(("ok", "slow", "cuda_error")), "gpu": st.sampled_from(("H100", "A100")),
})


def _series(rows, name: str, series_label: str) -> list[Sample]:
    out = []
    for r in rows:
        lab = {"__name__": name} if r["named"] else {}
        # now and then the key under the other label only: no series of a pool on `node` then
        lab["instance" if r["other_label"] == 0 else series_label] = _key(r["kind"], r["i"])
        if r["pool"] is not None:
            lab["pool"] = r["pool"]
        if r["replica"] == 1:
            lab["replica"] = "b"  # a second series for the same key: a conflict
        lab.update(result=r["result"], gpu=r["gpu"], job="vllm")
        out.append(Sample(lab, r["value"], 1000.0))
    return out


def _stamps(samples: list[Sample], rows) -> list[Sample]:
    out = []
    for s, r in zip(samples, rows, strict=True):
        lab = {k: v for k, v in s.labels.items() if k != "__name__"}
        if r["ts"] == "missing":
            continue
        if r["ts"] == "named":
            lab["__name__"] = "timestamp_kept_its_name"
        age = {"stale": 300.0, "nan": math.nan}.get(r["ts"], 5.0)
        if r["ts"] == "twice":
            out.append(Sample(dict(lab), 1000.0 - 300.0, 1000.0))  # the earlier one: the last one counts
        out.append(Sample(lab, 1000.0 - age, 1000.0))
    return out


def _answers(data, lat_rows, rate_rows, opt_rows, series_label, stamped):
    samples = {"latency": _series(lat_rows, "lat", series_label), "rate": _series(rate_rows, "rate", series_label)}
    if stamped:
        for name, rows in (("latency", lat_rows), ("rate", rate_rows)):
            samples[f"{name}_timestamp"] = _stamps(samples[name], rows)
    optional = {}
    for k, name in enumerate(decide.OPTIONAL):
        rows = data.draw(st.lists(st.sampled_from(opt_rows), max_size=len(opt_rows))) if opt_rows and k % 3 else \
            opt_rows[k % 2::]
        if name != "live_itl" or k:  # one signal absent: no query at all
            optional[name] = _series(rows, name, series_label)
    return samples, optional


FLEET = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2)), min_size=0, max_size=NODES)


@settings(max_examples=300, deadline=None)
@given(FLEET, st.lists(ROW, max_size=14), st.lists(ROW, max_size=14), st.lists(ROW, max_size=14),
       st.sampled_from(("instance", "node")), st.sampled_from((None, "gpu")), st.booleans(), st.data())
def test_the_observe_side_gives_what_the_plain_version_gave(kinds, lat_rows, rate_rows, opt_rows, series_label,
                                                            peer_group_label, stamped, data):
    pool, srv = _fleet(kinds, series_label, peer_group_label)
    samples, optional = _answers(data, lat_rows, rate_rows, opt_rows, series_label, stamped)
    grouped, grouped_opt = decide.by_pool(samples), decide.by_pool(optional)
    own, own_opt = decide.pool_samples(grouped, "us"), decide.pool_samples(grouped_opt, "us")
    canaries = {"n1": math.inf, "n2": 0.5}

    want = _ref_pool_data(pool, srv, samples, max_age_s=60)
    for got in (decide.pool_data(pool, srv, samples, max_age_s=60),
                decide.pool_data(pool, srv, own, 60, decide._keys(pool, srv))):
        assert repr(got) == repr(want)
    assert repr(decide.pool_data(pool, srv, samples)) == repr(_ref_pool_data(pool, srv, samples))

    want_sig = _ref_signal_maps(pool, srv, optional)
    assert repr(decide.signal_maps(pool, srv, optional)) == repr(want_sig)
    assert repr(decide.signal_maps(pool, srv, own_opt, decide._keys(pool, srv))) == repr(want_sig)

    want_in = _ref_node_inputs(pool, srv, samples, optional, canaries, want)
    assert repr(decide.node_inputs(pool, srv, samples, optional, canaries, want)) == repr(want_in)
    assert repr(decide.node_inputs(pool, srv, own, own_opt, canaries, want, decide._keys(pool, srv))) == \
        repr(want_in)
    assert repr(decide.node_inputs(pool, srv, samples, optional, canaries)) == \
        repr(_ref_node_inputs(pool, srv, samples, optional, canaries, _ref_pool_data(pool, srv, samples)))


@settings(max_examples=100, deadline=None)
@given(FLEET, st.lists(ROW, max_size=14), st.lists(ROW, max_size=14), st.lists(ROW, max_size=14),
       st.sampled_from((None, "gpu")), st.data())
def test_decide_tick_hands_the_policy_what_the_plain_version_built(kinds, lat_rows, rate_rows, opt_rows,
                                                                   peer_group_label, data):
    """decide_tick's plumbing (by_pool, pool_samples, the keys once per pool): the inputs decide_pools gets."""
    pool, srv = _fleet(kinds, "instance", peer_group_label)
    samples, optional = _answers(data, lat_rows, rate_rows, opt_rows, "instance", True)
    other = PoolConfig(name="eu", backend="b_eu")  # a second pool of the tick, on the same answers
    eu = {n: ServerState("b_eu", n, s.address, 100, 100, 0, 2) for n, s in srv.items()}
    seen = {}

    def decide_pools(pools, now):
        for _, inputs, policy in pools:
            seen[policy.name] = inputs
        return [SimpleNamespace(retained={}, nodes={}) for _ in pools]

    obs = decide.Observation(1000.0, samples, optional, {"us": decide.PoolObservation(srv, {}),
                                                         "eu": decide.PoolObservation(eu, {})}, 60.0)
    policies = {p: SimpleNamespace(name=p) for p in ("us", "eu")}
    real, decide.decide_pools = decide.decide_pools, decide_pools  # not monkeypatch: a fixture outlives examples
    try:
        decide.decide_tick(obs, [pool, other], policies)  # type: ignore[arg-type]
    finally:
        decide.decide_pools = real
    for cfg, servers in ((pool, srv), (other, eu)):
        want = _ref_pool_data(cfg, servers, samples, 60.0)
        got = seen.get(cfg.name)
        if want.held:
            assert got is None
        else:
            assert repr(got) == repr(_ref_node_inputs(cfg, servers, samples, optional, {}, want))


def test_ident_is_the_labels_but_the_metric_name():
    for labels in ({}, {"__name__": "x"}, {"__name__": "x", "instance": "a", "pool": "p"}, {"instance": "a"},
                   {"instance": "[fd00::1]:8000", "result": "ok", "le": "+Inf"}):
        assert decide._ident(labels) == _ref_ident(labels)
    assert decide._ident({"__name__": "x", "a": "1"}) == decide._ident({"a": "1"}) != decide._ident({"a": "2"})
