"""The flag convention every subcommand follows, and the old spellings kept for one release.

Prometheus-style: lowercase words, `-` inside a word group, `.` between namespaces (`--web.listen-address`,
`--probe.slow-threshold`, `--dry-run`); `--config.file`, `--web.listen-address`, `--log.level` and `--log.format`
mean the same on every subcommand (docs/cli.md). A renamed flag keeps its old spelling as a deprecated alias until
REMOVED_IN: hidden from --help, it still parses (into the same destination) and the command logs a warning that
names the new spelling.
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import Any

FLAG_RE = re.compile(r"--[a-z0-9]+(?:-[a-z0-9]+)*(?:\.[a-z0-9]+(?:-[a-z0-9]+)*)*")
REMOVED_IN = "0.2.0"  # the release that drops the deprecated aliases (docs/cli.md says the same)
_MARK = "_deprecated:"  # namespace attributes "_deprecated:<old>" = <new>: one per alias, so none overwrites another


class _Alias(argparse.Action):
    """An old spelling: does what the new flag's action does, and notes that the old one was used."""

    def __init__(self, option_strings: list[str], dest: str, *, target: argparse.Action, new: str, **kw: Any):
        super().__init__(option_strings, dest, **kw)
        self.target, self.new = target, new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        self.target(parser, namespace, values, option_string)
        setattr(namespace, _MARK + (option_string or self.option_strings[0]), self.new)


def alias(container: Any, old: str, target: argparse.Action) -> argparse.Action:
    """Accept `old` as a hidden, deprecated spelling of target's first flag (same destination, same value)."""
    return container.add_argument(
        old, action=_Alias, target=target, new=target.option_strings[0], dest=target.dest, nargs=target.nargs,
        const=target.const, type=target.type, choices=target.choices, metavar=target.metavar,
        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def renamed(container: Any, new: str, *old: str, required: bool = False, **kw: Any) -> argparse.Action:
    """add_argument(new, **kw) with each old spelling as a deprecated alias; returns the new flag's action.

    required: one of them must be given (a mutually exclusive group, so giving both is an error too); argparse's
    own `required` would refuse the old spelling."""
    if required:
        container = container.add_mutually_exclusive_group(required=True)
    action = container.add_argument(new, **kw)
    for o in old:
        alias(container, o, action)
    return action


def deprecated_used(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(old, new) for every deprecated spelling the command line used, in a stable order."""
    return sorted((k.removeprefix(_MARK), v) for k, v in vars(args).items() if k.startswith(_MARK))


def warn_deprecated(args: argparse.Namespace, log: logging.Logger | None = None) -> list[str]:
    """Log one warning per deprecated spelling used, naming the new one; the messages."""
    log = log or logging.getLogger("grayguard.cli")
    said = []
    for old, new in deprecated_used(args):
        msg = f"flag {old} is deprecated and will be removed in grayguard {REMOVED_IN}: use {new}"
        log.warning("%s", msg)
        said.append(msg)
    return said


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for parser and every sub-command parser below it (`rules render`: ("rules", "render"))."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))


def visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags parser shows in --help (deprecated aliases are hidden)."""
    return [s for a in parser._actions if a.help is not argparse.SUPPRESS
            for s in a.option_strings if s.startswith("--")]


def off_convention(parser: argparse.ArgumentParser) -> list[str]:
    """The visible long flags of parser that break the convention (FLAG_RE)."""
    return [s for s in visible_flags(parser) if s != "--help" and not FLAG_RE.fullmatch(s)]
