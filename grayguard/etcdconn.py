"""How grayguard reaches etcd: its endpoints in order, TLS (a CA, a client certificate) and an etcd user.

`settings(cfg.registry)` checks once, at startup, what the config alone cannot show (the files load, the password
can be read) and raises ConfigError naming the field; `EtcdSession` then carries the settings on every request of
one Registry (grayguard/etcdgw.py): TLS, the user's token as the Authorization header (authenticated again when
etcd rejects it: expired, revoked, etcd restarted), and the request sent to the endpoint in use, moved on to the
next one when it cannot be reached, all within the call's deadline. The CLIs' --registry.* flags
(`add_flags`, `settings_from_flags`) build the same RegistryConfig, so every process reaches etcd alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3

from grayguard.config import ConfigError, RegistryConfig
from grayguard.promclient import read_token_file

API_PATH = "/v3/"  # etcd >= 3.4's gateway (see etcdgw.API_PATH)
AUTH_PATH = "auth/authenticate"
# paths whose request changes nothing in etcd: sent again to the next endpoint after any failure (a write is
# sent again only when it cannot have reached etcd: no connection, no TLS handshake)
_READS = ("kv/range", "maintenance/status", AUTH_PATH, "watch")


@dataclass(frozen=True)
class EtcdSettings:
    """What every request to one etcd cluster carries; build it with settings() or settings_from_flags()."""

    endpoints: tuple[str, ...]
    timeout: float = 2.0  # overall deadline of one call, every endpoint and the authentication included
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: Callable[[], str] | None = field(default=None, repr=False, compare=False)  # read at each login

    @classmethod
    def plain(cls, url: str, timeout: float = 2.0) -> EtcdSettings:
        """One endpoint, no TLS files, no user."""
        return cls((url,), timeout)


def settings(cfg: RegistryConfig, environ: Mapping[str, str] | None = None, where: str = "registry") -> EtcdSettings:
    """cfg's connection, its files loaded once: ConfigError (named `where`.field) for a CA, certificate or key
    that does not load, or a password that cannot be read."""
    env = os.environ if environ is None else environ
    cfg.validate_connection(where)
    if not cfg.urls():
        raise ConfigError(f"{where}.url", "no etcd endpoint (set url or endpoints)")
    _load_tls(cfg, where)
    password: Callable[[], str] | None = None
    if cfg.password_env:
        value = env.get(cfg.password_env, "")
        if not value:
            raise ConfigError(f"{where}.password_env", f"environment variable {cfg.password_env} is not set or empty")
        password = functools.partial(str, value)  # read once, like every *_env
    elif cfg.password_file:
        path = cfg.password_file
        try:
            _read_password(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}.password_file", getattr(e, "strerror", None) or str(e)) from None
        password = functools.partial(_read_password, path)  # re-read at each login: a rotated one is used
    return EtcdSettings(cfg.urls(), cfg.timeout_s, cfg.ca_file, cfg.cert_file, cfg.key_file, cfg.username, password)


def _read_password(path: str) -> str:
    """The password in path: only line ends are taken off (a password may begin or end with a blank)."""
    return read_token_file(path, strip="\r\n")


def _load_tls(cfg: RegistryConfig, where: str) -> None:
    """Load the CA and the client certificate once: a missing file, a key that does not match its certificate or
    an encrypted key (OpenSSL would prompt on the terminal) is a ConfigError now, not an error every call."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cfg.ca_file:
        try:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"{where}.ca_file", f"cannot load CA file {cfg.ca_file}: {e}") from None
    if cfg.cert_file:
        try:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file, password=lambda: b"")
        except (OSError, ssl.SSLError) as e:
            key_bad = cfg.key_file is not None and not os.access(cfg.key_file, os.R_OK)
            raise ConfigError(f"{where}.{'key_file' if key_bad else 'cert_file'}",
                              f"cannot load the client certificate {cfg.cert_file} with key {cfg.key_file}: {e} "
                              "(the key must not be encrypted)") from None


# --- the CLIs' flags -------------------------------------------------------------------------------
FLAGS = {"url": "--registry.url", "endpoints": "--registry.url", "ca_file": "--registry.ca-file",
         "cert_file": "--registry.cert-file", "key_file": "--registry.key-file", "username": "--registry.user",
         "password_env": "--registry.password-env", "password_file": "--registry.password-file"}


