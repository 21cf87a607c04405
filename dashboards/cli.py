"""`grayguard dashboards`: render the Grafana dashboards from the grayguard config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grayguard import flags
from grayguard.config import ConfigError, load_config
from grayguard.dashboards.config import DashboardConfig

# The builders (and grafana-foundation-sdk) are imported when a dashboard is rendered, not here: the
# `grayguard` dispatcher imports every subcommand, and a missing SDK must not break the controller's CLI.
DASHBOARDS_DIR = Path(__file__).parent
SDK_HINT = "pip install 'grafana-foundation-sdk==1769699379!11.6.0' (or reinstall grayguard)"

HELP = "render the Grafana dashboards (JSON) from the config"
DESCRIPTION = f"""\
render  writes grayguard-pool-overview.json and grayguard-gpu-health.json from the config: the recorded
        series' window suffixes (rules.control_window, rules.human_window), the peer-score thresholds
        (thresholds.quarantine_score), the live ones (live_cut_ratio, live_drift),
        job names and vLLM naming. Without --config.file the
        defaults are used (the same as grayguard.example.yaml). Files are replaced atomically, only when
        they change. --check writes nothing and exits 1 when a file would change.

Grafana loads the files from a folder with dashboards/provisioning/*.yaml; see docs/dashboards.md.

examples:
  grayguard dashboards render                               # refresh the committed JSON in {DASHBOARDS_DIR.name}/
  grayguard dashboards render --config.file grayguard.yaml --out /var/lib/grafana/dashboards/grayguard
  grayguard dashboards render --check
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dashboards_action", metavar="ACTION")
    r = sub.add_parser("render", help="render the dashboard JSON files")
    flags.renamed(r, "--config.file", "--config", dest="config", metavar="FILE",
                  help="grayguard YAML config (default: built-in defaults)")
    r.add_argument("--out", default=str(DASHBOARDS_DIR), metavar="DIR",
                   help="output directory (default: %(default)s)")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")


def run(args: argparse.Namespace) -> int:
    if args.dashboards_action != "render":
        print("grayguard dashboards: choose an action: render (see --help)", file=sys.stderr)
        return 2
    try:
        from grayguard.dashboards.render import DashboardError, changed_files, render_all, write_if_changed
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "grafana_foundation_sdk":
            raise
        print(f"grayguard: the dashboards need grafana-foundation-sdk: {SDK_HINT}", file=sys.stderr)
        return 1
    try:
        cfg = DashboardConfig.from_config(load_config(args.config)) if args.config else DashboardConfig()
        files = render_all(cfg)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    except DashboardError as e:  # a builder bug: never write a dashboard Grafana would reject
        print(f"grayguard: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    if args.check:
        stale = changed_files(out, files)
        for name in files:
            print(f"{out / name}: {'would change' if name in stale else 'up to date'}")
        return 1 if stale else 0
    try:
        changed = write_if_changed(out, files)
    except OSError as e:
        print(f"grayguard: cannot write {out}: {e}", file=sys.stderr)
        return 1
    for name in files:
        print(f"{out / name}: {'written' if name in changed else 'unchanged'}")
    return 0
