"""`grayguard demo --fleet vllm`: its own defaults and faults, the shipped timing, and the real-vLLM targets."""

from __future__ import annotations

import argparse

import pytest

from grayguard.demo import cli


def parse(*argv: str) -> cli.DemoOptions:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.options_from_args(p.parse_args(list(argv)))


def test_the_real_fleet_has_its_own_defaults_and_a_flag_given_wins():
    sim, real = parse(), parse("--fleet", "vllm")
    assert (sim.fleet, sim.nodes, sim.rate, sim.fault_start_s, sim.control_window) == ("sim", 8, 20.0, 30.0, "10s")
    assert (real.fleet, real.nodes, real.rate, real.fault_start_s, real.fault_end_s, real.duration_s) == (
        "vllm", 4, 1.5, 60.0, 120.0, 180.0)
    assert real.control_window == "30s" and real.fault_params == {"k": 10}  # the shipped window; 10 % of a core
    assert parse("--fleet", "vllm", "--nodes", "8", "--fault-until", "-1").nodes == 8
    assert parse("--fleet", "vllm", "--fault-until", "-1").fault_end_s is None


@pytest.mark.parametrize("argv, message", [
    (("--fleet", "vllm", "--fault", "pcie"), "no fault 'pcie'"),  # a simulator fault the real fleet cannot make
    (("--fleet", "vllm", "--fault", "thermal", "--fault-param", "k=1"), "above 1"),
    (("--fleet", "vllm", "--control-window", "10s"), "shipped config's window"),
    (("--fault", "engine_death"), "unknown fault"),  # a real-fleet fault the simulator does not have
])
def test_a_fault_or_flag_the_fleet_cannot_take_is_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_a_real_fleet_run_is_judged_by_the_real_vllm_targets_and_says_what_served_it():
    r = {"fault": "thermal", "controller": True, "fault_start_s": 60.0, "first_weight_cut_s": 64.9,
         "quarantine_s": 69.0, "page_s": 74.0, "fault_end_s": 120.0, "recovered_s": 150.0, "false_quarantines": []}
    assert cli.verdict({**r, "fleet": "vllm"}).startswith("all targets met: weight cut within 5 s")
    assert "weight cut within 3 s" in cli.verdict({**r, "fleet": "sim"})  # 4.9 s: missed in demo time
    assert cli.verdict({**r, "fleet": "sim"}).startswith("MISSED")
