"""`grayguard rules`: render the Prometheus rules from the config, and check them with promtool."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import requests
import yaml

from grayguard import flags
from grayguard.binaries import install_hint
from grayguard.config import ConfigError, load_config
from grayguard.promclient import PromError, PrometheusClient
from grayguard.rules import shards
from grayguard.rules.render import recording_rule_names, render_all
from grayguard.rules.rerender import RuleFileError, fetch_baselines, write_if_changed

RULES_DIR = Path(__file__).parent

HELP = "render the Prometheus recording/alert rules from the config, or check them with promtool"
DESCRIPTION = """\
render  writes grayguard-recording.rules.yml and grayguard-alerts.rules.yml from the config (omega,
        windows, job names, thresholds). With --prometheus-baselines it first asks Prometheus for each
        pool's learned P99 time to first token and adds a regression alert per pool. Files are
        checked with promtool (when installed) and replaced atomically, only when they change.
check   runs `promtool check rules` on every *.rules.yml, `promtool test rules` on tests/*.test.yml,
        `promtool check config` on prometheus*.yml and `amtool check-config` on alertmanager*.yml
        of a rules directory.
shards  splits the config's pools over N Prometheus servers by Prometheus' own hashmod of the pool
        label, and prints each shard's pools (what its controllers list), the relabel_configs its
        Prometheus adds to every grayguard scrape job, and a warning for a shard without pools
        (docs/operations.md, "Sharding"; rules/shards.py).

examples:
  grayguard rules render --config.file grayguard.yaml --out /etc/prometheus/rules
  grayguard rules render --config.file grayguard.yaml --out rules --prometheus-baselines
  grayguard rules check
  grayguard rules shards --config.file grayguard.yaml --shards 2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="rules_action", metavar="ACTION")
    r = sub.add_parser("render", help="render rule files from the config")
    flags.renamed(r, "--config.file", "--config", required=True, dest="config", metavar="FILE",
                  help="YAML config (see grayguard.example.yaml)")
    r.add_argument("--out", metavar="DIR", help="output directory (default: rules.output_dir of the config)")
    r.add_argument("--prometheus-baselines", action="store_true",
                   help="query prometheus.url for learned per-pool TTFT baselines (regression alerts)")
    r.add_argument("--promtool", metavar="BIN", help="promtool binary (default: rules.promtool of the config)")
    c = sub.add_parser("check", help="promtool check/test the rules, amtool check the Alertmanager example")
    c.add_argument("--dir", default=str(RULES_DIR), metavar="DIR",
                   help="rules directory with *.rules.yml and tests/*.test.yml (default: %(default)s)")
    c.add_argument("--promtool", default="promtool", metavar="BIN")
    c.add_argument("--amtool", default="amtool", metavar="BIN")
    s = sub.add_parser("shards", help="split the pools over N Prometheus servers (hashmod of the pool label)")
    flags.renamed(s, "--config.file", "--config", required=True, dest="config", metavar="FILE",
                  help="YAML config listing every pool")
    s.add_argument("--shards", required=True, type=int, metavar="N", help="Prometheus servers (>= 1)")


def run(args: argparse.Namespace) -> int:
    if args.rules_action == "render":
        return render_cmd(args)
    if args.rules_action == "check":
        return check_cmd(args)
    if args.rules_action == "shards":
        return shards_cmd(args)
    print("grayguard rules: choose an action: render, check or shards (see --help)", file=sys.stderr)
    return 2


def render_cmd(args: argparse.Namespace) -> int:
    """Render into --out; exit 2 for a bad config, 1 when Prometheus or promtool refuse."""
    try:
        cfg = load_config(args.config)
        baselines: dict[str, float] = {}
        if args.prometheus_baselines:
            baselines = fetch_baselines(PrometheusClient(cfg.prometheus, session=requests.Session()), cfg)
            print(f"learned baselines (P99 TTFT, s): {baselines or 'none yet'}")
        files = render_all(cfg, baselines)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    except PromError as e:
        print(f"grayguard: cannot learn baselines from {cfg.prometheus.url}: {e}", file=sys.stderr)
        return 1
    names = set(recording_rule_names(cfg))
    for field in ("latency_query", "request_rate_query"):
        query = getattr(cfg.signals, field)
        if query not in names:
            print(f"grayguard: warning: signals.{field} {query!r} is not a recorded series of these rules "
                  f"(rules.control_window is {cfg.rules.control_window})", file=sys.stderr)
    out = Path(args.out or cfg.rules.output_dir)
    try:
        changed = write_if_changed(out, files, args.promtool or cfg.rules.promtool)
    except (RuleFileError, OSError) as e:
        print(f"grayguard: {e}", file=sys.stderr)
        return 1
    for name in sorted(files):
        print(f"{out / name}: {'written' if name in changed else 'unchanged'}")
    return 0


def _run_tool(argv: list[str], cwd: Path | None = None) -> bool:
    print("$ " + " ".join(argv), flush=True)
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout + proc.stderr)
    return proc.returncode == 0


def check_cmd(args: argparse.Namespace) -> int:
    """promtool check + test the rules in --dir, amtool check its Alertmanager configs; 0 when all pass."""
    d = Path(args.dir)
    promtool = shutil.which(args.promtool)
    if not promtool:
        print(f"grayguard: {args.promtool} not found: {install_hint('promtool')}", file=sys.stderr)
        return 1
    rule_files = sorted(d.glob("*.rules.yml")) + sorted(d.glob("tests/*.rules.yml"))
    tests = sorted(d.glob("tests/*.test.yml"))
    if not rule_files:
        print(f"grayguard: no *.rules.yml in {d}", file=sys.stderr)
        return 1
    ok = _run_tool([promtool, "check", "rules", "--lint-fatal", *map(str, rule_files)])
    for t in tests:  # test files name rule files relative to themselves
        ok = _run_tool([promtool, "test", "rules", t.name], cwd=t.parent) and ok
    for c in sorted(d.glob("prometheus*.yml")):
        ok = _run_tool([promtool, "check", "config", str(c)]) and ok
    am_configs = sorted(d.glob("alertmanager*.yml"))
    amtool = shutil.which(args.amtool)
    if am_configs and not amtool:
        print(f"grayguard: {args.amtool} not found, Alertmanager config not checked: {install_hint('amtool')}",
              file=sys.stderr)
    for c in am_configs if amtool else []:
        ok = _run_tool([amtool, "check-config", str(c)]) and ok
    print("rules check: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


def shards_cmd(args: argparse.Namespace) -> int:
    """Print each shard's pools and its Prometheus' relabel_configs; exit 2 for a bad config or --shards."""
    if args.shards < 1:
        print(f"grayguard: --shards: must be >= 1, got {args.shards}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return 2
    split = shards.assign([p.name for p in cfg.pools], args.shards)
    print(f"# {len(cfg.pools)} pools in {args.shards} shards by Prometheus' hashmod of the {shards.POOL_LABEL!r} "
          "label (docs/operations.md, \"Sharding\")")
    for k, pools in enumerate(split):
        print(f"\nshard {k}: {len(pools)} pools: {', '.join(pools) or '(none)'}\n"
              f"# its controllers list these pools (their pools[] entries), with prometheus.url: shard {k}'s "
              "Prometheus and registry.shard_pools: true\n"
              "# its Prometheus adds to every grayguard scrape job (vllm, grayguard-exporter, "
              "grayguard-exporter-fast):")
        print(yaml.safe_dump({"relabel_configs": shards.relabel_configs(k, args.shards)}, sort_keys=False), end="")
        if not pools:
            print(f"grayguard: warning: shard {k} has no pool: its Prometheus would scrape nothing; use fewer "
                  "shards", file=sys.stderr)
    return 0
