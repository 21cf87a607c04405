"""SIGTERM to `grayguard demo` stops everything it started and writes its report (exit 143).

`kill`, `timeout`, systemd and CI runners send SIGTERM, not Ctrl-C. Python's default for it is to die at once,
without `finally`: the demo then left HAProxy, Prometheus and Alertmanager running (and, with --fleet vllm, four
real vLLM servers of 3 GB each). grayguard.cli turns the first SIGTERM into an unwinding exception.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grayguard.localstack.vllmserver import children
from tests.support.procwatch import OutputWatch, alive, signals_at_default

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_stops_every_process_the_demo_started_and_writes_the_report(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "grayguard.cli", "demo", "--nodes", "3", "--duration", "300",
                             "--live", "plain", "--report-dir", str(report)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=signals_at_default)
    watch = OutputWatch(proc, "[run]", at_start=True)
    lines = watch.lines
    try:
        assert watch.seen.wait(180), "the demo never started its load:\n" + "".join(lines[-40:])
        started = children(proc.pid)
        names = {name for _, name in started}  # /proc's comm: 15 characters ("prometheus-aler")
        assert {"haproxy", "prometheus"} <= names and any("aler" in n for n in names), names
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:  # where it is stuck: faulthandler prints every thread's stack on SIGABRT
            proc.send_signal(signal.SIGABRT)
            proc.wait(15)
            watch.thread.join(10)
            raise AssertionError("the demo did not stop within 90 s of SIGTERM:\n" + "".join(lines[-150:])) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    watch.thread.join(10)
    out = "".join(lines)
    assert rc == 143, out[-3000:]
    deadline = time.monotonic() + 15
    while (left := [(p, n) for p, n in started if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after SIGTERM: {left}"
    doc = json.loads((report / "report.json").read_text())
    assert doc["interrupted"] is True
    assert "interrupted: stopping everything" in out
    assert "interrupted: the run did not finish" in out  # the verdict judges no targets on a cut-short run
    assert "Task was destroyed" not in out  # the load's requests were cancelled with it, not dropped


def test_sigterm_to_pytest_tears_its_fixtures_down(tmp_path):
    """The suite's own conftest: a test holding a real HAProxy in a fixture, pytest SIGTERMed mid-test."""
    mod = tmp_path / "test_held.py"
    mod.write_text(
        "import time\n"
        "def test_holds(haproxy_factory):\n"
        "    p = haproxy_factory({'be': [('s1', '127.0.0.1:9', 100)]})\n"
        "    print('HAPROXY', p.proc.pid, flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             "-p", "tests.conftest", "--rootdir", str(tmp_path), str(mod)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("HAPROXY"):
            pid = int(line.split()[1])
            break
    assert pid is not None and alive(pid), "".join(lines)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 15
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid), "HAProxy outlived a SIGTERMed pytest"
