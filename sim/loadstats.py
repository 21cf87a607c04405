"""Load-generator results: per-request records, phases, percentiles, error classes (pure)."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

QUANTILES = (50.0, 95.0, 99.0, 99.9)
# Request outcome classes, in the order reports list them.
STATUSES = ("ok", "timeout", "overflow", "connect", "http_4xx", "http_5xx", "stream_error", "garbage",
            "protocol")


@dataclass(frozen=True)
class Phase:
    """A named time range [start_s, end_s) of a run, counted from its start."""

    name: str
    start_s: float
    end_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.end_s > self.start_s:
            raise ValueError(f"phase {self.name!r}: end_s must be after start_s")

    @classmethod
    def parse(cls, spec: str) -> Phase:
        """`name:start_s:end_s` (end may be empty or `-` for open-ended)."""
        parts = spec.split(":")
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"bad phase {spec!r}: want name:start_s:end_s")
        try:
            end = math.inf if parts[2] in ("", "-") else float(parts[2])
            return cls(parts[0], float(parts[1]), end)
        except ValueError as e:
            raise ValueError(f"bad phase {spec!r}: {e}") from None

    def contains(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


@dataclass
class RequestRecord:
    """One request: when it was due (s from run start), its outcome and client-side latencies.

    Latencies count from the scheduled arrival, so a lagging generator shows up as latency
    (no coordinated omission). `e2e_s` is the time until the request ended, whatever its status.
    """

    index: int
    start_s: float
    status: str
    prompt_tokens: int
    max_tokens: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    http_status: int | None = None
    backend: str | None = None
    completion_tokens: int | None = None
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, like numpy's default; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def qkey(q: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{q:g}"


@dataclass
class LoadResult:
    """Everything a run produced; `records` is the time series for plots."""

    records: list[RequestRecord]
    phases: tuple[Phase, ...] = ()
    duration_s: float = 0.0  # the arrival window (rates are per this); the run lasts until the last answer
    wall_s: float = 0.0  # from the first arrival slot to the last answer
    started_at: float = 0.0  # wall-clock epoch seconds of the run's start
    config: dict[str, Any] = field(default_factory=dict)

    def select(self, phase: str | None = None, statuses: Iterable[str] | None = None) -> list[RequestRecord]:
        """Records of a phase (None or 'all': every record), optionally only some statuses."""
        recs = self.records
        if phase not in (None, "all"):
            ph = self._phase(phase)
            recs = [r for r in recs if ph.contains(r.start_s)]
        if statuses is not None:
            wanted = set(statuses)
            recs = [r for r in recs if r.status in wanted]
        return recs

    def _phase(self, name: str) -> Phase:
        for ph in self.phases:
            if ph.name == name:
                return ph
        raise KeyError(f"no phase {name!r}; phases: {', '.join(p.name for p in self.phases) or 'none'}")

    def percentiles(self, metric: str = "e2e", phase: str | None = None, qs: Sequence[float] = QUANTILES,
                    statuses: Iterable[str] = ("ok",)) -> dict[str, float | None]:
        """{'p50': ..., 'p95': ..., 'p99': ..., 'p99.9': ...} of 'e2e' or 'ttft' seconds."""
        if metric not in ("e2e", "ttft"):
            raise ValueError("metric must be 'e2e' or 'ttft'")
        attr = f"{metric}_s"
        values = [v for r in self.select(phase, statuses) if (v := getattr(r, attr)) is not None]
        return {qkey(q): percentile(values, q) for q in qs}

    def errors(self, phase: str | None = None) -> dict[str, int]:
        """Count of each non-ok status."""
        counts = Counter(r.status for r in self.select(phase))
        return {s: counts[s] for s in STATUSES if s != "ok" and counts[s]}

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per phase ('all' first): requests, ok, errors by class, achieved rate, TTFT and e2e percentiles."""
        out: dict[str, dict[str, Any]] = {}
        spans = [("all", 0.0, self.duration_s)] + [(p.name, p.start_s, min(p.end_s, self.duration_s))
                                                   for p in self.phases]
        for name, start, end in spans:
            recs = self.select(name)
            ok = sum(r.status == "ok" for r in recs)
            out[name] = {"requests": len(recs), "ok": ok, "errors": self.errors(name),
                         "rate": round(len(recs) / (end - start), 3) if end > start else None,
                         "ttft": self.percentiles("ttft", name), "e2e": self.percentiles("e2e", name)}
        return out

    def format_table(self) -> str:
        """A plain-text report: one row per phase, TTFT and e2e percentiles in milliseconds."""
        head = ["phase", "reqs", "ok", "err", *(f"ttft_{qkey(q)}" for q in QUANTILES),
                *(f"e2e_{qkey(q)}" for q in QUANTILES)]
        rows = [head]
        for name, s in self.summary().items():
            ms = [("-" if v is None else f"{v * 1000:.0f}") for m in ("ttft", "e2e") for v in s[m].values()]
            rows.append([name, str(s["requests"]), str(s["ok"]), str(sum(s["errors"].values())), *ms])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        errs = self.errors()
        lines.append("latencies in ms; errors: " + (", ".join(f"{k}={v}" for k, v in errs.items()) or "none"))
        return "\n".join(lines)

    def write_records(self, path: str) -> None:
        """The per-request time series as CSV (path ends .csv) or JSON lines."""
        with open(path, "w", newline="") as f:
            if path.endswith(".csv"):
                writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(RequestRecord)])
                writer.writeheader()
                for r in self.records:
                    writer.writerow(asdict(r))
            else:
                for r in self.records:
                    f.write(json.dumps(asdict(r)) + "\n")
