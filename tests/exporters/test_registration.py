"""The exporter's registration in a real etcd (localstack.etcd.EtcdProc), beside the simulated vLLM fleet:
pre-checks, the record, the adaptive lease, leaving on SIGTERM, expiry on SIGKILL, etcd restarts."""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from grayguard.etcdconn import EtcdSettings
from grayguard.exporters import cli
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.gpumetrics import GpuReading, NvmlSnapshot
from grayguard.exporters.nvml import NvmlCollector
from grayguard.exporters.precheck import gpu_info, gpu_verdict, numa_node_of
from grayguard.exporters.registration import Registrar, RegistrationConfig, material_change
from grayguard.exporters.server import Exporter
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import free_port, wait_until
from grayguard.registry import NodeRecord, Registry, RegistryError, first_ttl, node_key
from grayguard.sim.fleet import FleetThread
from tests.exporters.test_docs import DOC, exposed_names

_ids = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    proc = EtcdProc(tmp_path_factory.mktemp("etcd")).start()
    yield proc
    proc.stop()


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of this test alone (it gets killed, restarted, wiped)."""
    proc = EtcdProc(tmp_path / "etcd").start()
    yield proc
    proc.stop()


@pytest.fixture
def fleet():
    ft = FleetThread(n=2)
    ft.start()
    yield ft
    ft.stop()


@pytest.fixture
def prefix():
    return f"/gg{next(_ids)}"  # each test its own keys in the shared etcd


def config(url: str, node, prefix: str, **kw) -> RegistrationConfig:
    base = dict(url=url, pool="chat", node=node.name, advertise=node.address, prefix=prefix, heartbeat=0.3,
                ttl_min=2.0, ttl_max=3.0, leave_grace=0.3, timeout=1.0)
    return RegistrationConfig(**{**base, **kw})


def exporter(node, cfg: RegistrationConfig, nvml=None) -> Exporter:
    return Exporter(node.url, port=0, nvml=nvml or FakeNvml([healthy_h100(0), healthy_h100(1)]), probe=None,
                    xid_events=False, registration=cfg)


def value(ex: Exporter, name: str, **labels) -> float | None:
    return ex.registry.get_sample_value(name, labels)


def record_of(reg: Registry, key: str) -> NodeRecord | None:
    entry = reg.get(key)
    return NodeRecord.from_json(entry.value) if entry else None


def registered(ex: Exporter, timeout: float = 10.0) -> None:
    wait_until(lambda: value(ex, "grayguard_registry_registered") == 1, timeout, 0.05, "the node registered")


class Watch:
    """Every event under a prefix, collected in a thread from the current revision on."""

    def __init__(self, reg: Registry, prefix: str):
        _, rev = reg.get_prefix(prefix)
        self.events: list = []
        self.times: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(reg, prefix, rev + 1), daemon=True)
        self._t.start()

    def _run(self, reg, prefix, start):
        try:
            for ev in reg.watch_prefix(prefix, start, self._stop):
                self.events.append(ev)
                self.times.append(time.monotonic())
        except RegistryError:
            pass

    def close(self):
        self._stop.set()
        self._t.join(3)


# --- registering ---------------------------------------------------------------------------------
def test_register_writes_the_full_record_on_an_adaptive_lease_and_exports_its_state(etcd, fleet, prefix):
    node = fleet.nodes[0]
    cfg = config(etcd.url, node, prefix, max_concurrency=64)
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    before = time.time()
    with exporter(node, cfg) as ex:
        registered(ex)
        rec = record_of(reg, key)
        assert rec is not None and rec.state == "serving"
        assert (rec.pool, rec.node, rec.endpoint, rec.exporter) == ("chat", node.name, node.address,
                                                                    f"127.0.0.1:{ex.address[1]}")
        assert (rec.model, rec.version) == ("meta-llama/Llama-3.1-8B-Instruct", "0.33.0")  # /v1/models, /version
        assert rec.gpu.name == "NVIDIA H100 80GB HBM3" and rec.gpu.count == 2
        assert rec.gpu.pci_bus_ids == ("00000000:18:00.0", "00000000:2A:00.0")
        assert rec.max_concurrency == 64 and before - 1 <= rec.registered_at <= time.time()
        assert rec.agent == ""  # no prober, no agent check: a server added from the registry gets none
        assert reg.get(key).lease == ex.registrar.lease
        # the first lease is first_ttl (no interval measured yet: 3 x 1 s + 1 s, clamped to ttl_max 3 s); two
        # heartbeats later it adapts down to ttl_min
        wait_until(lambda: (r := record_of(reg, key)) is not None and r.ttl_s == 2, 10, 0.05, "the adapted TTL")
        assert record_of(reg, key).registered_at == rec.registered_at  # a re-grant is no new registration
        assert reg.get(key).lease == ex.registrar.lease
        wait_until(lambda: value(ex, "grayguard_registry_heartbeats_total", result="ok") >= 3, 10, 0.05, "beats")
        assert value(ex, "grayguard_registry_lease_ttl_seconds") == 2
        assert 0 <= value(ex, "grayguard_registry_last_heartbeat_age_seconds") < 2
        for check in ("gpu", "port", "model", "api_key"):
            assert value(ex, "grayguard_registry_precheck_ok", check=check) == 1
        assert value(ex, "grayguard_registry_heartbeats_total", result="error") == 0
        page = requests.get(f"{ex.url}/metrics", timeout=5).text
        assert "grayguard_registry_registered 1.0" in page


def test_stop_writes_leaving_then_the_key_is_gone_at_once_not_after_the_ttl(etcd, fleet, prefix):
    node = fleet.nodes[0]
    cfg = config(etcd.url, node, prefix, ttl_min=10.0, ttl_max=10.0, leave_grace=0.5)
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    ex = exporter(node, cfg).start()
    registered(ex)
    watch = Watch(reg, f"{prefix}/")
    started = time.monotonic()
    ex.stop()
    assert time.monotonic() - started < 3  # leave_grace and two etcd calls, not the 10 s TTL
    assert reg.get(key) is None
    wait_until(lambda: len(watch.events) >= 2, 5, 0.05, "two events")
    watch.close()
    leaving, gone = watch.events
    assert leaving.kind == "put" and NodeRecord.from_json(leaving.value).state == "leaving"
    assert gone.kind == "delete" and gone.key == key
    assert watch.times[1] - watch.times[0] >= 0.4  # "leaving" stood for the grace
    assert value(ex, "grayguard_registry_registered") == 0


def _cli_exporter(tmp_path: Path, etcd: EtcdProc, node, prefix: str, *flags: str,
                  port: int | None = None) -> subprocess.Popen:
    """`grayguard exporter` registering node; flags: more flags, which override the timings here."""
    argv = [sys.executable, "-m", "grayguard.cli", "exporter", "--vllm.url", node.url,
            "--web.listen-address", f"127.0.0.1:{port or free_port()}", "--no-agent", "--no-probe",
            "--no-collector.nvml", "--registry.url", etcd.url, "--registry.pool", "chat", "--registry.node", node.name,
            "--registry.advertise", node.address, "--registry.prefix", prefix, "--registry.heartbeat", "300ms",
            "--registry.ttl-min", "2s", "--registry.ttl-max", "3s", "--registry.leave-grace", "500ms", *flags]
    log = open(tmp_path / "exporter.log", "wb")  # noqa: SIM115 - closed by the test's tmp_path cleanup
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])


def test_sigterm_says_leaving_then_deregisters(tmp_path, etcd, fleet, prefix):
    node = fleet.nodes[0]
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    proc = _cli_exporter(tmp_path, etcd, node, prefix)
    try:
        wait_until(lambda: reg.get(key) is not None, 30, 0.1, "the CLI exporter registered")
        watch = Watch(reg, f"{prefix}/")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        wait_until(lambda: any(e.kind == "delete" for e in watch.events), 5, 0.05, "the delete")
        watch.close()
    finally:
        proc.kill()
    states = [NodeRecord.from_json(e.value).state if e.kind == "put" else "deleted" for e in watch.events]
    assert states[-2:] == ["leaving", "deleted"], (tmp_path / "exporter.log").read_text()
    assert "deregistered" in (tmp_path / "exporter.log").read_text()


def test_sigkill_leaves_no_leaving_record_and_the_key_expires_with_its_ttl(tmp_path, etcd, fleet, prefix):
    node = fleet.nodes[1]
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    proc = _cli_exporter(tmp_path, etcd, node, prefix)
    try:
        wait_until(lambda: (r := record_of(reg, key)) is not None and r.ttl_s == 2, 30, 0.1, "TTL adapted to 2 s")
        watch = Watch(reg, f"{prefix}/")
        proc.kill()
        killed = time.monotonic()
        proc.wait(5)
        wait_until(lambda: reg.get(key) is None, 10, 0.05, "the key to expire")
        gone = time.monotonic() - killed
        watch.close()
    finally:
        proc.kill()
    assert 1.0 <= gone <= 5.0  # the lease ran out (2 s TTL, etcd checks every 500 ms): no deregistration
    assert [e.kind for e in watch.events] == ["delete"]  # no "leaving": the controller tells a crash apart


def _ok_beats(port: int) -> float:
    """grayguard_registry_heartbeats_total{result="ok"} on a CLI exporter's /metrics (0 before any)."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "grayguard_registry_heartbeats_total" and s.labels.get("result") == "ok":
                return s.value
    return 0.0


