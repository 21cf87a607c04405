"""EtcdProc, a real etcd on the shared supervisor: 127.0.0.1 and free ports, restart with or without its data."""

import pytest

from grayguard.localstack.etcd import EtcdProc, etcd_healthy
from grayguard.localstack.procs import BinaryMissing
from grayguard.registry import Registry, RegistryError


def test_start_stop_restart_keeps_the_data_and_wipe_starts_empty(tmp_path):
    etcd = EtcdProc(tmp_path).start()
    try:
        assert etcd.url.startswith("http://127.0.0.1:") and etcd_healthy(etcd.url)
        reg = Registry(etcd.url, timeout=1)
        lease = reg.grant(30)
        reg.put("/k", "v", lease=lease)
        etcd.restart()
        assert reg.get("/k").value == "v" and reg.keep_alive(lease) > 0  # the lease survives a restart too
        etcd.kill()  # SIGKILL: no clean shutdown
        assert not etcd.running() and not etcd_healthy(etcd.url)
        with pytest.raises(RegistryError) as e:
            reg.get("/k")
        assert e.value.kind == "unreachable"
        etcd.start()
        assert reg.get("/k").value == "v"
        etcd.restart(wipe=True)
        assert reg.get("/k") is None and reg.keep_alive(lease) == 0
        assert (tmp_path / "etcd.log").exists()
    finally:
        etcd.stop()
    etcd.stop()  # idempotent


def test_missing_etcd_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BinaryMissing, match="apt-get install etcd-server"):
        EtcdProc(tmp_path)
