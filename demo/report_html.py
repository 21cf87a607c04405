"""The fault demo's report.html: the story in one glance, the events as a timeline, the latency per phase, the
parameters and the plots. Pure: a report dict (as in report.json), the samples and the client records in, HTML out."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from grayguard.config import RulesConfig
from grayguard.demo.report import rolling_percentile
from grayguard.htmlpage import Html, e, kv_table, link, page, table, value
from grayguard.svgplot import line_chart

TRANSITION = re.compile(r"^(?P<node>[^:]+): (?P<prev>\S+) -> (?P<state>\S+):? ?(?P<reason>.*)$")
QUANTILES = ("p50", "p95", "p99", "p99.9")


def secs(x: float | None) -> str:
    """1.2 s; – when it did not happen."""
    return "–" if x is None else f"{x:.1f} s"


def after(x: float | None, t0: float | None) -> str:
    """+3.1 s (or −18.0 s) from t0; – when either is missing."""
    return "–" if x is None or t0 is None else f"{'+' if x >= t0 else '−'}{abs(x - t0):.1f} s"


def fault_label(r: Mapping[str, Any]) -> str:
    """thermal (k=10); no fault."""
    if r.get("fault") == "none":
        return "no fault"
    params = r.get("fault_params") or {}
    return str(r.get("fault")) + (f" ({value(params)})" if params else "")


def p99(r: Mapping[str, Any] | None, phase: str) -> float | None:
    """Client P99 TTFT of a phase of a run (None: no such phase or run)."""
    return ((r or {}).get("phases") or {}).get(phase, {}).get("ttft", {}).get("p99")


def lat(x: float | None) -> str:
    """A latency: 0.216 s, 2.52 s; – when there is none."""
    return "–" if x is None else f"{x:.3g} s"


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}×" if a and b else "–"


def story_line(r: Mapping[str, Any], cmp: Mapping[str, Any] | None = None) -> Html:
    """Two sentences: what happened and when; what the clients saw during the fault."""
    node, fs = e(r.get("faulty_node")), r["fault_start_s"]
    if r.get("fault") == "none":
        first = f"No fault injected (a healthy fleet): {e(str(r.get('verdict', '')).partition(': ')[2])}."
    else:
        did = [f"{what} after {after(r.get(k), fs).lstrip('+')}" if r.get(k) is not None else f"not {none}"
               for k, what, none in (("first_weight_cut_s", "weight cut", "cut"),
                                     ("quarantine_s", "quarantined", "quarantined"), ("page_s", "paged", "paged"))]
        first = (f"<b>{e(fault_label(r))}</b> on <b>{node}</b> at {secs(fs)}"
                 + ("" if r.get("controller", True) else " with grayguard <b>off</b>") + ": " + ", ".join(did))
        fe, rec = r.get("fault_end_s"), r.get("recovered_s")
        if fe is not None:
            first += f"; the fault cleared at {secs(fe)}" + (
                f" and {node} was back at full weight {after(rec, fe).lstrip('+')} later "
                f"({after(rec, fs)} after the fault)" if rec is not None else "")
        first += "."
    during, before = p99(r, "fault"), p99(r, "baseline")
    window = "over the window of the fault" if r.get("fault") == "none" else "during the fault"
    second = (f"Client P99 TTFT {window}: <b>{lat(during)}</b>, against {lat(before)} before it "
              f"({_x(during, before)})")
    if cmp:
        off, healthy = cmp.get("p99_ttft_fault_without"), cmp.get("p99_ttft_fault_window_healthy")
        second += (f"; <b>{lat(off)}</b> without grayguard ({_x(off, during)} worse) and {lat(healthy)} in the "
                   f"healthy run over the same window ({_x(during, healthy)})")
    return Html(f'<p class="story">{first}<br>{second}.</p>')


def milestones(r: Mapping[str, Any]) -> Html:
    """The fault, cut, quarantine, page, clearing and recovery: when, and how long after the fault."""
    fs, fe = r["fault_start_s"], r.get("fault_end_s")
    head = ("milestone", "at (since the load started)", "after the fault")
    quarantined = ("nodes quarantined", value(r.get("false_quarantines") + [r.get("faulty_node")] * (
        r.get("quarantine_s") is not None)), "")
    if r.get("fault") == "none":
        return table(head, [quarantined])
    rows = [(f"fault injected: {fault_label(r)} on {r.get('faulty_node')}", secs(fs), "")]
    rows += [(what, secs(r.get(k)), after(r.get(k), fs)) for k, what in (
        ("first_weight_cut_s", "first weight cut"), ("quarantine_s", "quarantined"), ("page_s", "paged"))]
    if fe is not None:
        rows.append(("fault cleared", secs(fe), after(fe, fs)))
        rec = r.get("recovered_s")
        rows.append(("full weight again", secs(rec), after(rec, fs) + (f" ({after(rec, fe)} after it cleared)"
                                                                        if rec is not None else "")))
    rows.append(("other nodes quarantined", value(r.get("false_quarantines")), ""))
    return table(head, rows)


def runbook(alert: str | None, url: str | None) -> str | None:
    """The alert's runbook section: its runbook_url annotation, else the shipped runbook's anchor."""
    if url or not alert:
        return url
    return f"{RulesConfig().runbook_url.split('#')[0]}#{alert.lower()}"


def what_happened(ev: Mapping[str, Any]) -> Html:
    """An event as a sentence; transitions with their reason, alerts with severity, summary and runbook."""
    kind, text = ev.get("kind"), str(ev.get("text", ""))
    if kind == "transition":
        m = TRANSITION.match(text)
        prev = ev.get("from_state") or (m["prev"] if m else "?")
        reason = ev.get("reason") if "reason" in ev else (m["reason"] if m else text)
        return Html(f"<b>{e(prev)} → {e(ev.get('state') or (m['state'] if m else '?'))}</b>"
                    + (f": {e(reason)}" if reason else ""))
    if kind in ("page", "ticket") and ev.get("alert"):
        sev = ev.get("severity") or kind
        out = f"<b>{e(ev.get('status'))}</b> {e(ev['alert'])}, severity {e(sev)}"
        if ev.get("summary"):
            out += f": {e(ev['summary'])}"
        return Html(out + " (" + link(runbook(ev["alert"], ev.get("runbook_url")), "runbook") + ")")
    if kind == "fault" and ev.get("fault"):
        params = ev.get("params") or {}
        return Html(e(f"{ev['fault']} {ev.get('action', 'injected')}" + (f" ({value(params)})" if params else "")))
    return Html(e(text))


def timeline(events: Sequence[Mapping[str, Any]], t0: float | None = None, focus: str | None = None) -> Html:
    """Every event, in order: time after t0 (when given), time, kind, node, what happened."""
    rows, cls = [], []
    for ev in sorted(events, key=lambda x: x["t"]):
        m = TRANSITION.match(str(ev.get("text", ""))) if ev.get("kind") == "transition" else None
        node = ev.get("node") or (m["node"] if m else None) or ev.get("instance")
        rows.append(([after(ev["t"], t0)] if t0 is not None else []) + [f"{ev['t']:.1f} s", ev.get("kind"), node,
                                                                          what_happened(ev)])
        cls.append("page" if ev.get("kind") == "page" else "faulty" if focus and node == focus else "")
    head = (["after the fault"] if t0 is not None else []) + ["at", "kind", "node", "what happened"]
    return table(head, rows, cls)


def phases_table(phases: Mapping[str, Mapping[str, Any]]) -> Html:
    """Client latency per phase: requests, ok, failures, TTFT and end-to-end percentiles (seconds)."""
    rows = [[p, v["requests"], v["ok"], value(v.get("errors")) if v.get("errors") else "none"]
            + [v["ttft"].get(q) for q in QUANTILES] + [v["e2e"].get(q) for q in ("p50", "p99")]
            for p, v in phases.items()]
    return table(["phase", "requests", "ok", "failed", "TTFT p50", "p95", "p99", "p99.9", "e2e p50", "e2e p99"], rows)


def run_parameters(r: Mapping[str, Any]) -> Html:
    """How the run was set up, as key=value."""
    keys = ("fault", "fault_params", "faulty_node", "fault_start_s", "fault_end_s", "controller", "balance",
            "control_window", "nodes", "rate", "duration_s", "seed", "interrupted")
    return kv_table({k: r.get(k) for k in keys if k in r}, {"fault_params": "fault parameters",
                                                          "controller": "grayguard on", "rate": "rate (req/s)"})


def markers(r: Mapping[str, Any]) -> list[tuple[float, str]]:
    """The fault and what grayguard did, as labelled lines on the plots."""
    if r.get("fault") == "none":
        return [(r["quarantine_s"], f"{r.get('faulty_node')} quarantined")] if r.get("quarantine_s") else []
    out = [(r["fault_start_s"], f"fault {r.get('fault', '')}")]
    if r.get("fault_end_s") is not None:
        out.append((r["fault_end_s"], "fault cleared"))
    out += [(r[k], label) for k, label in (("first_weight_cut_s", "cut"), ("quarantine_s", "quarantine"),
                                           ("page_s", "page"), ("recovered_s", "recovered")) if r.get(k) is not None]
    return out


def charts(r: Mapping[str, Any], samples: Sequence[dict], records: Sequence[Any]) -> list[str]:
    """Per node: normalized latency, HAProxy weight, probe TTFT; the clients' TTFT."""
    nodes = sorted({n for s in samples for n in s["nodes"]}, key=lambda n: (len(n), n))
    end = r.get("duration_s") or (samples[-1]["t"] if samples else 1)
    mk = markers(r)

    def per_node(field: str) -> dict[str, list]:
        return {n: [(s["t"], s["nodes"].get(n, {}).get(field)) for s in samples] for n in nodes}

    ttft = {"client P99 TTFT": rolling_percentile(records, "ttft_s", 99, 10, 1, end),
            "client P50 TTFT": rolling_percentile(records, "ttft_s", 50, 10, 1, end)}
    return [
        line_chart(per_node("latency"), title="Normalized latency per node (Prometheus)", ylabel="s per weighted token",
                   markers=mk, log=True, x_max=end),
        line_chart(per_node("weight"), title="HAProxy weight per node", ylabel="weight", markers=mk, x_max=end),
        line_chart(ttft, title="Client TTFT over a 10 s window", ylabel="seconds", markers=mk, log=True, x_max=end),
        line_chart(per_node("probe_ttft"), title="Probe TTFT per node (exporter)", ylabel="seconds", markers=mk,
                   log=True, x_max=end),
    ]


