"""`grayguard replay`: run the controller's decision code over a recorded trace, in virtual time.

Two inputs: a controller's own recording (`--recording`, controller/recorder.py: every tick's Observation, so the
replay runs exactly the live tick's decision code, decide_tick, on exactly what it saw), or a trace CSV built by
hand or from Prometheus range queries (`--trace`: the 30 s window's latency and the probe, KV, error and GPU columns
only).

Trace CSV, one row per node per tick: t (seconds), pool, node, normalized_latency (empty: no data
that tick), and the optional columns listed in OPTIONAL. While a node is drained its trace values
stand for what its canary requests measure. Output: one JSON object per node per tick.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import IO

from grayguard import flags
from grayguard.config import Config, ConfigError, load_config
from grayguard.controller.decide import Observation, PoolOutcome, decide_tick
from grayguard.controller.haproxy import ADMF_FDRAIN, DRAIN_MASK, ServerState
from grayguard.controller.policy import (
    NodeInput,
    NodeState,
    Policy,
    canary_due,
    config_policy,
    decide_pool,
    is_cut,
    pool_policies,
)
from grayguard.vocab import PROBE_FAULTS, PROBE_RESULTS, State

HELP = "backtest the decision code on a recorded trace (CSV, or built from Prometheus range queries)"
DESCRIPTION = """\
Replays a trace through exactly the controller's decision code, with no Prometheus and no HAProxy,
so thresholds can be tuned on your own incidents before going live.

Trace CSV columns (one row per node per tick):
  t                   seconds (any origin); rows with equal t form one tick
  pool, node          names
  normalized_latency  seconds per weighted token; empty = no data that tick
Optional columns (empty = no data that tick):
  peer_group          compare only with nodes of the same group
  probe_result        the exporter's probe class: ok, slow, timeout, connect_error, http_error,
                      cuda_error, bad_response, starting
  probe_ttft_s        seconds to the probe's first token
  probe_sent_t        when the probe shown was sent, in t's seconds (the exporter's
                      grayguard_probe_last_sent_timestamp_seconds): rows that show one probe count it
                      once; without it every row counts as a probe of its own
  error_ratio         share of requests that finished with an error (0-1)
  kv_cache_usage      KV-cache usage (0-1)
  gpu_throttled, pcie_degraded, gpu_ecc_uncorrectable, gpu_xid
                      hardware evidence flags (0/1)
While a node is drained (quarantined/canary) its values stand for what its canaries measure: a
failing probe_result is a failed canary, otherwise normalized_latency is the canary's estimate.

Output (JSON lines, --out or stdout): {"t", "pool", "node", "state", "score", "weight", "reason"}.

examples:
  grayguard replay --config.file grayguard.yaml --trace incident.csv --out decisions.jsonl
  grayguard replay --config.file grayguard.yaml --trace incident.csv \\
      --from-prometheus http://prometheus:9090 --start 2026-11-20T10:00:00Z --end 2026-11-20T11:00:00Z --step 5
