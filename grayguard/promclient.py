"""Prometheus HTTP API client (works with Thanos Query and Mimir too). Errors are classified, never hidden."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import requests

from grayguard.config import ConfigError, PrometheusConfig


class PromError(Exception):
    """A failed query; kind is a short metric label (timeout, connect, http_4xx, http_5xx, bad_response, query)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float  # may be NaN or Inf: callers decide (they treat both as no data)
    timestamp: float


def _parse_value(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]  # "NaN", "+Inf", "-Inf" parse as floats
    except (TypeError, ValueError) as e:
        raise PromError("bad_response", f"unparseable sample value {v!r}") from e


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
    auth = None
    if cfg.basic_auth_user_env or cfg.basic_auth_password_env:
        if not (cfg.basic_auth_user_env and cfg.basic_auth_password_env):
            raise ConfigError("prometheus.basic_auth_user_env", "basic auth needs both the user and password env")
        auth = (env(cfg.basic_auth_user_env, "prometheus.basic_auth_user_env"),
                env(cfg.basic_auth_password_env, "prometheus.basic_auth_password_env"))
    return headers, auth


class PrometheusClient:
    """Instant and range queries with a timeout."""

    def __init__(self, cfg: PrometheusConfig, session: requests.Session | None = None,
                 environ: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.base = cfg.url.rstrip("/")
        self.session = session or requests.Session()
        self.headers, self.auth = build_session_headers(cfg, os.environ if environ is None else environ)

    def _get(self, path: str, params: dict) -> dict:
        url = f"{self.base}{path}"
        try:
            resp = self.session.get(url, params=params, headers=self.headers, auth=self.auth,
                                    timeout=self.cfg.timeout_s, verify=self.cfg.verify_tls)
        except requests.Timeout as e:
            raise PromError("timeout", f"Prometheus did not answer within {self.cfg.timeout_s}s: {url}") from e
        except requests.RequestException as e:
            raise PromError("connect", f"cannot reach Prometheus at {url}: {e}") from e
        if resp.status_code >= 400:
            kind = "http_5xx" if resp.status_code >= 500 else "http_4xx"
            raise PromError(kind, f"Prometheus answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            body = resp.json()
        except ValueError as e:
            raise PromError("bad_response", f"Prometheus answered non-JSON: {resp.text[:120]!r}") from e
        if not isinstance(body, dict) or body.get("status") != "success":
            err = body.get("error") if isinstance(body, dict) else body
            raise PromError("query", f"Prometheus query failed: {err}")
        data = body.get("data")
        if not isinstance(data, dict):
            raise PromError("bad_response", "Prometheus answer has no data object")
        return data

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """Instant query; a vector result (an empty list when nothing matches)."""
        params: dict = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        rtype, result = data.get("resultType"), data.get("result")
        if rtype == "scalar" and isinstance(result, list) and len(result) == 2:
            return [Sample({}, _parse_value(result[1]), float(result[0]))]
        if rtype != "vector" or not isinstance(result, list):
            raise PromError("bad_response", f"expected a vector, got {rtype}")
        out = []
        for item in result:
            try:
                ts, val = item["value"]
                out.append(Sample(dict(item.get("metric", {})), _parse_value(val), float(ts)))
            except (KeyError, TypeError, ValueError) as e:
                raise PromError("bad_response", f"malformed vector element {item!r}") from e
        return out

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
        """Range query: [(labels, [(t, value), ...]), ...]."""
        data = self._get("/api/v1/query_range", {"query": promql, "start": start, "end": end, "step": step})
        if data.get("resultType") != "matrix":
            raise PromError("bad_response", f"expected a matrix, got {data.get('resultType')}")
        out = []
        for series in data.get("result", []):
            pts = [(float(t), _parse_value(v)) for t, v in series.get("values", [])]
            out.append((dict(series.get("metric", {})), pts))
        return out


def finite(x: float | None) -> float | None:
    """x if it is a finite number, else None (absent is not zero)."""
    return x if x is not None and math.isfinite(x) else None
