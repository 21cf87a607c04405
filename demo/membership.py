"""`grayguard demo --scenario membership`: nodes join and crash mid-run on a registry-driven pool.

The local stack with etcd (localstack/registrystack.py): every node's exporter registers it, HAProxy's backend starts
empty, the controller (leader election on) adds each registered node. Under load, one more node starts and registers
(it enters HAProxy at the warm-up weight, then slow-starts), and another node's machine dies (SIGKILL of its node and
exporter: its lease expires, it is drained, then deleted). HAProxy is watched every 0.1 s and the registry through
its own watch, so the report has the join time to HAProxy, the time from the crash to out of rotation, and whether
any client request failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("grayguard.demo")


@dataclass
class MembershipOptions:
    nodes: int = 8  # registered from the start; the last one is the node that crashes
    rate: float = 20.0
    duration_s: float = 150.0
    join_at_s: float = 30.0
    crash_at_s: float = 90.0
    warmup_s: float = 10.0  # how long the joining node holds the warm-up weight (thresholds.new_node_warmup_s)
    seed: int = 1
    timeout_s: float = 30.0
    live: str = "auto"
    balance: str = "roundrobin"
    keep_workdir: bool = False
    overrides: dict = field(default_factory=dict)  # merged into the controller config document

    @property
    def crash_node(self) -> str:
        return f"node{self.nodes}"

    @property
    def join_node(self) -> str:
        return f"node{self.nodes + 1}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags only --scenario membership reads (it shares --nodes, --rate, --duration and the rest)."""
    d = MembershipOptions()
    g = p.add_argument_group("--scenario membership")
    g.add_argument("--join-at", type=float, default=d.join_at_s,
                   help=f"seconds: a new node starts and registers (default {d.join_at_s:g})")
    g.add_argument("--crash-at", type=float, default=d.crash_at_s,
                   help=f"seconds: the last node's node and exporter are SIGKILLed (default {d.crash_at_s:g})")
    g.add_argument("--join-warmup", type=float, default=d.warmup_s,
                   help=f"seconds the new node holds the warm-up weight before its slow start (default {d.warmup_s:g})")


FAULT_ONLY = ("fault", "fault_node", "fault_at", "fault_until", "fault_param", "no_controller", "compare",
              "control_window", "fleet")


def options_from_args(args: argparse.Namespace, defaults: argparse.Namespace) -> MembershipOptions:
    """MembershipOptions from the demo's flags; ValueError for a bad value or a flag of the fault scenario."""
    given = [f"--{k.replace('_', '-')}" for k in FAULT_ONLY if getattr(args, k) != getattr(defaults, k)]
    if given:
        raise ValueError(f"{', '.join(given)}: only for the fault scenario (--scenario fault)")
    d = MembershipOptions()
    o = MembershipOptions(nodes=d.nodes if args.nodes is None else args.nodes, rate=d.rate if args.rate is None
                          else args.rate, duration_s=d.duration_s if args.duration is None else args.duration,
                          join_at_s=args.join_at,
                          crash_at_s=args.crash_at, warmup_s=args.join_warmup, seed=args.seed, timeout_s=args.timeout,
                          live=args.live, balance=args.balance, keep_workdir=args.keep_workdir)
    check(o)
    return o


def check(o: MembershipOptions) -> None:
    """ValueError naming the flag when the scenario cannot run as asked."""
    if o.nodes < 3:
        raise ValueError("--nodes must be at least 3 (no peer comparison below)")
    if not 0 <= o.join_at_s < o.duration_s or not 0 <= o.crash_at_s < o.duration_s:
        raise ValueError("--join-at and --crash-at must be within the run (0 <= s < --duration)")
    if o.join_at_s == o.crash_at_s:
        raise ValueError("--join-at and --crash-at must differ (one thing at a time)")
    if o.warmup_s < 0 or o.rate <= 0:
        raise ValueError("--join-warmup must be >= 0 and --rate > 0")


