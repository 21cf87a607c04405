"""`grayguard config`: check a config file (every problem at once), or print the config's JSON Schema."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "check a config file (every problem at once), or print the config's JSON Schema"
DESCRIPTION = """\
check   reads FILE as the controller would and prints every problem, one a line (`path: problem`), then exits 2:
        types and ranges, unknown fields, a key given twice, fields that contradict each other (the signals'
        window against rules.control_window, the registry lease against the tick), and the signals' PromQL,
        parsed by promtool (rules.promtool) where it is installed. `grayguard controller --check` does the same
        and also checks the environment the config names (env vars, TLS files, the state file's directory).
schema  prints the JSON Schema (draft 2020-12) an editor validates the file with; grayguard/config.schema.json
        ships the same. A YAML language server picks it up from a first line
        `# yaml-language-server: $schema=<path or URL of config.schema.json>`.

examples:
  grayguard config check --config.file grayguard.yaml
  grayguard config schema > grayguard.schema.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="print every problem of a config file; exit 2 if there is one")
    check.add_argument("--config.file", dest="config_file", required=True, metavar="FILE", help="YAML config")
    check.add_argument("--no-promql", dest="promql", action="store_false",
                       help="do not parse the signals' PromQL with promtool")
    schema = actions.add_parser("schema", help="print the config's JSON Schema (draft 2020-12)")
    schema.add_argument("--out", metavar="FILE", default=None, help="write it to FILE instead of stdout")


def run(args: argparse.Namespace) -> int:
    if args.config_action == "schema":
        from grayguard.configschema import render

        text = render()
        if args.out:
            Path(args.out).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    from grayguard.config import ConfigError, load_config

    try:
        cfg = load_config(args.config_file, promql=args.promql)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    print(f"{args.config_file}: OK ({len(cfg.pools)} pool(s), {len(cfg.haproxy.endpoints)} HAProxy endpoint(s))")
    return 0
