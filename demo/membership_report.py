"""The membership scenario's report: milestones of the join and the crash from what was observed (pure functions over
the HAProxy and registry logs and the client records), the verdict, and report.json / report.md / report.html."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grayguard.controller.haproxy import DRAIN_MASK, MAINT_MASK
from grayguard.demo.report import rolling_percentile
from grayguard.demo.report_html import phases_table, timeline, verdict_class
from grayguard.htmlpage import e, kv_table, page
from grayguard.reflexes import DEFAULT
from grayguard.svgplot import line_chart

SRV_RUNNING = 2  # srv_op_state of a server that is UP (0: stopped, DOWN; 1: starting; 3: stopping)


def _first(log: Sequence[dict], node: str, since: float, pred) -> dict | None:
    """The first entry of node's HAProxy log at or after since for which pred holds."""
    return next((e for e in log if e["node"] == node and e["t"] >= since and pred(e)), None)


def ready(e: dict) -> bool:
    """Present in HAProxy and taking traffic as far as its admin state goes (not in maintenance, not drained)."""
    return e["present"] and not e["admin"] & (DRAIN_MASK | MAINT_MASK)


def in_rotation(e: dict) -> bool:
    """HAProxy sends it new requests: ready, UP and weighted."""
    return ready(e) and e["op"] == SRV_RUNNING and e["weight"] > 0


def join_milestones(haproxy: Sequence[dict], registry: Sequence[dict], node: str, started: float | None,
                    warm_weight: int, base_weight: int) -> dict[str, Any]:
    """When the joining node registered, entered HAProxy (and at which weight), came UP, began and ended its slow
    start; seconds from the start of the load, None where it did not happen."""
    put = next((e for e in registry if e["node"] == node and e["kind"] == "put"), None)
    registered = put["registered_at_s"] if put else None
    since = registered if registered is not None else (started or 0.0)
    entered = _first(haproxy, node, since, ready)
    up = _first(haproxy, node, since, in_rotation)
    weight = entered["weight"] if entered else None
    ramp = _first(haproxy, node, entered["t"], lambda e: ready(e) and e["weight"] > weight) if entered else None
    full = _first(haproxy, node, entered["t"], lambda e: ready(e) and e["weight"] >= base_weight) if entered else None
    return {"node": node, "started_s": started, "registered_s": registered,
            "registration_seen_s": put["t"] if put else None,
            "in_haproxy_s": entered["t"] if entered else None, "entry_weight": weight, "warm_weight": warm_weight,
            "join_latency_s": _round(entered["t"] - registered) if entered and registered is not None else None,
            "up_s": up["t"] if up else None, "slow_start_s": ramp["t"] if ramp else None,
            "full_weight_s": full["t"] if full else None}


def crash_milestones(haproxy: Sequence[dict], registry: Sequence[dict], node: str, killed: float | None,
                     ttl_s: int | None, tick_s: float, check_down_s: float | None = None) -> dict[str, Any]:
    """When the killed node's lease expired, HAProxy stopped sending it requests (whatever took it out: its health
    check, the controller's drain, the deletion), the controller drained it and deleted it.

    The contract: out of rotation within the later of its lease's TTL and HAProxy's health checks' fall
    (check_down_s: inter x fall of the shipped reflexes by default), plus a tick. An expiry alone removes no node
    HAProxy still has UP (controller/membership.py: the gateway's agreement), so a crash the checks have not seen yet
    waits for them."""
    if check_down_s is None:
        check_down_s = DEFAULT.check_inter_s * DEFAULT.check_fall
    out: dict[str, Any] = {"node": node, "killed_s": killed, "ttl_s": ttl_s, "tick_s": tick_s,
                           "check_down_s": check_down_s,
                           "contract_s": max(ttl_s, check_down_s) + tick_s if ttl_s is not None else None}
    if killed is None:
        return out
    gone = next((e for e in registry if e["node"] == node and e["kind"] == "delete" and e["t"] >= killed), None)
    down = _first(haproxy, node, killed, lambda e: e["present"] and e["op"] != SRV_RUNNING)
    drained = _first(haproxy, node, killed, lambda e: not ready(e))
    deleted = _first(haproxy, node, killed, lambda e: not e["present"])
    out_of = _first(haproxy, node, killed, lambda e: not in_rotation(e))
    out.update({
        "lease_expired_s": gone["t"] if gone else None, "last_value": gone["prev_state"] if gone else None,
        "haproxy_down_s": down["t"] if down else None, "drained_s": drained["t"] if drained else None,
        "deleted_s": deleted["t"] if deleted else None, "out_of_rotation_s": out_of["t"] if out_of else None,
        "out_of_rotation_after_s": _round(out_of["t"] - killed) if out_of else None,
        "drained_after_s": _round(drained["t"] - killed) if drained else None,
        "deleted_after_s": _round(deleted["t"] - killed) if deleted else None,
        "taken_out_by": (None if out_of is None else "haproxy (its health check or error limit)" if ready(out_of)
                         else "grayguard's drain" if out_of["present"] else "grayguard's del server"),
        # the policy drains a server HAProxy marked DOWN; membership drains one whose lease expired
        "drained_by": (None if drained is None else "grayguard policy (HAProxy had marked it DOWN)"
                       if gone is None or drained["t"] < gone["t"] else "grayguard membership (its lease expired)")})
    return out


