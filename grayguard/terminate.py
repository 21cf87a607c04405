"""SIGTERM as an unwinding exception, for the commands that start processes (demo, bench --cross-check, soak).

`kill`, `timeout`, systemd and CI runners send SIGTERM, not Ctrl-C, and Python's default for it is to die at once,
without `finally`: a demo then left HAProxy, Prometheus, Alertmanager and real vLLM servers (3 GB each) running.
Its own module, so that `python -m grayguard.cli` (which runs grayguard.cli as __main__) and the commands that
catch it share one class.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (exit status 143 by convention)."""


def _terminated(signum: int, frame: object) -> None:
    """The first SIGTERM unwinds; the ones after it are ignored, so the cleanup it starts runs to its end (SIGKILL
    still stops everything at once; Ctrl-C still interrupts)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("grayguard").warning("SIGTERM: stopping everything this command started")
    raise Terminated()


_previous_hook = sys.unraisablehook


def _unraisable(u: object) -> None:
    """sys.unraisablehook: a signal's exception that Python dropped is raised again.

    A Python signal handler runs at the main thread's next bytecode, which can be inside a finalizer (a weakref
    callback, a __del__ run by the collector), and an exception raised there is printed and dropped. The first
    SIGTERM then started no cleanup, and its handler had set every later SIGTERM to be ignored: the command ran on
    until SIGKILL (seen once in CI: the soak, its Terminated dropped in a WeakValueDictionary's callback). So the
    signal is sent again, with its handler back, from a thread a moment later: sent from here, its handler would run
    inside this hook, where its exception is dropped too."""
    exc = getattr(u, "exc_value", None)
    if isinstance(exc, Terminated):
        signal.signal(signal.SIGTERM, _terminated)
        _again(signal.SIGTERM)
    elif isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _again(signal.SIGINT)
    else:
        _previous_hook(u)  # type: ignore[arg-type]


def _again(sig: signal.Signals, delay_s: float = 0.01) -> None:
    timer = threading.Timer(delay_s, signal.pthread_kill, (threading.main_thread().ident, sig))
    timer.daemon = True
    timer.start()


def install() -> object | None:
    """Make SIGTERM raise Terminated in the main thread, and a signal's exception dropped in a finalizer come again
    (_unraisable); returns the previous handler (for restore), None off the main thread (only it may set handlers:
    a caller running a command in a thread keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    sys.unraisablehook = _unraisable
    return signal.signal(signal.SIGTERM, _terminated)


def restore(previous: object | None) -> None:
    """Put back what install() returned (nothing when it installed nothing)."""
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
        sys.unraisablehook = _previous_hook


def exit_status(e: KeyboardInterrupt) -> int:
    """143 for SIGTERM, 130 for Ctrl-C."""
    return 143 if isinstance(e, Terminated) else 130


def wait(stop: threading.Event, poll_s: float = 0.5) -> None:
    """Wait for stop in the main thread of a command whose SIGTERM/SIGINT handler sets it, returning to the
    interpreter every poll_s.

    A Python signal handler runs only in the main thread, between bytecodes. The kernel delivers a process-directed
    signal to any thread that does not block it, and one delivered to a worker thread does not interrupt the main
    thread's lock wait (Event.wait() with no timeout): the handler then ran only when a second signal happened to
    land on the main thread. A controller under `kill` or Kubernetes kept ticking (and leading) until SIGKILL. With
    a timed wait a stop is seen within poll_s, whichever thread the signal hit."""
    while not stop.wait(poll_s):
        pass