def add_flags(group: Any, *, required: bool = False, url_help: str = "") -> None:
    """The --registry.* flags that say how to reach etcd (the exporter's and the actuator's, alike)."""
    a = group.add_argument
    a("--registry.url", dest="registry_url", action="append", required=required, metavar="URL",
      help=(url_help or "etcd client URL, e.g. https://etcd-0:2379 (its v3 JSON gateway, etcd >= 3.4)")
      + "; repeat it for each member of the cluster: a call that cannot reach one goes on to the next")
    a("--registry.ca-file", dest="registry_ca_file", metavar="FILE",
      help="PEM CA bundle that signs etcd's server certificate (default: the system's CAs); needs https:// URLs")
    a("--registry.cert-file", dest="registry_cert_file", metavar="FILE",
      help="PEM client certificate, for an etcd started with --client-cert-auth (needs --registry.key-file)")
    a("--registry.key-file", dest="registry_key_file", metavar="FILE",
      help="the client certificate's PEM key, not encrypted")
    a("--registry.user", dest="registry_user", metavar="NAME",
      help="etcd user, for an etcd with auth enabled (needs --registry.password-file or --registry.password-env)")
    a("--registry.password-file", dest="registry_password_file", metavar="FILE",
      help="file holding the user's password, re-read at each authentication (never give it on the command line)")
    a("--registry.password-env", dest="registry_password_env", metavar="VAR",
      help="environment variable holding the user's password, instead of --registry.password-file")


