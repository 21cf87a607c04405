"""The token gaps a live ITL is a mean of, measured on a real vLLM: how much one gap varies, and how far a 5 s
window's mean strays.

    python -m grayguard.bench.itlgaps [--streams 4] [--seconds 60] [--json]

The controller compares each node's live ITL (the mean gap between two tokens over the exporter's 5 s window) in
its own noise: the pool's learned noise, widened by the sampling noise of the gaps it is a mean of,
`window_noise_cv` / sqrt(gaps) (`controller/live.py`: gaps). This starts one real vLLM (the CPU build and the test
model, as `make test`'s real tier does: localstack/vllmserver.py), sends it `--streams` concurrent streaming
completions of mixed lengths for `--seconds`, records when each token reached the client, and prints:

- the gaps (from each request's second token on: the first follows the prefill), their mean and their coefficient of
  variation over the run;
- per 5 s window: the gaps in it and their coefficient of variation (median, least, most);
- how far the windows' mean gap strays from window to window (the standard deviation of its log), next to what
  cv / sqrt(gaps) predicts from sampling alone.

Printed, never asserted: a measurement of this machine (2 shared cores: stalls included).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

WINDOW_S = 5.0  # the exporter's live window


def gap_stats(stamps: Iterable[tuple[str, float]], window_s: float = WINDOW_S, least: int = 10) -> dict:
    """The measurement from (request id, time a token arrived) pairs, in any order: the gaps from each request's
    second token on, their count, mean and cv over the run, and over each window of window_s (counted from the
    first gap counted, those with at least `least` gaps): the gaps a window, their cv, and the standard deviation
    of the log of the windows' mean gap. Raises ValueError with too few gaps to say anything."""
    by: dict[str, list[float]] = {}
    for rid, t in stamps:
        by.setdefault(rid, []).append(t)
    gaps = []
    for tt in by.values():
        tt.sort()
        gaps.extend((b, b - a) for a, b in zip(tt[1:-1], tt[2:], strict=True))
    if len(gaps) < 2 * least:
        raise ValueError(f"{len(gaps)} token gaps: too few to measure (streams that produced no tokens?)")
    end, length = min(gaps)
    t0 = end - length  # the first counted gap's start
    values = [g for _, g in gaps]
    mean = statistics.fmean(values)
    wins: dict[int, list[float]] = {}
    for t, g in gaps:
        wins.setdefault(int((t - t0) // window_s), []).append(g)
    kept = [v for _, v in sorted(wins.items()) if len(v) >= least and statistics.fmean(v) > 0]
    cvs = [statistics.pstdev(v) / statistics.fmean(v) for v in kept]
    counts = [len(v) for v in kept]
    logs = [math.log(statistics.fmean(v)) for v in kept]
    out = {"gaps": len(values), "mean_s": mean, "cv": statistics.pstdev(values) / mean if mean > 0 else None,
           "windows": len(kept)}
    if kept:
        cv, n = statistics.median(cvs), statistics.median(counts)
        out.update(gaps_per_window=n, window_cv_median=cv, window_cv_min=min(cvs), window_cv_max=max(cvs),
                   window_mean_log_sd=statistics.pstdev(logs) if len(logs) > 1 else None,
                   sampling_predicts=cv / math.sqrt(n))
    return out


def _stream(url: str, model: str, k: int, until: float, stamps: list, lock: threading.Lock, errors: list) -> None:
    import requests
    rnd = random.Random(k)
    i = 0
    while time.monotonic() < until:
        i += 1
        body = {"model": model, "prompt": " ".join(["hello"] * rnd.randint(8, 200)),
                "max_tokens": rnd.randint(20, 200), "stream": True, "ignore_eos": True, "temperature": 0}
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        with lock:
                            stamps.append((f"{k}.{i}", time.monotonic()))
        except requests.RequestException as e:
            errors.append(str(e))


def measure(streams: int, seconds: float, workdir: Path) -> dict:
    """Start one real vLLM, stream to it, stop it; the gap_stats of what the client saw."""
    from grayguard.localstack.procs import free_port
    from grayguard.localstack.vllmserver import VllmNode, ensure_model, model_name, vllm_python
    py = vllm_python()
    model = ensure_model(py)
    node = VllmNode("itlgaps", free_port(), py, model, workdir, None)
    print(f"starting vLLM (CPU build, {model_name(model)}) on {node.url}...", file=sys.stderr, flush=True)
    node.start()
    try:
        node.wait_ready()
        print(f"streaming {streams} requests at a time for {seconds:g} s...", file=sys.stderr, flush=True)
        stamps: list = []
        errors: list = []
        lock = threading.Lock()
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=_stream, args=(node.url, model_name(model), k, until, stamps, lock, errors))
                   for k in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        node.stop()
    out = gap_stats(stamps)
    out.update(streams=streams, seconds=seconds, failed_requests=len(errors))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grayguard.bench.itlgaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4, help="concurrent streaming requests (default 4)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to stream (default 60)")
    p.add_argument("--json", action="store_true", help="the measurement as one JSON object")
    args = p.parse_args(argv)
    if args.streams < 1 or not args.seconds > 0:
        print("--streams must be >= 1 and --seconds > 0", file=sys.stderr)
        return 2
    import tempfile
    with tempfile.TemporaryDirectory(prefix="grayguard-itlgaps-") as d:
        try:
            m = measure(args.streams, args.seconds, Path(d))
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"{m['gaps']} token gaps over {m['seconds']:g} s at {m['streams']} streams ({m['failed_requests']} failed "
          f"requests): mean {m['mean_s'] * 1000:.2f} ms, cv {m['cv']:.2f} over the run")
    if m["windows"]:
        sd = m["window_mean_log_sd"]
        print(f"{m['windows']} windows of {WINDOW_S:g} s, {m['gaps_per_window']:g} gaps a window (median): cv "
              f"{m['window_cv_median']:.2f} within a window (median; least {m['window_cv_min']:.2f}, most "
              f"{m['window_cv_max']:.2f})")
        print("the windows' mean gap strays " + (f"{sd:.3f}" if sd is not None else "-") + " in log units from "
              f"window to window; sampling alone (cv / sqrt(gaps)) predicts {m['sampling_predicts']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
