"""HaproxyProc, a real haproxy on the shared supervisor: config check, readiness, restart, orderly stop."""

import pytest

from grayguard.controller.haproxy import Command, RuntimeClient
from grayguard.localstack.haproxy import UNIX_PATH_MAX, HaproxyProc, haproxy_config
from grayguard.localstack.procs import BinaryMissing


@pytest.fixture
def hap(tmp_path):
    backends = {"vllm_chat": [(f"node{i}", f"127.0.0.1:{20000 + i}", 100) for i in range(2)]}
    p = HaproxyProc(tmp_path, haproxy_config(tmp_path / "admin.sock", backends))
    p.start()
    yield p
    p.stop()


def weights(hap: HaproxyProc) -> dict[str, int]:
    return {s.name: s.weight for s in RuntimeClient(hap.endpoint).show_servers_state("vllm_chat")}


def test_start_answers_on_the_runtime_socket_then_stop_ends_it(hap, tmp_path):
    proc = hap.proc
    assert proc is not None and proc.running()
    assert hap.endpoint == f"unix:{tmp_path / 'admin.sock'}"
    assert weights(hap) == {"node0": 100, "node1": 100}
    assert (tmp_path / "haproxy.log").exists()
    hap.stop()
    assert not proc.running() and hap.proc is None
    hap.stop()  # idempotent


def test_restart_comes_back_with_the_configured_weights(hap):
    assert all(r.ok for r in RuntimeClient(hap.endpoint).apply([Command("vllm_chat", "node0", "weight", 7)]))
    assert weights(hap)["node0"] == 7
    hap.restart()  # runtime changes are lost, as in production
    assert weights(hap) == {"node0": 100, "node1": 100}


def test_a_rejected_config_says_why_and_starts_nothing(tmp_path):
    hap = HaproxyProc(tmp_path, "backend b\n  balance no-such-algorithm\n")
    with pytest.raises(RuntimeError, match="haproxy rejected"):
        hap.start()
    assert hap.proc is None


def test_missing_haproxy_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BinaryMissing, match="apt-get install haproxy"):
        HaproxyProc(tmp_path)


def test_a_runtime_socket_path_too_long_for_unix_is_a_clear_error(tmp_path):
    """A long TMPDIR (pytest's own tmp_path nested a few levels) put the runtime socket beyond the 107 bytes a unix
    socket's path takes; `haproxy -c -q` refused it without a word ("haproxy rejected ...: "). Now the error says
    why."""
    d = tmp_path / ("d" * (UNIX_PATH_MAX - len(str(tmp_path))))
    d.mkdir()
    h = HaproxyProc(d, f"global\n  stats socket {d}/admin.sock\n")
    with pytest.raises(RuntimeError, match=r"is \d+ bytes, beyond the 107 a unix socket takes: use a shorter"):
        h.start()
    assert h.proc is None  # nothing started
