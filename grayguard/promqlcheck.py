"""The config's PromQL (the signals' queries) parsed by the real promtool, where one is installed.

promtool parses with Prometheus' own parser, so what it accepts the Prometheus the controller queries accepts. It
reads rule files, not bare expressions: each query becomes a recording rule of one generated file, named after its
field, and every rule promtool rejects is the field's problem. Without promtool the check is skipped, with a note.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from grayguard.config import Config, Problems

log = logging.getLogger("grayguard.config")
RECORD_PREFIX = "grayguard_config_check:"  # the generated rules' names: <prefix><field>
# promtool check rules: `FILE: L:C: group "G", rule N, "NAME": could not parse expression: ...`
_RULE_ERROR_RE = re.compile(r'rule \d+, "' + re.escape(RECORD_PREFIX) + r'(\w+)": (.*)$')
TIMEOUT_S = 30.0


def queries(cfg: Config) -> dict[str, str]:
    """The non-empty PromQL strings of the config, by field name (an empty optional signal is off)."""
    return {f.name: q for f in dataclasses.fields(cfg.signals)
            if isinstance(q := getattr(cfg.signals, f.name), str) and q.strip()}


def rule_file(exprs: dict[str, str]) -> str:
    """A rule file with one recording rule per query, named after its field."""
    rules = [{"record": RECORD_PREFIX + name, "expr": q} for name, q in exprs.items()]
    return yaml.safe_dump({"groups": [{"name": "grayguard-config-check", "rules": rules}]}, sort_keys=False)


def parse_problems(output: str) -> dict[str, str]:
    """promtool's complaints, by field name."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        m = _RULE_ERROR_RE.search(line.strip())
        if m:
            found.setdefault(m.group(1), m.group(2).strip())
    return found


def check_queries(cfg: Config, pr: Problems, which=shutil.which, run=subprocess.run) -> bool:
    """Record in pr each signals query promtool (rules.promtool) cannot parse; False when promtool is absent (the
    queries were not checked: said once in the log)."""
    exprs = queries(cfg)
    promtool = which(cfg.rules.promtool) if not pr.failed("rules.promtool") else None
    if promtool is None:
        log.warning("the signals' PromQL was not checked: %s is not installed (rules.promtool); Prometheus will "
                    "say at the first tick", cfg.rules.promtool)
        return False
    if not exprs:
        return True
    with tempfile.TemporaryDirectory(prefix="grayguard-config-") as d:
        f = Path(d) / "signals.rules.yml"
        f.write_text(rule_file(exprs))
        try:
            res = run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("the signals' PromQL was not checked: %s failed: %s", promtool, e)
            return False
    if res.returncode == 0:
        return True
    found = parse_problems(res.stdout + "\n" + res.stderr)
    for name, problem in found.items():
        pr.add(f"signals.{name}", f"not valid PromQL (promtool): {problem}")
    if not found:  # promtool refused the file for a reason of its own: say it, do not guess a field
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        pr.add("signals", f"promtool check rules failed (exit {res.returncode}): {tail[0]}")
    return True
