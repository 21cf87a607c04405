"""A /metrics page read by a test, as name{labels} -> value."""

from __future__ import annotations

import requests


def samples(url: str) -> dict[str, float]:
    """Every sample of the page at url, keyed by its name and labels as written (comments left out)."""
    with requests.Session() as s:
        s.trust_env = False
        text = s.get(url, timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}