class Observer:
    """HAProxy's servers every 0.1 s and the registry's watch, each change timed from t0 (the load's start)."""

    def __init__(self, stack: Any, t0: float, every_s: float = 0.1):
        from grayguard.controller.haproxy import RuntimeClient
        self.stack, self.t0, self.every_s = stack, t0, every_s
        self.rc = RuntimeClient(stack.haproxy.endpoint, 1.0)
        self.haproxy: list[dict] = []  # {t, node, present, weight, admin, op, status}, on every change
        self.registry: list[dict] = []  # {t, kind, node, state, ttl_s, registered_at_s, prev_state}
        self.events: list[dict] = []  # what the live view prints and the report lists
        self.latest: dict[str, dict] = {}
        self.notes_seen = 0  # webhook notifications already turned into events
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._poll, name="demo-haproxy", daemon=True),
                         threading.Thread(target=self._watch, name="demo-registry", daemon=True)]

    def now(self) -> float:
        return round(time.time() - self.t0, 3)

    def event(self, kind: str, text: str, **extra: Any) -> None:
        with self._lock:
            self.events.append({"t": round(self.now(), 2), "kind": kind, "text": text, **extra})

    def start(self) -> Observer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)

    def _poll(self) -> None:
        from grayguard.controller.haproxy import HaproxyError
        from grayguard.localstack.stack import BACKEND
        while not self._stop.wait(self.every_s):
            try:
                servers = {s.name: s for s in self.rc.show_servers_state(BACKEND)}
            except (HaproxyError, OSError) as e:
                log.debug("haproxy poll failed: %s", e)
                continue
            t = self.now()
            for name in sorted(set(servers) | set(self.latest)):
                s = servers.get(name)
                cur = ({"present": True, "weight": s.weight, "admin": s.admin_state, "op": s.op_state,
                        "status": s.status} if s else {"present": False, "weight": 0, "admin": 0, "op": 0,
                                                       "status": None})
                before = self.latest.get(name)
                if before == cur:
                    continue
                self.latest[name] = cur
                self.haproxy.append({"t": t, "node": name, **cur})
                what = self._describe(before, cur)
                if what:
                    self.event("haproxy", f"{name}: {what}", node=name)

    @staticmethod
    def _describe(before: dict | None, cur: dict) -> str:
        """A change worth a line (weights move every second in a slow start: the plot has those)."""
        if before is None or not before["present"]:
            return f"in the backend ({cur['status']}, weight {cur['weight']})" if cur["present"] else ""
        if not cur["present"]:
            return "deleted from the backend"
        if cur["status"] != before["status"]:
            return f"{before['status']} -> {cur['status']} (weight {cur['weight']})"
        return ""

    def _watch(self) -> None:
        from grayguard.registry import (
            DEFAULT_PREFIX,
            NodeRecord,
            RecordError,
            RegistryError,
            nodes_prefix,
            parse_node_key,
        )
        reg = self.stack.registry()
        prefix = nodes_prefix(DEFAULT_PREFIX)
        try:
            while not self._stop.is_set():
                try:
                    _, rev = reg.get_prefix(prefix)
                    for ev in reg.watch_prefix(prefix, rev + 1, self._stop, idle_timeout=5.0):
                        t = self.now()
                        try:
                            _, node = parse_node_key(DEFAULT_PREFIX, ev.key)
                            rec = NodeRecord.from_json(ev.value) if ev.kind == "put" else None
                            prev = NodeRecord.from_json(ev.prev_value) if ev.prev_value else None
                        except (ValueError, RecordError):
                            continue
                        e = {"t": t, "kind": ev.kind, "node": node, "state": rec.state if rec else None,
                             "ttl_s": rec.ttl_s if rec else None,
                             "registered_at_s": round(rec.registered_at - self.t0, 3) if rec else None,
                             "prev_state": prev.state if prev else None}
                        self.registry.append(e)
                        if ev.kind == "delete":
                            self.event("registry", f"{node}: key deleted (it said {e['prev_state']}: "
                                       f"{'its lease expired' if e['prev_state'] == 'serving' else 'it left'})",
                                       node=node)
                        elif prev is None:
                            self.event("registry", f"{node}: registered (TTL {rec.ttl_s}s)", node=node)
                except RegistryError as err:
                    log.debug("registry watch: %s", err)
                    self._stop.wait(0.5)
        finally:
            reg.close()


