"""HAProxy's agent check: one line per connection, "up" or "down #why", from the prober's last probe.

HAProxy (`agent-check agent-port 9401 agent-inter 500ms` on a server line) connects every agent-inter and reads a
line: "down" marks the server DOWN (agent) at once, "up" lets its health check decide again. A node that
answers 200 with broken text is invisible to HAProxy's own checks; this takes it out of rotation about a second
after the probe saw it, before any controller tick. docs/exporters.md, "Agent check", has the rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from grayguard.exporters.probe import ProbeState
from grayguard.vocab import PROBE_AGENT_DOWN, ProbeResult

log = logging.getLogger(__name__)

# results that take a node out on one strike: neither is load, and every answer the node gives meanwhile is broken
ONE_STRIKE = PROBE_AGENT_DOWN
STALE_INTERVALS = 3  # a last probe older than this many intervals plus the deadline says nothing any more
LINGER_S = 1.0  # longest a connection is kept: answer, then read what the client sent until it hangs up
DESCRIPTION_LIMIT = 160  # characters of the reason after '#' (HAProxy shows it as the agent's description)

Source = Callable[[], tuple[ProbeState, "float | None"]]  # (last state, clock() when the last probe ended)


@dataclass(frozen=True)
class Verdict:
    """What the agent answers: down or up, the cause (bad_response, cuda_error, hang) and why, in words."""

    down: bool
    why: str
    cause: str | None = None

    @property
    def text(self) -> str:
        """The agent reply without its newline: "up" or "down #why"."""
        return f"down #{self.why}" if self.down else "up"


def clean(text: str, limit: int = DESCRIPTION_LIMIT) -> str:
    """One line of printable ASCII (others become '?', runs of blanks one space), at most limit characters."""
    out = "".join(ch if " " <= ch <= "~" else "?" if not ch.isspace() else " " for ch in text)
    out = " ".join(out.split())
    return out if len(out) <= limit else out[:limit - 3] + "..."


def verdict(state: ProbeState, last_at: float | None, now: float, *, interval: float, deadline: float) -> Verdict:
    """Down on the last probe's bad_response or cuda_error, or on a timeout with hang evidence; up otherwise.

    Up as well with no probe yet, while starting, and when the last probe is older than STALE_INTERVALS
    intervals plus the deadline (a stuck prober): never down on missing data. Time is a parameter (clock()).
    """
    result = state.last_result
    if result is None or last_at is None:
        return Verdict(False, "no probe yet")
    age = now - last_at
    if age > STALE_INTERVALS * interval + deadline:
        return Verdict(False, f"last probe {age:.1f}s old (stale)")
    if result in ONE_STRIKE:
        detail = f": {state.last_detail}" if state.last_detail else ""
        return Verdict(True, clean(f"probe {result}{detail}"), result)
    progress = state.last_progress
    if result == ProbeResult.TIMEOUT and progress is not None and progress.hung:
        others = f"{progress.running:g} other requests in the engine"
        silent = progress.window if progress.silent_for is None else max(progress.window, progress.silent_for)
        return Verdict(True, clean(f"hang: no token in {silent:.1f}s ({others})"), "hang")
    if result == ProbeResult.TIMEOUT:
        if progress is None:
            why = "no hang evidence"
        elif progress.tokens == 0:  # silent, but not yet for longer than this engine's own stalls last
            why = (f"no token in {progress.silent_for or progress.window:.1f}s, within this engine's stalls: a hang "
                   f"after {progress.hang_after or 0:.1f}s")
        else:
            why = f"{progress.tokens:g} tokens in {progress.window:.1f}s"
        return Verdict(False, f"probe timeout ({why})")
    return Verdict(False, f"probe {result}")


class Agent:
    """Answers HAProxy's agent check on (host, port) from `source`, in its own thread; start(), stop().

    A connection never waits on the prober: source() reads the last state under the prober's lock.
    """

    def __init__(self, source: Source, *, interval: float, deadline: float, host: str = "127.0.0.1",
                 port: int = 9401, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._source, self._interval, self._deadline, self._clock = source, interval, deadline, clock
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._last: tuple[bool, str | None] = (False, None)  # (down, cause) last seen, for the change log
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        r = registry if registry is not None else CollectorRegistry()
        self.answers = Counter("grayguard_agent_answers", "Agent-check answers given to HAProxy, by verdict",
                               ["verdict"], registry=r)
        for v in ("up", "down"):
            self.answers.labels(v)
        self.down_collector = _DownCollector(self)
        r.register(self.down_collector)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) bound (port 0 asks the OS for a free one)."""
        if self._sock is None:
            return self._host, self._port
        host, port = self._sock.getsockname()[:2]
        return host, port

    def current(self) -> Verdict:
        """The verdict now; logs at WARNING when it changes (down/up or the cause of a down)."""
        state, last_at = self._source()
        v = verdict(state, last_at, self._clock(), interval=self._interval, deadline=self._deadline)
        with self._lock:
            changed, self._last = self._last != (v.down, v.cause), (v.down, v.cause)
        if changed:
            log.warning("agent check: %s (%s)", "down" if v.down else "up", v.why)
        return v

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Agent:
        """Bind (OSError if the address is taken) and serve in a daemon thread with its own event loop."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        self._sock = socket.create_server((self._host, self._port), family=family, backlog=64)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(self._sock, ready), name="agent", daemon=True)
        self._thread.start()
        ready.wait(5)
        log.info("agent check answering on %s:%d", *self.address)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening, let open connections end (each lasts at most LINGER_S) and join; idempotent."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _main(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock, ready))
        finally:
            pending = asyncio.all_tasks(loop)  # connections still lingering: cut them short
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending))
            loop.close()

    async def _serve(self, sock: socket.socket, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, sock=sock)
        ready.set()
        async with server:
            await self._stopping.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(LINGER_S):
                v = self.current()
                self.answers.labels("down" if v.down else "up").inc()
                writer.write(v.text.encode("ascii") + b"\n")
                await writer.drain()
                writer.write_eof()
                # Read what the client sent (HAProxy's agent-send text, or anything) until it hangs up: closing a
                # socket with unread data resets the connection, and a reset can destroy the answer in flight.
                while await reader.read(4096):
                    pass
        except (TimeoutError, ConnectionError, OSError):
            pass  # a client that sends forever, never hangs up or resets: routine, the next one is served
        except Exception:  # a bug must not end the server: log it, serve the next connection
            log.exception("agent check connection failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


class _DownCollector:
    """grayguard_agent_down: 1 while the agent answers down, 0 while up (the reason goes to the logs)."""

    def __init__(self, agent: Agent):
        self._agent = agent

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        fam.add_metric([], 1 if self._agent.current().down else 0)
        yield fam

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("grayguard_agent_down", "1 while the agent check answers HAProxy 'down' (the "
                                 "probe saw garbage, a CUDA error or a hang), 0 while it answers 'up'")