def test_a_node_killed_right_after_its_first_heartbeat_is_gone_within_the_first_ttl_not_ttl_max(
        tmp_path, etcd, fleet, prefix):
    """No interval can be measured before the second keep-alive: the first lease is first_ttl of the configured
    heartbeat (3 x 2 s + 1 s = 7 s here), not --registry.ttl-max (60 s) of HAProxy sending to a dead node."""
    node = fleet.nodes[1]
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    web = free_port()
    first = math.ceil(first_ttl(2.0, 1.0, lo=3.0, hi=60.0))
    assert first == 7
    proc = _cli_exporter(tmp_path, etcd, node, prefix, "--registry.heartbeat", "2s", "--registry.timeout", "1s",
                         "--registry.ttl-min", "3s", "--registry.ttl-max", "60s", port=web)
    try:
        # the second keep-alive, which measures a second interval (and moves the key to a 3 s lease), is 2 s off
        wait_until(lambda: _ok_beats(web) >= 1, 30, 0.02, "the first heartbeat")
        proc.kill()
        killed = time.monotonic()
        proc.wait(5)
        rec = record_of(reg, key)
        wait_until(lambda: reg.get(key) is None, first + 3.0, 0.05, f"the key to expire within {first} s")
        gone = time.monotonic() - killed
    finally:
        proc.kill()
    log = (tmp_path / "exporter.log").read_text()
    assert rec is not None and rec.ttl_s == first, log  # killed on its first lease
    assert gone <= first + 1.5  # counted from the first keep-alive, before the kill; etcd sweeps every 500 ms


