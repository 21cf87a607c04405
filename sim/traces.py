"""Production traces as load: Azure LLM inference (2023/2024), Mooncake (FAST'25) and BurstGPT, read as a stream.

Pure apart from reading the file: `read_trace` streams a file's records (it never holds more than the caller keeps),
`plan_trace` turns a window of them into arrivals (times from the run's start, token counts clipped to the
model's context) scaled by a speed-up, a target rate or a target utilization of the pool. A malformed file is a
`TraceError` naming the file, the line and the column. Timestamps must not go backwards: a window is read until
its end, so a later line that belonged to it would be lost; the public traces are sorted (sort a file first).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from grayguard.sim.loadgen import PROMPT_WORDS, LengthDist, make_prompt

FORMATS = ("azure", "mooncake", "burstgpt")
MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's traces: one hash id is a block of 512 prompt tokens
ATTRIBUTION = {
    "azure": "Azure LLM inference trace (Azure/AzurePublicDataset), from \"Splitwise: Efficient generative LLM "
             "inference using phase splitting\" (Patel, Choukse, Zhang, Shah, Goiri, Maleki, Bianchini; ISCA 2024). "
             "License: CC-BY 4.0.",
    "mooncake": "Mooncake trace (kvcache-ai/Mooncake), from \"Mooncake: Trading More Storage for Less Computation\" "
                "(FAST 2025).",
    "burstgpt": "BurstGPT trace (HPMLL/BurstGPT), from \"BurstGPT: A Real-world Workload Dataset to Optimize LLM "
                "Serving Systems\".",
}
# the columns of each CSV format: (time, prompt tokens, output tokens)
_CSV_COLUMNS = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                "burstgpt": ("Timestamp", "Request tokens", "Response tokens")}


class TraceError(ValueError):
    """A trace file that cannot be read, or options that do not fit it; the message names file, line, column."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace: seconds since the trace's first request, token counts, prefix-block ids."""

    t: float
    prompt: int
    output: int
    hash_ids: tuple[int, ...] = ()


def detect_format(path: str | Path) -> str:
    """The format of a trace, from its header (CSV) or first line (Mooncake's JSON lines)."""
    try:
        with open(path, newline="") as f:
            first = f.readline().strip()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror or e})") from None
    if first.startswith("{"):
        return "mooncake"
    header = [c.strip() for c in next(csv.reader([first]), [])]
    for fmt, cols in _CSV_COLUMNS.items():
        if cols[0] in header:
            return fmt
    raise TraceError(f"{path}:1: not a known trace format (Azure: TIMESTAMP,ContextTokens,GeneratedTokens; BurstGPT: "
                     f"Timestamp,...,Request tokens,Response tokens; Mooncake: JSON lines); got {first[:80]!r}")


def _seconds(value: str, fmt: str) -> float:
    if fmt == "azure":  # 2023-11-16 18:15:46.6805900 (7 digits are truncated to 6) or 2024-05-10 00:00:00.0099+00:00
        return datetime.fromisoformat(value.strip()).timestamp()
    return float(value)


def _count(value: Any, where: str) -> int:
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise TraceError(f"{where}: {value!r} is not a token count (a whole number >= 0)")
    return int(n)


def _rows(path: Path, fmt: str) -> Iterator[tuple[int, Any, Any, Any, Any]]:
    """(line, time, prompt, output, hash_ids) per data line, the columns checked present."""
    with open(path, newline="") as f:
        if fmt == "mooncake":
            for line, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path}:{line}:{e.colno}: not JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{path}:{line}:1: want a JSON object per line")
                for key in ("timestamp", "input_length", "output_length"):
                    if key not in obj:
                        raise TraceError(f"{path}:{line}: column {key!r} is missing")
                yield line, obj["timestamp"], obj["input_length"], obj["output_length"], obj.get("hash_ids", [])
            return
        reader = csv.reader(f)
        header = [c.strip() for c in next(reader, [])]
        cols = []
        for name in _CSV_COLUMNS[fmt]:
            if name not in header:
                raise TraceError(f"{path}:1: column {name!r} is missing (header: {', '.join(header)})")
            cols.append(header.index(name))
        for row in reader:
            line = reader.line_num
            if not row:
                continue
            if len(row) < len(header):
                missing = header[len(row)]
                raise TraceError(f"{path}:{line}:{len(row) + 1}: column {missing!r} is missing")
            yield line, row[cols[0]], row[cols[1]], row[cols[2]], ()


def _csv_positions(path: Path, fmt: str) -> dict[str, int | None]:
    try:
        with open(path, newline="") as f:
            header = [c.strip() for c in next(csv.reader(f), [])]
    except (OSError, UnicodeDecodeError):
        return {n: None for n in _CSV_COLUMNS[fmt]}  # _rows says what is wrong
    return {n: (header.index(n) + 1 if n in header else None) for n in _CSV_COLUMNS[fmt]}


