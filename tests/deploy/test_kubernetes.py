"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, each object is valid against the Kubernetes
schemas (kubernetes-validate, strict; the prometheus-operator objects structurally, tests/deploy/crds.py), each
PrometheusRule holds exactly `grayguard rules render` of the example config (its registry on, as the cluster runs
it) and passes `promtool check rules`, the
dashboard ConfigMaps hold exactly dashboards/*.json, the generated files equal a fresh render, and the parts agree
with each other (the controller's endpoints are the gateway pods' read-only views, the gateway's servers are the
fleet's pods, the monitors' ports exist, every grayguard command line parses, the image tag is the version)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from grayguard.rules.render import render_all

from grayguard import __version__
from grayguard.cli import build_parser
from grayguard.config import load_config, parse_config
from tests.deploy import crds
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBE_VERSION = "1.32.0"  # the kubectl this project pins; kubernetes-validate ships its schemas
IMAGE = "ghcr.io/grayguard/grayguard"
CRD_GROUP = "monitoring.coreos.com/"
EXAMPLE = REPO / "grayguard.example.yaml"


def kustomize(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is missing (it renders the manifests: `kubectl kustomize`)")
    p = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(K8S / "overlays" / o) for o in OVERLAYS}


@pytest.fixture(scope="module")
def example_rules() -> dict[str, str]:
    """`grayguard rules render` of the example config with its registry section on, as the cluster runs it (the
    leader alerts then also cover a replica that exports no leader series)."""
    example = load_config(EXAMPLE)
    deployed = parse_config(yaml.safe_load((K8S / "base" / "controller" / "grayguard.yaml").read_text()))
    return render_all(dataclasses.replace(example, registry=deployed.registry))


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def containers(objs: list[dict]):
    for w in workloads(objs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"In": labels.get(k) in vals, "NotIn": labels.get(k) not in vals, "Exists": k in labels,
              "DoesNotExist": k not in labels}[op]
        if not ok:
            return False
    return True


def test_there_are_a_dev_and_a_production_overlay():
    assert {"dev", "production"} <= set(OVERLAYS)


def test_generated_files_equal_a_fresh_render():
    p = subprocess.run([sys.executable, str(REPO / "deploy" / "render.py"), "--check"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"run `python deploy/render.py`:\n{p.stderr}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_schemas(rendered, overlay):
    objs = rendered[overlay]
    assert objs
    for o in objs:
        where = f"{overlay}: {o.get('kind')} {o.get('metadata', {}).get('name')}"
        if o.get("apiVersion", "").startswith(CRD_GROUP):
            assert crds.problems(o) == [], where
            continue
        try:
            kubernetes_validate.validate(o, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "two objects of one kind and name"
    assert {o["metadata"].get("namespace") for o in objs} == {f"grayguard{'-dev' if overlay == 'dev' else ''}"}


def test_the_crd_checks_catch_a_typo():
    pm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
          "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoint": [{"port": "http"}]}}
    assert any("podMetricsEndpoint: unknown field" in p for p in crds.problems(pm))
    pm["spec"] = {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "h", "interval": "5"}]}
    assert crds.problems(pm) == ["spec.podMetricsEndpoints[0].interval: not a duration: '5'"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rules_are_the_example_render_and_pass_promtool(rendered, overlay, example_rules, tmp_path):
    require("promtool")
    rules = {o["metadata"]["name"]: o["spec"] for o in rendered[overlay] if o["kind"] == "PrometheusRule"}
    expected = {f"grayguard-{f.removeprefix('grayguard-').removesuffix('.rules.yml')}": yaml.safe_load(text)
                for f, text in example_rules.items()}
    assert rules == expected
    for name, spec in rules.items():
        f = tmp_path / f"{name}.yml"
        f.write_text(yaml.safe_dump(spec, sort_keys=False))
        p = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmaps_hold_exactly_the_dashboards(rendered, overlay):
    maps = [o for o in rendered[overlay] if o["kind"] == "ConfigMap"
            and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    got = {k: v for m in maps for k, v in m["data"].items()}
    want = {p.name: p.read_text() for p in sorted((REPO / "dashboards").glob("*.json"))}
    assert want and got == want
    assert all(len(m["data"]) == 1 and m["metadata"]["annotations"]["grafana_folder"] == "grayguard" for m in maps)


def controller_config(objs: list[dict], tmp_path: Path):
    cm = one(objs, "ConfigMap", "grayguard-controller-config")
    f = tmp_path / "grayguard.yaml"
    f.write_text(cm["data"]["grayguard.yaml"])
    return load_config(f)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_controller_config_agrees_with_the_tier_and_renders_the_same_rules(rendered, overlay, example_rules,
                                                                                 tmp_path):
    objs = rendered[overlay]
    cfg = controller_config(objs, tmp_path)
    assert render_all(cfg) == example_rules  # the PrometheusRules are this config's rules too
    example = load_config(EXAMPLE)  # and the decisions are the example's: only where things are differs
    assert (cfg.thresholds, cfg.recovery, cfg.signals) == (example.thresholds, example.recovery, example.signals)
    assert cfg.rules == dataclasses.replace(example.rules, rerender_interval_s=0, output_dir=cfg.rules.output_dir)
    assert cfg.haproxy.writer == "actuators" and cfg.rules.rerender_interval_s == 0
    gw = one(objs, "StatefulSet", "grayguard-gateway")
    view = next(p["containerPort"] for _, c in containers([gw]) for p in c.get("ports", []) if p["name"] == "view")
    assert list(cfg.haproxy.endpoints) == [f"grayguard-gateway-{i}.{gw['spec']['serviceName']}:{view}"
                                           for i in range(gw["spec"]["replicas"])]
    governing = one(objs, "Service", gw["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None" and [p["port"] for p in governing["spec"]["ports"]] == [view]
    assert cfg.registry.url == one(objs, "ConfigMap", "grayguard-registry")["data"]["url"]
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    assert cfg.registry.url.split("//")[1].split(":")[0] in services
    ctl = one(objs, "Deployment", "grayguard-controller")
    assert ctl["spec"]["replicas"] == 2
    assert any("--id=$(POD_NAME)" in a for _, c in containers([ctl]) for a in c["args"])
    assert cfg.listen_address.endswith(":9300") and not cfg.listen_address.startswith("127.")
    assert cfg.rules.controller_job == job_of(one(objs, "ServiceMonitor", "grayguard-controller"), "metrics")


def job_of(monitor: dict, port: str, path: str = "/metrics") -> str:
    eps = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    ep = next(e for e in eps if e["port"] == port and e.get("path", "/metrics") == path)
    return next(r["replacement"] for r in ep["relabelings"] if r.get("targetLabel") == "job")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_keeps_the_runtime_api_in_the_pod_and_names_the_fleet(rendered, overlay, tmp_path):
    require("haproxy")
    objs = rendered[overlay]
    cfg_text = one(objs, "ConfigMap", "grayguard-gateway-haproxy")["data"]["haproxy.cfg"]
    sockets = re.findall(r"^\s*stats socket (\S+)(.*)$", cfg_text, re.M)
    assert sockets == [("/run/haproxy/admin.sock", " mode 600 level admin")], "only the pod-local admin socket"
    gw = one(objs, "StatefulSet", "grayguard-gateway")
    spec = gw["spec"]["template"]["spec"]
    runtime = next(v for v in spec["volumes"] if v["name"] == "runtime")
    assert set(runtime) == {"name", "emptyDir"}  # no hostPath, no PVC: nothing outside the pod
    mounts = {c["name"] for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == "runtime"}
    assert mounts == {"haproxy", "actuator"}
    pod_labels = gw["spec"]["template"]["metadata"]["labels"]
    exposed = {p["targetPort"] for s in objs if s["kind"] == "Service" and s["spec"].get("selector")
               and selects({"matchLabels": s["spec"]["selector"]}, pod_labels) for p in s["spec"]["ports"]}
    assert exposed == {"http", "view"}  # traffic and the read-only view; never a runtime API

    # the servers are the fleet's pods, one each; haproxy accepts the config
    fleet = one(objs, "StatefulSet", "vllm-chat")
    want = [f"vllm-chat-{i}" for i in range(fleet["spec"]["replicas"])]
    assert re.findall(r"^\s*server (\S+) ", cfg_text, re.M) == want
    assert one(objs, "Service", fleet["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    f = tmp_path / "haproxy.cfg"
    f.write_text(cfg_text.replace("/run/haproxy/admin.sock", str(tmp_path / "admin.sock")))
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", "FLEET_NAMESPACE": "ns", "CLUSTER_DOMAIN": "cluster.local"}
    p = subprocess.run(["haproxy", "-c", "-f", str(f)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr

    # the view only from the controller
    pol = one(objs, "NetworkPolicy", "grayguard-gateway")
    for rule in pol["spec"]["ingress"]:
        if any(p["port"] == 9999 for p in rule["ports"]):
            controller = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "grayguard-controller"}}}
            assert rule["from"] == [controller]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_carry_the_package_version(rendered, overlay):
    images = {c["image"] for _, c in containers(rendered[overlay])}
    ours = {i for i in images if i.split(":")[0] == IMAGE}
    assert ours == {f"{IMAGE}:{__version__}"}
    assert all(":" in i for i in images), f"an image without a tag: {images}"


def substitute(arg: str) -> str:
    """$(VAR) as the kubelet expands it, with sample values."""
    sample = {"POD_NAME": "vllm-chat-0", "POD_IP": "10.0.0.7", "GRAYGUARD_POOL": "chat",
              "GRAYGUARD_REGISTRY_URL": "http://grayguard-etcd:2379"}
    return re.sub(r"\$\((\w+)\)", lambda m: sample[m.group(1)], arg)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_grayguard_command_line_parses(rendered, overlay):
    from grayguard.controller import actuator
    from grayguard.exporters import cli as exporter_cli
    seen = set()
    for _, c in containers(rendered[overlay]):
        if not c["image"].startswith(IMAGE):
            continue
        argv = [substitute(a) for a in c.get("command", []) + c["args"]]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{c['name']}: `grayguard {' '.join(argv)}` does not parse")
        seen.add(argv[0])
        check = {"exporter": exporter_cli.config_error, "actuator": actuator.config_error}.get(argv[0])
        assert check is None or check(args) is None, (c["name"], check(args))
    assert {"controller", "actuator", "exporter"} <= seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitors_find_their_ports(rendered, overlay, tmp_path):
    objs = rendered[overlay]
    for m in (o for o in objs if o["kind"] in ("PodMonitor", "ServiceMonitor")):
        sel = m["spec"]["selector"]
        if m["kind"] == "PodMonitor":
            pods = [w["spec"]["template"] for w in workloads(objs) if selects(sel, w["spec"]["template"]["metadata"]
                                                                              ["labels"])]
            ports = {p["name"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
            eps = m["spec"]["podMetricsEndpoints"]
        else:
            svcs = [s for s in objs if s["kind"] == "Service" and selects(sel, s["metadata"].get("labels", {}))]
            ports = {p["name"] for s in svcs for p in s["spec"]["ports"]}
            eps = m["spec"]["endpoints"]
        assert ports, f"{m['kind']} {m['metadata']['name']} selects nothing"
        for e in eps:
            assert e["port"] in ports, f"{m['metadata']['name']}: no port {e['port']!r} in {sorted(ports)}"
    cfg = controller_config(objs, tmp_path)
    fleet = one(objs, "PodMonitor", "grayguard-fleet")
    assert job_of(fleet, "exporter") == cfg.rules.exporter_job
    assert job_of(fleet, "exporter", "/metrics/fast") == "grayguard-exporter-fast"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_our_containers_are_sized_and_locked_down(rendered, overlay):
    for w, c in containers(rendered[overlay]):
        if "grayguard.io/pool" in w["metadata"].get("labels", {}) and c["name"] == "vllm" \
                and not c["image"].startswith(IMAGE):
            continue  # the example fleet's own vLLM: yours to size
        where = f"{w['metadata']['name']}/{c['name']}"
        res = c.get("resources", {})
        assert {"cpu", "memory"} <= set(res.get("requests", {})) and "memory" in res.get("limits", {}), where
        sc, pod = c.get("securityContext", {}), w["spec"]["template"]["spec"].get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
        assert not sc.get("privileged") and not w["spec"]["template"]["spec"].get("hostNetwork"), where


def test_the_actuated_config_needs_what_kubernetes_gives_it():
    # the base config alone (no overlay): valid, and writer actuators is refused without a registry
    base = yaml.safe_load((K8S / "base" / "controller" / "grayguard.yaml").read_text())
    assert parse_config(base).haproxy.writer == "actuators"
    with pytest.raises(Exception, match="haproxy.writer"):
        parse_config({**base, "registry": {}})


def test_the_image_is_the_one_the_manifests_expect():
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["grayguard"]' in text  # the manifests' args start with the subcommand
    assert "USER 65532:65532" in text  # their runAsUser
