"""etcd through its v3 JSON gateway, with the maintained `etcd3gw` client: leases, puts, reads, a
compare-and-create and a prefix watch. Every call is bounded by a timeout and every failure is one
classified RegistryError (the contract, with the records it carries, is in grayguard/registry.py).
Several endpoints, TLS and an etcd user ride on the session (grayguard/etcdconn.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import etcd3gw
import requests
import urllib3
from etcd3gw import exceptions as gw
from etcd3gw.lease import Lease

from grayguard import etcdconn
from grayguard.etcdconn import EtcdSession, EtcdSettings

if TYPE_CHECKING:
    from collections.abc import Mapping

    from grayguard.config import RegistryConfig

T = TypeVar("T")
R = TypeVar("R", bound="Registry")
API_PATH = etcdconn.API_PATH  # etcd >= 3.4 (3.3 served /v3beta/): fixed, so no discovery request can fail first
# unreachable: no connection; timeout: no answer in time; garbage: an answer that is not etcd's JSON;
# rejected: etcd refused the request; lease_gone: the lease named does not exist (expired, revoked, etcd wiped);
# compacted: a watch's history is gone (compacted, or etcd lost its data): list again, then watch on
ERROR_KINDS = ("unreachable", "timeout", "garbage", "rejected", "lease_gone", "compacted")


class RegistryError(Exception):
    """etcd could not do what was asked; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Entry:
    """One key as etcd holds it (value decoded as UTF-8; lease 0: none)."""

    key: str
    value: str
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: kind "put" or "delete"; value "" for a delete."""

    kind: str
    key: str
    value: str
    revision: int  # the change's mod revision
    prev_value: str | None = None  # the value before the change, when etcd still had it


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: Any) -> str:
    return base64.b64decode(str(text), validate=True).decode("utf-8", errors="replace")


def _range_end(prefix: str) -> bytes:
    """The first key after every key that starts with prefix (etcd's prefix range)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"  # every key
    raw[-1] += 1
    return bytes(raw)


def _entry(kv: dict[str, Any]) -> Entry:
    return Entry(key=_unb64(kv["key"]), value=_unb64(kv.get("value", "")), mod_revision=int(kv.get("mod_revision", 0)),
                 create_revision=int(kv.get("create_revision", 0)), lease=int(kv.get("lease", 0)))


class Registry:
    """etcd at url (`http://127.0.0.1:2379`), or as EtcdSettings say (several endpoints, TLS, a user: build it
    with from_config); each call finishes within `timeout` s, every endpoint it tries included.

    Thread-safe for one caller per instance at a time (a requests.Session); a watch uses its own session.
    """

    def __init__(self, url: str | EtcdSettings = "http://127.0.0.1:2379", *, timeout: float = 2.0,
                 api_path: str = API_PATH, session: requests.Session | None = None):
        conn = url if isinstance(url, EtcdSettings) else EtcdSettings.plain(url, timeout)
        for ep in conn.endpoints:
            parts = urlsplit(ep)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an etcd client URL: {ep!r} (e.g. http://127.0.0.1:2379)")
        self.settings, self.timeout = conn, conn.timeout
        first = urlsplit(conn.endpoints[0])  # etcd3gw's URLs name it; EtcdSession sends them to the one in use
        self._gw = etcd3gw.Etcd3Client(host=first.hostname or "", port=first.port or 2379, protocol=first.scheme,
                                       timeout=conn.timeout, api_path=api_path,
                                       session=session or EtcdSession(conn))

    @classmethod
    def from_config(cls: type[R], cfg: RegistryConfig, environ: Mapping[str, str] | None = None) -> R:
        """The client cfg (the config's registry section) describes; ConfigError naming the field when a TLS
        file does not load or the password cannot be read."""
        return cls(etcdconn.settings(cfg, environ))

    @property
    def url(self) -> str:
        """The endpoint in use (the one that answered last)."""
        session = self._gw.session
        return (session.endpoint if isinstance(session, EtcdSession) else self.settings.endpoints[0]).rstrip("/")

    def _where(self) -> str:
        eps = self.settings.endpoints
        return self.url if len(eps) == 1 else f"etcd ({', '.join(e.rstrip('/') for e in eps)})"

    def close(self) -> None:
        """Close the connection pool."""
        self._gw.session.close()

    # --- leases ------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ttl whole seconds (>= 1); its id."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"a lease TTL is a whole number of seconds >= 1, got {ttl!r}")
        return self._call(lambda: self._gw.lease(ttl).id)

    def keep_alive(self, lease: int) -> int:
        """Refresh the lease; its TTL in seconds, or 0 when etcd no longer knows it (expired, revoked, wiped)."""
        return max(0, self._call(lambda: Lease(lease, self._gw).refresh()))

    def revoke(self, lease: int) -> bool:
        """Revoke the lease (its keys are deleted at once); False when it was already gone."""
        try:
            return self._call(lambda: Lease(lease, self._gw).revoke())
        except RegistryError as e:
            if e.kind == "lease_gone":
                return False
            raise

    # --- keys --------------------------------------------------------------------------------
    def put(self, key: str, value: str, *, lease: int = 0) -> None:
        """Write key (attached to lease when not 0); RegistryError lease_gone when the lease is unknown."""
        self._call(lambda: self._gw.put(key.encode(), value.encode(), lease=Lease(lease, self._gw) if lease else None))

    def get(self, key: str) -> Entry | None:
        """The key, or None when absent."""
        entries, _ = self._range({"key": _b64(key)})
        return entries.get(key)

    def get_prefix(self, prefix: str) -> tuple[dict[str, Entry], int]:
        """Every key under prefix, and the store revision they were read at (watch from revision + 1)."""
        return self._range({"key": _b64(prefix), "range_end": _b64(_range_end(prefix))})

    def delete(self, key: str) -> bool:
        """Delete key; False when it was absent."""
        return self._call(lambda: self._gw.delete(key.encode()))

    def create(self, key: str, value: str, *, lease: int = 0) -> bool:
        """Compare-and-create in one transaction: write key (on lease) only if it does not exist; True if written.

        The building block of leader election: the holder's key lives on its lease and vanishes with it.
        """
        return bool(self._call(lambda: self._gw.create(key.encode(), value.encode(),
                                                       lease=Lease(lease, self._gw) if lease else None)))

    def revision(self) -> int:
        """The store's current revision (also a cheap health check)."""
        result = self._call(lambda: self._gw.status())
        try:
            return int(result["header"]["revision"])
        except (KeyError, TypeError, ValueError):
            raise RegistryError("garbage", f"status without a revision: {str(result)[:120]}") from None

    def _range(self, body: dict[str, Any]) -> tuple[dict[str, Entry], int]:
        result = self._call(lambda: self._gw.post(self._gw.get_url("/kv/range"), json=body))
        try:
            entries = [_entry(kv) for kv in result.get("kvs", [])]
            return {e.key: e for e in entries}, int(result["header"]["revision"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RegistryError("garbage", f"range answer not understood ({e!r}): {str(result)[:120]}") from None

    def _call(self, fn: Callable[[], T]) -> T:
        """fn's result, every failure raised as a classified RegistryError."""
        where = self._where()
        try:
            return fn()
        except gw.ConnectionTimeoutError as e:
            raise RegistryError("timeout", f"{where}: no answer within {self.timeout:g}s ({_detail(e)})") from None
        except gw.ConnectionFailedError as e:
            raise RegistryError("unreachable", f"{where}: {_detail(e)}") from None
        except gw.Etcd3Exception as e:
            detail = _detail(e)
            if "lease not found" in detail:
                raise RegistryError("lease_gone", f"{where}: {detail}") from None
            # etcd's gateway explains a refusal in JSON ({"error", "code", "message"}); anything else is not etcd
            # (but for its plain-text refusal of a client certificate with a Common Name)
            refused = _etcd_error(e) or "CommonName of client" in detail
            raise RegistryError("rejected" if refused else "garbage", f"{where}: {detail}") from None
        except requests.Timeout as e:
            raise RegistryError("timeout", f"{where}: {e}") from None
        except requests.JSONDecodeError as e:  # a RequestException too, but an answer that is not etcd's
            raise RegistryError("garbage", f"{where}: answer not JSON: {e}") from None
        except requests.RequestException as e:  # broken mid-answer, too many redirects...
            raise RegistryError("unreachable", f"{where}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or JSON of another shape
            raise RegistryError("garbage", f"{where}: answer not understood: {e!r}") from None

    # --- watch -------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event, *,
                     idle_timeout: float = 30.0) -> Iterator[WatchEvent]:
        """Every change under prefix from start_revision on, in order, until stop is set (then it returns).

        A stream silent for idle_timeout s (or ended by a proxy) is reopened from the next revision, so a
        dead peer cannot hold it for ever and nothing is skipped or repeated. RegistryError: unreachable or
        timeout when etcd cannot be reached; compacted when the history from start_revision is gone
        (compacted, or etcd lost its data and its revision went back): list with get_prefix, watch again.
        """
        next_rev, seen, relogin = start_revision, 0, True
        while not stop.is_set():
            stream = _WatchStream(self, prefix, next_rev, idle_timeout)
            try:
                for msg in stream.messages(stop):
                    for event in self._events(msg, next_rev, seen):
                        next_rev = event.revision + 1
                        yield event
                    relogin = True  # the stream worked: a later rejected token may be renewed again
                    seen = max(seen, _header_revision(msg))
            except RegistryError as e:
                # etcd cancels a stream opened with a token it no longer knows: log in again, once
                if not (relogin and e.kind == "rejected" and "invalid auth token" in str(e)):
                    raise
                relogin = False
                stream.forget_token()
            finally:
                stream.close()

    def _events(self, msg: dict[str, Any], next_rev: int, seen: int) -> list[WatchEvent]:
        if "error" in msg:
            raise RegistryError("rejected", f"{self.url}: watch: {str(msg['error'])[:200]}")
        result = msg.get("result")
        if not isinstance(result, dict):
            raise RegistryError("garbage", f"{self.url}: watch message without a result: {str(msg)[:120]}")
        if result.get("canceled"):
            if int(result.get("compact_revision", 0)):
                raise RegistryError("compacted", f"{self.url}: history before revision "
                                                 f"{result['compact_revision']} is compacted (asked {next_rev})")
            raise RegistryError("rejected", f"{self.url}: watch canceled: {result.get('cancel_reason', '')}")
        head = _header_revision(msg)
        if result.get("created") and (head < next_rev - 1 or head < seen):
            behind = max(next_rev - 1, seen)
            raise RegistryError("compacted", f"{self.url}: etcd is at revision {head}, behind the {behind} seen: "
                                             "it lost its data")
        try:
            return [WatchEvent(kind="delete" if ev.get("type") == "DELETE" else "put", key=_unb64(ev["kv"]["key"]),
                               value=_unb64(ev["kv"].get("value", "")), revision=int(ev["kv"]["mod_revision"]),
                               prev_value=_unb64(ev["prev_kv"].get("value", "")) if "prev_kv" in ev else None)
                    for ev in result.get("events", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RegistryError("garbage", f"{self.url}: watch event not understood ({e!r})") from None


def _header_revision(msg: dict[str, Any]) -> int:
    try:
        return int(msg["result"]["header"]["revision"])
    except (KeyError, TypeError, ValueError):
        return 0


def _etcd_error(e: Exception) -> bool:
    try:
        doc = json.loads(getattr(e, "detail_text", None) or "")
    except ValueError:
        return False
    return isinstance(doc, dict) and "code" in doc


def _detail(e: Exception) -> str:
    detail = str(getattr(e, "detail_text", None) or str(e) or type(e).__name__)
    return " ".join(detail.split())[:300] + etcdconn.hint(detail)  # the hint even when the text is cut


class _WatchStream:
    """One open watch request; a reader thread turns its lines into messages for the caller's thread."""

    _END, _IDLE = object(), object()

    def __init__(self, registry: Registry, prefix: str, start_revision: int, idle_timeout: float):
        main = registry._gw.session
        # a session of its own (the stream holds it), with the registry's endpoints, TLS and token
        self._session = main.fork() if isinstance(main, EtcdSession) else requests.Session()
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_range_end(prefix)),
                                   "start_revision": start_revision, "prev_kv": True}}
        gwc = registry._gw
        try:
            resp = self._session.post(gwc.get_url("/watch"), json=body, stream=True,
                                      timeout=(registry.timeout, idle_timeout))
        except requests.Timeout as e:
            self._session.close()
            raise RegistryError("timeout", f"{registry._where()}: watch: {_detail(e)}") from None
        except requests.RequestException as e:
            self._session.close()
            raise RegistryError("unreachable", f"{registry._where()}: watch: {_detail(e)}") from None
        except RegistryError:  # the login failed
            self._session.close()
            raise
        if resp.status_code != 200:
            text = resp.text[:200]
            resp.close()
            self._session.close()
            raise RegistryError("rejected", f"{registry.url}: watch answered {resp.status_code}: {text}")
        self._resp, self._url = resp, registry.url
        self._queue: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="etcd-watch", daemon=True)
        self._reader.start()

    def messages(self, stop: threading.Event) -> Iterator[dict[str, Any]]:
        """The stream's JSON messages until stop is set, the stream idles out or ends (then it returns)."""
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=0.1)  # how often stop is looked at
            except queue.Empty:
                continue
            if item is self._IDLE:
                return
            if item is self._END:
                raise RegistryError("unreachable", f"{self._url}: the watch stream ended")
            if isinstance(item, RegistryError):
                raise item
            yield item

    def _read(self) -> None:
        buf = b""
        try:
            for chunk in self._resp.iter_content(chunk_size=None):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        try:
                            self._queue.put(json.loads(line))
                        except ValueError:
                            bad = f"{self._url}: watch line not JSON: {line[:80]!r}"
                            self._queue.put(RegistryError("garbage", bad))
                            return
            self._queue.put(self._END)
        except requests.ConnectionError as e:
            idle = any(isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in e.args)
            self._queue.put(self._IDLE if idle else self._END)
        except Exception:  # closed under us (stop), or a broken stream: either way this stream is over
            self._queue.put(self._END)

    def forget_token(self) -> None:
        """etcd rejected this stream's token: the next stream logs in again."""
        if isinstance(self._session, EtcdSession):
            self._session.forget_token(self._resp.request.headers.get("Authorization"))

    def close(self) -> None:
        """Shut the connection (unblocks the reader) and wait briefly for the reader."""
        with contextlib.suppress(Exception):  # already closed, or no socket behind it
            fd = self._resp.raw._fp.fileno()
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
                s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            self._resp.close()
        self._reader.join(1.0)
        self._session.close()
