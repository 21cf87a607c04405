"""The controller's flight recorder, pure codec plus a thin writer: every tick's Observation as one JSON line.

An Observation (controller/decide.py) is everything a tick decides on: the Prometheus samples, HAProxy's servers,
the states after the previous tick and the canary rounds that completed. Recorded tick by tick (`grayguard
controller --record FILE`), a run can be decided again offline by exactly the controller's decision code
(`grayguard replay --recording FILE`): with the same config the replay gives the same decisions tick for tick
(tests/controller/test_recorder.py checks it on a live stack), with another config it shows what that config
would have done on the same evidence (the states evolve from the replay's own decisions; the canary rounds and
everything HAProxy did stay as recorded).

Format: JSON lines; a name ending in .gz is gzip. The first line is a header {"recording": VERSION, "started":
unix time}; each other line one tick: {"now", "max_age_s", "samples", "optional", "pools"}. NaN and Inf sample
values are kept (Python's json writes and reads them). A line that is not a tick of this version is an error
naming the line; nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from grayguard.controller.decide import CanaryRound, Observation, PoolObservation
from grayguard.controller.haproxy import ServerState
from grayguard.controller.statefile import StateError, node_state
from grayguard.promclient import Sample

log = logging.getLogger("grayguard.recorder")
VERSION = 1
_SERVER_FIELDS = tuple(f.name for f in dataclasses.fields(ServerState))


class RecordingError(ValueError):
    """A recording that cannot be read back, with the line it failed on."""


def _samples(by_name: Mapping[str, Sequence[Sample]]) -> dict[str, list]:
    return {name: [[s.labels, s.value, s.timestamp] for s in ss] for name, ss in sorted(by_name.items())}


def _canary(r: CanaryRound) -> dict[str, Any]:
    return {"node": r.node, "peers": list(r.peers), "ttft": dict(r.ttft), "at": r.at,
            "emas": None if r.emas is None else dict(r.emas)}


def encode(obs: Observation) -> dict[str, Any]:
    """One tick as a JSON-ready dict (PoolObservation.data is left out: decide_tick recomputes it)."""
    pools = {}
    for name, po in sorted(obs.pools.items()):
        pools[name] = {"servers": {n: dataclasses.asdict(s) for n, s in sorted(po.servers.items())},
                       "prev": {n: dataclasses.asdict(s) for n, s in sorted(po.prev.items())},  # as the state file
                       "canaries": [_canary(r) for r in po.canaries]}
    return {"now": obs.now, "max_age_s": None if math.isinf(obs.max_age_s) else obs.max_age_s,
            "samples": _samples(obs.samples), "optional": _samples(obs.optional), "pools": pools}


def _decode_samples(doc: object, where: str) -> dict[str, list[Sample]]:
    if not isinstance(doc, dict):
        raise RecordingError(f"{where}: expected an object")
    out = {}
    for name, rows in doc.items():
        if not isinstance(rows, list):
            raise RecordingError(f"{where}.{name}: expected a list")
        got = []
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], dict)
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row[1:])):
                raise RecordingError(f"{where}.{name}[{i}]: expected [labels, value, timestamp]")
            got.append(Sample({str(k): str(v) for k, v in row[0].items()}, float(row[1]), float(row[2])))
        out[str(name)] = got
    return out


def decode(doc: object) -> Observation:
    """The Observation encode() wrote; RecordingError names the first field it cannot take."""
    if not isinstance(doc, dict):
        raise RecordingError("expected an object")
    try:
        now = float(doc["now"])
        max_age = doc.get("max_age_s")
        pools_doc = doc["pools"]
        if not isinstance(pools_doc, dict):
            raise RecordingError("pools: expected an object")
        pools = {}
        for name, p in pools_doc.items():
            servers = {n: ServerState(**{k: v for k, v in s.items() if k in _SERVER_FIELDS})
                       for n, s in p["servers"].items()}
            try:  # each state checked as the state file checks it, field by field
                prev = {n: node_state(d, f"pools.{name}.prev.{n}") for n, d in p["prev"].items()}
            except StateError as e:
                raise RecordingError(str(e)) from None
            canaries = tuple(CanaryRound(c["node"], tuple(c["peers"]), dict(c["ttft"]), c.get("at"), c.get("emas"))
                             for c in p.get("canaries", ()))
            pools[name] = PoolObservation(servers, prev, canaries)
        return Observation(now, _decode_samples(doc["samples"], "samples"),
                           _decode_samples(doc.get("optional", {}), "optional"), pools,
                           math.inf if max_age is None else float(max_age))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, RecordingError):
            raise
        raise RecordingError(f"{type(e).__name__}: {e}") from None


def _open(path: str | Path, mode: str) -> IO[str]:
    if str(path).endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")  # type: ignore[arg-type]
    return open(path, mode, encoding="utf-8")  # noqa: SIM115 (closed by the caller)


def read(path: str | Path) -> Iterator[Observation]:
    """Every tick of a recording, in order; RecordingError (with the line) on anything else."""
    with _open(path, "r") as f:
        for i, line in enumerate(f, 1):
            try:
                doc = json.loads(line)
            except ValueError as e:
                raise RecordingError(f"{path}:{i}: not JSON: {e}") from None
            if i == 1:
                if not (isinstance(doc, dict) and doc.get("recording") == VERSION):
                    raise RecordingError(f"{path}:1: not a grayguard recording of version {VERSION} "
                                         f"(header {str(doc)[:80]!r})")
                continue
            try:
                yield decode(doc)
            except RecordingError as e:
                raise RecordingError(f"{path}:{i}: {e}") from None


class Recorder:
    """Appends one line per tick to `path` (.gz: gzip), flushed each tick so a crash loses at most one tick.

    A failed write is logged once and the recorder stops: recording never fails a tick."""

    def __init__(self, path: str | Path, clock=time.time):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._f: IO[str] | None = _open(self.path, "w")
        self._f.write(json.dumps({"recording": VERSION, "started": clock()}) + "\n")
        self._f.flush()
        self.ticks = 0

    def write(self, obs: Observation) -> None:
        with self._lock:
            if self._f is None:
                return
            try:
                self._f.write(json.dumps(encode(obs)) + "\n")
                self._f.flush()
                self.ticks += 1
            except (OSError, ValueError, TypeError) as e:
                log.error("recording to %s stopped after %d tick(s): %s", self.path, self.ticks, e)
                self._close()

    def _close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError as e:
                log.error("closing the recording %s: %s", self.path, e)

    def close(self) -> None:
        with self._lock:
            self._close()
