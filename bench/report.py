"""Benchmark report: baselines joined to runs, the acceptance targets (PASS/MISS), Markdown tables. Pure."""

from __future__ import annotations

import statistics

from grayguard.bench.detection import GG, REFERENCES, detection_targets, percentile_table
from grayguard.sim.faults import LATENCY_FAULTS

POLICY_ORDER = ("roundrobin", "leastconn", "seeds", "envoy", "envoy-one", "envoy-lr", "linkerd", "epp", "haproxy",
                "grayguard", "oracle")
FAULTED = ("fault", "sensitivity", "double", "linkerd", "pool")
FAST_FAILS = ("cuda_error", "refused")  # faults HAProxy's reflexes see: the node answers 500 or refuses
RATIOS = ("ttft_p99", "ttft_p999", "e2e_p99", "e2e_p999")


def _order(policies) -> list[str]:
    known = [p for p in POLICY_ORDER if p in policies]
    return known + sorted(p for p in policies if p not in known)


def _ratio(a, b):
    return a / b if a is not None and b else None


def is_peer(policy: str) -> bool:
    """A policy users could run instead of grayguard: not grayguard (on any balancer, or a variant of it:
    `grayguard~knob=value`), not a reference (oracle)."""
    return policy.partition("@")[0].partition("~")[0] != GG and policy not in REFERENCES


def best_peers(rows: list[dict]) -> dict[str, dict]:
    """Per scenario, the peer's row with the lowest P99 TTFT (ties: report order); scenarios without a peer: none."""
    peers = [r for r in rows if is_peer(r["policy"]) and r["ttft_p99"] is not None]
    rank = {p: k for k, p in enumerate(_order({r["policy"] for r in peers}))}
    out: dict[str, dict] = {}
    for r in sorted(peers, key=lambda r: (r["ttft_p99"], rank[r["policy"]])):
        out.setdefault(r["scenario"], r)
    return out


def add_baselines(rows: list[dict]) -> None:
    """Add `<metric>_x` (vs the healthy twin, same policy), `ttft_p99_vs_lc` (vs leastconn, same scenario), and
    `best_peer` with `ttft_p99_vs_best_peer` (vs the scenario's best peer, bench.report.best_peers)."""
    twin = {(r["traffic_key"], r["policy"]): r for r in rows if r["group"] == "healthy"}
    lc = {r["scenario"]: r for r in rows if r["policy"] == "leastconn"}
    for r in rows:
        base = twin.get((r["traffic_key"], r["policy"])) if r["group"] in FAULTED else None
        for m in RATIOS:
            r[m + "_x"] = _ratio(r[m], base[m]) if base else None
        r["ttft_p99_settled_x"] = _ratio(r.get("ttft_p99_settled"), base["ttft_p99"]) if base else None
        # failures the fault caused: errors and 503s, and the timeouts beyond the fault-free run's (a mixed
        # pool's slowest class times out a few long generations without any fault)
        r["failed_by_fault"] = r["error"] + r["no_server"] + max(0, r["timeout"] - base["timeout"]) if base else None
        other = lc.get(r["scenario"])
        r["ttft_p99_vs_lc"] = _ratio(r["ttft_p99"], other["ttft_p99"]) if other else None
    best = best_peers(rows)
    for r in rows:
        b = best.get(r["scenario"])
        r["best_peer"] = b["policy"] if b else None
        r["ttft_p99_vs_best_peer"] = _ratio(r["ttft_p99"], b["ttft_p99"]) if b else None


def _med(vals):
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else None


