"""Fault catalogue for the simulated fleet: validation, phase multipliers, fake-GPU effects, schedules.

Pure: time is a parameter. A node holds at most one active fault (setting another replaces it);
a multiplicative fault may leave a residual slowdown that decays after it is cleared (`recovery_s`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grayguard.sim.model import NO_SLOWDOWN, Slowdown

CUDA_ERROR_TEXT = "CUDA error: an illegal memory access was encountered"

# fault -> its parameters and their defaults (every parameter is optional).
FAULTS: dict[str, dict[str, Any]] = {
    "thermal": {"k": 6.0, "recovery_s": 0.0},  # every phase x k
    "pcie": {"k": 3.0, "prefill_k": 2.0, "recovery_s": 0.0},  # decode x k, prefill x prefill_k
    # KV budget shrunk to kv_fraction (preemptions, usage near 1) plus periodic spikes of x spike_k
    # lasting spike_s every period_s, the first one when the fault starts.
    "kv_thrash": {"kv_fraction": 0.06, "spike_k": 3.0, "period_s": 4.0, "spike_s": 1.0},
    "hang": {},  # the engine freezes: requests are accepted and never answered; /health stays 200
    # rate: share of requests that fail; mode "http" = 500 before any output, "midstream" = an error
    # event after the first token (non-streaming requests get the 500 then).
    "cuda_error": {"rate": 1.0, "mode": "http", "xid": 31},
    "garbage": {"rate": 1.0, "style": "nan"},  # style: nan | bang | mojibake
    "slow_recovery": {"k": 6.0, "recovery_s": 30.0},  # x k; after clearing decays with time constant recovery_s
    # the serving process is gone, the host is up: every connection is refused at once (RST), /health too.
    # Modelled by the benchmark (bench/); the simulated fleet does not implement it yet.
    "refused": {},
}
# Faults whose effect is a slowdown of the engine's phases (the others give errors, silence or garbage).
LATENCY_FAULTS = ("thermal", "pcie", "kv_thrash", "slow_recovery")
THERMAL_FAULTS = ("thermal", "slow_recovery")  # every phase x k; the fake GPU shows thermal throttling
GARBAGE_STYLES = ("nan", "bang", "mojibake")
CUDA_MODES = ("http", "midstream")
_STR_PARAMS = {"mode", "style"}
_INT_PARAMS = {"xid"}
_RESIDUAL_FLOOR = 1.01  # a decaying residual below this multiplier is dropped


class FaultError(ValueError):
    """An unknown fault or a bad parameter."""


@dataclass(frozen=True)
class Fault:
    """An active fault on a node: its name, full parameters (defaults filled in) and start time."""

    name: str
    params: Mapping[str, Any]
    started_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"fault": self.name, "params": dict(self.params)}


def make_fault(name: str, params: Mapping[str, Any] | None = None, now: float = 0.0) -> Fault:
    """Validate a fault name and parameters (strings are converted) and fill in the defaults."""
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    defaults = FAULTS[name]
    full = dict(defaults)
    for key, value in (params or {}).items():
        if key not in defaults:
            known = ", ".join(defaults) or "none"
            raise FaultError(f"fault {name!r} has no parameter {key!r} (parameters: {known})")
        try:
            if key in _STR_PARAMS:
                full[key] = str(value)
            elif key in _INT_PARAMS:
                full[key] = int(value)
            else:
                full[key] = float(value)
        except (TypeError, ValueError):
            raise FaultError(f"fault {name!r} parameter {key!r}: not a number: {value!r}") from None
    for key in ("k", "prefill_k", "spike_k"):
        if key in full and full[key] < 1.0:
            raise FaultError(f"fault {name!r} parameter {key!r} must be >= 1, got {full[key]}")
    if "rate" in full and not 0.0 <= full["rate"] <= 1.0:
        raise FaultError(f"fault {name!r} parameter 'rate' must be within 0..1, got {full['rate']}")
    if name == "kv_thrash" and not (0 < full["kv_fraction"] <= 1 and full["period_s"] > 0):
        raise FaultError("fault 'kv_thrash' needs 0 < kv_fraction <= 1 and period_s > 0")
    if full.get("recovery_s", 0.0) < 0:
        raise FaultError(f"fault {name!r} parameter 'recovery_s' must be >= 0")
    if name == "cuda_error" and full["mode"] not in CUDA_MODES:
        raise FaultError(f"fault 'cuda_error' parameter 'mode' must be one of {CUDA_MODES}")
    if name == "garbage" and full["style"] not in GARBAGE_STYLES:
        raise FaultError(f"fault 'garbage' parameter 'style' must be one of {GARBAGE_STYLES}")
    return Fault(name, full, now)


def fault_slowdown(fault: Fault | None, now: float) -> Slowdown:
    """The phase multipliers a fault imposes at time `now`."""
    if fault is None:
        return NO_SLOWDOWN
    p = fault.params
    if fault.name in THERMAL_FAULTS:
        return Slowdown(prefill=p["k"], decode=p["k"])
    if fault.name == "pcie":
        return Slowdown(prefill=p["prefill_k"], decode=p["k"])
    if fault.name == "kv_thrash":
        in_spike = (now - fault.started_at) % p["period_s"] < p["spike_s"]
        k = p["spike_k"] if in_spike else 1.0
        return Slowdown(prefill=k, decode=k, kv_fraction=p["kv_fraction"])
    return NO_SLOWDOWN


def nominal_slowdown(name: str, params: Mapping[str, Any] | None = None) -> float | None:
    """The fixed multiplier a fault stands for: the smaller of its phase multipliers.

    None when the fault is not a slowdown (hang, cuda_error, garbage, refused) or not a fixed one (kv_thrash spikes).
    Raises FaultError for an unknown fault or a bad parameter.
    """
    fault = make_fault(name, params)
    if name not in LATENCY_FAULTS or name == "kv_thrash":  # kv_thrash: periodic spikes, no fixed multiplier
        return None
    sd = fault_slowdown(fault, 0.0)
    return float(min(sd.prefill, sd.decode))


@dataclass(frozen=True)
class _Residual:
    prefill: float
    decode: float
    since: float
    tau: float

    def at(self, now: float) -> tuple[float, float]:
        w = math.exp(-max(0.0, now - self.since) / self.tau)
        return 1 + (self.prefill - 1) * w, 1 + (self.decode - 1) * w


@dataclass
class FaultState:
    """One node's fault: what is active now and any residual slowdown still decaying."""

    active: Fault | None = None
    residual: _Residual | None = field(default=None, repr=False)

    def set(self, name: str, params: Mapping[str, Any] | None, now: float) -> Fault:
        """Activate a fault (replacing any other); returns it with defaults filled in."""
        self.active = make_fault(name, params, now)
        return self.active

    def clear(self, now: float) -> Fault | None:
        """Deactivate; a fault with recovery_s > 0 leaves a slowdown that decays from its level."""
        old, self.active = self.active, None
        if old is not None and old.params.get("recovery_s", 0.0) > 0:
            sd = fault_slowdown(old, now)
            self.residual = _Residual(sd.prefill, sd.decode, now, old.params["recovery_s"])
        return old

    def slowdown(self, now: float) -> Slowdown:
        """Multipliers now: the active fault's, times what remains of a cleared slow one."""
        sd = fault_slowdown(self.active, now)
        if self.residual is not None:
            prefill, decode = self.residual.at(now)
            if max(prefill, decode) < _RESIDUAL_FLOOR:
                self.residual = None
            else:
                sd = Slowdown(sd.prefill * prefill, sd.decode * decode, sd.kv_fraction)
        return sd

    def recovering(self, now: float) -> bool:
        """True while a cleared fault's residual slowdown is still noticeable."""
        self.slowdown(now)
        return self.residual is not None