def run_scenario(opts: MembershipOptions, report_dir: Path | None, out: TextIO | None = None) -> dict:
    """Bring the registry stack up, run the load, the join and the crash, tear down; return (and write) the report."""
    out = sys.stdout if out is None else out  # the stream at the call, not at import
    from grayguard.localstack.procs import wait_until
    from grayguard.localstack.registrystack import RegistryStack, RegistryTiming
    from grayguard.localstack.stack import StackSpec
    from grayguard.sim.loadgen import LoadConfig, run_load
    from grayguard.sim.loadstats import Phase

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    check(opts)
    timing = RegistryTiming(new_node_warmup_s=opts.warmup_s)
    stack = RegistryStack(StackSpec(nodes=opts.nodes - 1, seed=opts.seed, balance=opts.balance,
                                    overrides=opts.overrides), progress=lambda m: say(f"[setup] {m}"),
                          hosts=(opts.crash_node,), timing=timing)
    observer: Observer | None = None
    records: list = []
    samples: list[dict] = []
    result = None
    interrupted = False
    marks: dict[str, Any] = {}
    try:
        stack.start()
        names = [n.name for n in stack.nodes]
        say(f"[setup] waiting for the controller to add the {len(names)} registered nodes to HAProxy")
        stack.wait_registered(names)
        wait_until(lambda: _all_up(stack, names), 60, 0.2, "every registered node UP in HAProxy")
        (a, ta), (b, tb) = sorted((("join", opts.join_at_s), ("crash", opts.crash_at_s)), key=lambda x: x[1])
        phases = tuple(Phase(n, lo, hi) for n, lo, hi in (("baseline", 0, ta), (a, ta, tb), (b, tb, math.inf))
                       if hi > lo)
        cfg = LoadConfig(url=stack.gateway_url, rate=opts.rate, duration_s=opts.duration_s, seed=opts.seed,
                         timeout_s=opts.timeout_s, phases=phases)
        say(f"[run] {opts.duration_s:.0f} s of load at {opts.rate:g} req/s through HAProxy; {opts.join_node} joins at "
            f"{opts.join_at_s:g} s, {opts.crash_node} crashes at {opts.crash_at_s:g} s")
        t0 = time.time()
        observer = Observer(stack, t0).start()
        fut = stack.fleet.submit(run_load(cfg, sink=records))
        joiner: threading.Thread | None = None
        tty = opts.live == "tty" or (opts.live == "auto" and out.isatty())
        shown, next_table = 0, 2.0  # the first table once HAProxy has been read
        while not fut.done():
            el = time.time() - t0
            if joiner is None and el >= opts.join_at_s:
                joiner = threading.Thread(target=_join, args=(stack, opts.join_node, observer, marks), daemon=True)
                joiner.start()
            if "killed_s" not in marks and el >= opts.crash_at_s:
                _crash(stack, opts.crash_node, observer, marks)
            samples.append(_sample(stack, observer, marks))
            shown, next_table = _show(opts, observer, samples[-1], records, shown, next_table, tty, out)
            concurrent.futures.wait([fut], timeout=max(0.05, 1.0 - (time.time() - t0 - el)))
        result = fut.result()
        # the deletion may come after the last request: wait for it, within the lease's longest TTL and a minute
        if "killed_s" in marks:
            _settle(stack, observer, opts.crash_node, marks, samples, timing.ttl_max_s + 60.0)
        if joiner is not None:
            joiner.join(30)
    except KeyboardInterrupt:
        interrupted = True
        say("\n[demo] interrupted: stopping everything")
    finally:
        if observer is not None:
            observer.stop()
        leader = _leader(stack)
        stack.stop(keep_workdir=opts.keep_workdir)
        if opts.keep_workdir:
            say(f"[demo] kept {stack.dir} (configs and logs: etcd, HAProxy, Prometheus, the controller, node hosts)")
    if observer is None:
        raise RuntimeError("the stack did not start")
    return _finish(opts, report_dir, stack, observer, samples, records, result, marks, leader, interrupted, out)


