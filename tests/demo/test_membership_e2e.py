"""`grayguard demo --scenario membership` in a short form, on the real parts: etcd, the simulated fleet, exporters that
register their nodes, HAProxy, Prometheus, Alertmanager and the controller process (leader election, discovery:
registry). A node joins and another crashes (SIGKILL of its node and exporter) under load. HAProxy is polled every
0.1 s and the registry watched by the scenario itself (demo/membership.py, Observer); the wait for the deletion has a
deadline. Bounded: about 45 s."""

import io
import json

import pytest

from grayguard.demo.membership import MembershipOptions, run_scenario
from tests.support.stack import require

pytestmark = pytest.mark.e2e


def test_a_node_joins_at_the_warm_up_weight_and_a_crashed_node_leaves_rotation_within_ttl_plus_a_tick(tmp_path):
    require("etcd", "haproxy", "prometheus", "alertmanager")
    # 3 fleet nodes + node4 (its own process, it crashes) registered from the start; node5 joins. A short warm-up
    # so the slow start begins well within the run; a short client deadline only bounds the run.
    opts = MembershipOptions(nodes=4, rate=6, duration_s=24, join_at_s=4, crash_at_s=12, warmup_s=2, timeout_s=8,
                             live="off", seed=2)
    out = io.StringIO()
    r = run_scenario(opts, tmp_path / "report", out)
    log = out.getvalue()
    j, c, f = r["join"], r["crash"], r["clients"]

    # the join: in HAProxy within 2 s of registering, at the warm-up weight (10 % of 100), then slow start
    assert j["node"] == "node5" and j["registered_s"] is not None, log
    assert j["join_latency_s"] is not None and j["join_latency_s"] <= 2.0, (j, log)
    assert j["entry_weight"] == j["warm_weight"] == 10, j
    assert j["up_s"] is not None and j["slow_start_s"] is not None and j["slow_start_s"] > j["in_haproxy_s"], j

    # the crash: out of rotation within the later of its lease's TTL and HAProxy's checks' fall, + one tick of the
    # kill (an expiry removes no node HAProxy still has UP); the lease expired with its last value "serving" (no
    # goodbye), and the server was deleted after that: the registry's expiry, not HAProxy, removed it
    assert c["node"] == "node4" and c["killed_s"] is not None and c["ttl_s"] is not None, c
    assert c["out_of_rotation_after_s"] is not None and c["out_of_rotation_after_s"] <= c["contract_s"], c
    assert c["contract_s"] == max(c["ttl_s"], c["check_down_s"]) + c["tick_s"], c
    assert c["lease_expired_s"] is not None and c["last_value"] == "serving", c
    assert c["deleted_s"] is not None and c["deleted_s"] >= c["lease_expired_s"], c

    # clients: every failure is accounted for, and none but the streams cut on the dead node or the client deadline
    assert f["requests"] > 50 and f["failed"] == (f["in_flight_on_crashed_node"] + f["client_deadline"]
                                                  + f["other_failures"]), f
    assert f["other_failures"] == 0, f
    assert r["leadership"]["leads"] == ["all"] and r["leader"], r["leadership"]
    assert [ck for ck, ok in r["checks"].items() if not ok] == [], r["verdict"]

    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    assert {"join", "crash", "clients", "events", "haproxy_log", "registry_log", "samples", "verdict"} <= set(doc)
    kinds = {e["kind"] for e in doc["events"]}
    assert {"join", "crash", "registry", "haproxy"} <= kinds
    assert "<svg" in (tmp_path / "report" / "report.html").read_text()
    assert "out of rotation" in (tmp_path / "report" / "report.md").read_text()
