"""How often the garbage collector runs in the controller's process.

A tick allocates what it decodes: at 10,000 nodes, 18 answers of 10,000 series each, some 700,000 dicts and lists
alive together while they are parsed and matched. With CPython's default thresholds (700, 10, 10) the young
generation is collected about a thousand times a tick; what survives those collections (the answers still being
parsed) is promoted, and that promotion sets off a collection of the oldest generation, which holds the two million
objects the controller keeps (states, metric series, HAProxy's view), about three times a tick. Measured with
gc.callbacks on `python -m grayguard.bench.ticklocal --nodes 10000`: 1.6 s of a 5.5 s tick was the collector.

Nearly all of the controller's garbage goes by reference counting (the answers, states and decisions hold no
cycles); the collector is there for the rare cycle. So the young generation is collected every 100,000 net
allocations instead of 700: at 10,000 nodes four times a tick, and the oldest generation every fifty ticks or so,
not three times each. What a delayed collection can keep is at most the cyclic garbage of 100,000 allocations,
a few MiB. The controller's command sets it when it starts ticking; every benchmark of the controller (bench/
ticklocal.py, wholetick.py, controller.py's decision time, scale.py, floor.py) sets it too, to measure what ships.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLDS = (100_000, 20, 10)  # gc.set_threshold: young generation, middle, oldest


def tune() -> tuple[int, int, int]:
    """Set the controller's thresholds; the ones in force before."""
    before = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return before  # type: ignore[return-value]


@contextlib.contextmanager
def tuned() -> Iterator[None]:
    """The controller's thresholds while in the block, the previous ones after it (a benchmark run in a process that
    does other work)."""
    before = tune()
    try:
        yield
    finally:
        gc.set_threshold(*before)
