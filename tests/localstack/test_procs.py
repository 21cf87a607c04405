"""Process helpers shared by tests and the demo: binaries, ports, bounded waits, orderly stop."""

import random
import sys
import time

import pytest

from grayguard.localstack.procs import (
    LISTEN_PORTS_FROM,
    BinaryMissing,
    ManagedProcess,
    ProcessExited,
    ephemeral_range,
    find_binary,
    free_port,
    install_hint,
    start_process,
    wait_until,
)
from tests.support.stack import WebhookReceiver


def test_missing_binary_says_which_package(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BinaryMissing, match=r"promtool not found on PATH: apt-get install prometheus"):
        find_binary("promtool")
    with pytest.raises(BinaryMissing, match="apt-get install prometheus-alertmanager"):
        find_binary("alertmanager", "prometheus-alertmanager")
    assert install_hint("/usr/bin/amtool").startswith("apt-get install prometheus-alertmanager")


def test_find_binary_takes_the_first_present():
    assert find_binary("no-such-binary-x", sys.executable) == sys.executable


def test_free_port_is_bindable_and_outside_the_range_outgoing_connections_take():
    import socket
    lo, hi = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(LISTEN_PORTS_FROM <= p < lo for p in ports) and len(ports) > 1  # a random pick, not one port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use_and_falls_back_to_the_kernel_when_the_range_is_too_small(monkeypatch):
    import socket

    import grayguard.localstack.procs as procs
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        real_randrange = random.Random(7).randrange
        picks = iter([taken, taken])  # the held port twice, then random picks (one of them may be busy too)
        seen = []

        def pick(a, b):
            seen.append(port := next(picks, None) or real_randrange(a, b))
            return port
        monkeypatch.setattr(procs.random, "randrange", pick)
        monkeypatch.setattr(procs, "ephemeral_range", lambda: (65000, 65535))
        assert free_port() != taken and seen[:2] == [taken, taken] and len(seen) >= 3
    monkeypatch.setattr(procs, "ephemeral_range", lambda: (LISTEN_PORTS_FROM + 10, 65535))
    port = free_port()  # 10 ports below the range: too few to pick from, the kernel picks
    assert port >= LISTEN_PORTS_FROM + 10


def test_free_port_never_hands_out_a_port_twice_and_keeps_to_its_xdist_workers_share(monkeypatch):
    """A port is free only until its server binds it, which can be a minute later: the local stack picked its
    controller's port at its start and bound it after the fleet was up, and found it taken ("Address already in
    use", a fresh-clone CI run on f336a2c). One process never gets one port twice, and two xdist workers pick from
    disjoint shares."""
    import grayguard.localstack.procs as procs
    monkeypatch.setattr(procs, "ephemeral_range", lambda: (LISTEN_PORTS_FROM + 1200, 65535))
    monkeypatch.setattr(procs, "_HANDED_OUT", set())
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    ports = [free_port() for _ in range(300)]  # 300 picks of 1200 ports: repeats were likely before
    assert len(set(ports)) == len(ports)
    shares = {}
    for k in range(2):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        shares[k] = {free_port() for _ in range(50)}
    assert all(LISTEN_PORTS_FROM <= p < LISTEN_PORTS_FROM + 600 for p in shares[0])
    assert all(LISTEN_PORTS_FROM + 600 <= p < LISTEN_PORTS_FROM + 1200 for p in shares[1])


def test_wait_until_returns_the_value_or_times_out():
    t0 = time.monotonic()
    assert wait_until(lambda: time.monotonic() - t0 > 0.1 and "done", 5, 0.01) == "done"
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, 0.2, 0.05, "the impossible")
    with pytest.raises(TimeoutError, match="last error: boom"):
        wait_until(lambda: (_ for _ in ()).throw(ValueError("boom")), 0.1, 0.05)


def test_process_is_ready_then_stopped(tmp_path):
    port = free_port()
    p = start_process([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "log",
                      ready_url=f"http://127.0.0.1:{port}/", timeout_s=20)
    assert p.running()
    assert p.stop() is not None and not p.running()
    assert p.stop() == p.proc.returncode  # idempotent


def test_process_that_dies_reports_its_output(tmp_path):
    p = ManagedProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], tmp_path / "log")
    with pytest.raises(ProcessExited, match="bad flag"):
        p.wait_ready("http://127.0.0.1:1/", timeout_s=10)
    assert not p.running()


def test_process_that_never_gets_ready_is_killed(tmp_path):
    p = ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    with pytest.raises(TimeoutError):
        p.wait_ready(f"http://127.0.0.1:{free_port()}/", timeout_s=0.5)
    assert not p.running()


def test_webhook_receiver_records_posts():
    import requests
    with WebhookReceiver() as hook:
        requests.post(hook.url("/page"), json={"alerts": [{"status": "firing", "labels": {"a": "1"}}]}, timeout=5)
        got = hook.wait_for(lambda h: h.alerts("/page"), timeout_s=5)
        assert got[0]["labels"] == {"a": "1"}
        assert hook.alerts("/ticket") == []
