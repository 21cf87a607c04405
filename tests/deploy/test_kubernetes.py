"""deploy/kubernetes: every overlay renders with `kubectl kustomize` as shipped and set to other fleets (two fleet
sizes, both workload kinds, other names and namespaces: its grayguard-fleet literals and the fleet file it lists
changed, the one place docs/operations.md tells an operator to change), each object is valid against the Kubernetes
schemas (kubernetes-validate, strict; the prometheus-operator objects structurally, tests/deploy/crds.py), each
PrometheusRule holds exactly `grayguard rules render` of the example config (its registry on, as the cluster runs
it) and passes `promtool check rules`, the
dashboard ConfigMaps hold exactly dashboards/*.json, the generated files equal a fresh render, and the parts agree
with each other (the controller's endpoints are the gateway pods' read-only views, the gateway's server slots are the
fleet's replicas and its DNS name the fleet's headless Service, every object in its namespace, the monitors' ports
and namespaces exist, every grayguard command line parses, the image tag is the version)."""

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

from grayguard import __version__
from grayguard.cli import build_parser
from grayguard.config import load_config, parse_config
from grayguard.controller.haproxy import RuntimeClient
from grayguard.flags import deprecated_used
from grayguard.localstack.procs import free_port, wait_until
from grayguard.rules.render import render_all
from tests.deploy import crds
from tests.support.kube import kustomize
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBE_VERSION = "1.32.0"  # the kubectl this project pins; kubernetes-validate ships its schemas
IMAGE = "ghcr.io/grayguard/grayguard"
IMAGES = (IMAGE, f"{IMAGE}-dev")  # deploy/docker/Dockerfile's default target and its target dev
CRD_GROUP = "monitoring.coreos.com/"
EXAMPLE = REPO / "grayguard.example.yaml"
POOL_LABEL = "grayguard.io/pool"


@dataclasses.dataclass(frozen=True)
class Fleet:
    """One setting of an overlay's one place: its grayguard-fleet literals and the fleet file it lists."""

    kind: str = "StatefulSet"
    replicas: int | None = None  # None: as shipped
    name: str | None = None
    namespace: str | None = None  # grayguard's
    fleet_namespace: str | None = None

    def __str__(self) -> str:
        return "-".join(str(v) for v in dataclasses.astuple(self) if v is not None)


# as shipped; two fleet sizes of both kinds; a fleet of another name in a namespace of its own
FLEETS = (Fleet(), Fleet(replicas=2), Fleet("Deployment"), Fleet("Deployment", 7),
          Fleet("Deployment", 3, "llama-70b", "gg-system", "models"))
VARIANTS = [(o, f) for o in OVERLAYS for f in FLEETS]
IDS = [f"{o}-{f}" for o, f in VARIANTS]


def set_fleet(kustomization: str, fleet: Fleet) -> str:
    """The overlay's kustomization.yaml with fleet's values in its one place; each must be found exactly once."""
    subs = [(r"(- fleet\.replicas=)\d+", fleet.replicas), (r"(- fleet\.name=)\S+", fleet.name),
            (r"(- namespace=)\S+", fleet.namespace), (r"(- fleet\.namespace=)\S+", fleet.fleet_namespace)]
    for pattern, value in subs:
        if value is not None:
            kustomization, n = re.subn(pattern, lambda m, v=value: f"{m.group(1)}{v}", kustomization)
            assert n == 1, f"{pattern}: {n} matches in the overlay's kustomization.yaml"
    if fleet.kind == "Deployment":
        kustomization, n = re.subn(r"^(\s+- \S+-)statefulset\.yaml", r"\1deployment.yaml", kustomization, flags=re.M)
        assert n == 1, "the overlay lists no *-statefulset.yaml fleet"
    return kustomization


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[tuple[str, Fleet], list[dict]]:
    tree = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(K8S, tree)
    out = {}
    for overlay in OVERLAYS:
        kfile = tree / "overlays" / overlay / "kustomization.yaml"
        shipped = kfile.read_text()
        for fleet in FLEETS:
            kfile.write_text(set_fleet(shipped, fleet))
            out[(overlay, fleet)] = kustomize(kfile.parent)
        kfile.write_text(shipped)
    return out


def settings(objs: list[dict]) -> dict[str, str]:
    """The grayguard-fleet ConfigMap's values: namespace, fleet.namespace, fleet.name, fleet.replicas."""
    return one(objs, "ConfigMap", "grayguard-fleet")["data"]


