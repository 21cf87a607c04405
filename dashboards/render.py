"""Render every dashboard to JSON text (pure), and write the files that changed (atomically)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from grayguard.dashboards import gpu, pool
from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.lint import link_problems, problems

DASHBOARDS_DIR = Path(__file__).parent
# file name -> builder; the names are what the provisioning folder and docs/dashboards.md list.
BUILDERS: dict[str, Callable[[DashboardConfig], dict]] = {
    "grayguard-pool-overview.json": pool.build,
    "grayguard-gpu-health.json": gpu.build,
}


class DashboardError(ValueError):
    """A rendered dashboard breaks Grafana's model (a bug in a builder)."""


def to_text(doc: dict) -> str:
    """Stable JSON text: sorted keys, two-space indent, trailing newline (diffs stay small)."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all(cfg: DashboardConfig | None = None) -> dict[str, str]:
    """Every dashboard: file name -> JSON text. Raises DashboardError when one breaks the model or a link or a
    variable does not resolve."""
    cfg = cfg or DashboardConfig()
    docs = {}
    for name, build in BUILDERS.items():
        doc = build(cfg)
        bad = problems(doc)
        if bad:
            raise DashboardError(f"{name}: " + "; ".join(bad))
        docs[name] = doc
    bad = link_problems(docs)  # a link or variable that does not resolve is a builder bug too
    if bad:
        raise DashboardError("; ".join(bad))
    return {name: to_text(doc) for name, doc in docs.items()}


def changed_files(out_dir: Path, files: Mapping[str, str]) -> list[str]:
    """Names whose file in out_dir is missing or differs."""
    return [n for n, text in files.items() if not (out_dir / n).is_file() or (out_dir / n).read_text() != text]


def write_if_changed(out_dir: Path, files: Mapping[str, str]) -> list[str]:
    """Write the files that differ (temp file + rename, so Grafana never reads half a file); the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = changed_files(out_dir, files)
    for name in changed:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(files[name])
            os.chmod(tmp, 0o644)
            os.replace(tmp, out_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return changed
