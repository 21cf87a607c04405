"""One flag convention on every subcommand (docs/cli.md): the names, the shared logging flags after the subcommand,
the deprecated spellings that still parse and warn, and the two log formats."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grayguard import flags, logsetup
from grayguard.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "grayguard.example.yaml")
PARSER = build_parser()
ALL = list(flags.walk(PARSER))
LEAVES = [(path, p) for path, p in ALL if path and not any(
    isinstance(a, argparse._SubParsersAction) for a in p._actions)]  # `rules render`, `controller`, ...
# what reads a config file, and what serves HTTP: each takes the common flag
CONFIG_FILE = {("controller",), ("replay",), ("rules", "render"), ("rules", "shards"), ("dashboards", "render"),
               ("config", "check")}
LISTEN = {("controller",), ("exporter",), ("actuator",)}


def names(leaves):
    return [" ".join(path) for path, _ in leaves]


def required_argv(p: argparse.ArgumentParser) -> list[str]:
    """The fewest arguments p accepts: a value for each required flag, one member of each required group."""
    argv: list[str] = []

    def value(a: argparse.Action) -> list[str]:
        if a.nargs == 0:
            return []
        return [str(sorted(a.choices)[0]) if a.choices else "1"]
    for g in p._mutually_exclusive_groups:
        if g.required:
            a = next(a for a in g._group_actions if a.help is not argparse.SUPPRESS)
            argv += [a.option_strings[0], *value(a)]
    for a in p._actions:
        if a.required and a.option_strings:
            argv += [a.option_strings[0], *value(a)]
        elif not a.option_strings and not isinstance(a, argparse._SubParsersAction):
            argv += value(a)
    return argv


def test_the_walk_sees_every_subcommand_and_its_actions():
    got = names(LEAVES)
    for expected in ("controller", "actuator", "replay", "exporter", "rules render", "rules check", "rules shards",
                     "dashboards render"):
        assert expected in got


@pytest.mark.parametrize("path,p", ALL, ids=["grayguard", *names(ALL[1:])])
def test_every_long_flag_follows_the_convention(path, p):
    assert flags.off_convention(p) == [], f"grayguard {' '.join(path)}: lowercase words, '-' inside a word group, " \
                                          "'.' between namespaces (grayguard/flags.py FLAG_RE)"


def test_the_convention_rejects_what_it_should():
    for bad in ("--listen_address", "--Config", "--log.Level", "--web..listen", "--dry-run-", "--x.-y"):
        assert not flags.FLAG_RE.fullmatch(bad), bad
    for good in ("--web.listen-address", "--dry-run", "--no-collector.nvml.xid", "--probe.slow-threshold"):
        assert flags.FLAG_RE.fullmatch(good), good


@pytest.mark.parametrize("path,p", LEAVES, ids=names(LEAVES))
def test_log_flags_are_accepted_after_every_subcommand(path, p):
    assert {"--log.level", "--log.format"} <= set(flags.visible_flags(p))
    for level, fmt in (("debug", "json"), ("INFO", "logfmt"), ("Warning", "JSON"), ("error", "logfmt")):
        args = PARSER.parse_args([*path, *required_argv(p), "--log.level", level, f"--log.format={fmt}"])
        assert logsetup.chosen(args) == (level.lower(), fmt.lower())
    args = PARSER.parse_args([*path, *required_argv(p)])
    assert logsetup.chosen(args) == ("info", "logfmt")  # the defaults


def test_the_common_flags_are_where_they_belong():
    by_path = dict(ALL)
    for path in CONFIG_FILE:
        if path in by_path:  # `config` (grayguard/cmd_config.py) where this tree has it
            assert "--config.file" in flags.visible_flags(by_path[path]), path
    for path in LISTEN:
        assert "--web.listen-address" in flags.visible_flags(by_path[path]), path
    assert ("controller",) in by_path and ("rules", "render") in by_path


def test_a_bad_level_or_format_is_refused(capsys):
    for argv in (["exporter", "--log.level", "loud"], ["exporter", "--log.format", "text"]):
        with pytest.raises(SystemExit) as e:
            PARSER.parse_args(argv)
        assert e.value.code == 2
    assert "not a log format: 'text' (logfmt or json)" in capsys.readouterr().err


@pytest.mark.parametrize("argv,dest,value,old,new", [
    (["controller", "--config", "c.yaml"], "config", "c.yaml", "--config", "--config.file"),
    (["controller", "--config.file", "c.yaml", "--listen-address", ":9"], "listen_address", ":9",
     "--listen-address", "--web.listen-address"),
    (["replay", "--config", "c.yaml", "--trace", "t.csv"], "config", "c.yaml", "--config", "--config.file"),
    (["rules", "render", "--config", "c.yaml"], "config", "c.yaml", "--config", "--config.file"),
    (["rules", "shards", "--config", "c.yaml", "--shards", "2"], "config", "c.yaml", "--config", "--config.file"),
    (["dashboards", "render", "--config", "c.yaml"], "config", "c.yaml", "--config", "--config.file"),
    (["--log-level", "DEBUG", "exporter"], "log_level", "debug", "--log-level", "--log.level"),
])
def test_a_deprecated_spelling_still_parses_and_warns(argv, dest, value, old, new, caplog):
    args = PARSER.parse_args(argv)
    assert getattr(args, dest) == value
    assert flags.deprecated_used(args) == [(old, new)]
    with caplog.at_level(logging.WARNING, logger="grayguard.cli"):
        said = flags.warn_deprecated(args)
    assert said == [f"flag {old} is deprecated and will be removed in grayguard {flags.REMOVED_IN}: use {new}"]
    assert said[0] in caplog.text
    assert flags.deprecated_used(PARSER.parse_args([a if a != old else new for a in argv])) == []


def test_deprecated_spellings_are_hidden_from_help():
    by_path = dict(ALL)
    help_text = "".join(p.format_help() for p in by_path.values())
    assert not re.search(r"--config(?![.\w-])|--listen-address|--log-level", help_text)


def test_a_required_flag_is_required_in_either_spelling(capsys):
    with pytest.raises(SystemExit):
        PARSER.parse_args(["controller", "--check"])
    assert "--config.file is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # both spellings at once: which one is meant?
        PARSER.parse_args(["controller", "--config", "a", "--config.file", "b"])


def grayguard(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grayguard.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_the_command_warns_of_a_deprecated_flag_and_runs():
    p = grayguard("controller", "--config", EXAMPLE, "--check")
    assert p.returncode == 0, p.stderr
    assert "OK" in p.stdout
    assert re.search(r'^ts=\S+ level=warning logger=grayguard.cli msg="flag --config is deprecated and will be '
                     r'removed in grayguard \S+: use --config.file"$', p.stderr, re.M), p.stderr


def test_json_logs_are_one_object_a_line():
    p = grayguard("controller", "--listen-address", "127.0.0.1:1", "--config.file", EXAMPLE, "--check",
                  "--log.format=json", "--log.level", "debug")
    assert p.returncode == 0, p.stderr
    docs = [json.loads(line) for line in p.stderr.splitlines()]  # every line: one JSON object
    assert docs and all({"ts", "level", "logger", "msg"} <= set(d) for d in docs)
    assert {"level": "warning", "logger": "grayguard.cli", "msg": "flag --listen-address is deprecated and will be "
            f"removed in grayguard {flags.REMOVED_IN}: use --web.listen-address"}.items() <= docs[0].items()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", docs[0]["ts"])


def record(msg: str, *args, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad value\nsecond line")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("grayguard.test", logging.ERROR, __file__, 1, msg, args, exc_info)


def test_json_carries_the_exception_text():
    doc = json.loads(logsetup.JsonFormatter().format(record("tick %s failed", 7, exc=True)))
    assert doc["msg"] == "tick 7 failed" and doc["level"] == "error" and doc["logger"] == "grayguard.test"
    assert "ValueError: bad value\nsecond line" in doc["exc"] and "Traceback" in doc["exc"]
    assert "exc" not in json.loads(logsetup.JsonFormatter().format(record("fine")))


def test_logfmt_quotes_what_needs_quoting_on_one_line():
    line = logsetup.LogfmtFormatter().format(record('pool=chat said "hi"\tand\\left', exc=True))
    assert "\n" not in line
    assert re.fullmatch(r'ts=\S+ level=error logger=grayguard.test msg="pool=chat said \\"hi\\"\\tand\\\\left" '
                        r'exc="Traceback.*ValueError: bad value\\nsecond line"', line), line
    assert logsetup.logfmt_value("plain") == "plain" and logsetup.logfmt_value("") == '""'
    assert logsetup.logfmt_value("a=b") == '"a=b"' and logsetup.logfmt_value("\x01") == '"\\u0001"'


def test_setup_replaces_its_own_handler_and_leaves_a_foreign_one_alone():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers[:] = []
        out = io.StringIO()
        logsetup.setup("Debug", "json", out)
        logsetup.setup("warning", "json", out)  # again: still one handler, the new level
        assert len(root.handlers) == 1 and root.level == logging.WARNING
        logging.getLogger("grayguard.x").info("not shown")
        logging.getLogger("grayguard.x").warning("shown")
        assert [json.loads(s)["msg"] for s in out.getvalue().splitlines()] == ["shown"]
        foreign = logging.NullHandler()
        root.handlers[:] = [foreign]
        logsetup.setup("debug", "logfmt", out)
        assert root.handlers == [foreign]
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
