"""The `grayguard` command: one entry point, a subcommand per component."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from grayguard import __version__, flags, logsetup, terminate

# subcommand -> module providing HELP, add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "controller": "grayguard.controller.cmd_controller",
    "actuator": "grayguard.controller.actuator",
    "replay": "grayguard.controller.replay",
    "bench-controller": "grayguard.bench.controller",
    "exporter": "grayguard.exporters.cli",
    "rules": "grayguard.rules.cli",
    "fleet": "grayguard.sim.cli_fleet",
    "loadgen": "grayguard.sim.cli_loadgen",
    "demo": "grayguard.demo.cli",
    "bench": "grayguard.bench.cli",
    "dashboards": "grayguard.dashboards.cli",
    "config": "grayguard.cmd_config",
    "api": "grayguard.cmd_api",
}

# The components the production wheel leaves out: the simulator, the benchmarks, the local stack and the demo come
# with the grayguard-dev distribution (`pip install 'grayguard[dev]'`); without it their subcommands are not offered.
DEV_PACKAGES = ("grayguard.sim", "grayguard.bench", "grayguard.localstack", "grayguard.demo")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="grayguard",
        description="Find gray failures in LLM inference fleets (alive but slow vLLM nodes) and steer "
        "HAProxy traffic away from them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    flags.alias(parser, "--log-level", logsetup.add_flags(parser))  # before the subcommand only, as it was
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    absent = []
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name in DEV_PACKAGES:  # a dev component, not installed (grayguard[dev])
                absent.append(name)
                continue
            if e.name == modname:  # a subcommand not built into this tree
                continue
            raise
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        for _path, each in flags.walk(p):  # `rules render --log.level debug` too: after the last subcommand
            logsetup.add_flags(each)
        p.set_defaults(_run=mod.run)
    if absent:
        parser.epilog = f"not installed here: {', '.join(absent)} (they come with pip install 'grayguard[dev]')"
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, set up logging (grayguard/logsetup.py), warn of deprecated flags, run the subcommand.

    SIGTERM unwinds like Ctrl-C (exit 143, grayguard/terminate.py): a command that starts processes stops every one
    of them in its `finally` and writes what it has. Commands with their own handling (controller, exporter,
    actuator) install their handlers over this one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logsetup.setup_from_args(args)
    flags.warn_deprecated(args, logging.getLogger("grayguard.cli"))
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    previous = terminate.install()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt as e:
        return terminate.exit_status(e)
    finally:
        terminate.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
