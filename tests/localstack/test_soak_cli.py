"""The soak command: its analysis (pure), and a 30 s run on the real stack (the 20-minute soak is run by hand:
`python -m grayguard.localstack.soak --minutes 20 --out docs/soak.md`, see docs/benchmarks.md)."""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grayguard.localstack.soak import ProcResult, Series, SoakReport, Thresholds, analyze_series, main, render_markdown
from grayguard.localstack.vllmserver import children
from tests.support.procwatch import OutputWatch, left, signals_at_default, stopped
from tests.support.stack import require

TH = Thresholds(max_rss_growth_mib=4, max_fd_growth=2)
MIB = 1024  # KiB


def series(rss_kib, fds, step_s=10.0, role="controller") -> Series:
    return Series(role, [(i * step_s, r, f) for i, (r, f) in enumerate(zip(rss_kib, fds, strict=True))])


def test_a_flat_process_passes_after_its_warm_up():
    # Imports and caches grow the first minutes (the warm-up); afterwards it wobbles around 60 MiB.
    rss = [40 * MIB, 50 * MIB, 58 * MIB] + [60 * MIB + (i % 3) * 200 for i in range(117)]
    fds = [9, 12, 14] + [14 + (i % 4 == 0) * 3 for i in range(117)]  # a scrape or canary in flight now and then
    r = analyze_series(series(rss, fds), warmup_s=30, th=TH)
    assert r.problems == ()
    assert r.rss_start_mib == pytest.approx(60.2, abs=0.2) and r.rss_end_mib == pytest.approx(60.2, abs=0.2)
    assert r.rss_max_mib == pytest.approx(60.4, abs=0.1) and abs(r.rss_slope_mib_per_10min) < 0.1
    assert (r.fds_start, r.fds_end, r.fds_max, r.fd_growth) == (14, 14, 17, 0)


def test_a_steady_leak_fails_with_its_growth_and_slope():
    rss = [60 * MIB + i * 60 for i in range(120)]  # 60 KiB per 10 s sample: 3.5 MiB per 10 min
    r = analyze_series(series(rss, [14] * 120), warmup_s=0, th=TH)
    assert r.rss_slope_mib_per_10min == pytest.approx(3.52, abs=0.01)
    assert r.rss_growth_mib > 4 and "RSS grew" in r.problems[0], r


