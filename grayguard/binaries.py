"""The external programs grayguard drives (promtool, amtool, prometheus, alertmanager, haproxy, etcd; chromium for the
tests of the HTML reports) and the Debian package that provides each: found on PATH, or a message that says what to
install."""

from __future__ import annotations

import shutil
from pathlib import Path

# binary -> Debian package that provides it (the Makefile's `make deps` installs these).
DEBIAN_PACKAGES = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "alertmanager": "prometheus-alertmanager",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "haproxy": "haproxy",
    "victoria-metrics": "victoria-metrics",
    "vmagent": "victoria-metrics",
    "vmalert": "victoria-metrics",
    "vmauth": "victoria-metrics",
    "etcd": "etcd-server",
    "chromium": "chromium",  # only the tests: they open the HTML reports in it
}


class BinaryMissing(FileNotFoundError):
    """A required binary is not on PATH; the message says which package provides it."""


def install_hint(binary: str) -> str:
    """`apt-get install <package>` for binary (or a generic hint)."""
    pkg = DEBIAN_PACKAGES.get(Path(binary).name)
    return f"apt-get install {pkg} (or `make deps`)" if pkg else "install it and put it on PATH"


def find_binary(*names: str) -> str:
    """Full path of the first of names found on PATH (an absolute path is taken as is), else BinaryMissing."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise BinaryMissing(f"{' or '.join(names)} not found on PATH: {install_hint(names[0])}")
