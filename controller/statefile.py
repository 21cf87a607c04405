"""Persist node states between restarts: JSON, written atomically (temp file + rename)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

from controller.policy import NodeState
from controller.signals import SignalMemory
from grayguard.vocab import DrainCause, State

log = logging.getLogger("grayguard.state")
VERSION = 1


def dump_states(states: dict[str, dict[str, NodeState]]) -> str:
    """Serialize {pool: {node: NodeState}} (sorted, so equal states give equal text)."""
    doc = {"version": VERSION,
           "pools": {p: {n: dataclasses.asdict(s) for n, s in sorted(nodes.items())}
                     for p, nodes in sorted(states.items())}}
    return json.dumps(doc, indent=1, sort_keys=True)


def load_states(text: str) -> dict[str, dict[str, NodeState]]:
    """Parse dump_states() output; unknown fields are ignored, so older files still load."""
    doc = json.loads(text)
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported state file version {doc.get('version')!r}")
    return {p: {n: _node_state(s) for n, s in nodes.items()} for p, nodes in doc["pools"].items()}


def _node_state(d: dict) -> NodeState:
    names = {f.name for f in dataclasses.fields(NodeState)}
    kw = {k: v for k, v in d.items() if k in names}
    mem_names = {f.name for f in dataclasses.fields(SignalMemory)}
    kw["signals"] = SignalMemory(**{k: v for k, v in (kw.get("signals") or {}).items() if k in mem_names})
    kw["factors"] = tuple(tuple(f) for f in kw.get("factors") or ())
    for key, kind in (("state", State), ("cause", DrainCause)):
        if key in kw:
            kw[key] = _member(kind, kw[key])
    return NodeState(**kw)


def _member(kind: type[State] | type[DrainCause], value: object) -> object:
    """The vocabulary member a stored value names; any other value (unknown, empty, not a string) as it was."""
    try:
        return kind(value)
    except ValueError:
        return value


class StateFile:
    """Atomic JSON state file; a missing or corrupt file starts fresh (logged), never crashes the loop."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._last = ""

    def load(self) -> dict[str, dict[str, NodeState]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            states = load_states(text)
        except (ValueError, TypeError, KeyError) as e:
            bad = self.path.with_suffix(self.path.suffix + ".corrupt")
            log.error("state file %s is unreadable (%s); starting fresh, kept it as %s", self.path, e, bad)
            os.replace(self.path, bad)
            return {}
        self._last = text
        return states

    def save(self, states: dict[str, dict[str, NodeState]]) -> bool:
        """Write if changed; True when written."""
        text = dump_states(states)
        if text == self._last:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".grayguard-state.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._last = text
        return True