def client_failures(records: Sequence[Any], crashed: str | None, killed: float | None) -> dict[str, Any]:
    """Requests that did not end ok: how many, by status; how many were in flight on the crashed node when it died
    (a response already streaming cannot be retried elsewhere); how many the client's own deadline cut (long
    generations, on any node, as in any run); and the others, which the join or the crash would have caused. Called
    once the load is over: a request still "pending" then never got an outcome (the load generator lost it when its
    stream broke), and counts as failed."""
    failed = [r for r in records if r.status != "ok"]
    in_flight = [r for r in failed if crashed is not None and killed is not None and r.backend == crashed
                 and r.start_s <= killed <= r.start_s + (r.e2e_s or 0.0) + 0.5]
    deadline = [r for r in failed if r.status == "timeout" and r not in in_flight]
    return {"requests": len(records), "ok": sum(r.status == "ok" for r in records), "failed": len(failed),
            "any_failed": bool(failed), "by_status": dict(Counter(r.status for r in failed)),
            "in_flight_on_crashed_node": len(in_flight), "client_deadline": len(deadline),
            "other_failures": len(failed) - len(in_flight) - len(deadline),
            "examples": [{"start_s": round(r.start_s, 2), "status": r.status, "backend": r.backend,
                          "error": r.error} for r in failed[:10]]}


def verdict(r: dict) -> tuple[str, dict[str, bool]]:
    """One line, and each target met or not."""
    j, c, f = r["join"], r["crash"], r["clients"]
    checks = {
        "join in HAProxy within 2 s of registering": j["join_latency_s"] is not None and j["join_latency_s"] <= 2.0,
        "at the warm-up weight": j["entry_weight"] is not None and j["entry_weight"] == j["warm_weight"],
        "then slow start": j["slow_start_s"] is not None,
        "crashed node out of rotation within max(TTL, the checks' fall) + a tick":
        c.get("out_of_rotation_after_s") is not None and c["contract_s"] is not None
        and c["out_of_rotation_after_s"] <= c["contract_s"],
        "crashed node deleted": c.get("deleted_s") is not None,
        "no request failed but the streams in flight on the crashed node (and client deadlines)":
        f["other_failures"] == 0,
    }
    missed = [k for k, ok in checks.items() if not ok]
    line = ("all targets met: " + ", ".join(checks)) if not missed else "MISSED: " + ", ".join(missed)
    return line, checks


def _round(x: float) -> float:
    return round(x, 2)


def _s(x: float | None, ref: float | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}s" + (f" (+{x - ref:.2f}s)" if ref is not None else "")


def summary_text(r: dict) -> str:
    """The terminal summary (also report.md's body)."""
    j, c, f = r["join"], r["crash"], r["clients"]
    lines = [f"=== membership: {j['node']} joins at {r['join_at_s']:g}s, {c['node']} crashes (SIGKILL) at "
             f"{r['crash_at_s']:g}s; leader {r.get('leader') or '-'}",
             f"join   registered         {_s(j['registered_s'])}",
             f"       in HAProxy         {_s(j['in_haproxy_s'], j['registered_s'])} at weight {j['entry_weight']} "
             f"(warm-up {j['warm_weight']})",
             f"       UP (checks)        {_s(j['up_s'], j['registered_s'])}",
             f"       slow start from    {_s(j['slow_start_s'], j['registered_s'])}",
             f"       full weight        {_s(j['full_weight_s'], j['registered_s'])}",
             f"crash  killed             {_s(c['killed_s'])}   lease TTL {c['ttl_s']}s, tick {c['tick_s']:g}s",
             f"       out of rotation    {_s(c.get('out_of_rotation_s'), c['killed_s'])} by "
             f"{c.get('taken_out_by') or '-'}",
             f"       lease expired      {_s(c.get('lease_expired_s'), c['killed_s'])}",
             f"       drained            {_s(c.get('drained_s'), c['killed_s'])} by {c.get('drained_by') or '-'}",
             f"       deleted            {_s(c.get('deleted_s'), c['killed_s'])}",
             f"clients {f['requests']} requests, {f['ok']} ok, {f['failed']} failed "
             f"({f['in_flight_on_crashed_node']} in flight on {c['node']} when it died, {f['client_deadline']} cut by "
             f"the client's deadline, {f['other_failures']} other){': ' + str(f['by_status']) if f['failed'] else ''}",
             r["verdict"]]
    return "\n".join(lines)


