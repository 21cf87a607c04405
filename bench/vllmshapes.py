"""The latency shapes the detector relies on, measured on one real vLLM node and one simulated node side by side.

    python -m grayguard.bench.vllmshapes --out /tmp/shapes          # both engines, ~3 minutes on 2 cores
    python -m grayguard.bench.vllmshapes --engines sim --out /tmp/s  # the simulator alone (a minute and a half)
    python -m grayguard.bench.vllmshapes --replot docs/vllm-shapes.json --out /tmp/s  # the report, nothing measured

For each engine, client-side (streamed /v1/completions, bench/shapeclient.py), in this order:
  prompt   TTFT of a 1-token request against the prompt's length (one at a time, the median of --prompt-reps);
  batch    ITL and TTFT against the decode batch: b streams at once of --decode-tokens tokens, short prompts, with
           vLLM's own ITL histogram (/metrics, Δsum / Δcount) beside the client's;
  prefill  the decode steps of --prefill-streams running streams while a --long-prompt prompt arrives, and a probe's
           TTFT (1 token, --probe-prompt tokens) idle, beside the decodes, and sent just behind the long prompt;
  thermal  ITL (batch 1 and --thermal-batch) and TTFT before and under `thermal` k=--thermal-k: the real node's
           CPU quota of 1/k core (localstack/vllmfleet.py), the simulator's every phase x k (sim/faults.py).
The real node runs first and is stopped before the simulator starts, so neither shares the cores with the other.
Everything is then reported as ratios to each engine's own baseline, with the controller's batch model fitted
(bench/vllmshapes_report.py); `--out DIR` writes shapes.json, shapes.md and shapes.svg. Progress goes to stderr.
The machine's other work shows in every number: the load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from grayguard.bench import vllmshapes_report as report
from grayguard.bench.shapeclient import Client, Stream, model_id

Note = Callable[[str], None]
Cpu = Callable[[], "float | None"]  # CPU seconds the engine's processes have used so far (None: not known)
Fault = Callable[[bool], Awaitable[dict | None]]  # True: set the thermal fault; False: clear it, say how it went


@dataclass(frozen=True)
class Grid:
    """What is measured (each knob a command-line option)."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_tokens: int = 200  # generated per stream in the batch phase
    batch_prompt: int = 16  # the decoding streams' prompt tokens
    batch_reps: int = 3
    prompts: tuple[int, ...] = (8, 128, 512, 1024, 2048, 4000)
    prompt_reps: int = 3
    long_prompt: int = 4000
    prefill_streams: int = 4
    prefill_reps: int = 3
    probe_prompt: int = 8
    probes: int = 5
    thermal_k: float = 10.0
    thermal_tokens: int = 60  # fewer than decode_tokens: a 1/k-core node takes k times longer
    thermal_batch: int = 4
    thermal_prompt: int = 512


def _ok(ss: list[Stream]) -> list[Stream]:
    return [s for s in ss if s.error is None and len(s.times) > 1]


def _per_token(gaps: list[tuple[float, int]]) -> list[float]:
    return [g / n for g, n in gaps for _ in range(n)]


def _mean_itl(gaps: list[tuple[float, int]]) -> float | None:
    n = sum(k for _, k in gaps)
    return sum(g for g, _ in gaps) / n if n else None


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


async def batch_run(c: Client, b: int, g: Grid) -> dict:
    """b streams at once: the client's per-token gaps and TTFTs, and the server's own mean ITL over the run."""
    before = await c.itl_totals()
    ss = await c.streams(b, g.batch_prompt, g.decode_tokens)
    await asyncio.sleep(0.3)  # the engine's last step's stats reach /metrics
    after = await c.itl_totals()
    ok = _ok(ss)
    gaps = [x for s in ok for x in s.gaps()]
    srv = (after[0] - before[0]) / (after[1] - before[1]) if before and after and after[1] > before[1] else None
    return {"itl": _mean_itl(gaps), "samples": _per_token(gaps), "ttfts": [s.ttft_s for s in ok], "server": srv,
            "errors": len(ss) - len(ok)}


async def batch_phase(c: Client, g: Grid, note: Note) -> list[dict]:
    """Every batch size once per repetition, in turn (so a drift of the machine's load spreads over all of them);
    per batch size: the median of the runs' mean ITLs, the median ITL, the median TTFT, the server's mean ITL."""
    runs: dict[int, list[dict]] = {b: [] for b in g.batches}
    for i in range(g.batch_reps):
        for b in g.batches:
            runs[b].append(await batch_run(c, b, g))
        note(f"batch run {i + 1}/{g.batch_reps}: mean ITL " + ", ".join(
            f"b={b} {report.ms(runs[b][-1]['itl'])}" for b in g.batches))
    return [{"b": b, "itl_mean_s": _median([r["itl"] for r in rs]), "itl_mean_reps_s": [r["itl"] for r in rs],
             "itl_median_s": _median([x for r in rs for x in r["samples"]]),
             "ttft_median_s": _median([x for r in rs for x in r["ttfts"]]),
             "server_itl_mean_s": _median([r["server"] for r in rs]),
             "server_itl_reps_s": [r["server"] for r in rs], "tokens": sum(len(r["samples"]) for r in rs),
             "errors": sum(r["errors"] for r in rs)} for b, rs in runs.items()]


