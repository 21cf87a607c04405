"""NVML collector against the fake NVML module: golden exposition, throttling, PCIe, absent fields, errors."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from grayguard.exporters import fakenvml
from grayguard.exporters.fakenvml import FakeNvml, healthy_h100
from grayguard.exporters.gpumetrics import CLOCK_EVENT_REASONS
from grayguard.exporters.nvml import NvmlCollector
from grayguard.exporters.xid import XidWatcher
from grayguard.vocab import GPU_FLAGS

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "exporter_healthy_h100.prom"


def make(nvml, **kw):
    """A fresh registry with one NvmlCollector; returns (registry, collector)."""
    kw.setdefault("xid_events", False)
    registry = CollectorRegistry()
    collector = NvmlCollector(nvml=nvml, **kw)
    registry.register(collector)
    return registry, collector


def value(registry, name, gpu="0", **labels):
    uuid = healthy_h100(int(gpu)).uuid if gpu is not None else None
    full = {"gpu": gpu, "uuid": uuid, **labels} if gpu is not None else labels
    return registry.get_sample_value(name, full)


def wait_until(predicate, timeout=2.0):
    """Bounded wait for a condition another thread makes true."""
    deadline = time.monotonic() + timeout
    done = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        done.wait(0.005)
    return True


def test_golden_exposition_of_a_healthy_h100():
    registry, _ = make(FakeNvml([healthy_h100(0)]))
    text = generate_latest(registry).decode()
    if os.environ.get("GRAYGUARD_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_register_calls_no_nvml_and_describe_lists_every_family():
    fake = FakeNvml([healthy_h100(0)])
    _, collector = make(fake)
    assert fake.calls == 0 and not fake.initialized
    names = {m.name for m in collector.describe()}
    assert {"grayguard_exporter_nvml_up", "grayguard_gpu_info", "grayguard_gpu_xid_errors",
            "grayguard_gpu_clock_event_reasons", "grayguard_gpu_flags"} <= names


def test_thermally_throttled_gpu_shows_its_reasons_and_low_clock():
    gpu = healthy_h100(0, sm_clock_mhz=1095, temperature_c=91,
                       clock_event_reasons=fakenvml.CONSTANTS["nvmlClocksEventReasonHwThermalSlowdown"]
                       | fakenvml.CONSTANTS["nvmlClocksEventReasonSwThermalSlowdown"])
    registry, _ = make(FakeNvml([gpu]))
    assert value(registry, "grayguard_gpu_clock_event_reasons") == 0x40 | 0x20  # hw and sw thermal slowdown
    assert value(registry, "grayguard_gpu_sm_clock_hertz") == 1095e6
    assert value(registry, "grayguard_gpu_sm_clock_max_hertz") == 1980e6
    assert value(registry, "grayguard_gpu_temperature_celsius") == 91


@pytest.mark.parametrize("reason,bit", CLOCK_EVENT_REASONS)
def test_each_reason_is_its_nvml_bit_in_the_one_mask_series(reason, bit):
    registry, _ = make(FakeNvml([healthy_h100(0, clock_event_reasons=bit)]))
    assert bit == fakenvml.CONSTANTS["nvmlClocksEventReason" + "".join(w.title() for w in reason.split("_"))]
    assert value(registry, "grayguard_gpu_clock_event_reasons") == bit
    samples = [s for m in registry.collect() for s in m.samples if s.name == "grayguard_gpu_clock_event_reasons"]
    assert len(samples) == 1  # one series a GPU, whatever the mask


def test_the_mask_is_served_whole_with_bits_nvml_may_add():
    mask = 0x1 | 0x4 | 0x8 | 0x100 | 0x200  # 0x200: a bit newer than the table, passed through, not dropped
    registry, _ = make(FakeNvml([healthy_h100(0, clock_event_reasons=mask)]))
    assert value(registry, "grayguard_gpu_clock_event_reasons") == mask
    assert value(registry, "grayguard_gpu_flags") == BIT["slowed_under_load"]  # 0x8 hw_slowdown on a busy GPU


def info(registry, gpu="0"):
    """The labels of grayguard_gpu_info for one GPU (None when it has no such series)."""
    found = [s.labels for m in registry.collect() for s in m.samples
             if s.name == "grayguard_gpu_info" and s.labels["gpu"] == gpu]
    assert len(found) <= 1
    return found[0] if found else None


def test_gen1_link_on_a_gen5_gpu_shows_both_numbers():
    fake = FakeNvml([healthy_h100(0, pcie_gen=1, pcie_width=4, pcie_replay=1234)])
    registry, _ = make(fake)
    assert value(registry, "grayguard_gpu_pcie_link_generation") == 1
    assert value(registry, "grayguard_gpu_pcie_link_width") == 4
    labels = info(registry)  # the maxima are labels of the info series, not series of their own
    assert (labels["pcie_max_generation"], labels["pcie_max_width"]) == ("5", "16")
    assert value(registry, "grayguard_gpu_pcie_link_max_generation") is None
    assert value(registry, "grayguard_gpu_pcie_link_max_width") is None
    assert value(registry, "grayguard_gpu_pcie_replay_total") == 1234


def test_a_pcie_maximum_nvml_cannot_tell_is_an_absent_label():
    registry, _ = make(FakeNvml([healthy_h100(0, unsupported={"pcie_gen_max"}, no_permission={"pcie_width_max"})]))
    labels = info(registry)
    assert "pcie_max_generation" not in labels and "pcie_max_width" not in labels
    assert labels["name"] == "NVIDIA H100 80GB HBM3" and labels["driver_version"] == "550.54.15"
    assert value(registry, "grayguard_gpu_flags") == 0  # below its maximum is unknown: the bit is clear


BIT = dict(GPU_FLAGS)
THERMAL = fakenvml.CONSTANTS["nvmlClocksEventReasonHwThermalSlowdown"]


@pytest.mark.parametrize(("overrides", "flags"), [
    ({}, ()),  # busy and healthy
    ({"remapped_rows": (0, 1, 1, 0)}, ("row_remap_pending",)),
    ({"remapped_rows": (0, 1, 0, 1)}, ("row_remap_failure",)),
    ({"clock_event_reasons": THERMAL}, ("slowed_under_load",)),
    ({"clock_event_reasons": fakenvml.CONSTANTS["nvmlClocksEventReasonHwPowerBrakeSlowdown"]}, ("slowed_under_load",)),
    ({"clock_event_reasons": fakenvml.CONSTANTS["nvmlClocksEventReasonSwPowerCap"]}, ()),  # at its power limit
    ({"clock_event_reasons": THERMAL, "utilization_pct": 20}, ()),  # a slowdown on an idle GPU: no evidence
    ({"pcie_gen": 1, "utilization_pct": 0}, ("pcie_below_max",)),  # an idle link trains down: below max only
    ({"pcie_gen": 1}, ("pcie_below_max", "pcie_degraded_under_load")),
    ({"pcie_width": 8}, ("pcie_below_max", "pcie_degraded_under_load")),
    ({"pcie_gen": 4, "pcie_gen_max": 4}, ()),  # a Gen4 system: at its maximum
    ({"remapped_rows": (0, 2, 1, 1), "clock_event_reasons": THERMAL | 0x4, "pcie_width": 8},  # mixed
     ("row_remap_pending", "row_remap_failure", "slowed_under_load", "pcie_below_max", "pcie_degraded_under_load")),
])
def test_each_flag_is_its_bit_in_the_one_flags_series(overrides, flags):
    registry, _ = make(FakeNvml([healthy_h100(0, **overrides)]))
    assert value(registry, "grayguard_gpu_flags") == sum(BIT[f] for f in flags)
    samples = [s for m in registry.collect() for s in m.samples if s.name == "grayguard_gpu_flags"]
    assert len(samples) == 1  # one series a GPU, whatever holds


@pytest.mark.parametrize(("overrides", "flags"), [
    ({"unsupported": {"clock_event_reasons"}, "pcie_gen": 1},  # no reasons: slowed unknown; the link is known
     ("pcie_below_max", "pcie_degraded_under_load")),
    ({"unsupported": {"utilization_pct"}, "clock_event_reasons": THERMAL, "pcie_gen": 1},  # the load unknown
     ("pcie_below_max",)),
    ({"unsupported": {"remapped_rows"}}, ()),
    ({"no_permission": {"pcie_gen"}, "pcie_width": 8}, ()),  # the generation unknown: below its maximum unknown
    ({"unsupported": {"pcie_width_max"}, "pcie_width": 8}, ()),
])
def test_a_flag_whose_inputs_nvml_cannot_tell_is_clear(overrides, flags):
    registry, _ = make(FakeNvml([healthy_h100(0, **overrides)]))
    assert value(registry, "grayguard_gpu_flags") == sum(BIT[f] for f in flags)
    unknown = {"clock_event_reasons": "grayguard_gpu_clock_event_reasons",
               "utilization_pct": "grayguard_gpu_utilization_ratio", "remapped_rows": "grayguard_gpu_remapped_rows",
               "pcie_gen": "grayguard_gpu_pcie_link_generation"}
    for f in {*overrides.get("unsupported", ()), *overrides.get("no_permission", ())} & set(unknown):
        assert value(registry, unknown[f], **({"cause": "correctable"} if f == "remapped_rows" else {})) is None


def test_not_supported_and_no_permission_fields_are_absent_not_zero_and_logged_once(caplog):
    gpu = healthy_h100(0, unsupported={"memory_temperature_c", "ecc", "remapped_rows", "clock_event_reasons"},
                       no_permission={"pcie_replay", "energy_mj"})
    registry, _ = make(FakeNvml([gpu]))
    with caplog.at_level(logging.INFO, logger="grayguard.exporters.nvml"):
        for _ in range(3):
            text = generate_latest(registry).decode()
    for name in ("grayguard_gpu_memory_temperature_celsius", "grayguard_gpu_ecc_errors",
                 "grayguard_gpu_remapped_rows", "grayguard_gpu_clock_event_reasons", "grayguard_gpu_pcie_replay_total",
                 "grayguard_gpu_energy_joules_total"):
        assert f"\n{name}{{" not in text, name
    assert value(registry, "grayguard_gpu_temperature_celsius") == 46  # the rest is still there
    assert value(registry, "grayguard_gpu_flags") == 0  # its remap and slowdown bits unknown: clear
    assert value(registry, "grayguard_exporter_nvml_errors_total", gpu=None, kind="error") == 0
    skipped = [r for r in caplog.records if "not exported" in r.getMessage()]
    assert len(skipped) == 1 + 2 + 1 + 1 + 2  # each field once (ecc has 2 calls: volatile), over 3 scrapes


def test_library_not_found_gives_nvml_up_zero_and_no_gpu_series():
    registry, collector = make(FakeNvml([healthy_h100(0)], available=False))
    assert collector.start() is False
    text = generate_latest(registry).decode()
    assert registry.get_sample_value("grayguard_exporter_nvml_up") == 0
    assert "grayguard_gpu_" not in text  # grayguard_gpu_flags too: absent, not 0


def test_real_pynvml_on_a_machine_without_driver_is_nvml_down():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    registry, collector = make(pynvml)
    assert collector.start() is False
    assert registry.get_sample_value("grayguard_exporter_nvml_up") == 0


def test_old_driver_falls_back_to_throttle_reasons_and_temperature():
    fake = FakeNvml([healthy_h100(0, clock_event_reasons=0x4, temperature_c=71)], old_driver=True)
    registry, _ = make(fake)
    assert value(registry, "grayguard_gpu_clock_event_reasons") == 0x4  # sw_power_cap
    assert value(registry, "grayguard_gpu_temperature_celsius") == 71


def test_library_without_either_call_leaves_the_series_absent():
    class Ancient(FakeNvml):
        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            raise fakenvml.NVMLError_FunctionNotFound()

    fake = Ancient([healthy_h100(0)], old_driver=True)
    del_attr = "nvmlDeviceGetCurrentClocksEventReasons"
    fake.__dict__[del_attr] = None  # an old nvidia-ml-py without the newer function at all
    registry, _ = make(fake)
    assert value(registry, "grayguard_gpu_clock_event_reasons") is None
    assert value(registry, "grayguard_gpu_sm_clock_hertz") == 1980e6


def test_lost_gpu_is_a_series_and_the_other_gpus_keep_reporting():
    fake = FakeNvml([healthy_h100(0), healthy_h100(1)])
    registry, _ = make(fake)
    generate_latest(registry)  # learn identities while healthy
    fake.gpus[1].lost = True
    fake.gpus[1].remapped_rows = (0, 1, 1, 1)  # not read while lost: only the lost bit
    assert value(registry, "grayguard_gpu_flags", gpu="1") == BIT["lost"]
    assert value(registry, "grayguard_gpu_sm_clock_hertz", gpu="1") is None
    assert info(registry, "1")["uuid"] == healthy_h100(1).uuid and "pcie_max_width" not in info(registry, "1")
    assert value(registry, "grayguard_gpu_flags", gpu="0") == 0
    assert value(registry, "grayguard_gpu_sm_clock_hertz", gpu="0") == 1980e6
    assert value(registry, "grayguard_exporter_nvml_up", gpu=None) == 1
    fake.gpus[1].lost = False
    fake.gpus[1].reset_required = True
    assert value(registry, "grayguard_gpu_flags", gpu="1") == BIT["lost"]
    fake.gpus[1].reset_required = False
    assert value(registry, "grayguard_gpu_flags", gpu="1") == BIT["row_remap_pending"] | BIT["row_remap_failure"]


def test_gpu_lost_before_any_read_is_reported_with_an_empty_uuid():
    fake = FakeNvml([healthy_h100(0, lost=True)])
    registry, _ = make(fake)
    assert registry.get_sample_value("grayguard_gpu_flags", {"gpu": "0", "uuid": ""}) == BIT["lost"]


def test_gpu_that_falls_off_the_bus_is_reported_lost():
    fake = FakeNvml([healthy_h100(0), healthy_h100(1)])
    registry, _ = make(fake)
    generate_latest(registry)
    del fake.gpus[1]
    assert value(registry, "grayguard_gpu_flags", gpu="1") == BIT["lost"]
    assert value(registry, "grayguard_gpu_flags", gpu="0") == 0


def test_unexpected_nvml_error_is_counted_and_the_field_absent():
    class Flaky(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, h):
            raise fakenvml.NVMLError_Unknown()

    registry, _ = make(Flaky([healthy_h100(0)]))
    assert value(registry, "grayguard_gpu_power_watts") is None
    assert value(registry, "grayguard_gpu_power_limit_watts") == 700
    # get_sample_value scrapes: this is the third scrape, each counted one failed read
    assert registry.get_sample_value("grayguard_exporter_nvml_errors_total", {"kind": "error"}) == 3


def test_hung_nvml_does_not_block_the_scrape_past_the_read_timeout():
    fake = FakeNvml([healthy_h100(0)])
    registry, _ = make(fake, read_timeout=0.1)
    assert value(registry, "grayguard_gpu_sm_clock_hertz") == 1980e6
    fake.hang = threading.Event()
    try:
        start = time.monotonic()
        text = generate_latest(registry).decode()
        assert time.monotonic() - start < 0.5
        assert "grayguard_gpu_sm_clock_hertz{" not in text  # no stale data for a hung driver
        assert registry.get_sample_value("grayguard_exporter_nvml_errors_total", {"kind": "timeout"}) >= 1
    finally:
        fake.hang.set()
    assert wait_until(lambda: value(registry, "grayguard_gpu_sm_clock_hertz") == 1980e6)


def test_ecc_remap_utilization_and_memory_values():
    gpu = healthy_h100(0, remapped_rows=(3, 1, 1, 0), utilization_pct=42)
    gpu.ecc[("uncorrected", "volatile")] = 2
    registry, _ = make(FakeNvml([gpu]))
    ecc = "grayguard_gpu_ecc_errors"
    assert value(registry, ecc, error_type="uncorrected", counter_type="volatile") == 2
    assert value(registry, "grayguard_gpu_remapped_rows", cause="correctable") == 3
    assert value(registry, "grayguard_gpu_remapped_rows", cause="uncorrectable") == 1
    assert value(registry, "grayguard_gpu_flags") == BIT["row_remap_pending"]
    assert value(registry, "grayguard_gpu_utilization_ratio") == pytest.approx(0.42)
    assert value(registry, "grayguard_gpu_memory_total_bytes") == 85_520_809_984


@pytest.mark.parametrize("aggregate", [False, True])
def test_lifetime_ecc_counts_are_read_and_served_only_when_asked_for(aggregate):
    class Counting(FakeNvml):
        def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
            self.counter_types.add(counter_type)
            return super().nvmlDeviceGetTotalEccErrors(h, error_type, counter_type)

    gpu = healthy_h100(0)
    gpu.ecc[("uncorrected", "aggregate")] = 7
    fake = Counting([gpu])
    fake.counter_types = set()
    registry, _ = make(fake, ecc_aggregate=aggregate)
    samples = [s.labels for m in registry.collect() for s in m.samples if s.name == "grayguard_gpu_ecc_errors"]
    kinds = {(s["error_type"], s["counter_type"]) for s in samples}
    volatile = {("corrected", "volatile"), ("uncorrected", "volatile")}
    lifetime = {("corrected", "aggregate"), ("uncorrected", "aggregate")}
    assert kinds == (volatile | lifetime if aggregate else volatile)
    assert (fake.NVML_AGGREGATE_ECC in fake.counter_types) is aggregate  # not even read when off
    got = value(registry, "grayguard_gpu_ecc_errors", error_type="uncorrected", counter_type="aggregate")
    assert got == (7 if aggregate else None)


def test_xid_events_are_counted_per_gpu_and_code():
    fake = FakeNvml([healthy_h100(0), healthy_h100(1)])
    registry, collector = make(fake, xid_events=True)
    assert collector.start()
    try:
        generate_latest(registry)  # identities known, so XIDs carry the uuid
        assert collector.xid_watcher.ready.wait(2)
        fake.push_xid(0, 79)
        fake.gpus[0].push_xid(79)
        fake.push_xid(1, 48)
        assert wait_until(lambda: value(registry, "grayguard_gpu_xid_errors_total", xid="79") == 2)
        assert wait_until(lambda: value(registry, "grayguard_gpu_xid_errors_total", gpu="1", xid="48") == 1)
    finally:
        collector.stop()
    assert not collector.xid_watcher._thread.is_alive()


def test_xid_watcher_reports_events_and_treats_timeout_as_no_event():
    fake = FakeNvml([healthy_h100(0)])
    fake.nvmlInit()
    seen, got = [], threading.Event()
    watcher = XidWatcher(fake, lambda index, xid: (seen.append((index, xid)), got.set()), poll_ms=20)
    watcher.start()
    try:
        assert watcher.ready.wait(2)
        got.clear()
        assert not got.wait(0.1)  # several NVMLError_Timeout rounds, no event
        fake.push_xid(0, 94)
        assert got.wait(2)
        assert seen == [(0, 94)]
    finally:
        watcher.stop()


def test_a_driver_that_loads_late_is_picked_up_after_the_retry_interval():
    now = [100.0]
    fake = FakeNvml([healthy_h100(0)], available=False)
    registry, collector = make(fake, init_retry_s=30, clock=lambda: now[0])
    assert collector.start() is False
    fake.available = True
    assert registry.get_sample_value("grayguard_exporter_nvml_up") == 0  # too soon to retry
    now[0] += 31
    assert registry.get_sample_value("grayguard_exporter_nvml_up") == 1
    assert value(registry, "grayguard_gpu_sm_clock_hertz") == 1980e6
    collector.stop()
    now[0] += 31
    assert registry.get_sample_value("grayguard_exporter_nvml_up") == 0  # stopped stays stopped
    assert not fake.initialized