def read_trace(path: str | Path, fmt: str | None = None) -> Iterator[TraceRecord]:
    """The trace's requests in file order, streamed; t counts from the first request (a TraceError on bad lines)."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"{path}: unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    names = {"mooncake": ("timestamp", "input_length", "output_length")}.get(fmt) or _CSV_COLUMNS[fmt]
    # where a field is: file:line:column (the CSV column's number; JSON lines name the key alone)
    cols = _csv_positions(path, fmt) if fmt != "mooncake" else {n: None for n in names}
    t0 = prev = None
    try:
        for line, ts, prompt, output, hashes in _rows(path, fmt):
            at = {n: f"{path}:{line}" + (f":{c}" if c else "") + f": column {n!r}" for n, c in cols.items()}
            where = f"{path}:{line}"
            try:
                t = _seconds(ts, fmt) / (1000.0 if fmt == "mooncake" else 1.0)
            except (TypeError, ValueError, OverflowError):
                raise TraceError(f"{at[names[0]]}: {ts!r} is not a time") from None
            if prev is not None and t < prev:
                raise TraceError(f"{at[names[0]]}: the time goes backwards ({t - t0:.3f} s after the first request, "
                                 f"the line before was at {prev - t0:.3f} s): sort the trace by time")
            p = _count(prompt, at[names[1]])
            o = _count(output, at[names[2]])
            if not isinstance(hashes, list | tuple) or not all(isinstance(h, int) for h in hashes):
                raise TraceError(f"{where}: hash_ids {hashes!r} is not a list of integers")
            t0 = t if t0 is None else t0
            prev = t
            yield TraceRecord(t - t0, p, o, tuple(hashes))
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a text file ({e.reason})") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror or e})") from None


@dataclass(frozen=True)
class TraceLoad:
    """What to replay: a window of a trace [start_s, start_s + duration_s) in trace seconds, and its scale.

    Scale: `speedup` (trace seconds per run second), or a target mean `rate` (requests/s), or a target
    `utilization` of the pool's capacity (given to plan_trace in requests/s or tokens/s); at most one of them
    (none: the trace's own pace). max_model_len clips each request's prompt + output to the model's context.
    """

    path: str
    format: str | None = None
    start_s: float = 0.0
    duration_s: float | None = None  # None: as long as the run needs (or the rest of the trace)
    speedup: float | None = None
    rate: float | None = None
    utilization: float | None = None
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise TraceError(f"trace format {self.format!r}: known are {', '.join(FORMATS)}")
        if sum(x is not None for x in (self.speedup, self.rate, self.utilization)) > 1:
            raise TraceError("give one of speed-up, rate and utilization: each sets the trace's pace")
        for name in ("speedup", "rate", "utilization", "duration_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise TraceError(f"trace {name} must be > 0, got {v}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0) or self.max_model_len < 2:
            raise TraceError("trace window start must be >= 0 and max_model_len >= 2")


@dataclass(frozen=True)
class TracePlan:
    """A trace window as arrivals: times from the run's start (ascending), clipped token counts, prefix blocks."""

    t: tuple[float, ...]
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    hash_ids: tuple[tuple[int, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.t)

    def prompt_text(self, i: int, tokens: int, seed: int = 0) -> str:
        """Request i's prompt of `tokens` words: its prefix blocks' words first, so shared hash ids share a prefix."""
        words: list[str] = []
        for h in self.hash_ids[i]:
            if len(words) >= tokens:
                break
            words += _block(h)
        words = words[:tokens]
        rest = make_prompt(tokens - len(words), seed * 1_000_003 + i) if len(words) < tokens else ""
        return "".join(f"{w} " for w in words) + rest

    def hottest(self) -> list[bool]:
        """The hottest tenant's requests: the most frequent first prefix block, or (no hash ids) the longest decile.

        Azure and BurstGPT carry no tenant: their proxy for one heavy tenant is the requests whose prompt is in the
        window's longest 10 % (long-context users: RAG, code, documents), the load that skews one node most.
        """
        firsts = Counter(h[0] for h in self.hash_ids if h)
        if firsts:
            top = min(firsts, key=lambda h: (-firsts[h], h))
            return [bool(h) and h[0] == top for h in self.hash_ids]
        if not self.prompt:
            return []
        cut = sorted(self.prompt)[int(0.9 * (len(self.prompt) - 1))]
        return [p >= cut for p in self.prompt]


@lru_cache(maxsize=4096)
def _block(hash_id: int) -> tuple[str, ...]:
    rng = random.Random(hash_id * 2_654_435_761 + 97)
    return tuple(rng.choices(PROMPT_WORDS, k=MOONCAKE_BLOCK_TOKENS))


def mix_tokens(prompt: LengthDist, completion: LengthDist) -> float:
    """Mean prompt + completion tokens per request of a synthetic mix (lognormal means; the clip is far out in the
    tail): what a token-rate target matches a Poisson load's request rate with."""
    return sum(d.median * math.sqrt(1.0 + d.cv**2) for d in (prompt, completion))


def clip(prompt: int, output: int, max_model_len: int) -> tuple[int, int]:
    """Token counts that fit the model: output at most half the context, the prompt the rest; each at least 1."""
    o = min(max(1, output), max_model_len // 2)
    return min(max(1, prompt), max_model_len - o), o


def plan_trace(load: TraceLoad, run_s: float | None = None, *, capacity_rps: float | None = None,
               capacity_tps: float | None = None) -> TracePlan:
    """Arrivals of `load` for a run of run_s seconds (None: the whole window).

    A target (rate, or utilization x capacity) compresses the trace's time so the run's mean equals it: in
    requests/s, or with capacity_tps in tokens/s (prompt + output, after clipping). With no window length, the
    window is as long as the run needs at that target: the trace is read only that far.
    """
    target, per_token = load.rate, False
    if load.utilization is not None:
        if capacity_tps is None and capacity_rps is None:
            raise TraceError("a trace utilization needs the pool's capacity (requests/s or tokens/s)")
        per_token = capacity_tps is not None
        target = load.utilization * (capacity_tps if per_token else capacity_rps)
    start = load.start_s
    end = start + load.duration_s if load.duration_s is not None else (
        start + run_s * load.speedup if run_s is not None and load.speedup is not None else
        start + run_s if run_s is not None and target is None else math.inf)
    need = target * run_s if target is not None and run_s is not None and load.duration_s is None else None
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    clipped, total, stop_at = 0, 0.0, None
    last = None
    for r in read_trace(load.path, load.format):
        last = r.t
        if r.t < start:
            continue
        if r.t >= end or (need is not None and total >= need):
            stop_at = r.t
            break
        p, o = clip(r.prompt, r.output, load.max_model_len)
        clipped += (p, o) != (r.prompt, r.output)
        rows.append((r.t, p, o, r.hash_ids))
        total += (p + o) if per_token else 1
    if not rows:
        raise TraceError(f"{load.path}: no requests in the trace window from {start:g} s"
                         + (f" to {end:g} s" if math.isfinite(end) else "") + f" (the trace ends at {last or 0:g} s)")
    if math.isfinite(end) and (stop_at is not None or need is None):
        span = end - start
    elif stop_at is not None:
        span = stop_at - start
    else:  # the trace ended first: one mean gap after its last request
        span = (rows[-1][0] - start) * len(rows) / max(1, len(rows) - 1) or 1.0
    if load.speedup is not None:
        k = load.speedup
    elif target is not None:  # the run's mean at the target: the needed share read, or the window's mean scaled
        k = span / run_s if need is not None and stop_at is not None else target * span / total
    else:
        k = 1.0
    t = [(row[0] - start) / k for row in rows]
    keep = len(t) if run_s is None else sum(x < run_s for x in t)
    meta = {"file": str(load.path), "format": load.format or detect_format(load.path),
            "window_s": [round(start, 3), round(start + span, 3)], "speedup": round(k, 4),
            "requests": keep, "run_s": round(span / k if run_s is None else min(run_s, span / k), 3),
            "clipped": clipped, "max_model_len": load.max_model_len}
    tokens = sum(r[1] + r[2] for r in rows[:keep])
    meta["mean_rate"] = round(keep / meta["run_s"], 3) if meta["run_s"] > 0 else None
    meta["mean_tokens_per_s"] = round(tokens / meta["run_s"], 1) if meta["run_s"] > 0 else None
    meta["attribution"] = ATTRIBUTION[meta["format"]]
    rows = rows[:keep]
    return TracePlan(tuple(t[:keep]), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
                     tuple(r[3] for r in rows), meta)


def parse_window(text: str) -> tuple[float, float | None]:
    """'START:DURATION' in trace seconds (DURATION empty: open) -> (start, duration)."""
    start, sep, dur = str(text).partition(":")
    try:
        s = float(start or 0)
        d = float(dur) if dur.strip() else None
    except ValueError:
        raise TraceError(f"trace window {text!r}: want START:DURATION in seconds, e.g. 600:300") from None
    if s < 0 or (d is not None and d <= 0):
        raise TraceError(f"trace window {text!r}: want START >= 0 and DURATION > 0")
    return s, d


def summarize(plan: TracePlan, bin_s: float = 10.0) -> dict[str, Sequence[float]]:
    """Arrivals per second in bins of bin_s, and the prompt and output lengths (for the plot and the docs)."""
    if not plan.t:
        return {"rate": [], "prompt": [], "output": []}
    n = int(plan.t[-1] // bin_s) + 1
    bins = [0] * n
    for x in plan.t:
        bins[int(x // bin_s)] += 1
    return {"rate": [b / bin_s for b in bins], "prompt": list(plan.prompt), "output": list(plan.output)}


if __name__ == "__main__":
    from grayguard.sim.traces_plot import main

    raise SystemExit(main())
