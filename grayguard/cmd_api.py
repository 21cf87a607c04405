"""`grayguard api`: print the JSON Schemas of the controller's stable documents (/status, the desired state)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "print the JSON Schema of the controller's /status or of the desired-state document (docs/api.md)"
DESCRIPTION = """\
schema status    the controller's /status document, version 1 (grayguard/schemas/status.v1.json ships the same)
schema desired   the desired-state document the leader puts in etcd for the actuators
                 (<prefix>/desired/<pool>; grayguard/schemas/desired.v1.json)

Both are JSON Schema draft 2020-12 and stable within their major version: docs/api.md says what may change.

examples:
  grayguard api schema status > status.v1.json
  grayguard api schema desired --out desired.v1.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="api_action", metavar="ACTION", required=True)
    schema = actions.add_parser("schema", help="print a document's JSON Schema (draft 2020-12)")
    schema.add_argument("document", choices=("status", "desired"), help="which document")
    schema.add_argument("--out", metavar="FILE", default=None, help="write it to FILE instead of stdout")


def run(args: argparse.Namespace) -> int:
    from grayguard.verdict import render

    text = render(args.document)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
