"""Prometheus HTTP API client (works with Thanos Query and Mimir too). Errors are classified, never hidden."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple, TypeVar

import msgspec
import requests
import urllib3

from grayguard.config import ConfigError, PrometheusConfig
from grayguard.redact import redact

log = logging.getLogger("grayguard.prometheus")
T = TypeVar("T")


class PromError(Exception):
    """A failed query; kind is a short metric label (timeout, connect, http_4xx, http_5xx, bad_response, query).

    The message never holds a URL's userinfo (it becomes a hold reason, a log line, a rule-render error).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(redact(message))
        self.kind = kind


class Sample(NamedTuple):
    """One series of an answer. A tuple: a tick builds one per series and query (180,000 at 10,000 nodes), and
    _plain_vector builds them with tuple.__new__ at a fifth of a frozen dataclass's cost (3 ms against 16 for
    10,000)."""

    labels: dict[str, str]
    value: float  # may be NaN or Inf: callers decide (they treat both as no data)
    timestamp: float


_sample = partial(tuple.__new__, Sample)  # Sample from one (labels, value, timestamp) tuple, without __new__'s call


def _parse_value(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]  # "NaN", "+Inf", "-Inf" parse as floats
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: a JSON integer beyond any float
        raise PromError("bad_response", f"unparseable sample value {str(v)[:80]!r}") from e


def _parse_time(v: object) -> float:
    t = _parse_value(v)
    if not math.isfinite(t):
        raise PromError("bad_response", f"sample timestamp {str(v)[:80]!r} is not a finite number")
    return t


def _parse_labels(m: object) -> dict[str, str]:
    """A series' label set: string names to string values (the tick keys series by it)."""
    if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
        raise PromError("bad_response", f"malformed label set {str(m)[:120]!r}")
    return dict(m)


def _pair(p: object) -> tuple[float, float]:
    """A [timestamp, "value"] pair."""
    if not isinstance(p, list) or len(p) != 2:
        raise PromError("bad_response", f"malformed sample {str(p)[:120]!r}")
    return _parse_time(p[0]), _parse_value(p[1])


def _element(item: object) -> Sample:
    """One element of a vector result, every check made one by one: the classified error names what is wrong."""
    if not isinstance(item, dict) or "value" not in item:
        raise PromError("bad_response", f"malformed vector element {str(item)[:120]!r}")
    ts, val = _pair(item["value"])
    return Sample(_parse_labels(item.get("metric", {})), val, ts)


def _vector(result: list) -> list[Sample]:
    """A vector result's Samples, element by element: the classified error names the first bad one."""
    return [_element(item) for item in result]


class _Element(msgspec.Struct, kw_only=True):
    metric: dict[str, str] = msgspec.field(default_factory=dict)  # absent: no labels, as the general path takes it
    value: tuple[float, str]


class _VectorData(msgspec.Struct):
    resultType: Literal["vector"]
    result: list[_Element]


class _VectorAnswer(msgspec.Struct):
    status: Literal["success"]
    data: _VectorData


_VECTOR = msgspec.json.Decoder(_VectorAnswer)


def decode_instant(body: bytes) -> list[Sample]:
    """An instant query's Samples from its answer's bytes.

    A successful vector answer, the tick's every answer, is decoded to typed elements by msgspec in one pass in C: the
    answer's shape, every label a str to str, every pair a number and a string. Its values then go through float(),
    as the general path's do (Prometheus writes NaN and +Inf as strings). Anything else, an error answer, a scalar, a
    malformed element or a non-finite timestamp, goes the general path (json, then _instant), which gives the same
    Samples or raises the classified error naming what is wrong. At 10,000 series an answer decodes in half the time
    of json.loads and the checks (docs/benchmarks.md, "Decoding Prometheus' answers")."""
    try:
        answer = _VECTOR.decode(body)
        samples = [_sample((e.metric, float(e.value[1]), e.value[0])) for e in answer.data.result]
    except (msgspec.DecodeError, ValueError):  # ValidationError is a DecodeError; ValueError: float() of a value
        return _instant(answer_data(body))
    if not all(math.isfinite(e.value[0]) for e in answer.data.result):
        return _instant(answer_data(body))
    return samples