def fleet_objects(objs: list[dict]) -> list[dict]:
    return [o for o in objs if POOL_LABEL in o["metadata"].get("labels", {})]


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


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_every_object_is_valid_against_the_schemas(rendered, overlay, fleet):
    objs = rendered[(overlay, fleet)]
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


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_the_one_place_sets_namespaces_names_size_and_kind(rendered, overlay, fleet):
    objs = rendered[(overlay, fleet)]
    s = settings(objs)
    shipped = settings(rendered[(overlay, Fleet())])
    want = {"namespace": fleet.namespace or shipped["namespace"], "fleet.name": fleet.name or shipped["fleet.name"],
            "fleet.namespace": fleet.fleet_namespace or shipped["fleet.namespace"],
            "fleet.replicas": str(fleet.replicas or shipped["fleet.replicas"])}
    assert s == want
    assert shipped["namespace"] == f"grayguard{'-dev' if overlay == 'dev' else ''}"
    # every object in its namespace: the fleet's (labelled with its pool) in the fleet's, the rest in grayguard's
    ours = [o for o in objs if o not in fleet_objects(objs)]
    assert {o["metadata"].get("namespace") for o in ours} == {s["namespace"]}
    assert {o["metadata"].get("namespace") for o in fleet_objects(objs)} == {s["fleet.namespace"]}
    # the fleet: one workload of the kind listed, named, sized, its exporter sidecar in; its headless Service
    (w,) = workloads(fleet_objects(objs))
    assert (w["kind"], w["metadata"]["name"], w["spec"]["replicas"]) == (fleet.kind, s["fleet.name"],
                                                                          int(s["fleet.replicas"]))
    assert "grayguard-exporter" in {c["name"] for c in w["spec"]["template"]["spec"]["containers"]}
    assert POOL_LABEL in w["spec"]["template"]["metadata"]["labels"]
    svc = one(fleet_objects(objs), "Service", s["fleet.name"])
    assert svc["metadata"]["name"] == s["fleet.name"] and svc["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": svc["spec"]["selector"]}, w["spec"]["template"]["metadata"]["labels"])
    assert "http" in {p["name"] for p in svc["spec"]["ports"]}  # HAProxy asks for the SRV records _http._tcp
    if w["kind"] == "StatefulSet":
        assert w["spec"]["serviceName"] == s["fleet.name"]
    else:  # a slot per replica: never a surge pod HAProxy has no slot for
        assert w["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # Prometheus looks for the fleet in its namespace; the exporters reach etcd from there, by a qualified name
    assert one(objs, "PodMonitor", "grayguard-fleet")["spec"]["namespaceSelector"] == {
        "matchNames": [s["fleet.namespace"]]}
    url = one(objs, "ConfigMap", "grayguard-registry")["data"]["url"]
    assert url == f"http://grayguard-etcd.{s['namespace']}.svc:2379"
    exporter = next(c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "grayguard-exporter")
    assert {"name": "GRAYGUARD_REGISTRY_URL", "value": url} in exporter["env"]
    pol = one(objs, "NetworkPolicy", "grayguard-etcd")
    peers = [p for r in pol["spec"]["ingress"] for p in r["from"] if "namespaceSelector" in p]
    assert peers == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": s["fleet.namespace"]}},
                      "podSelector": {"matchExpressions": [{"key": POOL_LABEL, "operator": "Exists"}]}}]


