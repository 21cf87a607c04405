import json
import subprocess
import sys

import pytest

from grayguard.controller.policy import Policy
from grayguard.controller.replay import TraceError, read_trace, replay
from tests.support.trace_gen import make_trace


def run(rows):
    out = list(replay(rows, Policy()))
    for rec in out:
        assert set(rec) == {"t", "pool", "node", "state", "score", "weight", "reason"}
    return out


def states_of(out, node):
    return [r["state"] for r in out if r["node"] == node]


def test_one_node_5x_slower_in_a_4_node_pool_is_quarantined_others_keep_full_weight():
    out = run(make_trace(factor=lambda t, n: 5.0 if n == "n0" and t >= 30 else 1.0))
    assert "quarantined" in states_of(out, "n0")
    first_q = next(r["t"] for r in out if r["node"] == "n0" and r["state"] == "quarantined")
    assert first_q <= 30 + 3 * 5  # sustained for 3 ticks after the first slow tick
    for r in out:
        if r["node"] != "n0":
            assert r["state"] == "healthy" and r["weight"] == 100, r


def test_whole_pool_3x_slower_together_ejects_nobody():
    out = run(make_trace(factor=lambda t, n: 3.0 if t >= 30 else 1.0))
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in out)


def test_node_8pct_slower_in_a_quiet_pool_keeps_full_weight():
    out = run(make_trace(noise=0.005, factor=lambda t, n: 1.08 if n == "n0" else 1.0))
    assert all(r["state"] == "healthy" and r["weight"] == 100 for r in out)
    assert max(r["score"] for r in out if r["node"] == "n0") > 0.5  # it is measurably slower, yet untouched


def test_quarantined_node_that_heals_comes_back_through_canary_and_slow_start():
    out = run(make_trace(ticks=120, factor=lambda t, n: 5.0 if n == "n0" and 30 <= t < 120 else 1.0))
    seq = states_of(out, "n0")
    order = []
    for s in seq:
        if not order or order[-1] != s:
            order.append(s)
    assert order == ["healthy", "degraded", "quarantined", "canary", "slow_start", "healthy"]
    n0 = [r for r in out if r["node"] == "n0"]
    ramp = [r["weight"] for r in n0 if r["state"] == "slow_start"]
    assert ramp[0] == 10 and ramp == sorted(ramp)  # 10 % of base, rising
    assert n0[-1]["weight"] == 100


def test_trace_errors_name_the_line(tmp_path):
    import io
    with pytest.raises(TraceError, match="line 3: column normalized_latency"):
        read_trace(io.StringIO("t,pool,node,normalized_latency\n0,p,a,0.1\n5,p,a,fast\n"))
    with pytest.raises(TraceError, match="lacks column"):
        read_trace(io.StringIO("t,pool,node\n0,p,a\n"))
    rows = read_trace(io.StringIO("t,pool,node,normalized_latency,peer_group\n0,p,a,,h100\n0,p,b,NaN,\n"))
    assert rows[0].latency is None and rows[0].peer_group == "h100" and rows[1].latency is None


def test_replay_cli_writes_jsonl(tmp_path):
    trace = tmp_path / "t.csv"
    lines = ["t,pool,node,normalized_latency"]
    for r in make_trace(ticks=20, factor=lambda t, n: 5.0 if n == "n0" and t >= 30 else 1.0):
        lines.append(f"{r.t},{r.pool},{r.node},{r.latency}")
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.jsonl"
    p = subprocess.run([sys.executable, "-m", "grayguard.cli", "replay", "--config.file", "grayguard.example.yaml",
                        "--trace", str(trace), "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 80 and any(r["state"] == "quarantined" for r in recs)
    assert "node-ticks by state" in p.stderr
    bad = subprocess.run([sys.executable, "-m", "grayguard.cli", "replay", "--config.file", "grayguard.example.yaml",
                          "--trace", str(tmp_path / "missing.csv")], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot read trace" in bad.stderr


def _probe_trace(sent: bool) -> str:
    """A 6-node pool, a row a second, no live signals: node a's probe every 5 s, slow once (at t=20), shown on the
    five rows until the next one; the probe_sent_t column names each probe when `sent`."""
    import io
    lines = ["t,pool,node,normalized_latency,probe_result,probe_ttft_s" + (",probe_sent_t" if sent else "")]
    for t in range(40):
        for n in "abcdef":
            at = t - t % 5
            slow = n == "a" and at == 20
            row = f"{t},p,{n},0.02,{'slow' if slow else 'ok'},{0.4 if slow else 0.03}"
            lines.append(row + (f",{at - 0.5}" if sent else ""))
    return read_trace(io.StringIO("\n".join(lines) + "\n"))


def test_a_probe_shown_on_several_rows_counts_once_with_its_send_time():
    """One slow probe read on five rows (a probe every 5 s, a row a second) was a run of five slow probes, a cut of a
    healthy node; the probe_sent_t column names the probe, which then counts once, as the live controller counts it
    (NodeInput.probe_at)."""
    every_row = states_of(run(_probe_trace(sent=False)), "a")
    assert "degraded" in every_row[20:26]
    once = states_of(run(_probe_trace(sent=True)), "a")
    assert set(once) == {"healthy"}