def answer_data(body: bytes) -> dict:
    """The data object of a successful answer's body; PromError when it is not JSON, not a success, or has none."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser goes
        text = body.decode("utf-8", "replace")
        raise PromError("bad_response", f"Prometheus answered non-JSON: {text[:120]!r}") from e
    if not isinstance(doc, dict) or doc.get("status") != "success":
        err = doc.get("error") if isinstance(doc, dict) else doc
        raise PromError("query", f"Prometheus query failed: {err}")
    data = doc.get("data")
    if not isinstance(data, dict):
        raise PromError("bad_response", "Prometheus answer has no data object")
    return data


def build_session_headers(cfg: PrometheusConfig, environ: Mapping[str, str]) -> tuple[dict, tuple | None]:
    """Headers and basic auth from config and environment; a named but unset variable is a ConfigError."""

    def env(var: str, path: str) -> str:
        if var not in environ:
            raise ConfigError(path, f"environment variable {var} is not set")
        return environ[var]

    headers = dict(cfg.headers)
    for header, var in cfg.headers_env.items():
        headers[header] = env(var, f"prometheus.headers_env.{header}")
    if cfg.bearer_token_env:
        headers["Authorization"] = "Bearer " + env(cfg.bearer_token_env, "prometheus.bearer_token_env")
    if cfg.bearer_token_file:
        try:
            headers["Authorization"] = "Bearer " + read_token_file(cfg.bearer_token_file)
        except (OSError, ValueError) as e:
            raise ConfigError("prometheus.bearer_token_file", str(e)) from None
    auth = None
    if cfg.basic_auth_user_env or cfg.basic_auth_password_env:
        if not (cfg.basic_auth_user_env and cfg.basic_auth_password_env):
            raise ConfigError("prometheus.basic_auth_user_env", "basic auth needs both the user and password env")
        auth = (env(cfg.basic_auth_user_env, "prometheus.basic_auth_user_env"),
                env(cfg.basic_auth_password_env, "prometheus.basic_auth_password_env"))
    return headers, auth


def read_token_file(path: str, strip: str | None = None) -> str:
    """The secret in path (a bearer token, an etcd password) with the characters in strip (default: whitespace)
    taken off both ends; OSError or ValueError (not UTF-8, empty) otherwise."""
    try:
        token = Path(path).read_text().strip(strip)
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {path}: not UTF-8 text") from None
    except OSError as e:
        raise OSError(e.errno, f"cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def tls_settings(cfg: PrometheusConfig) -> tuple[bool | str, str | tuple[str, str] | None]:
    """requests' (verify, cert) for cfg: the CA file, the client certificate and key (mutual TLS).

    Each file is loaded once here, so a missing file, a key that does not match its certificate or an
    encrypted key (OpenSSL would prompt on the terminal) is a ConfigError at startup, not an error every tick.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    verify: bool | str = cfg.verify_tls
    if cfg.ca_file and cfg.verify_tls:
        try:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError("prometheus.ca_file", f"cannot load CA file {cfg.ca_file}: {e}") from None
        verify = cfg.ca_file
    cert: str | tuple[str, str] | None = None
    if cfg.cert_file:
        try:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file, password=lambda: b"")
        except (OSError, ssl.SSLError) as e:
            key_unreadable = cfg.key_file is not None and not os.access(cfg.key_file, os.R_OK)
            where = "prometheus.key_file" if key_unreadable else "prometheus.cert_file"
            raise ConfigError(where, f"cannot load the client certificate {cfg.cert_file}"
                              f"{' with key ' + cfg.key_file if cfg.key_file else ''}: {e} "
                              "(the key must not be encrypted)") from None
        cert = (cfg.cert_file, cfg.key_file) if cfg.key_file else cfg.cert_file
    return verify, cert


def read_within(resp: requests.Response, deadline: float) -> bytes:
    """Read a streamed response's whole body by a monotonic deadline, or raise requests.Timeout.

    requests' timeout bounds each socket read, not the body: a server trickling a byte at a time would hold
    the caller for ever. A timer shuts the socket down at the deadline, which ends the blocked read. (The
    status line and headers, read inside session.get, are still bounded per read only.)
    """
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        with contextlib.suppress(Exception):  # not a socket (a test double), or already released
            resp.raw.shutdown()

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop)
    timer.daemon = True
    timer.start()
    try:
        body = resp.content
    except requests.RequestException as e:
        if fired.is_set():
            resp.close()
            raise requests.Timeout("the response was not read by the deadline") from None
        if e.args and isinstance(e.args[0], urllib3.exceptions.ReadTimeoutError):  # requests calls it a
            raise requests.Timeout(str(e)) from e  # ConnectionError when the body, not the headers, timed out
        raise
    finally:
        timer.cancel()
    if fired.is_set():  # the shutdown may look like a short but complete body
        resp.close()
        raise requests.Timeout("the response was not read by the deadline")
    return body


# a tick runs its optional queries at once (controller/loop.py, one thread each): the connection pool must hold them
# all, or every tick drops the connections over requests' default 10 and logs "Connection pool is full"
POOL_CONNECTIONS = 32


def pooled_session(size: int = POOL_CONNECTIONS) -> requests.Session:
    """A requests Session whose connection pool keeps `size` connections per host."""
    s = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