# --- etcd restarts -------------------------------------------------------------------------------
def test_an_etcd_restart_with_its_data_keeps_every_node_registered_and_loses_nothing(own_etcd, fleet, prefix):
    reg = Registry(own_etcd.url, timeout=1)
    reg.put(f"{prefix}/other", "kept")
    exporters = [exporter(n, config(own_etcd.url, n, prefix)).start() for n in fleet.nodes]
    try:
        for ex in exporters:
            registered(ex)
        before = {n.name: record_of(reg, node_key(prefix, "chat", n.name)) for n in fleet.nodes}
        own_etcd.kill()
        # down longer than the TTL: the exporters can no longer claim their keys
        for ex in exporters:
            wait_until(lambda ex=ex: value(ex, "grayguard_registry_registered") == 0, 10, 0.05, "unregistered")
            assert value(ex, "grayguard_registry_errors_total", kind="unreachable") >= 1
        own_etcd.start()
        for ex in exporters:
            registered(ex)
        for ex, n in zip(exporters, fleet.nodes, strict=True):
            key = node_key(prefix, "chat", n.name)
            wait_until(lambda key=key, ex=ex: (e := reg.get(key)) is not None and e.lease == ex.registrar.lease,
                       10, 0.05, f"{key} on the exporter's lease")
            assert record_of(reg, key).registered_at >= before[n.name].registered_at
        assert reg.get(f"{prefix}/other").value == "kept"
        ok = value(exporters[0], "grayguard_registry_heartbeats_total", result="ok")
        wait_until(lambda: value(exporters[0], "grayguard_registry_heartbeats_total", result="ok") > ok + 2, 10, 0.05,
                   "heartbeats resumed")
    finally:
        for ex in exporters:
            ex.stop()


