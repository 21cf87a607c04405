"""Scenario suites: a compact YAML spec (bench/suites/<suite>.yaml) expanded into Scenario objects.

A suite names pools (speed-class compositions per mix and size), loads, fault injections and benign
variations, then lists groups; a group's `matrix` is expanded as a cross product. See
docs/benchmarks.md for the format. Errors name the suite file and the offending key.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from grayguard.bench.spec import Absence, FaultSpec, LoadSpec, NodeSpec, PinnedLoad, Scenario, TracePin, trace_plan
from grayguard.sim.faults import FaultError, nominal_slowdown
from grayguard.sim.loadgen import LengthDist
from grayguard.sim.model import ModelParams
from grayguard.sim.traces import FORMATS, TraceError, TraceLoad, parse_window

SCENARIO_DIR = Path(__file__).parent / "suites"
_SCENARIO_FIELDS = {f.name for f in fields(Scenario)} - {"name", "nodes", "load", "faults", "policies", "tags", "group"}
MAX_MODEL_LEN = ModelParams().max_model_len  # vLLM rejects prompt + completion above it: a spec must fit
_LOAD_FIELDS = {f.name for f in fields(LoadSpec)} - {"trace", "trace_pin"}
# a trace load's keys (docs/benchmarks.md): trace: FILE (relative to the suite's folder), window: START:DURATION (trace
# seconds), speedup, format, pin_hottest: {node, start_s, end_s}; with utilization, rate, rate_per_node, timeout_s
_TRACE_KEYS = {"trace", "window", "speedup", "format", "pin_hottest"}
_NOT_WITH_TRACE = {"prompt", "completion", "shape", "surges", "burst_period_s", "burst_s", "burst_factor",
                   "lull_factor"}
MATRIX_KEYS = ("fault", "benign", "size", "mix", "load")


class SuiteError(ValueError):
    """A malformed suite spec."""


def suites() -> list[str]:
    """Names of the suites shipped in bench/suites."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def _dist(d: Any, where: str) -> LengthDist:
    if not isinstance(d, dict):
        raise SuiteError(f"{where}: expected a mapping with median, cv, lo, hi")
    try:
        return LengthDist(float(d["median"]), float(d.get("cv", 1.0)), int(d.get("lo", 1)), int(d.get("hi", 4096)))
    except (KeyError, ValueError, TypeError) as e:
        raise SuiteError(f"{where}: bad length distribution {d!r} ({e})") from None


def _fits(prompt: LengthDist, completion: LengthDist, where: str) -> None:
    if prompt.hi + completion.hi > MAX_MODEL_LEN:
        raise SuiteError(f"{where}: prompt hi {prompt.hi} + completion hi {completion.hi} exceeds max_model_len "
                         f"{MAX_MODEL_LEN}: vLLM would reject the largest requests")


def _node_name(node: Any, nodes: tuple[NodeSpec, ...], where: str) -> str:
    if isinstance(node, int):
        if not 0 <= node < len(nodes):
            raise SuiteError(f"{where}: node {node} is not in a pool of {len(nodes)}")
        return nodes[node].name
    return str(node)


def _absent(entries: Any, nodes: tuple[NodeSpec, ...], where: str) -> tuple[Absence, ...]:
    """`absent: [{node, from_s, until_s, warmup_k?, warmup_tau_s?}, ...]` (node: an index or a name)."""
    out = []
    for j, a in enumerate(entries or []):
        w = f"{where}.absent[{j}]"
        unknown = set(a) - {"node", "from_s", "until_s", "warmup_k", "warmup_tau_s"}
        if unknown:
            raise SuiteError(f"{w}: unknown key(s) {sorted(unknown)}")
        ab = Absence(_node_name(a["node"], nodes, w), float(a.get("from_s", 0.0)), float(a["until_s"]),
                     float(a.get("warmup_k", 1.0)), float(a.get("warmup_tau_s", 10.0)))
        if not (ab.from_s < ab.until_s and ab.warmup_k >= 1.0 and ab.warmup_tau_s > 0):
            raise SuiteError(f"{w}: need from_s < until_s, warmup_k >= 1 and warmup_tau_s > 0")
        out.append(ab)
    return tuple(out)