# URL-encoded parameters longer than this go as a POST form, which Prometheus' query API takes as well (so do Thanos,
# Mimir and VictoriaMetrics): proxies in front of it refuse long URLs (8 KiB is a common limit), and a sharded
# replica's queries name every pool it leads (controller/readscope.py)
LONG_PARAMS = 4096


class PrometheusClient:
    """Instant and range queries with a timeout."""

    def __init__(self, cfg: PrometheusConfig, session: requests.Session | None = None,
                 environ: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.base = cfg.url.rstrip("/")
        self.session = session or pooled_session()
        self.headers, self.auth = build_session_headers(cfg, os.environ if environ is None else environ)
        self.verify, self.cert = tls_settings(cfg)
        self._token_error: str | None = None
        self._decoding = threading.Lock()  # one answer decoded at a time (_ask)

    def refresh_auth(self) -> None:
        """Re-read bearer_token_file (a rotated token is used at once); an unreadable file keeps the last token."""
        if not self.cfg.bearer_token_file:
            return
        try:
            value = "Bearer " + read_token_file(self.cfg.bearer_token_file)
        except (OSError, ValueError) as e:
            if str(e) != self._token_error:  # said once per distinct problem, not every query
                log.warning("prometheus.bearer_token_file: %s; using the last token read", e)
            self._token_error = str(e)
            return
        if value != self.headers.get("Authorization"):
            # a new dict, not an update in place: concurrent queries may be reading the old one
            self.headers = {**self.headers, "Authorization": value}
        if self._token_error is not None:
            log.info("prometheus.bearer_token_file: readable again")
        self._token_error = None

    def _ask(self, path: str, params: dict, decode: Callable[[bytes], T]) -> T:
        """GET path (a POST form when its parameters are long: LONG_PARAMS); its answer's body decoded by decode
        (which raises PromError on a malformed one).

        The answers of a tick's concurrent queries are read at once but decoded and shaped one at a time (under a
        lock): the decoding is pure CPU under the GIL, and threads taking turns at it every switch interval spent
        40 % more CPU than the same work done in turn (18 answers of 10,000 series: 3.2 s against 2.3 s)."""
        url = f"{self.base}{path}"
        self.refresh_auth()
        deadline = time.monotonic() + self.cfg.timeout_s
        try:
            how = {"data": params} if len(urllib.parse.urlencode(params)) > LONG_PARAMS else {"params": params}
            resp = self.session.request("POST" if "data" in how else "GET", url, **how, headers=self.headers,
                                        auth=self.auth, timeout=self.cfg.timeout_s, verify=self.verify,
                                        cert=self.cert, stream=True)
            read_within(resp, deadline)
        except requests.Timeout as e:
            raise PromError("timeout", f"Prometheus did not answer within {self.cfg.timeout_s}s: {url}") from e
        except requests.RequestException as e:
            raise PromError("connect", f"cannot reach Prometheus at {url}: {e}") from e
        if resp.status_code >= 400:
            kind = "http_5xx" if resp.status_code >= 500 else "http_4xx"
            raise PromError(kind, f"Prometheus answered HTTP {resp.status_code}: {resp.text[:200]}")
        with self._decoding:
            return decode(resp.content)

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """Instant query; a vector result (an empty list when nothing matches)."""
        params: dict = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._ask("/api/v1/query", params, decode_instant)

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
        """Range query: [(labels, [(t, value), ...]), ...]."""
        return self._ask("/api/v1/query_range", {"query": promql, "start": start, "end": end, "step": step},
                         lambda body: _matrix(answer_data(body)))


def _instant(data: dict) -> list[Sample]:
    """An instant query's samples: a vector's, or a scalar as one sample without labels."""
    rtype, result = data.get("resultType"), data.get("result")
    if rtype == "scalar" and isinstance(result, list) and len(result) == 2:
        ts, val = _pair(result)
        return [Sample({}, val, ts)]
    if rtype != "vector" or not isinstance(result, list):
        raise PromError("bad_response", f"expected a vector, got {str(rtype)[:40]}")
    return _vector(result)


def _matrix(data: dict) -> list[tuple[dict, list]]:
    """A range query's series: [(labels, [(t, value), ...]), ...]."""
    result = data.get("result", [])
    if data.get("resultType") != "matrix" or not isinstance(result, list):
        raise PromError("bad_response", f"expected a matrix, got {str(data.get('resultType'))[:40]}")
    out = []
    for series in result:
        values = series.get("values", []) if isinstance(series, dict) else None
        if not isinstance(values, list):
            raise PromError("bad_response", f"malformed matrix series {str(series)[:120]!r}")
        out.append((_parse_labels(series.get("metric", {})), [_pair(p) for p in values]))
    return out


def finite(x: float | None) -> float | None:
    """x if it is a finite number, else None (absent is not zero)."""
    return x if x is not None and math.isfinite(x) else None