def write_report(report: dict, samples: Sequence[dict], records: Sequence[Any], out_dir: Path) -> None:
    """report.json (milestones, events, the HAProxy and registry logs, samples), report.md and report.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps({**report, "samples": list(samples)}, indent=1, default=str))
    (out_dir / "report.md").write_text("# grayguard demo: membership\n\n```\n" + summary_text(report) + "\n```\n")
    j, c = report["join"], report["crash"]
    end = report.get("duration_s") or (samples[-1]["t"] if samples else 1)
    markers = [(t, label) for t, label in (
        (j["registered_s"], f"{j['node']} registered"), (j["full_weight_s"], f"{j['node']} full weight"),
        (c["killed_s"], f"{c['node']} killed"), (c.get("deleted_s"), f"{c['node']} deleted")) if t is not None]
    nodes = sorted({n for s in samples for n in s["nodes"]}, key=lambda n: (len(n), n))
    weights = {n: [(s["t"], s["nodes"].get(n, {}).get("weight")) for s in samples] for n in nodes}
    by_second = Counter((r.backend, int(r.start_s)) for r in records if r.backend)
    present = {n: [s["t"] for s in samples if n in s["nodes"]] for n in nodes}
    rate = {n: [(t, sum(by_second.get((n, k), 0) for k in range(t - 5, t)) / 5
                 if present[n] and present[n][0] <= t <= present[n][-1] + 1 else None) for t in range(5, int(end) + 1)]
            for n in nodes}  # over the last 5 s, while the server is in the backend
    ttft = {"client P99 TTFT": rolling_percentile(records, "ttft_s", 99, 10, 1, end),
            "client P50 TTFT": rolling_percentile(records, "ttft_s", 50, 10, 1, end)}
    charts = [line_chart(weights, title="HAProxy weight per server (absent: not in the backend)", ylabel="weight",
                        markers=markers, x_max=end),
              line_chart(rate, title="Requests per second by the server that answered (5 s mean)", ylabel="req/s",
                        markers=markers, x_max=end),
              line_chart(ttft, title="Client TTFT over a 10 s window", ylabel="seconds", markers=markers, log=True,
                        x_max=end)]

    title = f"grayguard demo: {j['node']} joins, {c['node']} crashes"
    clients = {k: v for k, v in report["clients"].items() if k != "examples"}
    v = report["verdict"]
    body = (f'<h1>{e(title)}</h1><p class="story">{e(_story(report))}</p><p class="{verdict_class(v)}">{e(v)}</p>'
            f"<h2>Join</h2>{kv_table(j)}<h2>Crash</h2>{kv_table(c)}<h2>Clients</h2>{kv_table(clients)}"
            f"<h2>Client latency per phase (seconds)</h2>{phases_table(report.get('phases') or {})}"
            f"<h2>Plots</h2>{''.join(charts)}"
            f"<h2>Timeline</h2>{timeline(report.get('events') or [])}")
    (out_dir / "report.html").write_text(page(title, body))


def _story(r: dict) -> str:
    """The join and the crash in two sentences."""
    j, c, f = r["join"], r["crash"], r["clients"]
    ref = j["registered_s"]
    if ref is None or j["in_haproxy_s"] is None:
        join = f"{j['node']} never joined."
    else:
        full = (f", at full weight {_s(_round(j['full_weight_s'] - ref))} after registering"
                if j["full_weight_s"] is not None else "")
        join = (f"{j['node']} registered at {_s(ref)} and was in HAProxy {_s(j['join_latency_s'])} later at weight "
                f"{j['entry_weight']}{full}.")
    crash = "" if c["killed_s"] is None else (
        f" {c['node']} was killed at {_s(c['killed_s'])}, out of rotation {_s(c.get('out_of_rotation_after_s'))} "
        f"later by {c.get('taken_out_by') or '-'}, deleted {_s(c.get('deleted_after_s'))} later; {f['failed']} of "
        f"{f['requests']} client requests failed.")
    return join + crash
