"""The Kubernetes manifests as `kubectl kustomize` renders them, for the deploy tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml


def kustomize(path: Path) -> list[dict]:
    """The documents kustomize renders from path; fails the test without kubectl (make test installs it)."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is missing (it renders the manifests: `kubectl kustomize`)")
    p = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]
