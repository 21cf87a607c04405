"""The cross-check's clients: the benchmark's arrival sequence, sent through HAProxy from a process of its own.

The load generator's request and record code (sim.loadgen) with the engine's arrivals (bench.spec.make_arrivals:
the same times and sizes) instead of its own Poisson draw. It runs in a child process (`python -m
bench.crossload`), as clients do: in the simulated fleet's interpreter its stream parsing would delay the fleet's
own event loop, and the engine has no such cost. Times are on time.monotonic, which the parent shares (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import aiohttp

from grayguard.sim.loadgen import LoadConfig, _first_model, _Run
from grayguard.sim.loadstats import RequestRecord

Plan = list[tuple[float, int, int]]  # (seconds from the start, prompt tokens, max_tokens)


async def run_plan(url: str, plan: Plan, timeout_s: float, sink: list[RequestRecord],
                   started: Callable[[float], None]) -> None:
    """Send the planned arrivals open-loop through url; started(t0) gets the loop's clock at the run's zero."""
    cfg = LoadConfig(url=url, rate=1.0, duration_s=None, count=max(1, len(plan)), timeout_s=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        run = _Run(cfg, session, await _first_model(session, cfg), sink)
        start = run.loop.time()
        started(start)
        tasks: set[asyncio.Task] = set()
        for i, (t, prompt, max_tokens) in enumerate(plan):
            rec = RequestRecord(i, t, "pending", prompt, max_tokens)
            sink.append(rec)
            delay = start + t - run.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            run.inflight += 1
            task = asyncio.create_task(run.one(rec, start + t))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


async def _drive(url: str, plan: Plan, timeout_s: float, window: tuple[float, float], say) -> list[RequestRecord]:
    """Run the plan; stop once it is sent and every request of the window has ended (the rest do not count)."""
    records: list[RequestRecord] = []
    t0: list[float] = []

    def started(t: float) -> None:
        t0.append(t)
        say({"t0": t})

    task = asyncio.ensure_future(run_plan(url, plan, timeout_s, records, started))
    loop = asyncio.get_running_loop()
    lo, hi = window
    end = plan[-1][0] if plan else 0.0
    next_note = 10.0
    while not task.done():
        await asyncio.sleep(0.2)
        if not t0:
            continue
        el = loop.time() - t0[0]
        if el >= next_note:
            say({"sent": len(records), "ok": sum(r.status == "ok" for r in records)})
            next_note += 10.0
        if el > end and all(r.status != "pending" for r in records if lo <= r.start_s < hi):
            task.cancel()
            break
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return records


def main(argv: list[str] | None = None) -> int:
    """`python -m grayguard.bench.crossload PLAN.json RECORDS.json`: the child process; one JSON line per event on
    stdout."""
    plan_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    job = json.loads(Path(plan_path).read_text())

    def say(msg: dict) -> None:
        print(json.dumps(msg), flush=True)

    records = asyncio.run(_drive(job["url"], [tuple(x) for x in job["plan"]], job["timeout_s"],
                                 tuple(job["window"]), say))
    Path(out_path).write_text(json.dumps([asdict(r) for r in records]))
    say({"done": len(records)})
    return 0


class LoadProcess:
    """The plan in a child process: start() returns its zero (time.monotonic), poll() reads its progress, records
    are set at the end."""

    def __init__(self, url: str, plan: Plan, timeout_s: float, window: tuple[float, float], workdir: Path) -> None:
        self.plan_path, self.out_path = workdir / "load-plan.json", workdir / "load-records.json"
        self.plan_path.write_text(json.dumps({"url": url, "plan": plan, "timeout_s": timeout_s,
                                              "window": list(window)}))
        self.lines: queue.Queue[dict] = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.t0: float | None = None
        self.sent = self.ok = 0
        self.records: list[RequestRecord] | None = None

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))

    def start(self, timeout_s: float = 60.0) -> float:
        """Start the child; returns its zero once the first request is due."""
        repo = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "grayguard.bench.crossload", str(self.plan_path),
                                      str(self.out_path)], stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
        threading.Thread(target=self._read, name="cross-check-load", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while self.t0 is None:
            self.poll(0.2)
            if self.t0 is None and (self.proc.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError(f"the load process sent nothing (exit code {self.proc.poll()})")
        return self.t0

    def poll(self, wait_s: float) -> bool:
        """Read what the child said within wait_s; True once its records are in."""
        try:
            msg = self.lines.get(timeout=wait_s)
        except queue.Empty:
            return self.records is not None
        self.t0 = msg.get("t0", self.t0)
        self.sent, self.ok = msg.get("sent", self.sent), msg.get("ok", self.ok)
        if "done" in msg:
            self.records = [RequestRecord(**d) for d in json.loads(self.out_path.read_text())]
        return self.records is not None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the child if it still runs (a failed run)."""
        if self.running():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