def _all_up(stack: Any, names: list[str]) -> bool:
    from grayguard.controller.haproxy import RuntimeClient
    from grayguard.demo.membership_report import in_rotation
    from grayguard.localstack.stack import BACKEND
    servers = {s.name: s for s in RuntimeClient(stack.haproxy.endpoint, 1.0).show_servers_state(BACKEND)}
    return all(n in servers and in_rotation({"present": True, "weight": servers[n].weight,
                                             "admin": servers[n].admin_state, "op": servers[n].op_state})
               for n in names)


def _join(stack: Any, name: str, observer: Observer, marks: dict) -> None:
    marks["join_started_s"] = observer.now()
    observer.event("join", f"{name}: starting its node and exporter (a new machine)", node=name)
    try:
        stack.start_host(name)
    except Exception as e:  # noqa: BLE001 - the report says the join did not happen
        observer.event("join", f"{name}: did not start: {e}", node=name)
        return
    observer.event("join", f"{name}: serving; its exporter registers it once its pre-checks pass", node=name)


def _crash(stack: Any, name: str, observer: Observer, marks: dict) -> None:
    rec = stack.records().get(name)
    marks["crash_ttl_s"] = rec.ttl_s if rec else None
    marks["killed_s"] = observer.now()
    stack.kill_host(name)
    observer.event("crash", f"{name}: SIGKILL to its node and exporter (lease TTL {marks['crash_ttl_s']}s)",
                   node=name)


def _settle(stack: Any, observer: Observer, name: str, marks: dict, samples: list, deadline_s: float) -> None:
    """After the load: until the crashed node is deleted from HAProxy, or deadline_s after the kill."""
    until = observer.t0 + marks["killed_s"] + deadline_s
    while time.time() < until and observer.latest.get(name, {}).get("present", True):
        samples.append(_sample(stack, observer, marks))
        time.sleep(0.5)


def _sample(stack: Any, observer: Observer, marks: dict) -> dict:
    """Once a second: each server's weight and status, the controller's state for it, who leads."""
    nodes: dict[str, dict] = {}
    for name, cur in dict(observer.latest).items():
        if cur["present"]:
            nodes[name] = {"weight": cur["weight"], "status": cur["status"], "admin": cur["admin"]}
    leader = None
    try:
        st = stack.controller_status()
        leader = ",".join(sorted(set((st.get("leadership") or {}).get("leaders", {}).values()))) or None
        for p in st["pools"]:
            for n in p["nodes"]:
                if n["node"] in nodes:
                    nodes[n["node"]]["state"] = n["state"]
    except Exception as e:  # noqa: BLE001 - a sample must never kill the run
        log.debug("controller status failed: %s", e)
    notes = stack.webhook.received()
    for n in notes[observer.notes_seen:]:
        for a in n.alerts:
            lab = a.get("labels", {})
            observer.event("page" if n.path == "/page" else "ticket",
                           f"{a.get('status')} {lab.get('alertname')} {lab.get('node') or lab.get('instance') or ''}",
                           alert=lab.get("alertname"), status=a.get("status"), node=lab.get("node"),
                           severity=lab.get("severity"), summary=a.get("annotations", {}).get("summary"),
                           runbook_url=a.get("annotations", {}).get("runbook_url"))
    observer.notes_seen = len(notes)
    return {"t": round(observer.now(), 2), "leader": leader, "nodes": nodes}


def _leader(stack: Any) -> dict:
    try:
        st = stack.controller_status().get("leadership") or {}
        return {"id": st.get("id"), "leads": st.get("leads"), "leaders": st.get("leaders"),
                "changes": stack.controller_metric("grayguard_controller_leader_changes_total")}
    except Exception as e:  # noqa: BLE001 - the stack may be half down
        log.debug("leadership read failed: %s", e)
        return {}


