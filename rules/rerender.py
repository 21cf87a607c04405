"""Re-render the rule files from the config and learned baselines; replace and reload only on change.

The controller runs RuleRerenderer.rerender() as its own scheduler job, off the control tick (promtool may
take a minute): every rules.rerender_interval_s it queries Prometheus for each pool's learned P99 TTFT,
renders, and when a file's content differs it writes a temp file, checks it with promtool (when installed),
atomically replaces the old file and POSTs the reload URL once (rules.reload_url; none for Mimir or Thanos,
which have no /-/reload). A render that fails the check never replaces the good file. A reload URL that
answers 404 or 405 does not exist: it is logged once and not tried again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from grayguard.config import Config
from grayguard.promclient import PromError, PrometheusClient, read_within
from grayguard.redact import redact, redact_url
from grayguard.rules.render import baseline_query, render_all

log = logging.getLogger("grayguard.rules")
NO_RELOAD = ("", "none")  # rules.reload_url values that switch the reload off
GONE = (404, 405)  # the reload endpoint does not exist (Mimir, Thanos) or takes no POST: retrying cannot help


class RuleFileError(Exception):
    """A rendered rule file failed validation; nothing was replaced."""


@dataclass(frozen=True)
class Result:
    """What one re-render did."""

    changed: bool  # at least one rule file was replaced
    reloaded: bool  # Prometheus acknowledged /-/reload
    error: str | None = None  # why it stopped early (the good files stay in place)
    files: tuple[str, ...] = ()  # names of the replaced files
    reload_error: str | None = None  # the reload failed: not_found (404/405: never retried), http or connect


def fetch_baselines(client: PrometheusClient, cfg: Config) -> dict[str, float]:
    """pool -> learned P99 TTFT seconds (finite values only); PromError when Prometheus fails."""
    out = {}
    for s in client.query(baseline_query(cfg)):
        pool = s.labels.get("pool")
        if pool and math.isfinite(s.value):
            out[pool] = s.value
    return out


def check_rule_files(paths: list[Path], promtool: str | None) -> None:
    """Raise RuleFileError unless every file is a YAML rule-group document that promtool accepts.

    Without promtool (not installed) only the YAML shape is checked.
    """
    for p in paths:
        try:
            doc = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise RuleFileError(f"{p.name}: not valid YAML: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
            raise RuleFileError(f"{p.name}: not a rule file (no `groups:` list)")
    if not promtool:
        return
    binary = shutil.which(promtool)
    if not binary:
        log.warning("promtool %r not found: rule files checked as YAML only", promtool)
        return
    try:
        proc = subprocess.run([binary, "check", "rules", "--lint-fatal", *map(str, paths)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuleFileError(f"promtool check rules could not run: {e}") from e
    if proc.returncode != 0:
        raise RuleFileError(f"promtool check rules failed:\n{(proc.stdout + proc.stderr).strip()}")


def write_if_changed(out_dir: str | os.PathLike[str], files: Mapping[str, str], promtool: str | None) -> list[str]:
    """Replace the files whose content differs, after checking them all; return the replaced names.

    Temp files sit next to their targets (same file system, so os.replace is atomic) and end in
    .tmp, so a Prometheus rule_files glob such as *.yml never loads them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    changed = {}
    for name, text in files.items():
        try:
            current = (out / name).read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            changed[name] = text
    if not changed:
        return []
    temps = {name: out / f".{name}.{os.getpid()}.tmp" for name in changed}
    try:
        for name, text in changed.items():
            with open(temps[name], "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temps[name], 0o644)  # Prometheus may run as another user
        check_rule_files(list(temps.values()), promtool)
        for name in changed:
            os.replace(temps[name], out / name)
    finally:
        for t in temps.values():
            t.unlink(missing_ok=True)
    return sorted(changed)


class RuleRerenderer:
    """Level-triggered rule re-rendering: render, compare with disk, replace and reload on change."""

    def __init__(self, cfg: Config, out_dir: str | os.PathLike[str] | None = None,
                 prometheus_url: str | None = None, session: requests.Session | None = None,
                 promtool: str | None = None, clock: Callable[[], float] = time.monotonic,
                 reload_url: str | None = None,
                 render: Callable[[Config, Mapping[str, float]], dict[str, str]] = render_all,
                 environ: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.out_dir = Path(out_dir if out_dir is not None else cfg.rules.output_dir)
        self.prometheus_url = (prometheus_url or cfg.prometheus.url).rstrip("/")
        self.session = session if session is not None else requests.Session()
        self.promtool = promtool if promtool is not None else cfg.rules.promtool
        self.clock = clock
        wanted = reload_url if reload_url is not None else cfg.rules.reload_url
        # None: Prometheus' own /-/reload; "" or "none": no reload (the rules are loaded some other way)
        self.reload_url: str | None = (None if wanted in NO_RELOAD else
                                       wanted or f"{self.prometheus_url}/-/reload")
        self.reload_gone = False  # the reload URL answered 404/405: it does not exist, never POSTed again
        self.render = render
        self.client = PrometheusClient(dataclasses.replace(cfg.prometheus, url=self.prometheus_url),
                                       session=self.session, environ=environ)
        self.interval_s = cfg.rules.rerender_interval_s
        self.last_attempt: float | None = None
        self.reload_pending = False  # a replaced file Prometheus has not loaded yet
        self.last_reload_error = "http"  # the kind of the last failed reload: connect, http or not_found
        self.baselines: dict[str, float] = {}

    def due(self, now: float) -> bool:
        """True when a re-render is due (the first call always is, unless the interval is 0)."""
        if self.interval_s <= 0:
            return False
        return self.last_attempt is None or now - self.last_attempt >= self.interval_s

    def maybe_rerender(self, now: float | None = None) -> Result:
        """Re-render when due; otherwise do nothing and return Result(False, False)."""
        now = self.clock() if now is None else now
        if not self.due(now):
            return Result(False, False)
        self.last_attempt = now
        return self.rerender()

    def rerender(self) -> Result:
        """Query baselines, render, replace changed files, reload; errors are returned, never raised."""
        try:
            baselines = fetch_baselines(self.client, self.cfg)
        except PromError as e:
            # Without baselines the regression alerts would vanish: keep the current files instead.
            return Result(False, False, f"baseline query failed ({e.kind}): {e}")
        try:
            files = self.render(self.cfg, baselines)
        except Exception as e:  # a template bug or bad override must not stop the controller
            return Result(False, False, f"render failed: {e}")
        try:
            changed = write_if_changed(self.out_dir, files, self.promtool)
        except (RuleFileError, OSError) as e:
            return Result(False, False, f"rules not replaced: {e}")
        self.baselines = dict(baselines)
        if changed:
            log.info("rule files changed: %s (baselines %s)", ", ".join(changed), baselines)
            self.reload_pending = True
        if self.reload_url is None or self.reload_gone:
            self.reload_pending = False  # nothing to reload through: the files are in place
            return Result(bool(changed), False, None, tuple(changed))
        if not self.reload_pending:
            return Result(False, False)
        error = self.reload()
        return Result(bool(changed), error is None, error, tuple(changed),
                      None if error is None else self.last_reload_error)

    def reload(self) -> str | None:
        """POST the reload URL once; None on success, else the error (retried on the next re-render, but a
        404 or 405 means there is no such endpoint: logged once, never retried)."""
        if self.reload_url is None:
            return None
        shown = redact_url(self.reload_url)
        self.client.refresh_auth()  # a rotated bearer_token_file
        deadline = time.monotonic() + self.cfg.prometheus.timeout_s  # one deadline for the whole call
        try:
            resp = self.session.post(self.reload_url, headers=self.client.headers, auth=self.client.auth,
                                     timeout=self.cfg.prometheus.timeout_s, verify=self.client.verify,
                                     cert=self.client.cert, stream=True)
            read_within(resp, deadline)
        except requests.RequestException as e:
            self.last_reload_error = "connect"
            return redact(f"reload failed: {e}")
        if resp.status_code in GONE:  # said once: the next re-renders do not POST again
            self.reload_gone = True
            self.reload_pending = False
            self.last_reload_error = "not_found"
            return (f"reload failed: HTTP {resp.status_code} from {shown}: there is no reload endpoint there "
                    "(Mimir and Thanos have none); not trying again. Set rules.reload_url to the Prometheus "
                    "that loads the rule files, or to none when they are loaded some other way")
        if resp.status_code >= 300:
            self.last_reload_error = "http"
            return redact(f"reload failed: HTTP {resp.status_code} from {shown}: {resp.text[:200]}")
        self.reload_pending = False
        log.info("Prometheus reloaded its rules (%s)", shown)
        return None
