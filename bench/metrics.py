"""Per-run figures from a RunResult: detection times, false cuts, client latency percentiles, capacity kept.

Definitions (docs/benchmarks.md):
- a node is *cut* when its weight falls below its base weight while it stays in rotation, *quarantined*
  when it is drained or set to weight 0 by a detector (Envoy ejection, the seeds' quarantine, grayguard's
  quarantined/canary states). A grayguard KV-saturation pause (weight 0, not drained) counts as a cut.
- latency percentiles cover every request that ARRIVED in the scenario's measurement window: answered
  ones with their latency, failed ones (timeout, HTTP error, no server, garbage text — the load generator
  counts that as an error too) as the client deadline: a failure is no better than the slowest acceptable
  answer, so a policy cannot improve its P99 by failing requests fast. A timed-out request that got its
  first token keeps that TTFT.
- a node that joins the pool (Scenario.absent) and is held in slow start from its join is warming up, not cut,
  until it first leaves slow start or reaches full weight; a node absent from the pool has no weight at all.
- agent mark-downs: HAProxy marked a server DOWN (agent) because its exporter answered "down"; a false one
  is on a node without a fault (or before its fault), at any time of the run.
- capacity kept: time average over the window of sum(capacity x min(1, weight/base)) over the nodes
  WITHOUT a fault, divided by their total capacity (1.0: nothing healthy was cut).
"""

from __future__ import annotations

import math

from grayguard.bench.engine import ERROR, GARBAGE, NO_SERVER, OK, TIMEOUT, RunResult
from grayguard.vocab import EJECTED

QUARANTINE_STATES = EJECTED  # grayguard's drained states (quarantined, canary)