def settings_from_flags(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EtcdSettings:
    """The settings the --registry.* flags describe; ConfigError naming the flag."""
    cfg = RegistryConfig(endpoints=tuple(args.registry_url or ()), ca_file=args.registry_ca_file,
                         cert_file=args.registry_cert_file, key_file=args.registry_key_file,
                         username=args.registry_user, password_env=args.registry_password_env,
                         password_file=args.registry_password_file)
    try:
        return replace(settings(cfg, environ), timeout=args.registry_timeout)
    except ConfigError as e:
        name = e.path.removeprefix("registry.").split("[")[0]
        raise ConfigError(FLAGS.get(name, e.path), _flag_names(e.problem)) from None


def _flag_names(problem: str) -> str:
    for name, flag in FLAGS.items():
        problem = problem.replace(f"registry.{name}", flag)
    return problem


# --- the session ---------------------------------------------------------------------------------
class _Shared:
    """What a Registry's session and its watch streams' sessions share: the etcd token (one login for all) and
    the endpoint in use (one that answers a watch is the one the next call tries first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.token: str | None = None
        self.current = 0  # index of the endpoint that answered last

    def drop(self, seen: str | None) -> None:
        """Forget the token etcd rejected (unless another thread already replaced it)."""
        with self._lock:
            if self.token == seen:
                self.token = None


class EtcdSession(requests.Session):
    """A requests.Session for one etcd cluster: TLS, the etcd token, the endpoint in use and the call's deadline.

    A request's URL may name any endpoint (etcd3gw builds it from the first): its path is sent to the endpoint in
    use. A token etcd rejects (401: expired, revoked, etcd restarted) is renewed and the request sent once more.
    """

    def __init__(self, settings: EtcdSettings, shared: _Shared | None = None):
        super().__init__()
        self.settings = settings
        self.verify = settings.ca_file or True
        self.cert = (settings.cert_file, settings.key_file) if settings.cert_file else None
        self._shared = shared or _Shared()

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self.settings.endpoints[self._shared.current]

    def fork(self) -> EtcdSession:
        """A session of its own (a watch stream's connection) sharing this one's token and endpoint in use."""
        return EtcdSession(self.settings, self._shared)

    def forget_token(self, token: str | None) -> None:
        """Drop token (etcd rejected it) so the next request logs in again."""
        self._shared.drop(token)

    @property
    def token(self) -> str | None:
        return self._shared.token

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        deadline = time.monotonic() + self.settings.timeout
        path = _path(str(url))
        if self.settings.username is None or path.endswith(AUTH_PATH):
            return self._send(str(method), path, kwargs, deadline)
        resp = self._authorized(str(method), path, kwargs, deadline)
        if resp.status_code == 401:  # etcd no longer knows the token (expired, revoked, restarted): log in again
            resp.close()
            resp = self._authorized(str(method), path, kwargs, deadline, rejected=resp.request.headers["Authorization"])
        return resp

    def _authorized(self, method: str, path: str, kwargs: dict[str, Any], deadline: float,
                    rejected: str | None = None) -> requests.Response:
        if rejected is not None:
            self._shared.drop(rejected)
        token = self._shared.token or self._login(deadline)
        return self._send(method, path, {**kwargs, "headers": {**(kwargs.get("headers") or {}),
                                                               "Authorization": token}}, deadline)

    def _login(self, deadline: float) -> str:
        from grayguard.etcdgw import RegistryError  # etcdgw imports this module

        s = self.settings
        try:
            password = s.password() if s.password else ""
        except (OSError, ValueError) as e:
            raise RegistryError("rejected", f"etcd user {s.username!r}: no password: {e}") from None
        resp = self._send("POST", API_PATH + AUTH_PATH, {"json": {"name": s.username, "password": password}},
                          deadline)
        if resp.status_code != 200:  # a refusal, or (5xx) an etcd that cannot answer now: no leader, say
            raise RegistryError("unreachable" if resp.status_code >= 500 else "rejected",
                                f"{self.endpoint}: etcd user {s.username!r} not authenticated: {_etcd_message(resp)}")
        try:
            token = str(resp.json()["token"])
        except (ValueError, KeyError, TypeError):
            raise RegistryError("garbage", f"{self.endpoint}: authentication answer without a token: "
                                           f"{resp.text[:120]}") from None
        self._shared.token = token
        return token

    def _send(self, method: str, path: str, kwargs: dict[str, Any], deadline: float) -> requests.Response:
        """Send to the endpoint in use, then to the others in order while one cannot be reached."""
        eps = self.settings.endpoints
        read_only = any(path.lstrip("/").endswith(p) for p in _READS)
        failed: list[str] = []
        last: Exception | None = None
        for i in range(len(eps)):
            idx = (self._shared.current + i) % len(eps)
            left = deadline - time.monotonic()
            if left <= 0 and i > 0:
                break
            timeout = _timeouts(kwargs.get("timeout"), max(left, 0.001), len(eps) - i, read_only)
            try:
                # verify and cert given per request: requests lets REQUESTS_CA_BUNDLE override a session's verify
                resp = super().request(method, eps[idx].rstrip("/") + path, **{**kwargs, "timeout": timeout,
                                                                                 "verify": self.verify,
                                                                                 "cert": self.cert})
            except (requests.ConnectionError, requests.Timeout) as e:
                if not (read_only or _not_sent(e)):
                    # a write that may have reached etcd is not sent twice (the caller decides), but the next
                    # call starts at the next endpoint: a member cut off from its quorum accepts and never answers
                    self._shared.current = (idx + 1) % len(eps)
                    raise
                failed.append(f"{eps[idx]}: {e}")
                last = e
                continue
            if resp.status_code == 503 and read_only and i < len(eps) - 1:
                failed.append(f"{eps[idx]}: 503 {resp.text[:120]}")  # a member without a leader, say
                resp.close()
                continue
            self._shared.current = idx
            return resp
        if last is not None and len(failed) == 1:
            raise last
        raise (type(last) if last is not None else requests.ConnectionError)("; ".join(failed))


def _path(url: str) -> str:
    """The path (and query) of url, without its scheme and host."""
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _timeouts(asked: Any, left: float, endpoints_left: int, read_only: bool) -> tuple[float, float]:
    """(connect, read) for one try: a connection gets its share of what is left, so a silent endpoint leaves time
    for the next, and so does the answer to a read (sent again elsewhere); a write's answer gets all that is left
    (it is not sent again). A stream's read timeout (a watch's idle timeout) stays as asked."""
    if isinstance(asked, tuple):
        connect, read = asked
        return min(connect, left / endpoints_left), read
    limit = float(asked) if asked is not None else left
    share = min(limit, left / endpoints_left)
    return share, share if read_only else min(limit, left)


def _not_sent(e: Exception) -> bool:
    """True when the request cannot have reached etcd: no connection, no TLS handshake, no name."""
    if isinstance(e, requests.ConnectTimeout | requests.exceptions.SSLError):
        return True
    reason = getattr(e.args[0], "reason", None) if e.args else None
    return isinstance(reason, urllib3.exceptions.NewConnectionError | urllib3.exceptions.NameResolutionError)


def _etcd_message(resp: requests.Response) -> str:
    try:
        doc = resp.json()
        text = str(doc.get("message") or doc.get("error") or doc)
    except (ValueError, AttributeError):
        text = resp.text
    return " ".join(text.split())[:200] + hint(text)


def hint(detail: str) -> str:
    """What to check for an error text that says TLS or etcd's gateway refused the client certificate."""
    if "CommonName of client" in detail:
        return (" (etcd's gateway refuses a client certificate that has a Common Name while auth is on: "
                "issue it without one, the user comes from registry.username)")
    if "CERTIFICATE_VERIFY_FAILED" in detail:
        return " (TLS: etcd's certificate is not signed by registry.ca_file, or does not name this host)"
    if any(t in detail for t in ("EOF occurred in violation", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED")):
        return (" (TLS: etcd refused the client certificate, or wants one: check registry.cert_file and key_file "
                "against etcd's --trusted-ca-file; or etcd does not serve TLS there)")
    if "SSL" in detail:
        return " (TLS: check registry.ca_file, cert_file and key_file)"
    if "Remote end closed connection without response" in detail or "Connection reset by peer" in detail:
        # what etcd's TLS port does to a plain HTTP request: it closes the connection, cleanly or with a reset,
        # as the timing goes (a reset was seen in CI, 2026-12-05)
        return " (does etcd serve https:// there?)"
    return ""
