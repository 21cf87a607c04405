"""Synthetic traces for replay tests: a pool of nodes at one latency, with per-node multipliers over time."""

from __future__ import annotations

import random

from grayguard.controller.replay import Row


def make_trace(n=4, ticks=80, step=5.0, base=0.02, noise=0.05, seed=1, factor=lambda t, node: 1.0, pool="p"):
    rnd = random.Random(seed)
    rows = []
    for k in range(ticks):
        t = k * step
        for i in range(n):
            v = base * (1 + rnd.gauss(0, noise)) * factor(t, f"n{i}")
            rows.append(Row(t, pool, f"n{i}", v))
    return rows
