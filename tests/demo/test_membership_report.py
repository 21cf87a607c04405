"""The membership scenario's milestones, client failures and verdict (pure: over observed logs and records)."""

import argparse

import pytest

from grayguard.demo import cli, membership
from grayguard.demo.membership_report import client_failures, crash_milestones, join_milestones, verdict
from grayguard.sim.loadstats import RequestRecord

UP, DOWN = 2, 0
MAINT, DRAIN = 0x01, 0x08


def hap(t, node, weight=100, admin=0, op=UP, present=True):
    return {"t": t, "node": node, "present": present, "weight": weight, "admin": admin, "op": op, "status": ""}


def test_join_milestones_from_registration_to_full_weight():
    registry = [{"t": 10.3, "kind": "put", "node": "n5", "state": "serving", "ttl_s": 10, "registered_at_s": 10.2,
                 "prev_state": None}]
    log = [hap(10.4, "n5", 10, admin=MAINT, op=DOWN),  # added in maintenance, then readied
           hap(10.5, "n5", 10, op=DOWN), hap(11.1, "n5", 10), hap(14.0, "n5", 15), hap(30.0, "n5", 100)]
    j = join_milestones(log, registry, "n5", 9.0, warm_weight=10, base_weight=100)
    assert j["registered_s"] == 10.2 and j["in_haproxy_s"] == 10.5 and j["entry_weight"] == 10
    assert j["join_latency_s"] == 0.3 and j["up_s"] == 11.1 and j["slow_start_s"] == 14.0
    assert j["full_weight_s"] == 30.0


def test_join_that_never_happened_is_none_everywhere():
    j = join_milestones([], [], "n5", None, 10, 100)
    assert j["registered_s"] is None and j["in_haproxy_s"] is None and j["join_latency_s"] is None


@pytest.mark.parametrize("log, by, out_after, deleted", [
    # HAProxy's health check first, then the controller's drain and deletion
    ([hap(20.0, "n4"), hap(21.2, "n4", op=DOWN), hap(22.0, "n4", admin=DRAIN, op=DOWN),
      hap(23.4, "n4", present=False)], "haproxy (its health check or error limit)", 1.2, 23.4),
    # the lease expired first: drained by grayguard, then deleted
    ([hap(20.0, "n4"), hap(23.1, "n4", admin=DRAIN), hap(23.5, "n4", present=False)],
     "grayguard's drain", 3.1, 23.5),
])
def test_crash_milestones_say_what_took_the_node_out(log, by, out_after, deleted):
    registry = [{"t": 22.9, "kind": "delete", "node": "n4", "state": None, "ttl_s": None, "registered_at_s": None,
                 "prev_state": "serving"}]
    c = crash_milestones(log, registry, "n4", 20.0, ttl_s=3, tick_s=1.0)
    assert c["taken_out_by"] == by and c["out_of_rotation_after_s"] == out_after
    assert c["contract_s"] == 7.0  # max(TTL 3, inter 2 s x fall 3) + a tick
    assert c["lease_expired_s"] == 22.9 and c["last_value"] == "serving" and c["deleted_s"] == deleted
    assert c["drained_by"] == ("grayguard policy (HAProxy had marked it DOWN)" if c["drained_s"] < 22.9 else
                               "grayguard membership (its lease expired)")


def rec(i, start, status, backend, e2e=1.0):
    return RequestRecord(index=i, start_s=start, status=status, prompt_tokens=10, max_tokens=10, e2e_s=e2e,
                         backend=backend)


def test_client_failures_tell_the_crash_from_the_client_deadline_and_the_rest():
    records = [rec(0, 1.0, "ok", "n1"), rec(1, 18.0, "protocol", "n4", 3.0),  # streaming on n4 when it died at 20
               rec(2, 5.0, "timeout", "n2", 10.0), rec(3, 25.0, "http_5xx", "n1"), rec(4, 30.0, "ok", "n5")]
    f = client_failures(records, "n4", 20.0)
    assert f["requests"] == 5 and f["ok"] == 2 and f["failed"] == 3 and f["any_failed"]
    assert f["in_flight_on_crashed_node"] == 1 and f["client_deadline"] == 1 and f["other_failures"] == 1
    assert f["by_status"] == {"protocol": 1, "timeout": 1, "http_5xx": 1}


def test_verdict_names_each_missed_target():
    j = {"join_latency_s": 0.2, "entry_weight": 10, "warm_weight": 10, "slow_start_s": 15.0}
    c = {"out_of_rotation_after_s": 1.1, "contract_s": 4.0, "deleted_s": 23.0}
    f = {"other_failures": 0}
    line, checks = verdict({"join": j, "crash": c, "clients": f})
    assert line.startswith("all targets met") and all(checks.values())
    line, checks = verdict({"join": {**j, "join_latency_s": 2.5}, "crash": {**c, "out_of_rotation_after_s": 4.2},
                            "clients": f})
    assert line.startswith("MISSED") and "within 2 s" in line and "the checks' fall) + a tick" in line


def parse(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_membership_flags_and_the_fault_scenarios_flags_do_not_mix(capsys):
    o = membership.options_from_args(parse(["--scenario", "membership", "--nodes", "5", "--join-at", "7"]),
                                     parse([]))
    assert (o.nodes, o.join_at_s, o.crash_at_s, o.crash_node, o.join_node) == (5, 7.0, 90.0, "node5", "node6")
    assert cli.run(parse(["--scenario", "membership", "--fault", "pcie"])) == 2
    assert "--fault: only for the fault scenario" in capsys.readouterr().err
    assert cli.run(parse(["--scenario", "membership", "--join-at", "200"])) == 2
    assert cli.run(parse(["--scenario", "membership", "--join-at", "9", "--crash-at", "9"])) == 2