def percentile(sorted_vals: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of a sorted list; None when empty."""
    if not sorted_vals:
        return None
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _kind(weight: int, drained: bool, state: str, base: int) -> str:
    if drained or state in QUARANTINE_STATES:
        return "quarantine"
    if weight < base:
        return "cut"
    return "full"


def transitions(res: RunResult) -> list[tuple[float, int, str]]:
    """(time, node, 'cut' | 'quarantine') each time a node newly enters a cut or quarantine.

    The slow start of a node that joined the pool (a new node's warm-up) is not a cut while it lasts, unless a finding
    cuts it (RunResult.cuts).
    """
    return [(t, k, new) for t, k, old, new in _changes(res) if new != "full" and (new == "quarantine" or old == "full")]


def out_of_full(res: RunResult) -> list[tuple[float, float, int]]:
    """(start, end, node) of every span a node spent below its full weight (cut or quarantined); a span still
    open at the run's end ends there."""
    start: dict[int, float] = {}
    out = []
    for t, k, old, new in _changes(res):
        if old == "full":
            start[k] = t
        elif new == "full":
            out.append((start.pop(k), t, k))
    return out + [(t0, float(res.scenario.duration_s), k) for k, t0 in start.items()]


def _changes(res: RunResult) -> list[tuple[float, int, str, str]]:
    """(time, node, kind before, kind after) at each change of a node's kind (full, cut, quarantine)."""
    scn = res.scenario
    bases = [n.base_weight for n in scn.nodes]
    joins = [sorted(scn.joins(n.name)) for n in scn.nodes]
    seen_join = [-math.inf] * len(bases)  # the last join already taken into account, per node
    warming = [False] * len(bases)
    cut = [False] * len(bases)  # a finding holds it below its state's weight (a warm-up's own cut counts as a cut)
    kind = ["full"] * len(bases)
    w, d, st = list(bases), [False] * len(bases), ["healthy"] * len(bases)
    # the assignments and the cut marks in time order (a mark after the assignment of the same tick)
    events = sorted([(r[0], 0, i, r) for i, r in enumerate(res.timeline)]
                    + [(c[0], 1, i, c) for i, c in enumerate(res.cuts)], key=lambda e: e[:3])
    out = []
    for t, is_mark, _, row in events:
        k = row[1]
        if is_mark:
            cut[k] = row[2]
        else:
            w[k], d[k], st[k] = row[2], row[3], row[4]
            j = max((x for x in joins[k] if x <= t), default=-math.inf)
            if j > seen_join[k]:
                seen_join[k], warming[k] = j, True
            if st[k] != "slow_start" or d[k] or w[k] >= bases[k]:
                warming[k] = False
        new = ("cut" if cut[k] else "full") if warming[k] else _kind(w[k], d[k], st[k], bases[k])
        if new != kind[k]:
            out.append((t, k, kind[k], new))
        kind[k] = new
    return out


def capacity_kept(res: RunResult, lo: float, hi: float) -> float | None:
    """Time-averaged share of the fault-free nodes' capacity left in rotation over [lo, hi)."""
    scn = res.scenario
    faulty = scn.faulty
    healthy = [k for k, n in enumerate(scn.nodes) if n.name not in faulty]
    total = sum(scn.nodes[k].capacity_rps for k in healthy)
    if not healthy or hi <= lo or total <= 0:
        return None
    share = {k: 1.0 for k in healthy}
    area, last = 0.0, lo
    cur = 1.0
    for t, k, w, d, _st in sorted(res.timeline, key=lambda r: r[0]):
        if k not in share:
            continue
        if t > last:
            seg_end = min(t, hi)
            if seg_end > last:
                area += cur * (seg_end - last)
                last = seg_end
        base = scn.nodes[k].base_weight
        share[k] = 0.0 if d or base <= 0 else min(1.0, w / base)
        cur = sum(share[j] * scn.nodes[j].capacity_rps for j in healthy) / total
    if hi > last:
        area += cur * (hi - last)
    return area / (hi - lo)


def summarize(res: RunResult) -> dict:
    """The figures of one run (plain JSON types)."""
    scn = res.scenario
    lo, hi = scn.window
    timeout = scn.load.timeout_s
    ttft, e2e = [], []
    counts = {"requests": 0, "ok": 0, "timeout": 0, "error": 0, "garbage": 0, "no_server": 0}
    names = {OK: "ok", TIMEOUT: "timeout", ERROR: "error", GARBAGE: "garbage", NO_SERVER: "no_server"}
    faulty_idx = {k for k, n in enumerate(scn.nodes) if n.name in scn.faulty}
    on_faulty = retried = retries = 0
    first_bad = math.inf  # when the first garbage answer reached a client (from a request of the window)
    tried = res.retried or bytearray(len(res.t))
    for i, t in enumerate(res.t):
        if not lo <= t < hi:
            continue
        st = res.status[i]
        counts["requests"] += 1
        counts[names.get(st, "timeout")] += 1
        on_faulty += res.node[i] in faulty_idx
        retried += tried[i] > 0
        retries += tried[i]
        if st == GARBAGE:
            first_bad = min(first_bad, t + res.e2e[i])
        if st == OK:
            ttft.append(res.ttft[i])
            e2e.append(res.e2e[i])
        elif st == TIMEOUT:
            ttft.append(res.ttft[i] if res.ttft[i] == res.ttft[i] else timeout)
            e2e.append(timeout)
        else:  # HTTP error (also mid-stream), no server, garbage text: the client got no usable answer
            ttft.append(timeout)
            e2e.append(timeout)
    ttft.sort()
    e2e.sort()
    trans = transitions(res)
    first: dict[str, dict[str, float]] = {"cut": {}, "quarantine": {}}
    false_cuts = false_quarantines = 0
    fault_at = {f.node: f.at_s for f in scn.faults}
    for t, k, kind in trans:
        name = scn.nodes[k].name
        if name in fault_at and t >= fault_at[name]:
            first[kind].setdefault(name, t - fault_at[name])
            if kind == "quarantine":
                first["cut"].setdefault(name, t - fault_at[name])
        else:  # a node without a fault, or a faulty node before its fault started
            if kind == "cut":
                false_cuts += 1
            else:
                false_quarantines += 1
    # the longest time a node without a fault (or before its fault) spent cut or drained (issue 13: no false cut
    # longer than one tick)
    false_spans = [t1 - t0 for t0, t1, k in out_of_full(res) if t0 < fault_at.get(scn.nodes[k].name, math.inf)]
    n = counts["requests"]
    t_bad_drain = None  # from the first garbage answer delivered to the drain of the node that gave it
    if first_bad < math.inf:
        q_abs = [fault_at[scn.nodes[k].name] + first["quarantine"][scn.nodes[k].name] for k in faulty_idx
                 if scn.nodes[k].name in first["quarantine"]]
        t_bad_drain = max(0.0, min(q_abs) - first_bad) if q_abs else None
        # out of rotation by any means: drained, or DOWN (agent) once the fault started
        out_abs = q_abs + [t for t, k, down, why in res.gateway if down and why == "agent" and k in faulty_idx
                           and t >= fault_at[scn.nodes[k].name]]
        t_bad_out = max(0.0, min(out_abs) - first_bad) if out_abs else None
    else:
        t_bad_out = None
    agent_downs = [(t, k) for t, k, down, why in res.gateway if down and why == "agent"]
    false_agent = sum(1 for t, k in agent_downs if t < fault_at.get(scn.nodes[k].name, math.inf))
    agent_first: dict[str, float] = {}  # from each faulty node's fault to its first DOWN (agent)
    for t, k in agent_downs:
        name = scn.nodes[k].name
        if t >= fault_at.get(name, math.inf):
            agent_first.setdefault(name, t - fault_at[name])
    settled = None  # P99 TTFT once every faulty node was drained: what is left is the capacity cost
    t_q = max(first["quarantine"].values()) if fault_at and len(first["quarantine"]) == len(fault_at) else None
    if t_q is not None:
        start = max(fault_at.values()) + t_q
        settled = percentile(sorted(x for x, t, st in zip(res.ttft, res.t, res.status, strict=True)
                                    if start <= t < hi and st == OK and x == x), 99)

    def worst(d: dict[str, float]) -> float | None:  # the last faulty node to be handled; None if one never was
        return max(d.values()) if d and len(d) == len(fault_at) else None

    return {
        "scenario": scn.name, "policy": res.policy, "group": scn.group, **scn.tag,
        "window": [lo, hi], "nodes": len(scn.nodes),
        "t_cut_s": worst(first["cut"]), "t_quarantine_s": worst(first["quarantine"]),
        "t_agent_down_s": worst(agent_first),
        "faulty_cut": len(first["cut"]), "faulty_quarantined": len(first["quarantine"]),
        "false_cuts": false_cuts, "false_quarantines": false_quarantines,
        "false_cut_longest_s": max(false_spans, default=None), "tick_s": scn.tick_s,
        "ttft_p99_settled": settled,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "ttft_p999": percentile(ttft, 99.9),
        "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99), "e2e_p999": percentile(e2e, 99.9),
        **counts,
        "success_ratio": counts["ok"] / n if n else None,
        "failed_share": (counts["error"] + counts["no_server"]) / n if n else None,
        "garbage_share": counts["garbage"] / n if n else None,
        "retried": retried, "retries": retries, "retried_share": retried / n if n else None,
        "t_garbage_to_drain_s": t_bad_drain, "t_garbage_to_out_s": t_bad_out,
        "gateway_downs": sum(1 for _t, _k, down, why in res.gateway if down and why != "agent" and lo <= _t < hi),
        "agent_downs": sum(1 for t, _k in agent_downs if lo <= t < hi), "false_agent_downs": false_agent,
        "on_faulty_share": on_faulty / n if n else None,
        "capacity_kept": capacity_kept(res, lo, hi),
        "canaries": res.canaries, "wall_s": round(res.wall_s, 3),
    }