def test_an_overlay_renders_without_a_fleet_of_its_own(tmp_path):
    """A fleet another tool deploys (KServe, production-stack, llm-d): the example's files left out, grayguard renders
    alone, the monitor and the gateway still pointed at the fleet by the one place."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    kfile = tree / "overlays" / "production" / "kustomization.yaml"
    text, n = re.subn(r"^\s+- vllm-chat-\S+\.yaml.*\n", "", set_fleet(kfile.read_text(), Fleet(
        "StatefulSet", 5, "llama", fleet_namespace="models")), flags=re.M)
    assert n == 2
    kfile.write_text(text)
    objs = kustomize(kfile.parent)
    assert fleet_objects(objs) == [] and {o["metadata"]["namespace"] for o in objs} == {"grayguard"}
    for o in objs:
        if not o["apiVersion"].startswith(CRD_GROUP):
            kubernetes_validate.validate(o, KUBE_VERSION, strict=True)
    assert one(objs, "PodMonitor", "grayguard-fleet")["spec"]["namespaceSelector"] == {"matchNames": ["models"]}
    assert settings(objs) == {"namespace": "grayguard", "fleet.namespace": "models", "fleet.name": "llama",
                              "fleet.replicas": "5"}


def test_the_crd_checks_catch_a_typo():
    pm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
          "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoint": [{"port": "http"}]}}
    assert any("podMetricsEndpoint: unknown field" in p for p in crds.problems(pm))
    pm["spec"] = {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "h", "interval": "5"}]}
    assert crds.problems(pm) == ["spec.podMetricsEndpoints[0].interval: not a duration: '5'"]
    pm["spec"] = {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "h"}],
                  "namespaceSelector": {"matchName": ["a"]}}
    assert crds.problems(pm) == ["spec.namespaceSelector.matchName: unknown field"]
    pm["spec"]["namespaceSelector"] = {"matchNames": ["FLEET_NAMESPACE"]}  # a placeholder left: no namespace's name
    assert crds.problems(pm) == ["spec.namespaceSelector.matchNames: expected a list of namespace names, got "
                                 "['FLEET_NAMESPACE']"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rules_are_the_example_render_and_pass_promtool(rendered, overlay, example_rules, tmp_path):
    require("promtool")
    rules = {o["metadata"]["name"]: o["spec"] for o in rendered[(overlay, Fleet())] if o["kind"] == "PrometheusRule"}
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
    maps = [o for o in rendered[(overlay, Fleet())] if o["kind"] == "ConfigMap"
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


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_the_controller_config_agrees_with_the_tier_and_renders_the_same_rules(rendered, overlay, fleet, example_rules,
                                                                                 tmp_path):
    objs = rendered[(overlay, fleet)]
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
    # the controller runs in grayguard's namespace: its etcd by the short name, the ConfigMap's by the qualified one
    host, port = cfg.registry.url.split("//")[1].split(":")
    (etcd,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == host]
    assert etcd["metadata"]["namespace"] == settings(objs)["namespace"]
    assert one(objs, "ConfigMap", "grayguard-registry")["data"]["url"] == \
        f"http://{host}.{etcd['metadata']['namespace']}.svc:{port}"
    ctl = one(objs, "Deployment", "grayguard-controller")
    assert ctl["spec"]["replicas"] == 2
    assert any("--id=$(POD_NAME)" in a for _, c in containers([ctl]) for a in c["args"])
    assert cfg.listen_address.endswith(":9300") and not cfg.listen_address.startswith("127.")
    assert cfg.rules.controller_job == job_of(one(objs, "ServiceMonitor", "grayguard-controller"), "metrics")


def container_env(objs: list[dict], workload: dict, container: str) -> dict[str, str]:
    """A container's environment as the kubelet gives it: values, and ConfigMap keys looked up in the render."""
    c = next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == container)
    out = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            cm = one(objs, "ConfigMap", ref["name"])
            assert cm["metadata"]["name"] == ref["name"], f"{ref['name']}: not the generated ConfigMap's name"
            assert cm["metadata"]["namespace"] == workload["metadata"]["namespace"]
            out[e["name"]] = cm["data"][ref["key"]]
        elif "value" in e:
            out[e["name"]] = e["value"]
    return out


