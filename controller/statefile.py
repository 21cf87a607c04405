"""Persist node states between restarts: JSON, written atomically (temp file + rename), one writer per host.

Nothing read from the file is trusted: every field of every node is checked (type, finite, a known state)
before the controller uses it. A file that fails any check is set aside and the controller starts with no
state, so every node is seeded from what HAProxy shows (a drained server stays out), never from garbage.
A failed save is logged and counted, never fails the tick: it is retried on the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import types
import typing
from pathlib import Path

from grayguard.atomicfile import write_atomic
from grayguard.controller.live import LiveMemory
from grayguard.controller.policy import NodeState
from grayguard.controller.scoring import NOISE_CLIP, NOISE_S, PRIOR_SPREAD, Noise
from grayguard.controller.signals import SignalMemory
from grayguard.vocab import DrainCause, State

log = logging.getLogger("grayguard.state")
VERSION = 1
MAX_WEIGHT = 256  # HAProxy's largest weight


class StateError(ValueError):
    """The state file's content is not a state document; the message says where and what."""


def dump_states(states: dict[str, dict[str, NodeState]]) -> str:
    """Serialize {pool: {node: NodeState}} (sorted, so equal states give equal text); ValueError on NaN or inf."""
    doc = {"version": VERSION,
           "pools": {p: {n: _stored(s) for n, s in sorted(nodes.items())} for p, nodes in sorted(states.items())}}
    # allow_nan=False: a non-finite number would make the next load reject the whole file
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)


def _stored(s: NodeState) -> dict:
    """What the file keeps of a node: its state but its signals' recent values (LiveMemory.xs, the live ITL's one a
    tick: 55 of them for every node would be rewritten every tick); a restarted controller gathers them anew."""
    d = dataclasses.asdict(s)
    d["live_itl"].pop("xs", None)
    d["window"].pop("xs", None)
    return d


def load_states(text: str) -> dict[str, dict[str, NodeState]]:
    """Parse and check dump_states() output; StateError names the first bad field.

    Unknown fields are ignored and missing ones take their defaults, so older and newer files still load.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise StateError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise StateError(f"expected an object with version and pools, got {_kind(doc)}")
    version = doc.get("version")
    if type(version) is not int or version != VERSION:
        raise StateError(f"unsupported state file version {version!r}")
    pools = doc.get("pools")
    if not isinstance(pools, dict):
        raise StateError(f"pools: expected an object, got {_kind(pools)}")
    out: dict[str, dict[str, NodeState]] = {}
    for p, nodes in pools.items():
        if not isinstance(nodes, dict):
            raise StateError(f"pools.{p}: expected an object, got {_kind(nodes)}")
        out[p] = {n: node_state(s, f"pools.{p}.{n}") for n, s in nodes.items()}
    return out


def _kind(v: object) -> str:
    return {type(None): "null", dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _fields(cls: type, d: object, where: str) -> dict:
    """The known fields of a JSON object, each checked against cls's annotation."""
    if not isinstance(d, dict):
        raise StateError(f"{where}: expected an object, got {_kind(d)}")
    hints = typing.get_type_hints(cls)
    return {f.name: _value(hints[f.name], d[f.name], f"{where}.{f.name}")
            for f in dataclasses.fields(cls) if f.name in d}


