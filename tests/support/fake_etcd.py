"""An in-memory etcd for the election's unit tests: leases that expire on a test clock, create revisions, the
guarded transactions of controller/leader_store.py; each replica talks through its own Client, which a test can
cut off (a partition) or slow down (a renewal that takes its time)."""

from __future__ import annotations

from collections.abc import Callable

from grayguard.controller.leader_store import Campaign
from grayguard.registry import Entry, RegistryError


class FakeEtcd:
    """The store: keys (Entry), leases {id: (ttl, expires at)}, one revision counter; time is clock()."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.kv: dict[str, Entry] = {}
        self.leases: dict[int, tuple[int, float]] = {}
        self.rev = 1
        self.down = False
        self._next_lease = 100

    def expire(self) -> None:
        """Drop every lease past its time, with its keys (etcd's lessor)."""
        now = self.clock()
        for lid, (_, until) in list(self.leases.items()):
            if now >= until:
                self._drop_lease(lid)

    def _drop_lease(self, lid: int) -> None:
        del self.leases[lid]
        for k in [k for k, e in self.kv.items() if e.lease == lid]:
            del self.kv[k]
            self.rev += 1

    def _put(self, key: str, value: str, lease: int) -> None:
        self.rev += 1
        old = self.kv.get(key)
        self.kv[key] = Entry(key, value, self.rev, old.create_revision if old else self.rev, lease)


class Client:
    """ElectionStore's seam over a FakeEtcd; cut=True: unreachable; delay_s: each call moves the clock this much."""

    def __init__(self, etcd: FakeEtcd, advance: Callable[[float], None] | None = None):
        self.etcd, self.advance = etcd, advance
        self.cut = False
        self.delay_s = 0.0
        self.calls: list[str] = []

    def _enter(self, op: str) -> FakeEtcd:
        self.calls.append(op)
        if self.delay_s and self.advance:
            self.advance(self.delay_s)
        if self.cut or self.etcd.down:
            raise RegistryError("unreachable", "fake etcd: connection refused")
        self.etcd.expire()
        return self.etcd

    def grant(self, ttl: int) -> int:
        e = self._enter("grant")
        e._next_lease += 1
        e.leases[e._next_lease] = (ttl, e.clock() + ttl)
        return e._next_lease

    def keep_alive(self, lease: int) -> int:
        e = self._enter("keep_alive")
        if lease not in e.leases:
            return 0
        ttl = e.leases[lease][0]
        e.leases[lease] = (ttl, e.clock() + ttl)
        return ttl

    def revoke(self, lease: int) -> bool:
        e = self._enter("revoke")
        if lease not in e.leases:
            return False
        e._drop_lease(lease)
        return True

    def put(self, key: str, value: str, *, lease: int = 0) -> None:
        e = self._enter("put")
        if lease and lease not in e.leases:
            raise RegistryError("lease_gone", "lease not found")
        e._put(key, value, lease)

    def get(self, key: str) -> Entry | None:
        return self._enter("get").kv.get(key)

    def get_prefix(self, prefix: str) -> tuple[dict[str, Entry], int]:
        e = self._enter("get_prefix")
        return {k: v for k, v in e.kv.items() if k.startswith(prefix)}, e.rev

    def campaign(self, key: str, value: str, lease: int) -> Campaign:
        e = self._enter("campaign")
        if key in e.kv:
            return Campaign(False, holder=e.kv[key])
        if lease not in e.leases:
            raise RegistryError("lease_gone", "lease not found")
        e._put(key, value, lease)
        return Campaign(True, revision=e.kv[key].create_revision)

    def put_if_held(self, guard: str, revision: int, puts: dict[str, str]) -> bool:
        e = self._enter("put_if_held")
        if guard not in e.kv or e.kv[guard].create_revision != revision:
            return False
        for k, v in puts.items():
            e._put(k, v, 0)
        return True

    def delete_if_held(self, key: str, revision: int) -> bool:
        e = self._enter("delete_if_held")
        if key not in e.kv or e.kv[key].create_revision != revision:
            return False
        del e.kv[key]
        e.rev += 1
        return True