async def prompt_point(c: Client, n: int, reps: int) -> dict:
    ss = [await c.stream(n, 1) for _ in range(reps)]
    return {"tokens": n, "ttft_median_s": _median([s.ttft_s for s in ss]), "ttft_s": [s.ttft_s for s in ss],
            "error": next((s.error for s in ss if s.error), None)}


async def _until_tokens(ss: list[Stream], n: int, timeout_s: float = 60.0) -> None:
    t_end = time.perf_counter() + timeout_s
    while min(sum(s.tokens) for s in ss) < n and time.perf_counter() < t_end:
        if any(s.error for s in ss):
            return
        await asyncio.sleep(0.005)


async def prefill_rep(c: Client, g: Grid) -> dict:
    """Streams decoding; a probe beside them; then the long prompt and, just behind it, another probe."""
    ss = [Stream(0.0) for _ in range(g.prefill_streams)]
    tasks = [asyncio.create_task(c.stream(g.batch_prompt, 2000, out=s)) for s in ss]
    try:
        await _until_tokens(ss, 20)
        beside = await c.ttft(g.probe_prompt)
        n0 = min(sum(s.tokens) for s in ss)
        await _until_tokens(ss, n0 + 1)
        t_steady = time.perf_counter()
        await _until_tokens(ss, n0 + 30)
        t_long = time.perf_counter()
        long_task = asyncio.create_task(c.stream(g.long_prompt, 1))
        await asyncio.sleep(report.PROBE_BEHIND_S)  # the long prompt reaches the engine first
        behind = await c.stream(g.probe_prompt, 1)
        long_s = await long_task
        await asyncio.sleep(0.3)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if long_s.ttft_s is None:
        return {"error": long_s.error or "the long prompt produced no token"}
    t_first = long_s.times[0]
    steady = [x for s in ss for x in s.gaps(t_steady, t_long)]
    steady_itl = _mean_itl(steady)
    slack = 0.5 * (steady_itl or 0.0)  # the prefill's last step's decodes arrive beside the long prompt's token
    during = [s.gaps(t_long, t_first + slack) for s in ss]
    longest = [max(g for g, _ in d) for d in during if d]
    # each stream's decode time lost to the prefill: its gaps in the window beyond what its tokens take when steady
    stall = [sum(g for g, _ in d) - steady_itl * sum(n for _, n in d) for d in during if d and steady_itl]
    # the steps that carried a prefill chunk: gaps far above the steady ITL
    long_steps = [float(sum(g > 3 * steady_itl for g, _ in d)) for d in during] if steady_itl else []
    return {"steady_itl_s": steady_itl, "stall_s": _median(stall),
            "longest_gap_s": _median(longest), "long_steps": _median(long_steps),
            "long_ttft_s": long_s.ttft_s, "probe_beside_s": beside, "probe_behind_s": behind.ttft_s,
            "probe_after_long": bool(behind.times and behind.times[0] >= t_first - 0.005)}


async def prefill_phase(c: Client, g: Grid) -> dict:
    idle = [await c.ttft(g.probe_prompt) for _ in range(g.probes)]
    return {"probe_idle_s": idle, "reps": [await prefill_rep(c, g) for _ in range(g.prefill_reps)]}


async def _thermal_numbers(c: Client, g: Grid, tokens: int, cpu: Cpu) -> dict:
    c0 = cpu()
    one = _ok(await c.streams(1, g.batch_prompt, tokens))
    c1 = cpu()
    many = _ok(await c.streams(g.thermal_batch, g.batch_prompt, tokens))
    return {"itl_b1_s": _mean_itl([x for s in one for x in s.gaps()]),
            # the node's CPU time per token at batch 1 (all its processes): a quota of 1/k core makes each token
            # take at least k times this, whatever the token took on the wall before
            "cpu_per_token_b1_s": (c1 - c0) / tokens if c0 is not None and c1 is not None else None,
            "itl_batch_s": _mean_itl([x for s in many for x in s.gaps()]),
            "ttft_s": _median([await c.ttft(g.thermal_prompt) for _ in range(g.prompt_reps)]),
            "probe_s": _median([await c.ttft(g.probe_prompt) for _ in range(g.probes)])}


