"""Keep secrets out of logs, errors, metrics and /status: URL userinfo (`user:password@`) is masked.

`http://user:pass@prom:9090` is a valid Prometheus URL (requests turns the userinfo into basic auth), so
the password would otherwise show in every "cannot reach Prometheus at ..." hold reason and log line.
Every URL grayguard logs, puts into an error or a hold reason, exports or serves goes through redact().
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://userinfo@ : the userinfo runs to the last '@' before the host ends (/, ?, #, whitespace or a quote),
# so an unencoded '@' inside a password is masked too.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s'\"<>]*@")


def redact(text: str) -> str:
    """text with the userinfo of every URL in it replaced by ***; text without one comes back unchanged."""
    return _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)


def redact_url(url: str | None) -> str | None:
    """A URL fit to show: `http://user:pass@host/x` -> `http://***@host/x` (None stays None).

    A value without a scheme (a malformed URL quoted in a config error) loses its userinfo too:
    `user:pass@host:8000` -> `***@host:8000`.
    """
    if url is None:
        return None
    shown = redact(url)
    if "://" not in shown:
        authority, sep, rest = shown.partition("/")
        if "@" in authority:
            shown = MASK + "@" + authority.rpartition("@")[2] + sep + rest
    return shown