def job_of(monitor: dict, port: str, path: str = "/metrics") -> str:
    eps = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    ep = next(e for e in eps if e["port"] == port and e.get("path", "/metrics") == path)
    return next(r["replacement"] for r in ep["relabelings"] if r.get("targetLabel") == "job")


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_the_gateway_keeps_the_runtime_api_in_the_pod_and_names_the_fleet(rendered, overlay, fleet, tmp_path):
    require("haproxy")
    objs = rendered[(overlay, fleet)]
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

    # the servers: a slot per fleet replica, named after the fleet, found in its headless Service's SRV records;
    # the environment HAProxy expands them from is the grayguard-fleet ConfigMap's
    s = settings(objs)
    templates = re.findall(r"^\s*server-template (.*)$", cfg_text, re.M)
    assert templates == ['"${FLEET_NAME}-slot" "${FLEET_REPLICAS}" '
                         '"_http._tcp.${FLEET_NAME}.${FLEET_NAMESPACE}.svc.${CLUSTER_DOMAIN}" resolvers kube '
                         'init-addr none weight 100']
    assert not re.findall(r"^\s*server ", cfg_text, re.M)
    env = container_env(objs, gw, "haproxy")
    assert {k: env[k] for k in ("FLEET_NAME", "FLEET_NAMESPACE", "FLEET_REPLICAS")} == {
        "FLEET_NAME": s["fleet.name"], "FLEET_NAMESPACE": s["fleet.namespace"], "FLEET_REPLICAS": s["fleet.replicas"]}
    f = tmp_path / "haproxy.cfg"
    sock = tmp_path / "admin.sock"
    for port in (":8000", ":8404"):  # away from anything of this machine's
        cfg_text = cfg_text.replace(f"bind {port}", f"bind 127.0.0.1:{free_port()}")
    f.write_text(cfg_text.replace("/run/haproxy/admin.sock", str(sock)))
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", **env}
    p = subprocess.run(["haproxy", "-c", "-f", str(f)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    # what the controller sees of that HAProxy: the slots, each waiting for a pod (no DNS here)
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(f)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(sock.exists, timeout_s=10, what="the admin socket")
        seen = RuntimeClient(f"unix:{sock}").show_servers_state()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    replicas = int(s["fleet.replicas"])
    assert [(x.backend, x.name) for x in seen] == [("vllm_chat", f"{s['fleet.name']}-slot{i}")
                                                   for i in range(1, replicas + 1)]
    assert all(x.maint for x in seen)

    # the view only from the controller
    pol = one(objs, "NetworkPolicy", "grayguard-gateway")
    for rule in pol["spec"]["ingress"]:
        if any(p["port"] == 9999 for p in rule["ports"]):
            controller = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "grayguard-controller"}}}
            assert rule["from"] == [controller]


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_images_carry_the_package_version(rendered, overlay, fleet):
    images = {c["image"] for _, c in containers(rendered[(overlay, fleet)])}
    ours = {i for i in images if i.split(":")[0] in IMAGES}
    assert f"{IMAGE}:{__version__}" in ours and ours <= {f"{i}:{__version__}" for i in IMAGES}
    assert all(":" in i for i in images), f"an image without a tag: {images}"


def substitute(arg: str) -> str:
    """$(VAR) as the kubelet expands it, with sample values."""
    sample = {"POD_NAME": "vllm-chat-0", "POD_IP": "10.0.0.7", "GRAYGUARD_POOL": "chat",
              "GRAYGUARD_REGISTRY_URL": "http://grayguard-etcd.grayguard.svc:2379"}
    return re.sub(r"\$\((\w+)\)", lambda m: sample[m.group(1)], arg)


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_every_grayguard_command_line_parses(rendered, overlay, fleet):
    from grayguard.controller import actuator
    from grayguard.exporters import cli as exporter_cli
    seen = set()
    for _, c in containers(rendered[(overlay, fleet)]):
        if not c["image"].startswith(IMAGE):
            continue
        argv = [substitute(a) for a in c.get("command", []) + c["args"]]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{c['name']}: `grayguard {' '.join(argv)}` does not parse")
        assert deprecated_used(args) == [], f"{c['name']}: a deprecated spelling (grayguard/flags.py): {argv}"
        seen.add(argv[0])
        check = {"exporter": exporter_cli.config_error, "actuator": actuator.config_error}.get(argv[0])
        assert check is None or check(args) is None, (c["name"], check(args))
    assert {"controller", "actuator", "exporter"} <= seen


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_monitors_find_their_ports(rendered, overlay, fleet, tmp_path):
    objs = rendered[(overlay, fleet)]
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


@pytest.mark.parametrize(("overlay", "fleet"), VARIANTS, ids=IDS)
def test_our_containers_are_sized_and_locked_down(rendered, overlay, fleet):
    for w, c in containers(rendered[(overlay, fleet)]):
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probes_ask_the_loops_not_the_http_server(rendered, overlay):
    """Liveness fails when the loop stalls and readiness waits for its first round: /metrics would answer from the
    HTTP server's own thread while the tick loop is dead."""
    objs = rendered[(overlay, Fleet())]
    probes = {}
    for _, c in containers(objs):
        if c["name"] in ("controller", "actuator"):
            probes[c["name"]] = [(c[k]["httpGet"]["path"], c[k]["httpGet"]["port"])
                                 for k in ("livenessProbe", "readinessProbe")]
    assert probes == {"controller": [("/healthz", "metrics"), ("/readyz", "metrics")],
                      "actuator": [("/healthz", "actuator"), ("/readyz", "actuator")]}
    for src in ("controller/httpserver.py", "controller/actuator.py"):  # and the programs serve them
        text = (REPO / src).read_text()
        assert '"GET /healthz"' in text and '"GET /readyz"' in text, src


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
