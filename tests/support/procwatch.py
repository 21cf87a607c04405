"""A command run as a real process by a test that stops it mid-run: its output read as it comes, a line awaited, and
whether the processes it started are still alive afterwards."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class OutputWatch:
    """Reads a Popen's text stdout on a daemon thread into `lines`; `seen` is set at the first line containing
    `marker` (a line that starts with it when `at_start`)."""

    def __init__(self, proc: subprocess.Popen, marker: str, at_start: bool = False):
        self.proc, self.marker, self.at_start = proc, marker, at_start
        self.lines: list[str] = []
        self.seen = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(self.marker) if self.at_start else self.marker in line:
                self.seen.set()

    def text(self) -> str:
        return "".join(self.lines)


def signals_at_default() -> None:
    """A Popen preexec_fn: SIGINT and SIGTERM at their default action and unblocked in the command, whatever the test
    process inherited (a CI runner or a shell's background job starts it with SIGINT ignored, and an ignored signal
    stays ignored across exec: Python then never turns SIGINT into KeyboardInterrupt). A stop test sends the command
    a signal a terminal or `timeout` would, so the command must start as one started from a terminal does."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stopped(proc: subprocess.Popen, watch: OutputWatch, send: Callable[[], object]) -> tuple[int, str]:
    """Send the signal (send()) and wait for the command; (its exit status, its output).

    A command still running 60 s on fails the test with its output's tail, and with every thread's stack when it
    runs with PYTHONFAULTHANDLER set: SIGABRT makes faulthandler print them before it dies (where it was stuck is
    what a hang that comes once in a CI run needs)."""
    try:
        send()
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            watch.thread.join(10)
            raise AssertionError("still running 60 s after the signal:\n" + "".join(watch.lines[-200:])) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    watch.thread.join(10)
    return rc, watch.text()


def left(started: list[tuple[int, str]], grace_s: float = 15.0) -> list[tuple[int, str]]:
    """The processes of `started` still alive grace_s on (a child may take a moment to see its parent go)."""
    deadline = time.monotonic() + grace_s
    while (running := [(p, n) for p, n in started if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return running