def test_an_etcd_that_lost_its_data_gets_the_node_registered_again(own_etcd, fleet, prefix):
    reg = Registry(own_etcd.url, timeout=1)
    node = fleet.nodes[0]
    key = node_key(prefix, "chat", node.name)
    with exporter(node, config(own_etcd.url, node, prefix)) as ex:
        registered(ex)
        first = reg.get(key)
        own_etcd.kill()
        own_etcd.restart(wipe=True)
        wait_until(lambda: reg.get(key) is not None, 15, 0.05, "registered again in the empty etcd")
        assert reg.get(key).lease != first.lease and reg.get(key).lease == ex.registrar.lease
        assert value(ex, "grayguard_registry_heartbeats_total", result="lost") >= 1
        registered(ex)


# --- pre-checks ----------------------------------------------------------------------------------
def _fails(ex: Exporter, check: str, reg: Registry, key: str, caplog, why: str) -> None:
    wait_until(lambda: value(ex, "grayguard_registry_precheck_ok", check=check) == 0, 10, 0.05, f"{check} judged")
    time.sleep(1.0)  # three more tries: still unregistered, and said once, not every try
    assert value(ex, "grayguard_registry_registered") == 0 and reg.get(key) is None
    said = [r.getMessage() for r in caplog.records if "not registering" in r.getMessage()]
    assert len(said) == 1 and f"{check}: " in said[0] and why in said[0], said


def test_a_wrong_api_key_keeps_the_node_unregistered_until_the_key_is_right(tmp_path, etcd, fleet, prefix, caplog):
    caplog.set_level(logging.INFO, logger="grayguard.exporters.registration")
    node = fleet.nodes[0]
    fleet.call(setattr, fleet.fleet.nodes[node.name], "api_key", "s3cret")
    key_file = tmp_path / "key"
    key_file.write_text("bad-key-123\n")
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    with exporter(node, config(etcd.url, node, prefix, api_key_file=str(key_file))) as ex:
        _fails(ex, "api_key", reg, key, caplog, "answered 401")
        assert "s3cret" not in caplog.text and "bad-key-123" not in caplog.text  # no key is ever logged
        key_file.write_text("s3cret\n")  # re-read at every try
        registered(ex)
        assert value(ex, "grayguard_registry_precheck_ok", check="api_key") == 1 and reg.get(key) is not None


def test_no_model_loaded_keeps_the_node_unregistered_until_it_is(etcd, fleet, prefix, caplog):
    caplog.set_level(logging.INFO, logger="grayguard.exporters.registration")
    node = fleet.nodes[0]
    fleet.call(setattr, fleet.fleet.nodes[node.name], "model_loaded", False)
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    with exporter(node, config(etcd.url, node, prefix)) as ex:
        _fails(ex, "model", reg, key, caplog, "no model loaded")
        fleet.call(setattr, fleet.fleet.nodes[node.name], "model_loaded", True)
        registered(ex)


def test_a_model_other_than_the_one_asked_for_fails_the_model_check(etcd, fleet, prefix, caplog):
    node = fleet.nodes[0]
    reg = Registry(etcd.url)
    with exporter(node, config(etcd.url, node, prefix, model="other/model")) as ex:
        _fails(ex, "model", reg, node_key(prefix, "chat", node.name), caplog, "'other/model' not loaded")


def test_an_uncorrectable_ecc_error_fails_the_gpu_check(etcd, fleet, prefix, caplog):
    node = fleet.nodes[0]
    gpu = healthy_h100(1)
    gpu.ecc[("uncorrected", "volatile")] = 2
    reg = Registry(etcd.url)
    with exporter(node, config(etcd.url, node, prefix), nvml=FakeNvml([healthy_h100(0), gpu])) as ex:
        _fails(ex, "gpu", reg, node_key(prefix, "chat", node.name), caplog, "2 uncorrectable ECC errors")


def test_an_unreachable_serving_port_fails_the_port_check(etcd, fleet, prefix, caplog):
    node = fleet.nodes[0]
    reg = Registry(etcd.url)
    cfg = config(etcd.url, node, prefix, advertise=f"127.0.0.1:{free_port()}")
    with exporter(node, cfg) as ex:
        _fails(ex, "port", reg, node_key(prefix, "chat", node.name), caplog, "cannot connect")