async def thermal_phase(c: Client, g: Grid, fault: Fault, cpu: Cpu) -> dict:
    base = await _thermal_numbers(c, g, g.decode_tokens, cpu)  # healthy, just before: as long as the batches'
    try:
        await fault(True)
    except Exception as e:  # noqa: BLE001 - no cgroup here: the rest of the run stands, this part is absent
        return {"k": g.thermal_k, "base": base, "error": f"{type(e).__name__}: {e}"}
    try:
        under = await _thermal_numbers(c, g, g.thermal_tokens, cpu)
    finally:
        status = await fault(False)
    return {"k": g.thermal_k, "base": base, "fault": under, "fault_status": status}


async def measure(url: str, g: Grid, fault: Fault, note: Note, deadline: float, seed: int,
                  cpu: Cpu = lambda: None) -> dict:
    """Every phase on one engine; a phase not begun by the deadline is left out (absent, not zero)."""
    out: dict = {"url": url}
    async with aiohttp.ClientSession() as session:
        c = Client(session, url, await model_id(session, url), seed)
        out["model"] = c.model
        out["tokenize_check"] = {"words": 100, "tokens": await c.tokens_of(100)}
        note("warm-up (a long prompt, a full batch)")
        await c.stream(g.long_prompt, 2)
        await c.streams(max(g.batches), g.batch_prompt, 16)
        steps: list[tuple[str, Callable[[], Awaitable]]] = [
            *((f"prompt {n}", lambda n=n: prompt_point(c, n, g.prompt_reps)) for n in g.prompts),
            ("batch", lambda: batch_phase(c, g, note)),
            ("prefill", lambda: prefill_phase(c, g)),
            ("thermal", lambda: thermal_phase(c, g, fault, cpu))]
        for name, step in steps:
            if time.monotonic() > deadline:
                note(f"{name}: skipped (past the --budget-s deadline)")
                continue
            t0 = time.monotonic()
            r = await step()
            kind = name.split()[0]
            if kind == "prompt":
                out.setdefault(kind, []).append(r)
            else:
                out[kind] = r
            note(f"{name}: {report.brief(kind, r)} ({time.monotonic() - t0:.1f} s)")
    return out


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process and all its descendants so far (/proc); None when it is gone."""
    from grayguard.localstack.vllmserver import children
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for p in [pid, *(c for c, _ in children(pid))]:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of proc(5))
    return total or None


def _real(g: Grid, workdir: Path, note: Note, deadline: float, device: str) -> dict:
    from grayguard.localstack.vllmfleet import VllmFleetThread
    note(f"starting one vLLM node on {device} (workdir {workdir})")
    t0 = time.monotonic()
    ft = VllmFleetThread(1, workdir=workdir, device=device)
    try:
        url = ft.start()[0].url
        note(f"vLLM {ft.version} serving at {url} after {time.monotonic() - t0:.0f} s")

        async def fault(on: bool) -> dict | None:
            if on:
                await asyncio.to_thread(ft.set_fault, "node1", "thermal", k=g.thermal_k)
                return None
            status = (await asyncio.to_thread(ft.fault_status))["node1"]  # the quota and the time throttled
            await asyncio.to_thread(ft.clear_fault, "node1")
            return status
        node = ft.fleet.nodes["node1"]  # type: ignore[attr-defined]

        def cpu() -> float | None:
            return tree_cpu_s(node.proc.pid) if node.proc is not None else None
        r = asyncio.run(measure(url, g, fault, lambda s: note("real: " + s), deadline, seed=1, cpu=cpu))
        r["version"] = ft.version
        return r
    finally:
        ft.stop()
        note("vLLM node stopped")


def _sim(g: Grid, note: Note, deadline: float) -> dict:
    from grayguard.sim.fleet import FleetThread
    from grayguard.sim.node import VLLM_VERSION
    with FleetThread(n=1, seed=1) as ft:
        url = ft.nodes[0].url

        async def fault(on: bool) -> dict | None:
            if on:
                ft.set_fault("node1", "thermal", k=g.thermal_k)
                return None
            status = ft.fault_status()["node1"]
            ft.clear_fault("node1")
            return status
        r = asyncio.run(measure(url, g, fault, lambda s: note("sim: " + s), deadline, seed=2))
    r["version"] = f"simulator (as vLLM {VLLM_VERSION})"
    return r


def run(g: Grid, engines: tuple[str, ...], workdir: Path, note: Note, budget_s: float, device: str = "cpu") -> dict:
    """Measure each engine in turn; the raw numbers, with what the run was and how loaded the machine was."""
    t0 = time.monotonic()
    deadline = t0 + budget_s
    meta = {"grid": asdict(g), "engines": list(engines), "device": device,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    results: dict = {}
    for e in engines:
        t1 = time.monotonic()
        results[e] = _real(g, workdir, note, deadline, device) if e == "real" else _sim(g, note, deadline)
        results[e]["wall_s"] = round(time.monotonic() - t1, 1)
    meta |= {"loadavg_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1)}
    return {"meta": meta, "engines": results}


def _ints(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"integers of at least 1 expected: {s!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    d = Grid()
    ap = argparse.ArgumentParser(prog="python -m grayguard.bench.vllmshapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="real,sim", help="real, sim or both, in this order (default real,sim)")
    ap.add_argument("--out", type=Path, help="write shapes.json, shapes.md and shapes.svg into this folder")
    ap.add_argument("--workdir", type=Path, help="the vLLM node's logs (default: a new temporary folder)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="the real node's vLLM build (localstack/vllmfleet.py; cuda: GRAYGUARD_VLLM_PYTHON's vLLM)")
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="measure nothing: the tables and files again from an earlier run's shapes.json")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="no phase begins after this many seconds from the start (default 480)")
    ap.add_argument("--batches", type=_ints, default=d.batches, help="decode batch sizes (default 1,2,4,8,16)")
    ap.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="tokens per stream (default 200)")
    ap.add_argument("--batch-reps", type=int, default=d.batch_reps, help="runs of each batch size (default 3)")
    ap.add_argument("--prompts", type=_ints, default=d.prompts,
                    help="prompt lengths for TTFT (default 8,128,512,1024,2048,4000)")
    ap.add_argument("--prompt-reps", type=int, default=d.prompt_reps, help="requests per prompt length (default 3)")
    ap.add_argument("--long-prompt", type=int, default=d.long_prompt, help="the long prefill's prompt (default 4000)")
    ap.add_argument("--prefill-reps", type=int, default=d.prefill_reps, help="long prompts sent (default 3)")
    ap.add_argument("--batch-prompt", type=int, default=d.batch_prompt,
                    help="prompt tokens of the decoding streams (default 16)")
    ap.add_argument("--prefill-streams", type=int, default=d.prefill_streams,
                    help="streams decoding while the long prompt arrives (default 4)")
    ap.add_argument("--probe-prompt", type=int, default=d.probe_prompt, help="a probe's prompt tokens (default 8)")
    ap.add_argument("--probes", type=int, default=d.probes,
                    help="idle probes, and probes per thermal state (default 5)")
    ap.add_argument("--thermal-k", type=float, default=d.thermal_k, help="the thermal fault's k (default 10)")
    ap.add_argument("--thermal-tokens", type=int, default=d.thermal_tokens,
                    help="tokens per stream under the fault (default 60)")
    ap.add_argument("--thermal-batch", type=int, default=d.thermal_batch,
                    help="the second batch size measured under the fault (default 4)")
    ap.add_argument("--thermal-prompt", type=int, default=d.thermal_prompt,
                    help="the prompt of the TTFT measured under the fault (default 512)")
    a = ap.parse_args(argv)
    engines = tuple(a.engines.split(","))
    if not engines or any(e not in ("real", "sim") for e in engines) or len(set(engines)) != len(engines):
        ap.error(f"--engines: real, sim or both, not {a.engines!r}")
    counts = (a.batch_reps, a.prompt_reps, a.prefill_reps, a.long_prompt, a.batch_prompt, a.prefill_streams,
              a.probe_prompt, a.probes, a.thermal_batch, a.thermal_prompt)
    if min(a.decode_tokens, a.thermal_tokens) < 2 or min(counts) < 1 or a.thermal_k <= 1:
        ap.error("--decode-tokens and --thermal-tokens at least 2, the other counts at least 1, --thermal-k above 1")
    g = Grid(batches=a.batches, decode_tokens=a.decode_tokens, batch_prompt=a.batch_prompt, batch_reps=a.batch_reps,
             prompts=a.prompts, prompt_reps=a.prompt_reps, long_prompt=a.long_prompt,
             prefill_streams=a.prefill_streams, prefill_reps=a.prefill_reps, probe_prompt=a.probe_prompt,
             probes=a.probes, thermal_k=a.thermal_k, thermal_tokens=a.thermal_tokens, thermal_batch=a.thermal_batch,
             thermal_prompt=a.thermal_prompt)
    t0 = time.monotonic()

    def note(s: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {s}", file=sys.stderr, flush=True)
    if a.replot:
        raw = json.loads(a.replot.read_text())
        result = report.derive({"meta": raw["meta"], "engines": raw["engines"]})
    else:
        workdir = a.workdir or Path(tempfile.mkdtemp(prefix="grayguard-vllmshapes-"))
        workdir.mkdir(parents=True, exist_ok=True)
        result = report.derive(run(g, engines, workdir, note, a.budget_s, a.device))
    print(report.markdown(result))
    if a.out:
        for p in report.write(result, a.out):
            note(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