def _value(tp: object, v: object, where: str) -> object:
    """v checked against the annotation tp: typed, numbers finite (a bool is not a number)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), v, where)
    if tp in (SignalMemory, LiveMemory, Noise):
        made = tp(**_fields(tp, v, where))  # type: ignore[operator]
        return _noise(made, where) if tp is Noise else _shares(made, where) if tp is SignalMemory else made
    if typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,):  # tuple[float, ...]: a JSON list
        if not isinstance(v, list):
            raise StateError(f"{where}: expected a list, got {_kind(v)}")
        return tuple(_value(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if tp is bool:
        if not isinstance(v, bool):
            raise StateError(f"{where}: expected true or false, got {_kind(v)}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StateError(f"{where}: expected a whole number >= 0, got {v!r:.40}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise StateError(f"{where}: expected a finite number, got {v!r:.40}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise StateError(f"{where}: expected a string, got {_kind(v)}")
        return v
    return v  # a field this loader does not know how to check: as stored (a newer NodeState)


_NOISE_MAX = max(NOISE_CLIP, PRIOR_SPREAD)  # the largest spread Noise.learn keeps: the prior, or a clipped sample


def _noise(m: Noise, where: str) -> Noise:
    """A learned noise as Noise.learn can make it: a spread in [0, NOISE_CLIP] (each sample's is clipped there),
    learned over [0, NOISE_S] seconds. A larger one would blind the detector for hours (a spread of 1e300, unlearned
    at e^-1 a minute, cuts nothing for eleven), a negative time would never learn."""
    if not 0 <= m.dev <= _NOISE_MAX:
        raise StateError(f"{where}.dev: a learned noise is in [0, {_NOISE_MAX:g}], got {m.dev:g}")
    if not 0 <= m.seconds <= NOISE_S:
        raise StateError(f"{where}.seconds: a noise is learned over 0..{NOISE_S:g} s, got {m.seconds:g}")
    return m


def _shares(m: SignalMemory, where: str) -> SignalMemory:
    """A node's learned shares of slow and of failed probes as learned_share makes them: in [0, 1]. A larger one
    would make every run of the node's peers need more probes than a pool ever sends (probe_run_needed: a share of 1
    or more is no evidence at all), so no node of the pool would be cut or drained for its probes again."""
    for name in ("probe_waited_share", "probe_failed_share"):
        if not 0.0 <= getattr(m, name) <= 1.0:
            raise StateError(f"{where}.{name}: a share of probes is in [0, 1], got {getattr(m, name):g}")
    return m


def _factor(f: object, where: str) -> tuple:
    """One (signal, factor in [0, 1], reason) triple."""
    if not (isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and isinstance(f[2], str)):
        raise StateError(f"{where}: expected [signal, factor, reason], got {f!r:.60}")
    factor = _value(float, f[1], where)
    if not 0 <= factor <= 1:  # type: ignore[operator]
        raise StateError(f"{where}: a weight factor must be in [0, 1], got {factor}")
    return (f[0], factor, f[2])


def node_state(d: object, where: str) -> NodeState:
    if not isinstance(d, dict):
        raise StateError(f"{where}: expected an object, got {_kind(d)}")
    raw = d.get("factors")
    kw = _fields(NodeState, {k: v for k, v in d.items() if k != "factors"}, where)
    if raw is not None:
        if not isinstance(raw, list):
            raise StateError(f"{where}.factors: expected a list, got {_kind(raw)}")
        kw["factors"] = tuple(_factor(f, f"{where}.factors[{i}]") for i, f in enumerate(raw))
    if "state" in kw:
        try:
            kw["state"] = State(kw["state"])
        except ValueError:  # an unknown state would stick for ever: no transition leaves it
            raise StateError(f"{where}.state: unknown state {kw['state']!r:.40} "
                             f"(known: {', '.join(State)})") from None
    if "cause" in kw:  # a DrainCause, or another cause the policy recorded (e.g. seeded): kept as text
        with contextlib.suppress(ValueError):
            kw["cause"] = DrainCause(kw["cause"])
    if kw.get("weight") is not None and kw["weight"] > MAX_WEIGHT:
        raise StateError(f"{where}.weight: must be in 0..{MAX_WEIGHT}, got {kw['weight']}")
    return NodeState(**kw)


class StateFile:
    """Atomic JSON state file; a missing, unreadable or invalid file starts empty (logged), never crashes."""

    def __init__(self, path: str | os.PathLike[str], save_errors: typing.Any = None):
        self.path = Path(path)
        self.save_errors = save_errors  # a counter (.inc()) of failed saves, e.g. grayguard_state_save_errors
        self._last = ""
        self._save_error: str | None = None

    def load(self) -> dict[str, dict[str, NodeState]]:
        """The stored states, or {} (every node is then seeded from HAProxy) with a warning saying why."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:  # a directory, a path under a regular file, no permission
            log.warning("state file %s cannot be read (%s); starting with no state: every node is seeded from "
                        "HAProxy", self.path, e.strerror or e)
            return {}
        try:
            text = data.decode()
            states = load_states(text)
        except (StateError, UnicodeDecodeError) as e:
            bad = self.path.with_suffix(self.path.suffix + ".corrupt")
            try:
                os.replace(self.path, bad)
                kept = f"kept it as {bad}"
            except OSError as err:
                kept = f"could not set it aside ({err.strerror or err})"
            log.warning("state file %s is not valid (%s); starting with no state: every node is seeded from "
                        "HAProxy; %s", self.path, e, kept)
            return {}
        self._last = text
        return states

    def save(self, states: dict[str, dict[str, NodeState]]) -> bool:
        """Write if changed; True when written. A failure is logged (once per distinct error) and counted,
        never raised: the tick goes on, and the next tick tries again."""
        try:
            text = dump_states(states)
            if text == self._last:
                return False
            self._write(text)
        except (OSError, ValueError, TypeError) as e:
            if self.save_errors is not None:
                self.save_errors.inc()
            problem = f"{type(e).__name__}: {e}"
            if problem != self._save_error:
                log.error("state file %s not saved (%s); the controller goes on and tries again every tick",
                          self.path, problem)
            self._save_error = problem
            return False
        if self._save_error is not None:
            log.info("state file %s saved again", self.path)
            self._save_error = None
        self._last = text
        return True

    def _write(self, text: str) -> None:
        write_atomic(self.path, text, prefix=".grayguard-state.")


class StateLockError(Exception):
    """Another process holds the state file's lock."""

    def __init__(self, lock_path: Path, holder: int | None):
        who = f"pid {holder}" if holder is not None else "pid unknown"
        super().__init__(f"another grayguard controller ({who}) holds {lock_path}: only one controller may write "
                         f"the state file {lock_path.with_suffix('')} and drive HAProxy from this host")
        self.holder = holder


class StateLock:
    """An exclusive flock on `<state file>.lock`, held for the controller's life: one writer per host.

    The kernel drops the lock when the process dies (even SIGKILL), so there is no stale lock to clean up;
    the file is left in place (deleting it would let two processes lock two different files).
    """

    def __init__(self, state_path: str | os.PathLike[str]):
        self.path = Path(f"{os.fspath(state_path)}.lock")
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        """Take the lock or raise StateLockError (held elsewhere) or OSError (cannot create the file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise StateLockError(self.path, holder) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message a second controller prints
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _pid_in(fd: int) -> int | None:
    """The pid the lock's holder wrote, or None (not written yet, or garbage)."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