def _show(opts: MembershipOptions, observer: Observer, s: dict, records: list, shown: int, next_table: float,
          tty: bool, out) -> tuple[int, float]:
    """Events as they come; the table of servers on a terminal every second, else every 15 s."""
    if opts.live == "off":
        return len(observer.events), next_table
    lines = [f"grayguard demo (membership)  t={s['t']:6.1f}s / {opts.duration_s:.0f}s  leader={s['leader'] or '-'}  "
             f"requests={len(records)} failed={sum(r.status not in ('ok', 'pending') for r in list(records))}",
             f"{'server':<8}{'status':<14}{'state':<12}{'weight':>7}"]
    for name, v in sorted(s["nodes"].items(), key=lambda kv: (len(kv[0]), kv[0])):
        lines.append(f"{name:<8}{str(v.get('status')):<14}{v.get('state', '-'):<12}{v['weight']:>7}")
    events = observer.events
    if tty:
        lines += ["events:"] + [f"  {e['t']:6.1f}s {e['kind']:<9} {e['text'][:100]}" for e in events[-10:]]
        out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        out.flush()
        return len(events), next_table
    for e in events[shown:]:
        print(f"  {e['t']:6.1f}s {e['kind']:<9} {e['text']}", file=out, flush=True)
    if s["t"] >= next_table:
        print("\n".join(lines), file=out, flush=True)
        next_table = s["t"] + 15
    return len(events), next_table


def _finish(opts, report_dir, stack, observer, samples, records, result, marks, leader, interrupted, out) -> dict:
    from grayguard.demo.membership_report import (
        client_failures,
        crash_milestones,
        join_milestones,
        summary_text,
        verdict,
        write_report,
    )
    cfg = stack.cfg
    base = 100
    warm = max(1, round(base * cfg.recovery.slow_start_initial))
    join = join_milestones(observer.haproxy, observer.registry, opts.join_node, marks.get("join_started_s"), warm,
                           base)
    crash = crash_milestones(observer.haproxy, observer.registry, opts.crash_node, marks.get("killed_s"),
                             marks.get("crash_ttl_s"), cfg.tick_interval_s)
    phases = result.summary() if result is not None else {}
    phases.pop("all", None)
    report = {"scenario": "membership", "join_at_s": opts.join_at_s, "crash_at_s": opts.crash_at_s,
              "join": join, "crash": crash, "clients": client_failures(records, opts.crash_node, crash["killed_s"]),
              "leader": (leader or {}).get("id"), "leadership": leader, "nodes": opts.nodes, "rate": opts.rate,
              "duration_s": opts.duration_s, "seed": opts.seed, "balance": opts.balance,
              "warmup_s": opts.warmup_s, "registry_timing": dataclasses.asdict(stack.timing),
              "interrupted": interrupted, "phases": phases,
              "events": sorted(observer.events, key=lambda e: e["t"]), "haproxy_log": observer.haproxy,
              "registry_log": observer.registry}
    report["verdict"], report["checks"] = verdict(report)
    print("\n" + summary_text(report), file=out, flush=True)
    if report_dir is not None:
        write_report(report, samples, records, report_dir)
        if result is not None:
            result.write_records(str(report_dir / "requests.csv"))
        print(f"[report] {report_dir / 'report.json'}  {report_dir / 'report.md'}  {report_dir / 'report.html'}",
              file=out, flush=True)
    return report


def run(args: argparse.Namespace) -> int:
    """`grayguard demo --scenario membership`: 0 when it ran, 2 on a bad flag, 1 when a binary is missing."""
    from grayguard.binaries import BinaryMissing
    from grayguard.demo.cli import add_arguments as demo_arguments
    p = argparse.ArgumentParser()
    demo_arguments(p)
    try:
        opts = options_from_args(args, p.parse_args([]))
    except ValueError as e:
        print(f"grayguard demo: {e}", file=sys.stderr)
        return 2
    # The live view shows the join, the crash and the pages; per-tick logs would drown it (--log.level debug: all).
    if logging.getLogger().level > logging.DEBUG:
        for name in ("aiohttp", "grayguard", "exporters", "rules", "sim", "localstack", "demo"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        run_scenario(opts, Path(args.report_dir))
    except BinaryMissing as e:
        print(f"grayguard demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