def _f(x, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _pct2(x) -> str:
    return "–" if x is None else f"{100 * x:.2f} %"


def _failed(r: dict) -> int:
    """Client requests that got no answer: HTTP errors, HAProxy's 503s, timeouts."""
    return r["error"] + r["no_server"] + r["timeout"]


def _share(n: int, d: int) -> float | None:
    return n / d if d else None


def _target(name: str, ok: bool | None, measured: str, detail: str = "") -> dict:
    return {"target": name, "status": "n/a" if ok is None else "PASS" if ok else "MISS", "measured": measured,
            "detail": detail}


def targets(rows: list[dict]) -> list[dict]:
    """The issue's acceptance targets for grayguard's default policy, measured."""
    gg = [r for r in rows if r["policy"] == GG]
    out = []
    benign = [r for r in gg if r["group"] == "benign"]
    # a DOWN (agent) takes a node out of rotation as surely as a drain: it counts as a false quarantine here
    bad = [r for r in benign if r["false_quarantines"] or r.get("false_agent_downs")]
    out.append(_target("zero false quarantines in every benign scenario", None if not benign else not bad,
                       f"{sum(r['false_quarantines'] for r in benign)} false quarantine(s) and "
                       f"{sum(r.get('false_agent_downs', 0) for r in benign)} agent mark-down(s) in {len(benign)} "
                       "scenarios",
                       ", ".join(f"{r['scenario']} ({r['false_quarantines']}, agent {r.get('false_agent_downs', 0)})"
                                 for r in bad)))
    slow = [r for r in gg if r["group"] in ("fault", "sensitivity") and (r.get("slowdown") or 0) >= 2]
    missed = [r for r in slow if r["t_quarantine_s"] is None]
    sizes = sorted({r["size"] for r in slow})
    out.append(_target(f"quarantines every injected slowdown >= 2x (pool sizes {', '.join(map(str, sizes))})",
                       None if not slow else not missed, f"{len(slow) - len(missed)}/{len(slow)} quarantined",
                       ", ".join(r["scenario"] for r in missed)))
    faults = [r for r in gg if r["group"] == "fault"]
    m = _med(r["ttft_p99_x"] for r in faults)
    lat = [r for r in faults if r["fault"] in LATENCY_FAULTS]
    other = [r for r in faults if r["fault"] not in LATENCY_FAULTS]
    out.append(_target("P99 TTFT during faults within 1.3x of the healthy baseline (median over fault scenarios)",
                       None if m is None else m <= 1.3, f"median {_f(m)}x over {len(faults)} scenarios",
                       f"slowdown faults ({', '.join(LATENCY_FAULTS)}): {_f(_med(r['ttft_p99_x'] for r in lat))}x "
                       f"over {len(lat)}; the others (requests fail): {_f(_med(r['ttft_p99_x'] for r in other))}x "
                       f"over {len(other)}"))
    by = {(r["scenario"], r["policy"]): r for r in rows}
    others = _order({r["policy"] for r in rows if r["group"] == "fault"} - {GG} - REFERENCES)
    parts, ok, losses, e2e = [], True, [], []
    for p in others:
        rel = [_ratio(r["ttft_p99"], by[(r["scenario"], p)]["ttft_p99"]) for r in faults if (r["scenario"], p) in by]
        mr = _med(rel)
        lost = sum(1 for x in rel if x is not None and x > 1.05)
        ok = ok and mr is not None and mr < 1.0
        parts.append(f"{p} {_f(mr)}x")
        losses.append(f"{p} {lost}")
        rel_e2e = [_ratio(r["e2e_p99"], by[(r["scenario"], p)]["e2e_p99"]) for r in faults if (r["scenario"], p) in by]
        e2e.append(f"{p} {_f(_med(rel_e2e))}x")
    out.append(_target("beats every other policy on P99 TTFT in the fault scenarios (median of grayguard/other)",
                       None if not faults or not others else ok, ", ".join(parts),
                       f"scenarios where grayguard's P99 TTFT was >5 % worse: {', '.join(losses)} of {len(faults)}; "
                       f"P99 e2e grayguard/other: {', '.join(e2e)}"))
    return out + reflex_targets(gg) + detection_targets(rows, _target)


def reflex_targets(gg: list[dict]) -> list[dict]:
    """Issue 14's targets (gateway reflexes), over grayguard's rows; every scenario must meet them."""
    out = []
    fast = [r for r in gg if r["group"] == "fault" and r["fault"] in FAST_FAILS]
    sizes = ", ".join(map(str, sorted({r["size"] for r in fast})))
    shares = [(_share(r["failed_by_fault"], r["requests"]) if r["failed_by_fault"] is not None else None, r)
              for r in fast]
    bad = [r for x, r in shares if x is None or x > 0.001]
    worst = max(shares, key=lambda xr: xr[0] or 0.0, default=(None, None))
    out.append(_target(f"{' and '.join(FAST_FAILS)}: failed client requests <= 0.1 % of the fault window's requests "
                       f"in every scenario (pool sizes {sizes})", None if not fast else not bad,
                       f"{sum(r['failed_by_fault'] or 0 for r in fast)} failed of {sum(r['requests'] for r in fast)} "
                       f"over {len(fast)} scenarios (errors, 503s, timeouts beyond the fault-free run's); "
                       f"worst {_pct2(worst[0])}"
                       + (f" ({worst[1]['scenario']})" if worst[1] else ""),
                       ", ".join(f"{r['scenario']} ({_pct2(x)})" for x, r in shares if r in bad)))
    xs = [(r["ttft_p99_x"], r) for r in fast]
    slow = [r for x, r in xs if x is None or x > 1.2]
    out.append(_target(f"{' and '.join(FAST_FAILS)}: P99 TTFT <= 1.2x the healthy baseline in every scenario",
                       None if not fast else not slow,
                       f"median {_f(_med(x for x, _r in xs))}x, "
                       f"worst {_f(max((x or 0.0 for x, _r in xs), default=None))}x",
                       ", ".join(f"{r['scenario']} ({_f(x)}x)" for x, r in xs if r in slow)))
    garbage = [r for r in gg if r["group"] == "fault" and r["fault"] == "garbage"]
    late = [r for r in garbage if r["garbage"] and (r["t_garbage_to_drain_s"] is None or r["t_garbage_to_drain_s"] > 5)]
    out.append(_target("garbage: drained within 5 s of the first garbage answer, in every scenario",
                       None if not garbage else not late,
                       f"median {_f(_med(r['t_garbage_to_drain_s'] for r in garbage), 1, ' s')}, worst "
                       f"{_f(max((r['t_garbage_to_drain_s'] or 0.0 for r in garbage), default=None), 1, ' s')}",
                       ", ".join(f"{r['scenario']} ({_f(r['t_garbage_to_drain_s'], 1, ' s')})" for r in late)))
    gs = [(_share(r["garbage"], r["requests"]), r) for r in garbage]
    many = [r for x, r in gs if x is None or x > 0.005]
    out.append(_target("garbage: answers delivered <= 0.5 % of the window's requests, in every scenario",
                       None if not garbage else not many,
                       f"{sum(r['garbage'] for r in garbage)} of {sum(r['requests'] for r in garbage)} over "
                       f"{len(garbage)} scenarios; worst {_pct2(max((x or 0.0 for x, _r in gs), default=None))}",
                       ", ".join(f"{r['scenario']} ({_pct2(x)})" for x, r in gs if r in many)))
    hang = [r for r in gg if r["group"] == "fault" and r["fault"] == "hang"]
    m = _med(r["ttft_p99_x"] for r in hang)
    out.append(_target("hang: P99 TTFT <= 1.1x the baseline (median over hang scenarios)",
                       None if m is None else m <= 1.1, f"median {_f(m)}x over {len(hang)} scenarios"))
    pool = [r for r in gg if r["group"] == "pool"]
    storm = [r for r in pool if r["retried_share"] is None or r["retried_share"] > 0.10]
    out.append(_target("whole pool failing at once: retried requests <= 10 % of traffic, in every scenario",
                       None if not pool else not storm,
                       f"worst {_pct(max((r['retried_share'] or 0.0 for r in pool), default=None))} over "
                       f"{len(pool)} scenarios", ", ".join(f"{r['scenario']} ({_pct(r['retried_share'])})"
                                                           for r in storm)))
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _fault_summary(rows: list[dict]) -> list[str]:
    faults = [r for r in rows if r["group"] == "fault"]
    if not faults:
        return []
    n = len({r["scenario"] for r in faults})
    body = []
    for p in _order({r["policy"] for r in faults}):
        rs = [r for r in faults if r["policy"] == p]
        slow = [r for r in rs if (r.get("slowdown") or 0) >= 2]
        body.append([p, f"{sum(r['t_cut_s'] is not None for r in slow)}/{len(slow)}",
                     f"{sum(r['t_quarantine_s'] is not None for r in slow)}/{len(slow)}",
                     _f(_med(r["t_cut_s"] for r in slow), 0, " s"),
                     _f(_med(r["t_quarantine_s"] for r in slow), 0, " s"),
                     sum(r["false_cuts"] for r in rs), sum(r["false_quarantines"] for r in rs),
                     _f(_med(r["ttft_p99_x"] for r in rs)), _f(_med(r["ttft_p999_x"] for r in rs)),
                     _f(_med(r["e2e_p99_x"] for r in rs)), sum(r["timeout"] for r in rs),
                     sum(r["error"] + r["no_server"] for r in rs), sum(r["garbage"] for r in rs),
                     _pct(_med(r["capacity_kept"] for r in rs))])
    return [f"### Fault scenarios ({n}: every fault type x pool size x mix x load)", "",
            "Detection columns count the slowdown faults of 2x or more (thermal, pcie, slow_recovery); "
            "latency columns are medians over all fault scenarios of P99 during the fault / P99 of the same "
            "scenario without the fault (same policy, same seed); failed requests (timeouts, errors, garbage) "
            "count as the client deadline. Counts are sums over the scenarios' fault windows.", ""] + _table(
        ["policy", "slowdowns cut", "quarantined", "median time to cut", "median time to quarantine",
         "false cuts", "false quarantines", "P99 TTFT x", "P99.9 TTFT x", "P99 e2e x", "timeouts", "errors",
         "garbage answers", "capacity kept"], body) + [""]


def _per_fault(rows: list[dict]) -> list[str]:
    faults = [r for r in rows if r["group"] == "fault"]
    if not faults:
        return []
    pols = _order({r["policy"] for r in faults})
    body = []
    for f in sorted({r["fault"] for r in faults}):
        rs = [r for r in faults if r["fault"] == f]
        g = [r for r in rs if r["policy"] == GG]
        row = [f] + [_f(_med(r["ttft_p99_x"] for r in rs if r["policy"] == p)) for p in pols]
        row += [f"{sum(r['t_quarantine_s'] is not None for r in g)}/{len(g)}",
                _f(_med(r["t_cut_s"] for r in g), 0, " s"), _f(_med(r["t_quarantine_s"] for r in g), 0, " s"),
                sum(r["timeout"] for r in g), sum(r["error"] for r in g), sum(r["garbage"] for r in g)]
        body.append(row)
    return ["### Per fault type (median P99 TTFT x healthy baseline over sizes, mixes, loads)", ""] + _table(
        ["fault"] + pols + ["grayguard quarantined", "time to cut", "time to quarantine", "timeouts", "errors",
                            "garbage answers"], body) + [""]


def _per_size(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "fault" and (r.get("slowdown") or 0) >= 2]
    if not rs:
        return []
    pols = _order({r["policy"] for r in rs})
    body = []
    for size in sorted({r["size"] for r in rs}):
        for mix in sorted({r["mix"] for r in rs}):
            sub = [r for r in rs if r["size"] == size and r["mix"] == mix]
            g = [r for r in sub if r["policy"] == GG]
            if not g:
                continue
            body.append([size, mix] + [_f(_med(r["ttft_p99_x"] for r in sub if r["policy"] == p)) for p in pols]
                        + [f"{sum(r['t_quarantine_s'] is not None for r in g)}/{len(g)}",
                           _f(_med(r["t_quarantine_s"] for r in g), 0, " s"),
                           _f(_med(r["ttft_p99_settled_x"] for r in g)),
                           sum(r["false_cuts"] for r in g), sum(r["false_quarantines"] for r in g)])
    return ["### Slowdown faults of 2x or more, by pool (median P99 TTFT x baseline; grayguard detection)", "",
            "`after quarantine`: grayguard's P99 TTFT over the requests that arrived once the faulty node was "
            "drained, against the baseline: the price of the lost capacity, without the detection delay.", ""] + _table(
        ["nodes", "mix"] + pols + ["quarantined", "time to quarantine", "P99 after quarantine x", "false cuts",
                                   "false quarantines"], body) + [""]


def _reflexes(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "fault" and r["fault"] in (*FAST_FAILS, "garbage", "hang")]
    if not rs:
        return []
    body = []
    for f in sorted({r["fault"] for r in rs}):
        for p in _order({r["policy"] for r in rs}):
            sub = [r for r in rs if r["fault"] == f and r["policy"] == p]
            req = sum(r["requests"] for r in sub)
            nf = sum(_failed(r) for r in sub)
            body.append([f, p, len(sub), req, f"{nf} ({_pct2(_share(nf, req))})",
                         f"{max((_failed(r) / r['requests'] for r in sub if r['requests']), default=0.0) * 100:.2f} %",
                         f"{sum(r['garbage'] for r in sub)} ({_pct2(_share(sum(r['garbage'] for r in sub), req))})",
                         f"{sum(r['retried'] for r in sub)} ({_pct2(_share(sum(r['retried'] for r in sub), req))})",
                         sum(r["gateway_downs"] for r in sub), sum(r.get("agent_downs", 0) for r in sub),
                         _f(_med(r["ttft_p99_x"] for r in sub)),
                         _f(max((r["ttft_p99_x"] or 0.0 for r in sub), default=None)),
                         _f(_med(r["t_garbage_to_drain_s"] for r in sub), 1, " s"),
                         _f(_med(r.get("t_garbage_to_out_s") for r in sub), 1, " s")])
    return ["### Fast failures and garbage: what reached the clients (sums over sizes, mixes, loads)", "",
            "failed = HTTP errors + HAProxy 503s + timeouts; retried = client requests HAProxy retried on another "
            "server; marked down = HAProxy's own mark-downs (error-limit, failed checks); agent down = DOWN (agent) "
            "mark-downs (the exporter's verdict); garbage to out = from the first garbage answer to the node's leaving "
            "rotation (drained, or DOWN (agent)). Only `haproxy`, `grayguard` and `oracle` have HAProxy's reflexes.",
            ""] + _table(
        ["fault", "policy", "scenarios", "requests", "failed", "worst scenario", "garbage answers", "retried",
         "marked down", "agent down", "median P99 TTFT x", "worst P99 TTFT x", "garbage to drain", "garbage to out"],
        body) + [""]


def _pool(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "pool"]
    if not rs:
        return []
    by = sorted(rs, key=lambda r: (r["scenario"], _order([x["policy"] for x in rs]).index(r["policy"])))
    body = [[r["scenario"], r["policy"], r["requests"], f"{r['ok']} ({_pct(r['success_ratio'])})", _failed(r),
             f"{r['retried']} ({_pct(r['retried_share'])})", r["retries"], r["gateway_downs"],
             _f(r["t_quarantine_s"], 0, " s")] for r in by]
    return ["### The whole pool failing at once (every node answers HTTP 500): no retry storm", ""] + _table(
        ["scenario", "policy", "requests", "answered", "failed", "retried requests", "retries", "marked down",
         "all quarantined after"], body) + [""]


def _sensitivity(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "sensitivity"]
    if not rs:
        return []
    body = []
    for r in sorted((r for r in rs if r["policy"] == GG), key=lambda r: (r["slowdown"] or 0, r["size"])):
        body.append([_f(r["slowdown"], 2, "x"), r["size"], _f(r["t_cut_s"], 0, " s"), _f(r["t_quarantine_s"], 0, " s"),
                     r["false_cuts"], r["false_quarantines"], _f(r["ttft_p99_x"]), _f(r["ttft_p99_vs_lc"])])
    return ["### Sensitivity: thermal slowdown k on homogeneous pools, steady load (grayguard)", ""] + _table(
        ["slowdown", "nodes", "time to cut", "time to quarantine", "false cuts", "false quarantines",
         "P99 TTFT x baseline", "P99 TTFT vs leastconn"], body) + [""]


def _benign(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "benign"]
    if not rs:
        return []
    pols = [p for p in _order({r["policy"] for r in rs}) if p not in ("roundrobin", "leastconn")]
    by = {(r["scenario"], r["policy"]): r for r in rs}
    body = []
    for scn in sorted({r["scenario"] for r in rs}):
        row = [scn]
        for p in pols:
            r = by.get((scn, p))
            row.append("–" if r is None else f"{r['false_cuts']} / {r['false_quarantines']}")
        g = by.get((scn, GG))
        row += [_f(g["ttft_p99_vs_lc"]) if g else "–", _pct(g["capacity_kept"]) if g else "–",
                g.get("false_agent_downs", 0) if g else "–"]
        body.append(row)
    return ["### Benign scenarios (must trigger nothing): false cuts / false quarantines", ""] + _table(
        ["scenario"] + pols + ["grayguard P99 TTFT vs leastconn", "grayguard capacity kept",
                               "grayguard agent mark-downs"], body) + [""]


def _double(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "double"]
    if not rs:
        return []
    pols = _order({r["policy"] for r in rs})
    by = {(r["scenario"], r["policy"]): r for r in rs}
    body = []
    for scn in sorted({r["scenario"] for r in rs}):
        g = by.get((scn, GG))
        body.append([scn] + [_f(by[(scn, p)]["ttft_p99_x"]) if (scn, p) in by else "–" for p in pols]
                    + ([f"{g['faulty_cut']}/{g['faulty_quarantined']}", g["false_quarantines"]] if g else ["–", "–"]))
    return ["### Two faults at once (P99 TTFT x baseline)", ""] + _table(
        ["scenario"] + pols + ["grayguard faulty nodes cut/quarantined", "false quarantines"], body) + [""]


def _linkerd(rows: list[dict]) -> list[str]:
    rs = [r for r in rows if r["group"] == "linkerd"]
    if not rs:
        return []
    body = [[r["policy"], _pct(r["success_ratio"]), r["timeout"], r["requests"], _f(r["e2e_p99"], 3, " s"),
             _f(r["t_cut_s"], 1, " s"), _f(r["t_quarantine_s"], 1, " s")]
            for r in sorted(rs, key=lambda r: _order([x["policy"] for x in rs]).index(r["policy"]))]
    return ["### Linkerd \"Beyond Round Robin\" replica (11 backends, 1000 req/s, one at 2 s for 30 s, 1 s timeout)",
            "", "Linkerd measured about 95 % (round robin), 99 % (least loaded), 99.9 % (peak EWMA).", ""] + _table(
        ["policy", "success", "timeouts", "requests", "P99 e2e", "time to cut", "time to quarantine"], body) + [""]


def _best_peer(rows: list[dict]) -> list[str]:
    gg = {r["scenario"]: r for r in rows if r["policy"] == GG}
    body, faults = [], []
    for scn in sorted(gg):
        g = gg[scn]
        if g.get("best_peer") is None:
            continue
        peer = next(r for r in rows if r["scenario"] == scn and r["policy"] == g["best_peer"])
        body.append([scn, g["best_peer"], _f(peer["ttft_p99"], 3), _f(g["ttft_p99"], 3),
                     _f(g["ttft_p99_vs_best_peer"])])
        if g["group"] in FAULTED:
            faults.append(g["ttft_p99_vs_best_peer"])
    if not body:
        return []
    return ["### grayguard against the best peer of each scenario (P99 TTFT)", "",
            "The best peer: the policy other than grayguard and the oracle with the lowest P99 TTFT in the scenario "
            "(failed requests count as the client deadline). grayguard / best peer below 1: grayguard is faster. "
            f"Median over the faulted scenarios: {_f(_med(faults))}x over {len(faults)}.", ""] + _table(
        ["scenario", "best peer", "its P99 TTFT", "grayguard P99 TTFT", "grayguard / best peer"], body) + [""]


def _details(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        body.append([r["scenario"], r["policy"], _f(r["t_cut_s"], 0), _f(r["t_quarantine_s"], 0),
                     f"{r['false_cuts']}/{r['false_quarantines']}", _f(r["ttft_p99"], 3), _f(r["ttft_p99_x"]),
                     _f(r["ttft_p999_x"]), _f(r["e2e_p99"], 2), _f(r["e2e_p99_x"]), r["timeout"],
                     r["error"] + r["no_server"], _pct(r["capacity_kept"]), r.get("best_peer") or "–",
                     _f(r.get("ttft_p99_vs_best_peer"))])
    return ["## Per scenario", "", "Times in seconds from the fault; x = ratio to the healthy baseline; vs best peer = "
            "P99 TTFT over that of the scenario's best peer (the policy other than grayguard and the oracle with the "
            "lowest).", ""] + _table(
        ["scenario", "policy", "cut", "quarantine", "false cut/q", "P99 TTFT", "x", "P99.9 TTFT x", "P99 e2e",
         "x", "timeouts", "errors", "capacity", "best peer", "P99 TTFT vs best peer"], body)


def markdown_parts(rows: list[dict], tgt: list[dict], meta: dict) -> tuple[list[str], list[str], list[str]]:
    """The report's Markdown lines in three parts: the title and the targets, the summary tables, every run."""
    head = [f"# grayguard bench: suite `{meta['suite']}`", "",
            f"{meta['scenarios']} scenarios, {meta['runs']} runs in {meta['families']} families, "
            f"{meta['wall_s']} s wall on {meta['workers']} worker(s) ({meta['cpu_s']} s of simulation), "
            f"commit {meta['commit'] or '?'}{' (controller/ modified)' if meta['controller_dirty'] else ''}.", ""]
    tl = ["### Targets (grayguard default policy)", ""] + [
        f"- **{t['status']}** {t['target']}: {t['measured']}" + (f" ({t['detail']})" if t["detail"] else "")
        for t in tgt] + [""]
    tables = _fault_summary(rows) + _per_fault(rows) + _reflexes(rows) + _pool(rows) + _per_size(rows) \
        + percentile_table(rows) + _sensitivity(rows) + _benign(rows) + _double(rows) + _linkerd(rows) \
        + _best_peer(rows)
    return head + tl, tables, _details(rows)


def markdown(rows: list[dict], tgt: list[dict], meta: dict) -> str:
    """The report as Markdown: targets, summary tables, then every run."""
    return "\n".join(line for part in markdown_parts(rows, tgt, meta) for line in part) + "\n"