def test_gpu_verdict_and_metadata_are_pure(tmp_path):
    healthy = NvmlSnapshot(up=True, gpus=(GpuReading(0, "GPU-a", "H100", "00000000:18:00.0"),
                                          GpuReading(1, "GPU-b", "H100", "00000000:2A:00.0")))
    assert gpu_verdict(healthy).ok
    assert "NVML not readable" in gpu_verdict(NvmlSnapshot(up=False)).reason
    assert "no GPU" in gpu_verdict(NvmlSnapshot(up=True)).reason
    lost = NvmlSnapshot(up=True, gpus=(GpuReading(0, "GPU-a", lost=True),))
    assert "lost" in gpu_verdict(lost).reason
    xid = NvmlSnapshot(up=True, gpus=healthy.gpus, xid_counts={(1, "GPU-b", 79): 1})
    assert gpu_verdict(xid).reason == "GPU 1 (GPU-b) reported XID 79 (1x) since the exporter started"
    info = gpu_info(healthy, {"00000000:18:00.0": 1, "00000000:2A:00.0": 0}.get)
    assert (info.name, info.count, info.numa_nodes) == ("H100", 2, (0, 1))
    sysfs = tmp_path / "devices"
    for bus, numa in (("0000:18:00.0", "1\n"), ("0000:2a:00.0", "-1\n")):
        (sysfs / bus).mkdir(parents=True)
        (sysfs / bus / "numa_node").write_text(numa)
    assert numa_node_of("00000000:18:00.0", sysfs) == 1
    assert numa_node_of("00000000:2A:00.0", sysfs) is None  # -1: the platform does not say
    assert numa_node_of("00000000:99:00.0", sysfs) is None


def test_numa_nodes_come_from_the_injected_lookup_into_the_record(etcd, fleet, prefix):
    node = fleet.nodes[0]
    collector = NvmlCollector(nvml=FakeNvml([healthy_h100(0), healthy_h100(1)]), xid_events=False)
    collector.start()
    numa = {"00000000:18:00.0": 0, "00000000:2A:00.0": 1}
    r = Registrar(config(etcd.url, node, prefix), vllm_url=node.url, nvml_snapshot=collector.snapshot,
                  numa_of=numa.get)
    r.start(exporter="127.0.0.1:9400")
    try:
        wait_until(lambda: r.registered, 10, 0.05, "registered")
        rec = record_of(Registry(etcd.url), node_key(prefix, "chat", node.name))
        assert rec.gpu.numa_nodes == (0, 1) and rec.exporter == "127.0.0.1:9400"
    finally:
        r.stop()
        collector.stop()


# --- the heartbeat -------------------------------------------------------------------------------
class _Jittery:
    """A Registry whose keep-alives arrive after a random delay (a loaded node, a slow network)."""

    def __init__(self, inner: Registry, rng: random.Random, most: float):
        self._inner, self._rng, self._most = inner, rng, most
        self.waits: list[float] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def keep_alive(self, lease: int) -> int:
        wait = self._rng.uniform(0, self._most)
        self.waits.append(wait)
        time.sleep(wait)
        return self._inner.keep_alive(lease)


def test_a_jittery_heartbeat_does_not_evict(etcd, fleet, prefix):
    node = fleet.nodes[0]
    client = _Jittery(Registry(etcd.url), random.Random(3), most=1.2)  # intervals 0.2 to 1.4 s
    cfg = config(etcd.url, node, prefix, heartbeat=0.2, ttl_min=2.0, ttl_max=6.0)
    r = Registrar(cfg, vllm_url=node.url, client=client)
    reg = Registry(etcd.url)
    key = node_key(prefix, "chat", node.name)
    r.start(exporter="127.0.0.1:9400")
    try:
        wait_until(lambda: r.registered, 10, 0.05, "registered")
        lease = r.lease
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:  # the key never blinks, the lease is never lost
            assert reg.get(key) is not None
            time.sleep(0.1)
        assert r.sample()["beats"]["lost"] == 0 and r.sample()["beats"]["ok"] >= 6
        assert max(client.waits) > 0.8 and r.registered
        assert lease is not None
    finally:
        r.stop()
    assert reg.get(key) is None


def test_a_ttl_change_is_material_at_a_quarter_and_one_second():
    assert not material_change(5, 5) and not material_change(5, 6) and material_change(5, 7)
    assert material_change(60, 5) and material_change(2, 3) and not material_change(40, 35)


# --- flags and docs ------------------------------------------------------------------------------
def _parse(*argv: str):
    import argparse
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


REG = ("--registry.url", "http://127.0.0.1:2379", "--registry.pool", "chat", "--registry.node", "node3",
       "--registry.advertise", "10.0.0.13:8000")


