"""`grayguard exporter` flags, validation, exit codes and clean shutdown on SIGTERM."""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from grayguard.exporters import cli
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults():
    args = parse()
    assert args.vllm_url == "http://127.0.0.1:8000"
    assert args.listen == ("127.0.0.1", 9400)
    assert (args.probe_interval, args.probe_slow, args.probe_deadline) == (1.0, 0.3, 2.0)
    assert args.probe and args.nvml and args.xid and not args.ecc_aggregate
    assert args.probe_model is None and args.probe_key_env == "VLLM_API_KEY"
    assert args.agent and args.agent_listen == ("127.0.0.1", 9401)
    assert cli.config_error(args) is None


def test_prometheus_style_flags():
    args = parse("--vllm.url", "http://10.0.0.7:8000", "--web.listen-address", ":9500", "--probe.interval", "5s",
                 "--probe.slow-threshold", "250ms", "--probe.deadline", "1m", "--probe.model", "m",
                 "--probe.api-key-file", "/run/key", "--no-collector.nvml", "--no-probe")
    assert args.listen == ("0.0.0.0", 9500)
    assert (args.probe_interval, args.probe_slow, args.probe_deadline) == (5.0, 0.25, 60.0)
    assert not args.nvml and not args.probe and args.probe_model == "m"


def test_help_mentions_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for flag in ("--vllm.url", "--web.listen-address", "--probe.interval", "--probe.slow-threshold",
                 "--probe.deadline", "--probe.model", "--probe.api-key-env", "--probe.api-key-file",
                 "--no-collector.nvml", "--no-probe", "--agent.listen-address", "--no-agent",
                 "--live.window", "/metrics/fast", "--collector.ecc-aggregate"):
        assert flag in out
    assert cli.HELP and "\n" not in cli.HELP
    assert "agent-port" in out and "':9401' = all interfaces" in out


@pytest.mark.parametrize("text,seconds", [("300ms", 0.3), ("2s", 2), ("1m30s", 90), ("1h", 3600), ("0.5", 0.5)])
def test_parse_duration(text, seconds):
    assert cli.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "2x", "s", "1s2", "fast"])
def test_bad_duration_is_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_duration(text)


@pytest.mark.parametrize("text,addr", [("127.0.0.1:9400", ("127.0.0.1", 9400)), ("[::1]:9400", ("::1", 9400)),
                                       (":0", ("0.0.0.0", 0))])
def test_parse_listen_address(text, addr):
    assert cli.parse_listen_address(text) == addr


@pytest.mark.parametrize("argv,flag", [
    (["--vllm.url", "localhost:8000"], "--vllm.url"),
    (["--probe.interval", "0s"], "--probe.interval"),
    (["--probe.slow-threshold", "3s"], "--probe.slow-threshold"),
    (["--probe.jitter", "1.5"], "--probe.jitter"),
    (["--live.window", "0s"], "--live.window"),
    (["--agent.listen-address", "127.0.0.1:9400"], "--agent.listen-address"),
    (["--agent.listen-address", ":9400"], "--agent.listen-address"),
    (["--web.listen-address", ":9401"], "--agent.listen-address"),
])
def test_bad_configuration_names_the_flag_and_exits_2(argv, flag, caplog):
    args = parse(*argv)
    assert flag in cli.config_error(args)
    assert cli.run(args) == 2
    assert flag in caplog.text


def test_taken_listen_address_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        args = parse("--web.listen-address", f"127.0.0.1:{s.getsockname()[1]}", "--no-probe", "--no-collector.nvml")
        assert cli.run(args) == 1


def test_build_exporter_takes_an_injected_nvml():
    args = parse("--web.listen-address", "127.0.0.1:0", "--no-probe")
    fake = FakeNvml([healthy_h100(0)])
    with cli.build_exporter(args, nvml=fake) as exporter, requests.Session() as session:
        session.trust_env = False
        text = session.get(exporter.url + "/metrics", timeout=5).text
    assert healthy_h100(0).uuid in text