"""
REQUIRED = ("t", "pool", "node", "normalized_latency")
FLAGS = ("gpu_throttled", "pcie_degraded", "gpu_ecc_uncorrectable", "gpu_xid")
PROBE_CLASSES = frozenset(PROBE_RESULTS)


class TraceError(ValueError):
    """A malformed trace, with the line number."""


@dataclass(frozen=True)
class Row:
    t: float
    pool: str
    node: str
    latency: float | None
    peer_group: str | None = None
    probe_result: str | None = None
    probe_ttft: float | None = None
    error_ratio: float | None = None
    kv_cache_usage: float | None = None
    gpu_throttled: bool | None = None
    pcie_degraded: bool | None = None
    gpu_ecc_uncorrectable: bool | None = None
    gpu_xid: bool | None = None
    probe_sent_t: float | None = None


def _num(text: str, line: int, col: str) -> float | None:
    text = (text or "").strip()
    if text == "":
        return None
    try:
        v = float(text)
    except ValueError:
        raise TraceError(f"line {line}: column {col}: {text!r} is not a number") from None
    return v if math.isfinite(v) else None


def read_trace(f: IO[str]) -> list[Row]:
    """Parse a trace CSV; raise TraceError naming the line and column of the first problem."""
    reader = csv.DictReader(f)
    missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"trace header lacks column(s) {', '.join(missing)} (has: {reader.fieldnames})")
    rows = []
    for line, rec in enumerate(reader, start=2):
        t = _num(rec["t"], line, "t")
        if t is None:
            raise TraceError(f"line {line}: column t is empty")
        if not rec["pool"] or not rec["node"]:
            raise TraceError(f"line {line}: pool and node must not be empty")
        probe = (rec.get("probe_result") or "").strip() or None
        if probe is not None and probe not in PROBE_CLASSES:
            known = sorted(map(str, PROBE_CLASSES))  # plain strings: the message lists 'ok', not ProbeResult.OK
            raise TraceError(f"line {line}: column probe_result: {probe!r} is not one of {known}")
        flags = {}
        for col in FLAGS:
            v = _num(rec.get(col) or "", line, col)
            if v is not None and v not in (0, 1):
                raise TraceError(f"line {line}: column {col}: must be 0 or 1, got {rec[col]!r}")
            flags[col] = None if v is None else bool(v)
        def opt(col: str, line: int = line, rec: dict = rec) -> float | None:
            return _num(rec.get(col) or "", line, col)
        rows.append(Row(t, rec["pool"], rec["node"], _num(rec["normalized_latency"], line, "normalized_latency"),
                        (rec.get("peer_group") or None), probe, opt("probe_ttft_s"), opt("error_ratio"),
                        opt("kv_cache_usage"), **flags, probe_sent_t=opt("probe_sent_t")))
    return rows


def _canary(r: Row | None) -> float | None:
    """What a canary to a drained node measures in the trace: failed (inf), an estimate, or nothing."""
    if r is None:
        return None
    if r.probe_result in PROBE_FAULTS:
        return math.inf
    return r.latency


def replay(rows: Iterable[Row], policy: Policy, base_weight: int = 100,
           pools: Mapping[str, Policy] | None = None) -> Iterator[dict]:
    """Yield one decision record per node per tick, in time order; a pool in `pools` runs its own Policy."""
    pools = pools or {}
    ticks: dict[float, dict[str, dict[str, Row]]] = {}
    for r in rows:
        ticks.setdefault(r.t, {}).setdefault(r.pool, {})[r.node] = r
    states: dict[str, dict[str, NodeState]] = {}
    members: dict[str, dict[str, str | None]] = {}  # nodes stay members once seen (group remembered)
    for t in sorted(ticks):
        for pool in sorted(set(members) | set(ticks[t])):
            seen = ticks[t].get(pool, {})
            for n, r in seen.items():
                members.setdefault(pool, {})[n] = r.peer_group
            prev = states.get(pool, {})
            inputs = {}
            for n, group in members[pool].items():
                r = seen.get(n)
                due = n in prev and canary_due(prev[n], t, policy.recovery)
                inputs[n] = NodeInput(
                    base_weight=base_weight, latency=r.latency if r else None, peer_group=group,
                    canary=_canary(r) if due else None,
                    probe_at=r.probe_sent_t if r else None,
                    **({k: getattr(r, k) for k in ("probe_result", "probe_ttft", "error_ratio", "kv_cache_usage",
                                                   *FLAGS)} if r else {}))
            d = decide_pool(prev, inputs, pools.get(pool, policy), t)
            states[pool] = {n: nd.state for n, nd in d.nodes.items()}
            for n, nd in sorted(d.nodes.items()):
                s = nd.state
                yield {"t": t, "pool": pool, "node": n, "state": s.state,
                       "score": None if s.score is None else round(s.score, 4),
                       "weight": nd.weight, "reason": s.reason}


def replay_recording(ticks: Iterable[Observation], cfg: Config
                     ) -> Iterator[tuple[Observation, dict[str, PoolOutcome]]]:
    """Each recorded tick decided again by decide_tick under cfg: (the tick as recorded, the replay's outcomes).

    The first tick a pool appears in starts from the states recorded with it; after that each tick starts from the
    replay's own states (as the live loop starts from its last tick's), so another config's decisions evolve on
    their own. Everything the shell did (canary rounds, HAProxy's view) is as recorded."""
    policies = pool_policies(cfg)
    states: dict[str, dict[str, NodeState]] = {}
    written: dict[str, dict[str, tuple[int | None, bool]]] = {}  # the replay's last weight and drain of each node
    for obs in ticks:
        pools = {p: replace(po, prev=states.get(p, po.prev),
                            servers=_as_written(po.servers, po.prev, states.get(p), written.get(p, {})))
                 for p, po in obs.pools.items()}
        outcomes = decide_tick(replace(obs, pools=pools), cfg.pools, policies)
        for p, o in outcomes.items():
            states[p] = o.states
            written.setdefault(p, {}).update({n: (nd.weight, nd.drain) for n, nd in o.decision.nodes.items()})
        yield obs, outcomes


def _as_written(servers: Mapping[str, ServerState], live: Mapping[str, NodeState],
                replayed: Mapping[str, NodeState] | None, written: Mapping[str, tuple[int | None, bool]]
                ) -> Mapping[str, ServerState]:
    """HAProxy's servers as the replay's own writes would have left them: a node the replay holds in another state
    than the live controller did gets the weight and drain the replay last decided (what HAProxy's checks and
    agents did stays as recorded). Where the two agree, the recorded servers are the truth."""
    if not replayed or not written:
        return servers
    out = dict(servers)
    for n, s in servers.items():
        mine, theirs = replayed.get(n), live.get(n)
        if mine is None or theirs is None or mine.state == theirs.state or n not in written:
            continue
        weight, drain = written[n]
        admin = (s.admin_state & ~DRAIN_MASK) | (ADMF_FDRAIN if drain else 0)
        out[n] = replace(s, weight=s.weight if weight is None else weight, admin_state=admin)
    return out


def recording_decisions(ticks: Iterable[Observation], cfg: Config) -> Iterator[dict]:
    """One record per node per decided tick: the replay's state, score, weight and reason, and `live`: the state
    the recording's controller held after that tick (the next tick's recorded states; None on the last tick)."""
    pending: list[tuple[Observation, dict[str, PoolOutcome]]] = []
    for obs, outcomes in replay_recording(ticks, cfg):
        if pending:
            yield from _decided(*pending.pop(), obs)
        pending.append((obs, outcomes))
    if pending:
        yield from _decided(*pending.pop(), None)


def _decided(obs: Observation, outcomes: dict[str, PoolOutcome], following: Observation | None) -> Iterator[dict]:
    for pool, o in outcomes.items():
        nxt = following.pools.get(pool) if following is not None else None
        for n, nd in sorted(o.decision.nodes.items()):
            s = nd.state
            live = nxt.prev.get(n) if nxt is not None else None
            yield {"t": round(obs.now, 3), "pool": pool, "node": n, "state": s.state,
                   "score": None if s.score is None else round(s.score, 4), "weight": nd.weight,
                   # cut: held below its state's weight by a finding, degraded or in slow start (a warm-up's cut
                   # is one as well: its weight falls the same way)
                   "cut": is_cut(s),
                   "reason": s.reason, "cause": s.cause, "live": None if live is None else live.state,
                   # what detectors in shadow mode asked for: "<detector>:cut" / "<detector>:quarantine"
                   "shadow": sorted(f"{f.detector}:{a}" for f in nd.shadow for a in f.asks())}


def summarize(decisions: Iterable[dict]) -> dict[str, dict]:
    """Per node: ticks in each state, quarantines begun, weight cuts begun (a node newly held below its state's weight
    by a finding: degraded, or cut in slow start) and the longest cut in ticks, the ticks on which the replay's state
    differs from the live controller's, and the findings the detectors in shadow mode began ("live:cut": times)."""
    out: dict[str, dict] = {}
    last: dict[str, str] = {}
    run: dict[str, int] = {}
    asked: dict[str, set[str]] = {}
    for d in decisions:
        key = f"{d['pool']}/{d['node']}"
        s = out.setdefault(key, {"ticks": {}, "quarantines": 0, "cuts": 0, "longest_cut_ticks": 0, "differ": 0,
                                 "shadow": {}})
        now = set(d.get("shadow", ()))
        for f in now - asked.get(key, set()):
            s["shadow"][f] = s["shadow"].get(f, 0) + 1
        asked[key] = now
        s["ticks"][d["state"]] = s["ticks"].get(d["state"], 0) + 1
        before = last.get(key)
        if d["state"] == State.QUARANTINED and before != State.QUARANTINED:
            s["quarantines"] += 1
        if d["cut"]:  # degraded, or cut in slow start
            run[key] = run.get(key, 0) + 1
            if run[key] == 1:
                s["cuts"] += 1
            s["longest_cut_ticks"] = max(s["longest_cut_ticks"], run[key])
        else:
            run[key] = 0
        if d["live"] is not None and d["live"] != d["state"]:
            s["differ"] += 1
        last[key] = d["state"]
    return out


def run_recording(args: argparse.Namespace, cfg: Config) -> int:
    from grayguard.controller.recorder import RecordingError, read
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 (stdout must not be closed)
    decisions: list[dict] = []
    try:
        for rec in recording_decisions(read(args.recording), cfg):
            out.write(json.dumps(rec) + "\n")
            decisions.append(rec)
    except OSError as e:
        print(f"grayguard: cannot read recording {args.recording}: {e.strerror or e}", file=sys.stderr)
        return 2
    except RecordingError as e:
        print(f"grayguard: {e}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout:
            out.close()
    ticks = len({d["t"] for d in decisions})
    print(f"replayed {ticks} recorded tick(s) of {args.recording}", file=sys.stderr)
    for node, s in sorted(summarize(decisions).items()):
        states = ", ".join(f"{k}={v}" for k, v in sorted(s["ticks"].items()))
        print(f"  {node}: {states}; quarantines {s['quarantines']}, cuts {s['cuts']} (longest "
              f"{s['longest_cut_ticks']} ticks); differs from the live controller on {s['differ']} tick(s)"
              + ("; shadow: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["shadow"].items())) if s["shadow"] else ""),
              file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.renamed(p, "--config.file", "--config", required=True, dest="config", metavar="FILE",
                  help="YAML config: thresholds and recovery")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recording", metavar="FILE",
                     help="a controller's recording (grayguard controller --record FILE; .gz read as gzip): "
                     "every tick decided again by the live decision code under --config.file; stderr sums up each "
                     "node (quarantines, cuts, ticks that differ from what the live controller did)")
    src.add_argument("--trace", metavar="CSV",
                     help="trace to replay (with --from-prometheus: where the built trace is written)")
    p.add_argument("--out", metavar="FILE", help="JSON-lines output (default stdout)")
    p.add_argument("--base-weight", type=int, default=100, help="HAProxy weight of a healthy node (default 100)")
    p.add_argument("--from-prometheus", metavar="URL", help="build the trace from range queries first")
    p.add_argument("--start", help="range start (RFC 3339 or unix seconds)")
    p.add_argument("--end", help="range end (RFC 3339 or unix seconds)")
    p.add_argument("--step", type=float, default=5.0, help="range step in seconds (default 5, ~ the tick)")


def run(args: argparse.Namespace) -> int:
    try:
        # a recorded trace or flight recording is replayed without a query: its config may name the series of its day
        cfg = load_config(args.config, series=bool(args.from_prometheus))
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    if not 0 <= args.base_weight <= 256:
        print("grayguard: --base-weight must be in 0..256", file=sys.stderr)
        return 2
    if args.recording:
        return run_recording(args, cfg)
    if args.from_prometheus:
        from grayguard.controller.trace_builder import build_trace_cli
        rc = build_trace_cli(cfg, args)
        if rc:
            return rc
    try:
        with open(args.trace, newline="") as f:
            rows = read_trace(f)
    except OSError as e:
        print(f"grayguard: cannot read trace {args.trace}: {e.strerror or e}", file=sys.stderr)
        return 2
    except TraceError as e:
        print(f"grayguard: {args.trace}: {e}", file=sys.stderr)
        return 2
    # each pool runs the live loop's Policy (its group_speed included); a pool the config lacks, the defaults
    policies = pool_policies(cfg)
    for pool in sorted({r.pool for r in rows} - set(policies)):
        print(f"grayguard: pool {pool!r} of the trace is not in {args.config}: replayed with the config's "
              "thresholds and no group_speed", file=sys.stderr)
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 (stdout must not be closed)
    counts: dict[str, int] = {}
    try:
        for rec in replay(rows, config_policy(cfg), args.base_weight, policies):
            out.write(json.dumps(rec) + "\n")
            counts[rec["state"]] = counts.get(rec["state"], 0) + 1
    finally:
        if out is not sys.stdout:
            out.close()
    summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"replayed {len(rows)} rows: node-ticks by state: {summary}", file=sys.stderr)
    return 0
