"""Logging for every `grayguard` subcommand: the --log.level and --log.format flags and the two line formats.

logfmt (the default, as Prometheus' own binaries write it) is one record a line of key=value pairs:

    ts=2024-05-01T12:00:00.123Z level=info logger=grayguard.controller msg="controller running: tick every 5s"

json is one JSON object a line, {"ts", "level", "logger", "msg"} and "exc" (the traceback) when there is one, for
a log pipeline that parses JSON. Both keep a record on one line: a traceback is escaped into it, not printed after,
so a collector never splits one record into several.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("logfmt", "json")
DEFAULT_LEVEL = "info"
DEFAULT_FORMAT = "logfmt"
_ALIASES = {"warn": "warning"}  # Prometheus says warn, Python says warning: both mean the same


def parse_level(text: str) -> str:
    """The level named in any case ("debug", "INFO", "Warning", "warn"), lowercase; ArgumentTypeError otherwise."""
    level = _ALIASES.get(text.strip().lower(), text.strip().lower())
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(f"not a log level: {text!r} (one of {', '.join(LEVELS)}, any case)")
    return level


def parse_format(text: str) -> str:
    """logfmt or json, any case; ArgumentTypeError otherwise."""
    fmt = text.strip().lower()
    if fmt not in FORMATS:
        raise argparse.ArgumentTypeError(f"not a log format: {text!r} (logfmt or json)")
    return fmt


def add_flags(p: argparse.ArgumentParser) -> argparse.Action:
    """--log.level and --log.format on p; returns --log.level's action. Their default is SUPPRESS: a subcommand's
    parser that does not see the flag leaves what the top-level parser set (argparse copies a subparser's defaults
    over its parent's)."""
    g = p.add_argument_group("logging")
    level = g.add_argument("--log.level", dest="log_level", type=parse_level, default=argparse.SUPPRESS,
                           metavar="LEVEL", help=f"only log messages at this level or above: {', '.join(LEVELS)}, "
                           f"any case (default {DEFAULT_LEVEL})")
    g.add_argument("--log.format", dest="log_format", type=parse_format, default=argparse.SUPPRESS,
                   metavar="FORMAT", help=f"logfmt (key=value) or json (one object a line) (default {DEFAULT_FORMAT})")
    return level


def chosen(args: argparse.Namespace) -> tuple[str, str]:
    """(level, format) the parsed flags ask for, the defaults where none was given."""
    level = getattr(args, "log_level", None) or DEFAULT_LEVEL
    return parse_level(level), getattr(args, "log_format", None) or DEFAULT_FORMAT


def _ts(record: logging.LogRecord) -> str:
    """RFC 3339 UTC with milliseconds, as Prometheus' logs have it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _exc_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    parts = []
    if record.exc_info:
        parts.append(formatter.formatException(record.exc_info))
    if record.stack_info:
        parts.append(formatter.formatStack(record.stack_info))
    return "\n".join(parts) or None


def logfmt_value(value: str, *, force_quotes: bool = False) -> str:
    """value as logfmt writes it: bare when it is one plain token, else double-quoted with \\, ", newlines and
    other control characters escaped."""
    if value and not force_quotes and all(c > " " and c not in '="\\' for c in value):
        return value
    out = []
    for c in value:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        elif c < " " or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


class LogfmtFormatter(logging.Formatter):
    """ts=... level=... logger=... msg="..." [exc="..."], one record a line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = [f"ts={_ts(record)}", f"level={record.levelname.lower()}", f"logger={logfmt_value(record.name)}",
                  f"msg={logfmt_value(record.getMessage(), force_quotes=True)}"]
        exc = _exc_text(self, record)
        if exc:
            fields.append(f"exc={logfmt_value(exc)}")
        return " ".join(fields)


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "msg"[, "exc"]}, one object a line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": _ts(record), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        exc = _exc_text(self, record)
        if exc:
            doc["exc"] = exc
        return json.dumps(doc, ensure_ascii=False)


class _Handler(logging.StreamHandler):
    """Ours, so that a second setup() replaces it rather than adding another."""


def setup(level: str = DEFAULT_LEVEL, fmt: str = DEFAULT_FORMAT, stream: TextIO | None = None) -> None:
    """Send the root logger's records at level and above to stream (default stderr) in fmt.

    Like logging.basicConfig, it leaves a root logger alone that someone else already gave a handler (pytest's
    log capture, an embedding program): their output is theirs to format."""
    root = logging.getLogger()
    others = [h for h in root.handlers if not isinstance(h, _Handler)]
    if others:
        return
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if parse_format(fmt) == "json" else LogfmtFormatter())
    root.addHandler(handler)
    root.setLevel(parse_level(level).upper())


def setup_from_args(args: argparse.Namespace, default_level: str = DEFAULT_LEVEL) -> None:
    """setup() with what --log.level and --log.format say (default_level where no level was given)."""
    level = getattr(args, "log_level", None) or default_level
    setup(level, getattr(args, "log_format", None) or DEFAULT_FORMAT)
