import pytest

from localstack.haproxy import HaproxyProc, haproxy_config


@pytest.fixture
def haproxy_factory(tmp_path):
    """haproxy_factory(backends, balance=...) -> a started HaproxyProc, stopped after the test."""
    procs = []

    def make(backends, balance="leastconn"):
        d = tmp_path / f"hap{len(procs)}"
        d.mkdir()
        p = HaproxyProc(d, haproxy_config(d / "admin.sock", backends, balance))
        p.start()
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()
