"""`python -m grayguard.bench.probeinterval`: false slow-probe cuts of a healthy pool at a probe interval longer than
the tick, with each probe counted once (its send time, NodeInput.probe_at) and with every tick counted (no time: an
exporter before 2026-12-07, or a probe-result query of one's own).

A healthy pool whose engines have no live fast path, so that the probes judge them (signals.probe): each node probes
every --intervals seconds from a phase of its own, each probe slow (0.4 s against 0.03) at a chance of --chances;
the decision core ticks every second (decide_pool, the shipped thresholds). It prints, per interval, chance and seed,
the node-seconds not healthy both ways; then the seconds until a node whose every probe is slow is cut among such peers
(what the run model costs a sick node). Pure and seeded: the same numbers on any machine.
"""

from __future__ import annotations

import argparse
import random
import sys

from grayguard.controller.policy import NodeInput, Policy, decide_pool
from grayguard.vocab import State

SLOW_TTFT, OK_TTFT = 0.4, 0.03
ONSET_S = 600  # when the sick node of the second measurement turns slow


def run(interval: float, chance: float, seed: int, identity: bool, seconds: int = 1800, nodes: int = 10,
        slow_node: str | None = None) -> int:
    """Node-seconds not healthy over `seconds` ticks of a healthy pool; identity: each probe's send time given.
    slow_node: that node's every probe is slow from ONSET_S on (the pool's probes seen for as long before); then the
    seconds from ONSET_S until it is cut (seconds - ONSET_S if never)."""
    rnd = random.Random(seed)
    phase = {f"n{i}": rnd.uniform(0, interval) for i in range(nodes)}
    shown: dict[str, tuple[str, float | None]] = dict.fromkeys(phase, ("ok", None))
    prev: dict = {}
    policy, out = Policy(), 0
    for k in range(seconds):
        now = 1000.0 + k
        for n, ph in phase.items():  # a probe that ended in (now - 1, now] is shown from now
            if (now - ph) % interval < 1.0:
                shown[n] = ("slow" if rnd.random() < chance or (n == slow_node and k >= ONSET_S) else "ok",
                            now - 0.5)
        inputs = {n: NodeInput(base_weight=100, latency=0.02 * (1 + rnd.gauss(0, 0.05)), request_rate=5.0,
                               probe_result=r, probe_ttft=SLOW_TTFT if r == "slow" else OK_TTFT, probe_failures=0,
                               probe_at=at if identity else None) for n, (r, at) in shown.items()}
        d = decide_pool(prev, inputs, policy, now)
        prev = {n: nd.state for n, nd in d.nodes.items()}
        if slow_node is not None:
            if k >= ONSET_S and prev[slow_node].state != State.HEALTHY:
                return k - ONSET_S
            continue
        out += sum(1 for nd in d.nodes.values() if nd.state.state != State.HEALTHY)
    return seconds - ONSET_S if slow_node is not None else out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grayguard.bench.probeinterval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="1,5", help="comma-separated probe intervals, s (default %(default)s)")
    ap.add_argument("--chances", default="0.02,0.1",
                    help="comma-separated chances of a slow probe (default %(default)s)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default %(default)s)")
    ap.add_argument("--minutes", type=float, default=30.0, help="simulated minutes per run (default %(default)s)")
    args = ap.parse_args(argv)
    seconds = round(args.minutes * 60)

    def numbers(flag: str, text: str, kind: type, ok) -> list:
        try:
            got = [kind(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag}: comma-separated numbers, got {text!r}")
        bad = [x for x in got if not ok(x)]
        if bad:
            ap.error(f"{flag}: {bad[0]} is out of range")
        return got
    intervals = numbers("--intervals", args.intervals, float, lambda x: 0 < x < 1e6)
    chances = numbers("--chances", args.chances, float, lambda x: 0 <= x <= 1)
    seeds = numbers("--seeds", args.seeds, int, lambda x: True)
    if seconds < 1:
        ap.error("--minutes: at least one second")
    print(f"node-seconds not healthy in {seconds} s, a healthy 10-node pool judged by its probes, seeds "
          f"{args.seeds}: every tick counts -> each probe once")
    for interval in intervals:
        for chance in chances:
            pairs = [(run(interval, chance, s, False, seconds), run(interval, chance, s, True, seconds))
                     for s in seeds]
            print(f"  probe every {interval:g} s, slow {chance:.0%}: "
                  + ", ".join(f"{a} -> {b}" for a, b in pairs), flush=True)
    if seconds <= ONSET_S:
        print(f"(the sick node's measurement needs --minutes over {ONSET_S / 60:g})")
        return 0
    print(f"seconds until a node whose every probe is slow from {ONSET_S} s on is cut, among those peers (each probe "
          f"once), seeds {args.seeds}")
    for interval in intervals:
        for chance in chances:
            cut = [run(interval, chance, s, True, seconds, slow_node="n0") for s in seeds]
            print(f"  probe every {interval:g} s, peers slow {chance:.0%}: " + ", ".join(map(str, cut)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