def _slowdown_all(entries: Any, where: str) -> tuple[tuple[float, float, float], ...]:
    """`slowdown_all: [[start_s, end_s, k], ...]`: every node's steps x k together."""
    out = []
    for e in entries or []:
        start, end, k = (float(x) for x in e)
        if not (start < end and k > 0):
            raise SuiteError(f"{where}.slowdown_all: need start_s < end_s and k > 0, got {e!r}")
        out.append((start, end, k))
    return tuple(out)


def _trace(d: dict, nodes: tuple[NodeSpec, ...], where: str, base_dir: Path | None) -> dict[str, Any]:
    """The trace keys of a load (popped from d) as LoadSpec fields; errors name the key."""
    kw: dict[str, Any] = {}
    path = Path(str(d.pop("trace")))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise SuiteError(f"{where}.trace: no trace file {str(path)!r}")
    bad = sorted(set(d) & _NOT_WITH_TRACE)
    if bad:
        raise SuiteError(f"{where}.{bad[0]}: not with a trace (its arrivals and lengths are the trace's)")
    fmt = d.pop("format", None)
    if fmt is not None and fmt not in FORMATS:
        raise SuiteError(f"{where}.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    window = d.pop("window", "0:")
    try:
        start, dur = (parse_window(window) if isinstance(window, str) else
                      (float(window[0]), None if len(window) < 2 or window[1] is None else float(window[1])))
    except (TraceError, TypeError, ValueError, IndexError) as e:
        raise SuiteError(f"{where}.window: {window!r}: want 'START:DURATION' or [start, duration] ({e})") from None
    speedup = d.pop("speedup", None)
    if speedup is not None:
        if "utilization" in d or "rate" in d or "rate_per_node" in d:
            raise SuiteError(f"{where}.speedup: give speedup or a utilization/rate, not both (each sets the pace)")
        kw["utilization"] = None
    try:
        kw["trace"] = TraceLoad(str(path.resolve()), fmt, start, dur, None if speedup is None else float(speedup),
                                max_model_len=MAX_MODEL_LEN)
    except (TraceError, TypeError, ValueError) as e:
        raise SuiteError(f"{where}.{'speedup' if speedup is not None else 'window'}: {e}") from None
    pin = d.pop("pin_hottest", None)
    if pin is not None:
        w = f"{where}.pin_hottest"
        unknown = set(pin) - {"node", "start_s", "end_s", "max_rate"} if isinstance(pin, dict) else {"(not a mapping)"}
        if unknown or "node" not in pin:
            raise SuiteError(f"{w}: want {{node, start_s?, end_s?, max_rate?}}, got {pin!r}")
        kw["trace_pin"] = TracePin(_node_name(pin["node"], nodes, w), float(pin.get("start_s", 0.0)),
                                   float(pin.get("end_s", math.inf)),
                                   None if pin.get("max_rate") is None else float(pin["max_rate"]))
        tp = kw["trace_pin"]
        if not tp.start_s < tp.end_s or (tp.max_rate is not None and tp.max_rate <= 0):
            raise SuiteError(f"{w}: need start_s < end_s and max_rate > 0")
    return kw


def _load(d: dict, nodes: tuple[NodeSpec, ...], where: str, base_dir: Path | None = None) -> LoadSpec:
    d = dict(d)
    kw: dict[str, Any] = {}
    if "trace" in d:
        kw.update(_trace(d, nodes, where, base_dir))
    elif set(d) & (_TRACE_KEYS - {"trace"}):
        raise SuiteError(f"{where}.{sorted(set(d) & _TRACE_KEYS)[0]}: only with a trace (load key `trace: FILE`)")
    per_node = d.pop("rate_per_node", None)
    if per_node is not None:
        kw["rate"], kw["utilization"] = float(per_node) * len(nodes), None
    for key in ("prompt", "completion"):
        if key in d:
            kw[key] = _dist(d.pop(key), f"{where}.{key}")
    if "surges" in d:
        kw["surges"] = tuple(tuple(float(x) for x in s) for s in d.pop("surges"))
    pinned = []
    for j, p in enumerate(d.pop("pinned", []) or []):
        w = f"{where}.pinned[{j}]"
        node = p["node"]
        name = _node_name(node, nodes, w)
        pl = PinnedLoad(name, float(p["start_s"]), float(p["end_s"]), float(p["rate"]),
                        _dist(p["prompt"], w + ".prompt"), _dist(p["completion"], w + ".completion"))
        _fits(pl.prompt, pl.completion, w)
        pinned.append(pl)
    kw["pinned"] = tuple(pinned)
    unknown = set(d) - _LOAD_FIELDS
    if unknown:
        raise SuiteError(f"{where}: unknown load key(s) {sorted(unknown)}")
    kw.update(d)
    load = LoadSpec(**kw)
    _fits(load.prompt, load.completion, where)
    return load


def _nodes(composition: list, node_spec: dict) -> tuple[NodeSpec, ...]:
    classes = [(int(c), str(k)) for c, k in composition]
    grouped = len(classes) > 1  # mixed pools declare one peer group per speed class
    out = []
    for count, cls in classes:
        for _ in range(count):
            out.append(NodeSpec(f"node{len(out)}", cls, cls if grouped else None, **node_spec))
    return tuple(out)


def _faults(entry: str, spec: dict, nodes: tuple[NodeSpec, ...], at: float, where: str
            ) -> tuple[tuple[FaultSpec, ...], float | None]:
    """Faults for `entry` ('thermal', or 'thermal+cuda_error' for two nodes at once) and the nominal slowdown.

    A fault declared with `node: all` strikes every node of the pool at once.
    """
    out, slow = [], []
    for j, name in enumerate(entry.split("+")):
        f = spec.get(name)
        if f is None:
            raise SuiteError(f"{where}: fault {name!r} is not declared under faults")
        params = dict(f.get("params") or {})
        targets = [n.name for n in nodes] if f.get("node") == "all" else [nodes[int(f.get("node", j))].name]
        until = f.get("until_s")
        try:
            slow.append(nominal_slowdown(f["fault"], params))
            out += [FaultSpec(node, f["fault"], float(f.get("at_s", at)), None if until is None else float(until),
                              params) for node in targets]
        except FaultError as e:
            raise SuiteError(f"{where}: {e}") from None
    known = [s for s in slow if s is not None]
    return tuple(out), (min(known) if known and len(known) == len(slow) else None)


def load_suite(name_or_path: str) -> tuple[list[Scenario], dict]:
    """Expand a suite (a name in bench/suites or a path) into scenarios; also returns the raw spec."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise SuiteError(f"no suite {name_or_path!r} (known: {', '.join(suites())})")
    spec = yaml.safe_load(path.read_text()) or {}
    try:
        return expand(spec, path.name, path.parent), spec
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SuiteError):
            raise
        raise SuiteError(f"{path.name}: {type(e).__name__}: {e}") from None


def expand(spec: dict, where: str = "suite", base_dir: Path | None = None) -> list[Scenario]:
    """Scenarios of a parsed suite spec, in a stable order; a trace's relative path is read from base_dir."""
    base = dict(spec.get("base") or {})
    fault_at = float(base.pop("fault_at_s", 40.0))
    node_spec = dict(base.pop("node", {}) or {})
    unknown = set(base) - _SCENARIO_FIELDS
    if unknown:
        raise SuiteError(f"{where}: base: unknown key(s) {sorted(unknown)}")
    policies = tuple(spec.get("policies") or ())
    out: list[Scenario] = []
    seen: set[str] = set()
    for gi, g in enumerate(spec.get("groups") or []):
        gw = f"{where}: groups[{gi}]"
        matrix = g.get("matrix") or {}
        bad = set(matrix) - set(MATRIX_KEYS)
        if bad:
            raise SuiteError(f"{gw}.matrix: unknown key(s) {sorted(bad)} (known: {', '.join(MATRIX_KEYS)})")
        keys = [k for k in MATRIX_KEYS if k in matrix]
        for combo in itertools.product(*(matrix[k] for k in keys)):
            c = dict(zip(keys, combo, strict=True))
            out.append(_one(spec, g, c, base, node_spec, fault_at, policies, gw, base_dir))
            if out[-1].name in seen:
                raise SuiteError(f"{gw}: duplicate scenario name {out[-1].name}")
            seen.add(out[-1].name)
    return out


def _one(spec: dict, g: dict, c: dict, base: dict, node_spec: dict, fault_at: float, policies: tuple,
         where: str, base_dir: Path | None = None) -> Scenario:
    overrides: dict[str, Any] = dict(g.get("set") or {})
    benign = c.get("benign")
    if benign is not None:
        b = (spec.get("benign") or {}).get(benign)
        if b is None:
            raise SuiteError(f"{where}: benign case {benign!r} is not declared under benign")
        overrides.update({k: v for k, v in b.items() if k not in ("mix", "load")})
        c = {"mix": b.get("mix", "homogeneous"), "load": b.get("load", "steady"), **c}
    mix, size, load_name = c.get("mix", "homogeneous"), int(c["size"]), c.get("load", "steady")
    comp = (spec.get("pools") or {}).get(mix, {}).get(size)
    if comp is None:
        raise SuiteError(f"{where}: no pool composition for mix {mix!r} size {size}")
    nodes = _nodes(comp, {**node_spec, **(g.get("node") or {})})
    load_def = load_name if isinstance(load_name, dict) else (spec.get("loads") or {}).get(load_name)
    if load_def is None:
        raise SuiteError(f"{where}: load {load_name!r} is not declared under loads")
    load_def = {**load_def, **(overrides.pop("load_overrides", None) or {})}
    load = _load(load_def, nodes, f"{where}.load", base_dir)
    faults, slowdown = (), None
    if "fault" in c:
        faults, slowdown = _faults(c["fault"], spec.get("faults") or {}, nodes, fault_at, where)
    parts = [c.get("fault") or benign or group_name(g), f"n{size}", mix[:5], str(load_name)]
    seed = int(base.get("seed", 1)) * 1000 + size * 10 + (1 if mix != "homogeneous" else 0) \
        + (5 if load_name != "steady" else 0)
    kw = {**base, **{k: v for k, v in overrides.items() if k in _SCENARIO_FIELDS}}
    unknown = set(overrides) - _SCENARIO_FIELDS
    if unknown:
        raise SuiteError(f"{where}: unknown scenario key(s) {sorted(unknown)}")
    kw["seed"] = seed
    if "absent" in kw:
        kw["absent"] = _absent(kw["absent"], nodes, where)
    if "slowdown_all" in kw:
        kw["slowdown_all"] = _slowdown_all(kw["slowdown_all"], where)
    tags = {"fault": c.get("fault") or benign or group_name(g), "size": size, "mix": mix, "load": str(load_name),
            "slowdown": slowdown}
    scn = Scenario(name="/".join(parts), nodes=nodes, load=load, faults=faults, group=g["group"],
                   policies=tuple(g.get("policies") or policies), tags=tuple(tags.items()))
    scn = replace(scn, **kw)
    if scn.load.trace is not None:  # read it now: a bad file or an empty window fails the suite, not a run
        try:
            trace_plan(scn)
        except TraceError as e:
            raise SuiteError(f"{where}.load.trace: {e}") from None
    return scn


def group_name(g: dict) -> str:
    return str(g.get("name", g["group"]))
