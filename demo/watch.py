"""Timestamps the demo's outcomes to a tenth of a second: HAProxy weights and the controller's states.

The demo's Sampler reads everything once a second (Prometheus, the exporters, the webhook): a cut that
happened just after a sample was reported up to a second late. The watcher polls only what is cheap and
decides the headline (each node's weight and drain in HAProxy, and its state in the controller, which
runs in this process) every `interval` seconds, and keeps a mark each time one of them changes. Marks
have the samples' shape ({"t", "nodes": {name: {...}}}), so demo.report.headline reads both alike.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class Watcher:
    """A daemon thread that polls `stack` every `interval` s and records changes as marks."""

    def __init__(self, stack: Any, t0: float, interval: float = 0.1, clock=time.time):
        self.stack, self.t0, self.interval, self._clock = stack, t0, interval, clock
        self.marks: list[dict] = []
        self._last: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> dict | None:
        """Read once; a mark (also appended to marks) when anything changed since the last poll, else None."""
        t = round(self._clock() - self.t0, 2)
        nodes: dict[str, dict] = {}
        try:
            for name, (w, drained) in self.stack.haproxy_weights().items():
                nodes.setdefault(name, {}).update(weight=w, drained=drained)
        except Exception as e:  # noqa: BLE001 - a poll must never kill the run; the next one tries again
            log.debug("watch: haproxy read failed: %s", e)
        ctl = self.stack.controller
        if ctl is not None:
            for name, s in dict(ctl.states.get("chat", {})).items():
                nodes.setdefault(name, {})["state"] = s.state
        if not nodes or nodes == self._last:
            return None
        self._last = nodes
        mark = {"t": t, "nodes": nodes}
        self.marks.append(mark)
        return mark

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="demo-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Safe at any point: SIGTERM (grayguard.terminate's exception) can land inside start(), before the thread
        has started; joining it then raised RuntimeError over the interruption (the demo exited 1, not 143)."""
        self._stop.set()
        if self._thread is not None and self._thread.ident is not None:  # started
            self._thread.join(2)

    def _main(self) -> None:
        while True:  # at least one poll, then one every interval until stopped
            self.poll()
            if self._stop.wait(self.interval):
                return
