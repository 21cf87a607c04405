"""The registration's pre-checks ask the node's own engine (RegistrationConfig.engine, the exporter's --engine): a node
of each engine registers in a real etcd (localstack.etcd.EtcdProc) against a stand-in of that engine
(tests/support/engine_standin.py), with the model and version its own endpoints give; against a stand-in of another
engine the model check fails, named, and the node stays out. vLLM's pre-checks are tests/exporters/test_registration.py.
"""

from __future__ import annotations

import argparse
import itertools
import logging

import pytest
import requests

from grayguard.exporters import cli
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.registration import RegistrationConfig
from grayguard.exporters.server import Exporter
from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import wait_until
from grayguard.registry import NodeRecord, Registry, node_key
from tests.support.engine_standin import VERSIONS, StandIn

pytestmark = pytest.mark.e2e

_ids = itertools.count()
MODEL = {"sglang": "m", "tgi": "m", "llamacpp": "m", "triton": "ensemble"}  # what each stand-in serves
# a stand-in of another engine, and why the model check fails against it
WRONG = {"sglang": ("triton", "/v1/models answered 404"), "tgi": ("triton", "/v1/models answered 404"),
         "llamacpp": ("triton", "/v1/models answered 404"),
         "triton": ("sglang", "'ensemble' not ready: GET {url}/v2/models/ensemble/ready answered 404")}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    proc = EtcdProc(tmp_path_factory.mktemp("etcd")).start()
    yield proc
    proc.stop()


def config(url: str, node: StandIn, engine: str) -> RegistrationConfig:
    return RegistrationConfig(url=url, pool="p", node=f"{engine}-0", advertise=node.netloc,
                              prefix=f"/gge{next(_ids)}", heartbeat=0.3, ttl_min=2.0, ttl_max=3.0, leave_grace=0.1,
                              timeout=1.0, api_key_env=None, engine=engine)


def value(ex: Exporter, name: str, **labels) -> float | None:
    return ex.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("engine", sorted(MODEL))
def test_a_node_of_each_engine_registers_with_its_engines_model_and_version(etcd, engine):
    with StandIn(engine) as node:
        cfg = config(etcd.url, node, engine)
        with Exporter(node.url, port=0, nvml=None, probe=None, registration=cfg) as ex:
            wait_until(lambda: value(ex, "grayguard_registry_registered") == 1, 10, 0.05, f"the {engine} node")
            for check in ("port", "model", "api_key"):
                assert value(ex, "grayguard_registry_precheck_ok", check=check) == 1, check
            entry = Registry(etcd.url).get(node_key(cfg.prefix, "p", cfg.node))
            rec = NodeRecord.from_json(entry.value)
            assert (rec.model, rec.version) == (MODEL[engine], next(iter(VERSIONS[engine][1].values())))


@pytest.mark.parametrize("engine", sorted(WRONG))
def test_against_another_engines_stand_in_the_model_check_fails_named(etcd, engine, caplog):
    caplog.set_level(logging.INFO, logger="grayguard.exporters.registration")
    other, why = WRONG[engine]
    with StandIn(other) as node:
        cfg = config(etcd.url, node, engine)
        with Exporter(node.url, port=0, nvml=None, probe=None, registration=cfg) as ex:
            wait_until(lambda: value(ex, "grayguard_registry_precheck_ok", check="model") == 0, 10, 0.05,
                       "the model check judged")
            assert value(ex, "grayguard_registry_registered") == 0
            assert Registry(etcd.url).get(node_key(cfg.prefix, "p", cfg.node)) is None
            said = [r.getMessage() for r in caplog.records if "not registering" in r.getMessage()]
            assert said and "model: " in said[0] and why.format(url=node.url) in said[0], said


def test_vllms_pre_checks_against_a_triton_node_fail_as_before_engines(etcd, caplog):
    """Without --engine the pre-checks are vLLM's: a Triton node has no /v1/models and never registers."""
    caplog.set_level(logging.INFO, logger="grayguard.exporters.registration")
    with StandIn("triton") as node:
        cfg = config(etcd.url, node, "vllm")
        with Exporter(node.url, port=0, nvml=None, probe=None, registration=cfg) as ex:
            wait_until(lambda: value(ex, "grayguard_registry_precheck_ok", check="model") == 0, 10, 0.05,
                       "the model check judged")
            assert value(ex, "grayguard_registry_registered") == 0


def test_the_exporter_gives_the_registration_the_engine_it_probes_with_and_names_it(etcd):
    """exporters/cli.py builds the registration from --registry.* and the probe from --engine: the exporter hands the
    probe's engine to the registration, so a Triton node behind `--engine triton` registers."""
    with StandIn("triton") as node:
        cfg = config(etcd.url, node, "vllm")  # as the --registry.* flags give it
        probe = ProbeConfig(interval=0.5, deadline=3.0, slow_threshold=1.0, api_key_env=None, engine="triton")
        with Exporter(node.url, port=0, nvml=None, probe=probe, agent=None, registration=cfg) as ex:
            assert ex.registrar is not None and ex.registrar.config.engine == "triton"
            wait_until(lambda: value(ex, "grayguard_registry_registered") == 1, 10, 0.05, "the Triton node")
            with requests.Session() as s:
                s.trust_env = False
                page = s.get(ex.url + "/", timeout=5).text
            assert f"Triton Inference Server at {node.url}" in page and "vLLM" not in page


def test_engine_reaches_the_registration_from_the_flags_with_or_without_the_probe():
    reg = ["--registry.url", "http://127.0.0.1:2379", "--registry.pool", "p", "--registry.node", "n",
           "--registry.advertise", "10.0.0.13:8000"]
    for extra in ((), ("--no-probe",)):
        args = _parse(*reg, "--engine", "triton", *extra)
        assert cli.registration_config(args).engine == "triton"
        assert cli.build_exporter(args, nvml=None).registrar.config.engine == "triton"
    assert cli.registration_config(_parse(*reg)).engine == "vllm"


def _parse(*argv: str):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))
