from pathlib import Path

import pytest

from grayguard import terminate
from grayguard.localstack.haproxy import HaproxyProc, haproxy_config


def pytest_configure(config):
    """SIGTERM (a CI runner's timeout, `kill`) unwinds like Ctrl-C: pytest then tears the fixtures down, so the
    servers they started (HAProxy, Prometheus, etcd, real vLLM servers of 3 GB each) stop with it
    (tests/demo/test_sigterm.py)."""
    terminate.install()


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


# `make test` runs the suite in two processes (pytest-xdist, `-n 2 --dist loadgroup`): the modules below are pure
# (no server, no wall-clock figure) and run beside the rest; every other module, the ones that start real
# processes or time real seconds, stays in one group that one process runs in turn, as a plain `pytest` does, so
# no two stacks compete for the cores and their timings are what they were. A new module is in that group until
# it is listed here. Each listed module is a group of its own, so its module fixtures are built once.
PARALLEL_SAFE = frozenset({
    "bench/test_agent.py",
    "bench/test_benign_events.py",
    "bench/test_canary_shared.py",
    "bench/test_detection.py",
    "bench/test_engine.py",
    "bench/test_floor.py",
    "bench/test_live.py",
    "bench/test_model_option.py",
    "bench/test_reflexes.py",
    "bench/test_report_html.py",
    "bench/test_shipped_timing.py",
    "bench/test_smoke.py",
    "bench/test_vllmshapes.py",
    "controller/test_core_speed_equivalence.py",
    "controller/test_decide_equivalence_fast.py",
    "controller/test_decide_pools.py",
    "controller/test_decisions_identical.py",
    "controller/test_desired_version.py",
    "controller/test_export.py",
    "controller/test_fuzz_parsers.py",
    "controller/test_garbage_one_strike.py",
    "controller/test_gateway.py",
    "controller/test_gcpolicy.py",
    "controller/test_kv_outlier.py",
    "controller/test_leader.py",
    "controller/test_live.py",
    "controller/test_membership.py",
    "controller/test_policy.py",
    "controller/test_scoring.py",
    "controller/test_signals_replay.py",
    "controller/test_startup_checks.py",
    "controller/test_status_schema.py",
    "controller/test_tick_pure.py",
    "dashboards/test_links.py",
    "dashboards/test_render.py",
    "demo/test_fleet_options.py",
    "demo/test_membership_report.py",
    "demo/test_report.py",
    "demo/test_report_browser.py",
    "demo/test_report_html.py",
    "exporters/test_engine_fuzz.py",
    "exporters/test_engine_profiles.py",
    "exporters/test_engine_rules.py",
    "exporters/test_live.py",
    "exporters/test_podinfo_dcgm.py",
    "exporters/test_probe.py",
    "grayguard/test_config_all_errors.py",
    "grayguard/test_config_fuzz.py",
    "grayguard/test_config_schema.py",
    "grayguard/test_config_sections.py",
    "grayguard/test_health.py",
    "grayguard/test_htmlpage.py",
    "grayguard/test_httpserve.py",
    "grayguard/test_promclient_parse_fast.py",
    "grayguard/test_promclient_pool.py",
    "grayguard/test_verdict.py",
    "grayguard/test_vocab.py",
    "localstack/test_vllmfleet_pure.py",
    "rules/test_cli.py",
    "rules/test_dcgm.py",
    "rules/test_removed_series.py",
    "rules/test_render.py",
    "rules/test_rerender.py",
    "rules/test_rerender_offtick.py",
    "sim/test_calibrate.py",
    "sim/test_faults.py",
    "sim/test_model.py",
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(root):  # a module outside the suite (test_sigterm's pytest run): one group
            item.add_marker(pytest.mark.xdist_group("realtime"))
            continue
        module = item.path.relative_to(root).as_posix()
        item.add_marker(pytest.mark.xdist_group(module if module in PARALLEL_SAFE else "realtime"))
