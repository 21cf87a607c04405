"""`grayguard fleet` and `grayguard loadgen`: parsing, help, and a real fleet process driven by loadgen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from grayguard.cli import build_parser, main
from grayguard.sim import cli_fleet, cli_loadgen

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("mod", [cli_fleet, cli_loadgen])
def test_modules_follow_the_dispatcher_contract(mod):
    assert isinstance(mod.HELP, str) and "\n" not in mod.HELP
    assert callable(mod.add_arguments) and callable(mod.run)


@pytest.mark.parametrize("cmd", ["fleet", "loadgen"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        parse(cmd, "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert ("--rate" if cmd == "loadgen" else "--fault") in out


def test_speed_class_specs():
    assert cli_fleet.parse_speed_classes("a100") == "a100"
    assert cli_fleet.parse_speed_classes("h100,a100") == ["h100", "a100"]
    assert cli_fleet.parse_speed_classes("node3=a100, node4=l40s") == {"node3": "a100", "node4": "l40s"}
    with pytest.raises(ValueError):
        cli_fleet.parse_speed_classes("node3=a100,h100")


def test_latency_options_map_to_params():
    p = cli_fleet.params_from_args(parse("fleet", "--decode-ms", "10", "--decode-ms-at-max-batch", "40",
                                         "--max-num-seqs", "31", "--prefill-ms-per-token", "0.2"))
    assert p.decode_s_base == pytest.approx(0.010)
    assert p.decode_s_base + 30 * p.decode_s_per_seq == pytest.approx(0.040)
    assert p.prefill_s_per_token == pytest.approx(0.0002) and p.max_num_seqs == 31
    default = cli_fleet.params_from_args(parse("fleet"))
    assert default.decode_s_base + 63 * default.decode_s_per_seq == pytest.approx(0.030)


@pytest.mark.parametrize("argv", [
    ["fleet", "--fault", "node3:meltdown:1"],
    ["fleet", "--nodes", "2", "--fault", "node3:thermal:1"],
    ["fleet", "--speed-class", "tpu"],
    ["loadgen", "--url", "http://x", "--phase", "bad"],
    ["loadgen", "--url", "http://x", "--rate", "0"],
    ["loadgen", "--url", "http://x", "--header", "novalue"],
])
def test_bad_options_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "grayguard" in capsys.readouterr().err


def test_fleet_process_with_loadgen(capsys, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "grayguard.cli", "fleet", "--log.level", "warning", "--nodes", "2",
         "--decode-ms", "3", "--jitter", "0", "--fault", "node2:thermal:0:-:k=3"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once every node listens
        info = json.loads(line)
        nodes = {n["name"]: n for n in info["nodes"]}
        assert set(nodes) == {"node1", "node2"} and info["model"]
        status = requests.get(nodes["node2"]["url"] + "/admin/fault", timeout=5).json()
        assert status["fault"] == "thermal" and status["params"]["k"] == 3.0
        records = tmp_path / "rec.csv"
        rc = main(["loadgen", "--url", nodes["node1"]["url"], "--rate", "20", "--duration", "1", "--seed", "4",
                   "--completion-median", "10", "--json", "--phase", "a:0:0.5", "--phase", "b:0.5:",
                   "--records", str(records)])
        assert rc == 0
        summary = json.loads(capsys.readouterr().out)
        assert list(summary) == ["all", "a", "b"]
        assert summary["all"]["ok"] == summary["all"]["requests"] > 0
        assert summary["all"]["e2e"]["p99.9"] >= summary["all"]["e2e"]["p50"] > 0
        assert len(records.read_text().splitlines()) == summary["all"]["requests"] + 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
            proc.stderr.close()


def test_fleet_port_in_use_exits_1(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["fleet", "--nodes", "1", "--base-port", str(port)]) == 1
    assert "cannot listen" in capsys.readouterr().err


def test_fleet_stopped_by_sigterm_exits_0_and_closes_its_ports():
    """`kill`, `timeout` and systemd stop a fleet with SIGTERM: it stops serving like Ctrl-C (exit 0), and no port of
    its nodes still listens (issue 34: nothing left behind; the fleet is one process, its nodes asyncio servers)."""
    import socket
    import urllib.parse

    proc = subprocess.Popen([sys.executable, "-m", "grayguard.cli", "fleet", "--log.level", "warning", "--nodes",
                             "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        nodes = json.loads(proc.stdout.readline())["nodes"]
        ports = [urllib.parse.urlparse(n["url"]).port for n in nodes]
        assert all(requests.get(n["url"] + "/health", timeout=5).ok for n in nodes)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
