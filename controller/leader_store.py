"""The etcd transactions leader election needs beyond grayguard.registry's Registry: a campaign that says who holds
the key when it fails, and a put or delete that happens only while the caller still holds the leader key.

The guard is the leader key's create_revision: a key re-created by another replica (after the lease expired) has a
new one, so a deposed leader's late write fails in etcd itself, whatever its clocks say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grayguard.etcdgw import Entry, Registry, RegistryError, _b64, _entry  # the gateway's own encoding helpers


@dataclass(frozen=True)
class Campaign:
    """The outcome of one compare-and-create: won (revision: the new key's create_revision) or the holder."""

    won: bool
    revision: int = 0  # create_revision of the key this replica now holds (won)
    holder: Entry | None = None  # who holds it (lost; None when it went between the compare and the read)


class ElectionStore(Registry):
    """Registry plus the guarded transactions of controller/leader.py; every failure is a RegistryError."""

    def campaign(self, key: str, value: str, lease: int) -> Campaign:
        """Create key on lease unless it exists; in the same transaction, read the holder when it does."""
        k = _b64(key)
        res = self._txn({"compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
                         "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
                         "failure": [{"request_range": {"key": k}}]})
        if res.get("succeeded"):
            return Campaign(True, revision=_revision(res))
        kvs = _first(res).get("response_range", {}).get("kvs", [])
        return Campaign(False, holder=_entry(kvs[0]) if kvs else None)

    def put_if_held(self, guard: str, revision: int, puts: dict[str, str]) -> bool:
        """Write every key of puts in one transaction if guard's create_revision is still revision; True if done."""
        ops = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        return bool(self._txn({"compare": [_held(guard, revision)], "success": ops, "failure": []}).get("succeeded"))

    def delete_if_held(self, key: str, revision: int) -> bool:
        """Delete key if its create_revision is still revision (resign without touching a successor's key)."""
        return bool(self._txn({"compare": [_held(key, revision)],
                               "success": [{"request_delete_range": {"key": _b64(key)}}],
                               "failure": []}).get("succeeded"))

    def _txn(self, body: dict[str, Any]) -> dict[str, Any]:
        res = self._call(lambda: self._gw.transaction(body))
        if not isinstance(res, dict) or "header" not in res:
            raise RegistryError("garbage", f"{self._where()}: transaction answer not understood: {str(res)[:120]}")
        return res


def _held(key: str, revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def _revision(res: dict[str, Any]) -> int:
    try:
        return int(res["header"]["revision"])  # a successful create's revision is the key's create_revision
    except (KeyError, TypeError, ValueError):
        raise RegistryError("garbage", f"transaction without a revision: {str(res)[:120]}") from None


def _first(res: dict[str, Any]) -> dict[str, Any]:
    responses = res.get("responses") or [{}]
    return responses[0] if isinstance(responses[0], dict) else {}
