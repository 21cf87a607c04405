"""`grayguard controller` with a registry, as processes: two replicas elect one leader; SIGKILL the leader and the
standby leads within the lease + one tick; SIGTERM resigns (the lease is revoked, logged); `--once` on a standby
says so and writes nothing. Prometheus is unreachable here: the election does not depend on it."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request

import pytest
import yaml

from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import free_port, start_process, wait_until
from tests.support.ctl_helpers import servers
from tests.support.stack import require

pytestmark = pytest.mark.e2e
TTL, TICK, SLACK = 2, 0.5, 2.0


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as r:
        return json.loads(r.read())


def leads(port: int, rid: str) -> bool:
    return status(port)["leadership"]["leads"] == ["all"] and status(port)["leadership"]["id"] == rid


def test_two_processes_elect_one_leader_and_the_standby_takes_over(tmp_path, haproxy_factory):
    require("haproxy", "etcd")
    hap = haproxy_factory({"vllm_chat": servers(4)})
    etcd = EtcdProc(tmp_path / "etcd").start()
    procs = []
    try:
        def config(rid: str, port: int) -> str:
            p = tmp_path / f"{rid}.yaml"
            p.write_text(yaml.safe_dump({
                "prometheus": {"url": "http://127.0.0.1:1", "timeout_s": 0.2},
                "haproxy": {"endpoints": [hap.endpoint], "timeout_s": 1.0},
                "pools": [{"name": "chat", "backend": "vllm_chat"}], "tick_interval_s": TICK,
                "state_file": str(tmp_path / f"{rid}-state.json"), "listen_address": f"127.0.0.1:{port}",
                "rules": {"rerender_interval_s": 0},
                "registry": {"url": etcd.url, "lease_ttl_s": TTL, "timeout_s": 0.5}}))
            return str(p)

        def start(rid: str):
            port = free_port()
            p = start_process([sys.executable, "-m", "grayguard.cli", "controller", "--config.file", config(rid, port),
                               "--id", rid], tmp_path / f"{rid}.log")
            procs.append(p)
            wait_until(lambda: status(port), 20, what=f"{rid} serves /status")
            return p, port

        a, pa = start("a")
        wait_until(lambda: leads(pa, "a"), 10, what="a leads")
        b, pb = start("b")
        wait_until(lambda: status(pb)["leadership"]["leaders"] == {"all": "a"}, 10, what="b sees a lead")
        assert not leads(pb, "b")

        once = start_process([sys.executable, "-m", "grayguard.cli", "controller", "--config.file",
                              config("c", free_port()),
                              "--id", "c", "--once"], tmp_path / "c.log")
        once.proc.wait(30)
        assert once.proc.returncode == 1 and "STANDBY: replica c stands by (a leads)" in once.log_tail()

        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: leads(pb, "b"), TTL + TICK + SLACK + 5, interval_s=0.05, what="b leads")
        assert time.monotonic() - killed <= TTL + TICK + SLACK

        b.proc.send_signal(signal.SIGTERM)
        b.proc.wait(60)  # a clean stop takes a second or two; a loaded 2-core machine, more
        assert "replica b resigned (lease revoked)" in b.log_tail(60)
    finally:
        for p in procs:
            p.stop()
        etcd.stop()