def test_registry_flags_map_to_the_config_and_are_off_by_default():
    assert cli.registration_config(_parse()) is None and cli.config_error(_parse()) is None
    args = _parse(*REG, "--registry.heartbeat", "500ms", "--registry.ttl-min", "3s", "--registry.ttl-max", "1m",
                  "--registry.leave-grace", "2s", "--registry.max-concurrency", "64", "--probe.model", "m",
                  "--probe.api-key-file", "/k", "--registry.prefix", "/gg/v1")
    assert cli.config_error(args) is None
    assert cli.registration_config(args) == RegistrationConfig(
        url="http://127.0.0.1:2379", pool="chat", node="node3", advertise="10.0.0.13:8000", prefix="/gg/v1",
        heartbeat=0.5, ttl_min=3.0, ttl_max=60.0, leave_grace=2.0, timeout=2.0, max_concurrency=64, model="m",
        api_key_file="/k", api_key_env="VLLM_API_KEY", etcd=EtcdSettings(("http://127.0.0.1:2379",), 2.0))


@pytest.mark.parametrize(("extra", "says"), [
    (("--registry.url", "etcd:2379"), "--registry.url"),
    (("--registry.node", "node 3"), "HAProxy-safe"),
    (("--registry.pool", "a;b"), "HAProxy-safe"),
    (("--registry.prefix", "gg"), "prefix"),
    (("--registry.advertise", "10.0.0.13"), "--registry.advertise"),
    (("--registry.exporter-address", "h:0"), "--registry.exporter-address"),
    (("--registry.heartbeat", "5s"), "--registry.heartbeat < --registry.ttl-min"),
    (("--registry.ttl-min", "90s"), "--registry.ttl-min <= --registry.ttl-max"),
    (("--registry.ttl-min", "500ms", "--registry.heartbeat", "100ms"), "at least 1s"),
    (("--registry.leave-grace", "-1"), "--registry.leave-grace"),
    (("--registry.max-concurrency", "0"), "--registry.max-concurrency"),
])
def test_a_bad_registry_flag_is_named(extra, says):
    assert says in cli.config_error(_parse(*REG, *extra))


def test_registry_flags_need_pool_node_and_advertise():
    assert "needs --registry.pool" in cli.config_error(_parse("--registry.url", "http://127.0.0.1:2379"))


def test_every_registry_series_is_documented():
    ex = Exporter("http://127.0.0.1:1", port=0, nvml=None, probe=None,
                  registration=RegistrationConfig(url="http://127.0.0.1:1", pool="p", node="n", advertise="h:1"))
    names = {n for n in exposed_names(ex.registry) if n.startswith("grayguard_registry_")}
    assert names == {"grayguard_registry_registered", "grayguard_registry_lease_ttl_seconds",
                     "grayguard_registry_heartbeats_total", "grayguard_registry_last_heartbeat_age_seconds",
                     "grayguard_registry_precheck_ok", "grayguard_registry_errors_total"}
    exporters_doc = (Path(__file__).resolve().parents[2] / "docs" / "exporters.md").read_text()
    for name in sorted(names):
        assert f"`{name}`" in DOC, name
        assert name in exporters_doc, name
    assert json.loads(NodeRecord(pool="p", node="n", endpoint="h:1", exporter="h:2", model="m").to_json())["state"] \
        == "serving"


def test_the_simulated_node_can_require_a_key_on_v1_and_hide_its_model(fleet):
    """sim/node.py's two pre-check options: like vLLM --api-key (only /v1/ routes), and no model loaded yet."""
    node = fleet.nodes[0]
    sim = fleet.fleet.nodes[node.name]
    fleet.call(setattr, sim, "api_key", "k1")
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi", "max_tokens": 1}
    assert requests.get(f"{node.url}/v1/models", timeout=5).status_code == 401
    assert requests.post(f"{node.url}/v1/completions", json=body, timeout=5).json() == {"error": "Unauthorized"}
    auth = {"Authorization": "Bearer k1"}
    assert requests.post(f"{node.url}/v1/completions", json=body, headers=auth, timeout=5).status_code == 200
    assert requests.get(f"{node.url}/health", timeout=5).status_code == 200  # vLLM guards /v1/ only
    assert requests.get(f"{node.url}/version", timeout=5).status_code == 200
    fleet.call(setattr, sim, "model_loaded", False)
    assert requests.get(f"{node.url}/v1/models", headers=auth, timeout=5).json()["data"] == []
