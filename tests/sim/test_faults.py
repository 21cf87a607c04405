"""Fault catalogue: validation, multipliers over time, residual decay, schedules, fake-GPU effects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.sim.faults import (
    FAULTS,
    THERMAL_REASONS,
    FaultError,
    FaultState,
    ScheduledFault,
    fault_slowdown,
    gpu_effects,
    make_fault,
    nominal_slowdown,
)
from grayguard.sim.model import NO_SLOWDOWN

# The FakeGpu dataclass fields (exporters/fakenvml.py) plus the `xid` event key.
FAKEGPU_FIELDS = {
    "name", "uuid", "pci_bus_id", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz",
    "clock_event_reasons", "temperature_c", "memory_temperature_c", "power_mw", "power_limit_mw", "energy_mj",
    "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "pcie_replay", "ecc", "remapped_rows",
    "utilization_pct", "memory_used_bytes", "memory_total_bytes", "lost", "unsupported",
}


def test_defaults_filled_and_strings_converted():
    f = make_fault("thermal", {"k": "3"})
    assert f.params == {"k": 3.0, "recovery_s": 0.0}
    assert make_fault("cuda_error").params["mode"] == "http"
    assert make_fault("cuda_error", {"xid": "79"}).params["xid"] == 79


@pytest.mark.parametrize("name,params,match", [
    ("melt", {}, "unknown fault"),
    ("thermal", {"q": 1}, "no parameter 'q'"),
    ("thermal", {"k": "fast"}, "not a number"),
    ("thermal", {"k": 0.5}, ">= 1"),
    ("cuda_error", {"rate": 2}, "0..1"),
    ("cuda_error", {"mode": "boom"}, "mode"),
    ("garbage", {"style": "x"}, "style"),
    ("kv_thrash", {"period_s": 0}, "period_s"),
])
def test_bad_faults_are_reported_with_the_offending_field(name, params, match):
    with pytest.raises(FaultError, match=match):
        make_fault(name, params)


def test_thermal_multiplies_every_phase_pcie_separately():
    assert fault_slowdown(make_fault("thermal", {"k": 6}), 0.0).__dict__ == {
        "prefill": 6.0, "decode": 6.0, "kv_fraction": 1.0}
    sd = fault_slowdown(make_fault("pcie", {"k": 4, "prefill_k": 2}), 0.0)
    assert (sd.prefill, sd.decode) == (2.0, 4.0)
    for name in ("hang", "cuda_error", "garbage"):
        assert fault_slowdown(make_fault(name), 0.0) == NO_SLOWDOWN
    assert fault_slowdown(None, 0.0) == NO_SLOWDOWN


def test_kv_thrash_spikes_periodically_and_shrinks_the_cache():
    f = make_fault("kv_thrash", {"spike_k": 5, "period_s": 4, "spike_s": 1}, now=10.0)
    assert fault_slowdown(f, 10.5).decode == 5.0
    assert fault_slowdown(f, 12.0).decode == 1.0
    assert fault_slowdown(f, 14.2).decode == 5.0
    assert fault_slowdown(f, 12.0).kv_fraction == pytest.approx(0.06)


def test_slow_recovery_decays_after_clearing():
    state = FaultState()
    state.set("slow_recovery", {"k": 5, "recovery_s": 10}, now=0.0)
    assert state.slowdown(5.0).decode == 5.0
    state.clear(now=20.0)
    assert state.active is None
    values = [state.slowdown(20.0 + dt).decode for dt in (0, 5, 10, 30, 80)]
    assert values[0] == pytest.approx(5.0)
    assert values == sorted(values, reverse=True)
    assert values[2] == pytest.approx(1 + 4 / 2.718281828, rel=1e-3)
    assert values[-1] == 1.0 and not state.recovering(100.0)


def test_instant_recovery_by_default_and_replacing_a_fault():
    state = FaultState()
    state.set("thermal", {"k": 4}, 0.0)
    state.set("pcie", None, 1.0)
    assert state.active.name == "pcie"
    assert state.clear(2.0).name == "pcie"
    assert state.slowdown(2.0) == NO_SLOWDOWN
    assert state.clear(3.0) is None


@given(k=st.floats(1.0, 40.0), tau=st.floats(0.1, 100.0), t1=st.floats(0, 500), t2=st.floats(0, 500))
def test_residual_never_below_one_and_monotone(k, tau, t1, t2):
    state = FaultState()
    state.set("thermal", {"k": k, "recovery_s": tau}, 0.0)
    state.clear(0.0)
    a, b = sorted((t1, t2))
    sa, sb = state.slowdown(a).decode, state.slowdown(b).decode
    assert 1.0 <= sb <= sa + 1e-12 <= k + 1e-9


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_gpu_effects_use_fakegpu_field_names(name):
    effects = gpu_effects(name, {})
    assert set(effects) <= FAKEGPU_FIELDS | {"xid"}


def test_gpu_effects_tell_the_same_story():
    th = gpu_effects("thermal", {"k": 6})
    assert th["temperature_c"] >= 88 and th["clock_event_reasons"] & THERMAL_REASONS == THERMAL_REASONS
    assert th["sm_clock_mhz"] == 1980 // 6
    assert gpu_effects("thermal", {"k": 2}, base={"sm_clock_max_mhz": 1410})["sm_clock_mhz"] == 705
    pcie = gpu_effects("pcie")
    assert pcie == {"pcie_gen": 1}  # max generation untouched
    assert gpu_effects("cuda_error")["xid"] == 31
    assert gpu_effects("cuda_error", {"xid": 79})["xid"] == 79
    assert gpu_effects("garbage") == {} and gpu_effects("kv_thrash") == {}
    with pytest.raises(FaultError):
        gpu_effects("nope")


@pytest.mark.parametrize("spec,expected", [
    ("node3:thermal:30:90", ScheduledFault("node3", "thermal", 30.0, 90.0, {})),
    ("node3:thermal:30", ScheduledFault("node3", "thermal", 30.0, None, {})),
    ("node1:pcie:5:-:k=3,prefill_k=2", ScheduledFault("node1", "pcie", 5.0, None, {"k": "3", "prefill_k": "2"})),
    ("node2:hang:1:2.5", ScheduledFault("node2", "hang", 1.0, 2.5, {})),
    ("n:cuda_error:0:k=1", None),  # cuda_error has no k
])
def test_parse_fault_spec(spec, expected):
    if expected is None:
        with pytest.raises(FaultError):
            ScheduledFault.parse(spec)
    else:
        assert ScheduledFault.parse(spec) == expected


@pytest.mark.parametrize("spec", ["node3:thermal", "node3:thermal:x", "node3:thermal:30:20", "n:thermal:1:2:k"])
def test_bad_fault_specs(spec):
    with pytest.raises(FaultError):
        ScheduledFault.parse(spec)


def test_scheduled_fault_from_dict():
    sf = ScheduledFault.from_dict({"node": "node2", "fault": "thermal", "at_s": 3, "until_s": 9,
                                   "params": {"k": 4}})
    assert sf == ScheduledFault("node2", "thermal", 3.0, 9.0, {"k": 4})


def test_scheduled_fault_owns_its_params_and_is_hashable():
    params = {"k": 4}
    sf = ScheduledFault("node1", "thermal", 1.0, None, params)
    params["k"] = 9  # the caller's dict changing does not change the schedule
    assert sf.params == {"k": 4}
    assert hash(sf) == hash(ScheduledFault("node1", "thermal", 1.0, None, {"k": 4}))
    assert len({sf, ScheduledFault("node1", "thermal", 1.0, None, {"k": 4})}) == 1


@pytest.mark.parametrize("name,params,expected", [
    ("thermal", {}, 6.0),
    ("thermal", {"k": "3"}, 3.0),
    ("slow_recovery", {"k": 5}, 5.0),
    ("pcie", {}, 2.0),  # the smaller of decode x3 and prefill x2
    ("pcie", {"k": 1.5, "prefill_k": 4}, 1.5),
    ("kv_thrash", {}, None),  # spikes: no fixed multiplier
    ("hang", {}, None),
    ("cuda_error", {"rate": 0.5}, None),
    ("garbage", {}, None),
])
def test_nominal_slowdown_is_the_smaller_phase_multiplier(name, params, expected):
    assert nominal_slowdown(name, params) == expected


def test_nominal_slowdown_validates():
    with pytest.raises(FaultError, match="no parameter"):
        nominal_slowdown("hang", {"k": 2})


def test_the_http_node_refuses_a_fault_it_cannot_model():
    import pytest

    from grayguard.sim.faults import FaultError
    from grayguard.sim.node import SimNode

    with pytest.raises(FaultError, match="benchmark only"):
        SimNode("x").set_fault("refused")