@pytest.mark.parametrize("aggregate", [False, True])
def test_lifetime_ecc_counts_are_served_only_with_the_flag(aggregate):
    args = parse("--web.listen-address", "127.0.0.1:0", "--no-probe", *(["--collector.ecc-aggregate"] * aggregate))
    with cli.build_exporter(args, nvml=FakeNvml([healthy_h100(0)])) as exporter, requests.Session() as session:
        session.trust_env = False
        text = session.get(exporter.url + "/metrics", timeout=5).text
    assert 'counter_type="volatile"' in text
    assert ('counter_type="aggregate"' in text) is aggregate


def test_the_ecc_aggregate_help_says_what_it_serves_and_why_it_is_off(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "lifetime ECC counts" in out and "default off" in out and "remapped rows" in out


def test_live_window_flag_reaches_the_prober():
    assert parse().live_window == 5.0
    args = parse("--web.listen-address", "127.0.0.1:0", "--no-collector.nvml", "--no-agent", "--live.window", "2500ms")
    exporter = cli.build_exporter(args)
    assert exporter.prober is not None and exporter.prober.config.live_window == 2.5


def test_the_grayguard_dispatcher_offers_the_exporter():
    from grayguard.cli import build_parser

    args = build_parser().parse_args(["exporter", "--probe.deadline", "1s"])
    assert args._run is cli.run and args.probe_deadline == 1.0


# The exporter's own entry, without the dispatcher (which imports every component).
ENTRY = ("import argparse, sys, logging; from grayguard.exporters import cli; logging.basicConfig(level='INFO'); "
         "p = argparse.ArgumentParser(); cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))")


def test_sigterm_shuts_down_cleanly():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, "--web.listen-address", "127.0.0.1:0", "--no-probe",
                             "--no-collector.nvml"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)  # EOF: the process ended

    threading.Thread(target=pump, daemon=True).start()
    try:
        url, seen = None, []
        while url is None:
            line = lines.get(timeout=10)
            assert line is not None, f"exporter exited early: {''.join(seen)}"
            seen.append(line)
            if "serving on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
        with requests.Session() as session:
            session.trust_env = False
            assert "grayguard_exporter_nvml_up 0.0" in session.get(url, timeout=5).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv", [["--agent.listen-address", "127.0.0.1:9400", "--no-agent"],
                                  ["--agent.listen-address", "127.0.0.1:9400", "--no-probe"],
                                  ["--agent.listen-address", "127.0.0.2:9400"]])
def test_agent_address_checked_only_when_it_is_used(argv):
    assert cli.config_error(parse(*argv)) is None


def test_bad_agent_address_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--agent.listen-address", "localhost")
    assert e.value.code == 2 and "--agent.listen-address" in capsys.readouterr().err


def test_agent_flags_reach_the_exporter():
    args = parse("--web.listen-address", "127.0.0.1:0", "--agent.listen-address", "127.0.0.1:0",
                 "--no-collector.nvml", "--vllm.url", "http://127.0.0.1:1")
    with cli.build_exporter(args) as exporter, socket.create_connection(exporter.agent.address, timeout=5) as s:
        assert s.recv(64) == b"up\n"  # no probe yet (or a refused vLLM): up
    assert cli.build_exporter(parse("--no-agent")).agent is None


def test_no_probe_switches_the_agent_off_and_says_so(caplog):
    with caplog.at_level("INFO", logger="grayguard.exporters.cli"):
        exporter = cli.build_exporter(parse("--no-probe", "--no-collector.nvml"))
    assert exporter.agent is None and exporter.prober is None
    assert "agent check off: --no-probe" in caplog.text


def test_taken_agent_address_exits_1_naming_the_flag(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        args = parse("--web.listen-address", "127.0.0.1:0", "--agent.listen-address",
                     f"127.0.0.1:{s.getsockname()[1]}", "--no-collector.nvml", "--vllm.url", "http://127.0.0.1:1")
        assert cli.run(args) == 1
    assert "--agent.listen-address" in caplog.text and "cannot listen" in caplog.text