def verdict_class(verdict: str) -> str:
    """pass (green), miss (red) or nothing, for a verdict line."""
    if verdict.startswith(("all targets met", "PASS")) or verdict.endswith("nobody quarantined"):
        return "pass"
    return "miss" if verdict.startswith(("MISS", "no fault injected: QUARANTINED")) else ""


def render(r: Mapping[str, Any], samples: Sequence[dict], records: Sequence[Any]) -> str:
    """report.html of one run."""
    title = "grayguard demo: " + (fault_label(r) if r.get("fault") == "none" else
                                  f"{fault_label(r)} on {r.get('faulty_node')}")
    verdict = str(r.get("verdict", ""))
    t0 = None if r.get("fault") == "none" else r["fault_start_s"]
    body = (f"<h1>{e(title)}</h1>{story_line(r)}"
            f'<p class="{verdict_class(verdict)}">{e(verdict)}</p>'
            f"<h2>Milestones</h2>{milestones(r)}"
            f"<h2>Client latency per phase (seconds)</h2>{phases_table(r.get('phases') or {})}"
            f"<h2>Plots</h2>{''.join(charts(r, samples, records))}"
            f"<h2>Timeline</h2><p class=\"muted\">Times in seconds; rows of {e(r.get('faulty_node'))} highlighted, "
            f"pages in red.</p>{timeline(r.get('events') or [], t0, r.get('faulty_node'))}"
            f"<h2>Run parameters</h2>{run_parameters(r)}")
    return page(title, body)