# Reference values of an H100 SXM; pass `base` (the fake GPU's normal fields) to scale from yours.
_H100 = {"sm_clock_max_mhz": 1980, "power_limit_mw": 700_000}
THERMAL_REASONS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown


def gpu_effects(fault: str, params: Mapping[str, Any] | None = None,
                base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fake-GPU field overrides (FakeGpu names) that tell the same story as `fault`.

    Keys are FakeGpu fields plus `xid` (an XID event to emit once). {} means the GPU looks normal:
    kv_thrash is software, garbage output is silent data corruption.
    """
    full = make_fault(fault, params).params
    ref = {**_H100, **(base or {})}
    sm_max, power_limit = int(ref["sm_clock_max_mhz"]), int(ref["power_limit_mw"])
    if fault in THERMAL_FAULTS:
        k = full["k"]
        return {
            "temperature_c": 90 if k >= 2 else 84,
            "memory_temperature_c": 95 if k >= 2 else 88,
            "clock_event_reasons": THERMAL_REASONS,
            "sm_clock_mhz": max(210, int(sm_max / k)),
            "power_mw": int(power_limit * min(0.9, 1.5 / k)),
        }
    if fault == "pcie":
        return {"pcie_gen": 1}  # pcie_gen_max is untouched: the link trained below its maximum
    if fault == "hang":
        return {"utilization_pct": 100, "power_mw": int(power_limit * 0.3)}  # spinning, no work
    if fault == "cuda_error":
        return {"xid": full["xid"]}
    return {}


@dataclass(frozen=True)
class ScheduledFault:
    """Set `fault` on `node` at `at_s` seconds after start; clear it at `until_s` (None: never).

    The one fault schedule entry: the fleet (sim/fleet.py) arms it on the loop clock, the benchmark
    (bench.spec.FaultSpec) in virtual time. `params` are as given (validated, defaults not filled in);
    the entry is hashable.
    """

    node: str
    fault: str
    at_s: float
    until_s: float | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(self.params))  # an own copy: the caller's dict may change
        make_fault(self.fault, self.params)
        if self.at_s < 0 or (self.until_s is not None and self.until_s <= self.at_s):
            raise FaultError(f"{self.node}:{self.fault}: need 0 <= at_s < until_s")

    def __hash__(self) -> int:
        return hash((self.node, self.fault, self.at_s, self.until_s, tuple(sorted(self.params.items()))))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScheduledFault:
        """From {node, fault, at_s, until_s?, params?} (e.g. a YAML scenario entry)."""
        until = d.get("until_s")
        return cls(str(d["node"]), str(d["fault"]), float(d.get("at_s", 0.0)),
                   None if until is None else float(until), dict(d.get("params") or {}))

    @classmethod
    def parse(cls, spec: str) -> ScheduledFault:
        """Parse `node:fault:at_s[:until_s][:k=v,k=v]`; until_s may be `-` (never)."""
        parts = spec.split(":")
        if len(parts) < 3:
            raise FaultError(f"bad fault spec {spec!r}: want node:fault:at_s[:until_s][:k=v,...]")
        node, name, at = parts[0], parts[1], parts[2]
        rest = parts[3:]
        until: float | None = None
        if rest and "=" not in rest[0]:
            until = None if rest[0] in ("", "-") else _num(rest[0], spec)
            rest = rest[1:]
        params: dict[str, str] = {}
        for item in ",".join(rest).split(","):
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise FaultError(f"bad fault parameter {item!r} in {spec!r}: want key=value")
            params[key.strip()] = value.strip()
        return cls(node, name, _num(at, spec), until, params)


def _num(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FaultError(f"bad time {text!r} in fault spec {spec!r}") from None