def test_leaked_file_descriptors_fail_spikes_do_not():
    leak = analyze_series(series([60 * MIB] * 60, [14 + i // 10 for i in range(60)]), warmup_s=0, th=TH)
    assert leak.fd_growth == 5 and "open fds grew by 5" in leak.problems[0]
    spikes = analyze_series(series([60 * MIB] * 60, [14 + 6 * (i % 7 == 3) for i in range(60)]), warmup_s=0, th=TH)
    assert spikes.problems == () and spikes.fds_max == 20


def test_a_process_that_exited_or_was_never_seen_fails():
    gone = series([60 * MIB] * 10, [14] * 10)
    gone.exited_at = 100.0
    assert analyze_series(gone, 0, TH).problems == ("exited at 100 s",)
    never = analyze_series(Series("exporter node1"), 0, TH)
    assert "no samples" in never.problems and math.isnan(never.rss_start_mib)


def report(**kw) -> SoakReport:
    flat = ProcResult("controller", 60, 60.5, 61, 0.5, 0.2, 14, 14, 17, 0, ())
    meta = {"date": "2026-11-30 00:00 UTC", "command": "python -m grayguard.localstack.soak --minutes 20",
            "host": "2 CPUs", "commit": "abc1234", "nodes": 5, "rate": 12.0, "minutes": 20.0, "sample_s": 10.0,
            "warmup_s": 180.0,
            "thresholds": TH, "processes": {"controller": "pid 7: python -m grayguard.cli controller"}}
    return SoakReport(**{"processes": [flat], "writes": 0, "off_weight": [], "transitions": {},
                         "ticks": {"ok": 1200.0}, "requests": {"ok": 14000}, "meta": meta, **kw})


def test_the_report_is_a_table_and_a_verdict():
    text = render_markdown(report())
    assert "| controller | 60.0 | 60.5 | 61.0 | +0.5 | +0.20 | 14 | 14 | 17 | flat |" in text
    assert "the first 3 min are warm-up" in text and "**PASS**" in text
    assert report().problems == []


def test_a_weight_written_to_a_healthy_node_fails_the_soak():
    r = report(writes=2, off_weight=[(300.0, "node3", 50, False)], transitions={"node3: healthy -> degraded": 1})
    assert r.problems == ["the controller wrote 2 weight/state change(s) to healthy nodes",
                          "HAProxy showed healthy node(s) off full weight: node3"]
    text = render_markdown(r)
    assert "**FAIL**" in text and "node3: healthy -> degraded (1)" in text and "**2**" in text


@pytest.mark.e2e
def test_a_30_second_soak_measures_the_controller_and_exporter_processes(tmp_path):
    require("haproxy", "prometheus", "alertmanager")
    out, path = io.StringIO(), tmp_path / "soak.md"
    rc = main(["--timing", "demo", "--minutes", "0.5", "--sample-s", "2", "--nodes", "3", "--rate", "8",
               "--out", str(path)], out=out)
    text = path.read_text()
    assert rc == (1 if "**FAIL**" in text else 0), out.getvalue()
    rows = [ln.split(" | ")[0].lstrip("| ") for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert rows[1:] == ["controller", "exporter node1", "exporter node2", "exporter node3"], text
    # What was measured is the controller and the exporters themselves, each its own process.
    assert "controller = `pid " in text and "-m grayguard.cli controller --config.file" in text
    assert text.count("-m grayguard.localstack.stack exporter") == 3
    assert "Ticks: ok" in text and "Requests:" in text
    for ln in text.splitlines():  # every process sampled: no empty row
        if ln.startswith("| controller") or ln.startswith("| exporter"):
            assert "nan" not in ln and "no samples" not in ln, ln


def test_the_soak_runs_at_the_shipped_timing_by_default():
    import argparse

    from grayguard.localstack.soak import stack_spec

    prod = stack_spec(argparse.Namespace(nodes=5, seed=1, timing="production"))
    assert (prod.tick_s, prod.control_window, prod.scrape_interval) == (5.0, "30s", "5s")
    assert "thresholds" not in prod.overrides  # the shipped thresholds (the stack sets none of its own)
    assert prod.overrides["rules"]["control_interval"] == "5s"  # six samples a window: the shipped observation
    demo = stack_spec(argparse.Namespace(nodes=5, seed=1, timing="demo"))
    assert (demo.tick_s, demo.control_window, demo.scrape_interval) == (1.0, "10s", "1s")


def test_the_soak_stopped_by_sigterm_stops_its_stack():
    """`python -m grayguard.localstack.soak` under `timeout` or a CI runner gets SIGTERM: Python's default died at once
    and left HAProxy, Prometheus, Alertmanager, the controller and every exporter running (issue 34). It unwinds now:
    exit 143, none of its processes left."""
    require("haproxy", "prometheus", "alertmanager")
    proc = subprocess.Popen([sys.executable, "-m", "grayguard.localstack.soak", "--minutes", "5", "--nodes", "3",
                             "--timing", "demo", "--sample-s", "2"], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=signals_at_default)
    watch = OutputWatch(proc, "[soak] running", at_start=True)
    started: list[tuple[int, str]] = []
    try:
        assert watch.seen.wait(180), "the soak never ran:\n" + "".join(watch.lines[-40:])
        started = children(proc.pid)
        assert {"haproxy", "prometheus"} <= {name for _, name in started}, started
    finally:
        rc, out = stopped(proc, watch, lambda: proc.send_signal(signal.SIGTERM))
    assert rc == 143, out[-3000:]
    still = left(started)
    assert not still, f"still running after SIGTERM: {still}\n{out[-2000:]}"
