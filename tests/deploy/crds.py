"""Structural checks of the prometheus-operator objects the manifests use (ServiceMonitor, PodMonitor,
PrometheusRule, AlertmanagerConfig): kubernetes-validate has no schemas for CRDs, so each object's apiVersion,
kind, required fields and every field name we use are checked against prometheus-operator's API (v0.7x); a typo
in a field name is an error here, not a field the API server would drop or refuse at apply time."""

from __future__ import annotations

import re
from collections.abc import Iterator

DURATION = re.compile(r"^(0|(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?)$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
META = {"name", "namespace", "labels", "annotations"}
RELABEL = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
ACTIONS = {"replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase", "uppercase",
           "keepequal", "dropequal", "Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep"}
SCRAPE_PROTOCOLS = {"PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                    "PrometheusText1.0.0"}
ENDPOINT = {"port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
            "honorTimestamps", "trackTimestampsStaleness", "relabelings", "metricRelabelings", "tlsConfig",
            "authorization", "basicAuth", "oauth2", "followRedirects", "enableHttp2", "filterRunning", "proxyUrl",
            "bearerTokenSecret", "bearerTokenFile"}
POD_ENDPOINT = (ENDPOINT - {"bearerTokenFile"}) | {"portNumber"}
MONITOR_SPEC = {"selector", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit", "targetLimit",
                "scrapeProtocols", "scrapeClass", "attachMetadata", "labelLimit", "labelNameLengthLimit",
                "labelValueLengthLimit", "keepDroppedTargets"}
SELECTOR = {"matchLabels", "matchExpressions"}
NAMESPACE_SELECTOR = {"any", "matchNames"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a namespace's name
ROUTE = {"receiver", "groupBy", "groupWait", "groupInterval", "repeatInterval", "matchers", "continue", "routes",
         "muteTimeIntervals", "activeTimeIntervals"}
MATCHER = {"name", "value", "matchType"}
RECEIVER_KINDS = {"webhookConfigs", "pagerdutyConfigs", "opsgenieConfigs", "slackConfigs", "emailConfigs",
                  "pushoverConfigs", "victoropsConfigs", "wechatConfigs", "telegramConfigs", "snsConfigs",
                  "discordConfigs", "webexConfigs", "msteamsConfigs"}
WEBHOOK = {"url", "urlSecret", "sendResolved", "httpConfig", "maxAlerts"}


def problems(obj: dict) -> list[str]:
    """Everything structurally wrong with one prometheus-operator object (empty: fine)."""
    kind = obj.get("kind")
    check = {"ServiceMonitor": _service_monitor, "PodMonitor": _pod_monitor, "PrometheusRule": _prometheus_rule,
             "AlertmanagerConfig": _alertmanager_config}.get(kind)
    if check is None:
        return [f"not a prometheus-operator kind: {kind!r}"]
    version = "monitoring.coreos.com/v1alpha1" if kind == "AlertmanagerConfig" else "monitoring.coreos.com/v1"
    out = [] if obj.get("apiVersion") == version else [f"apiVersion {obj.get('apiVersion')!r}, expected {version}"]
    meta = obj.get("metadata") or {}
    out += _keys(meta, META, "metadata") + ([] if meta.get("name") else ["metadata.name missing"])
    out += _keys(obj, {"apiVersion", "kind", "metadata", "spec"}, "")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [*out, "spec: expected an object"]
    return out + list(check(spec))


def _keys(d: object, allowed: set[str], where: str) -> list[str]:
    if not isinstance(d, dict):
        return [f"{where}: expected an object, got {type(d).__name__}"]
    return [f"{where}.{k}: unknown field" for k in sorted(set(d) - allowed)]


def _duration(v: object, where: str) -> Iterator[str]:
    if not isinstance(v, str) or not DURATION.match(v) or v == "":
        yield f"{where}: not a duration: {v!r}"


def _selector(sel: object, where: str) -> Iterator[str]:
    yield from _keys(sel, SELECTOR, where)
    if isinstance(sel, dict) and not sel:
        yield f"{where}: empty (selects everything)"


def _relabelings(rs: object, where: str) -> Iterator[str]:
    if not isinstance(rs, list):
        yield f"{where}: expected a list"
        return
    for i, r in enumerate(rs):
        w = f"{where}[{i}]"
        yield from _keys(r, RELABEL, w)
        if not isinstance(r, dict):
            continue
        if r.get("action", "replace") not in ACTIONS:
            yield f"{w}.action: {r.get('action')!r}"
        if r.get("action", "replace") in ("replace", "Replace") and not LABEL.match(str(r.get("targetLabel", ""))):
            yield f"{w}.targetLabel: required for replace, a label name"
        for s in r.get("sourceLabels", []):
            if not LABEL.match(s):
                yield f"{w}.sourceLabels: not a label name: {s!r}"


def _endpoints(eps: object, allowed: set[str], where: str) -> Iterator[str]:
    if not isinstance(eps, list) or not eps:
        yield f"{where}: expected a non-empty list"
        return
    for i, e in enumerate(eps):
        w = f"{where}[{i}]"
        yield from _keys(e, allowed, w)
        if not isinstance(e, dict):
            continue
        if not any(k in e for k in ("port", "portNumber", "targetPort")):
            yield f"{w}: no port"
        for k in ("interval", "scrapeTimeout"):
            if k in e:
                yield from _duration(e[k], f"{w}.{k}")
        if "relabelings" in e:
            yield from _relabelings(e["relabelings"], f"{w}.relabelings")


def _monitor(spec: dict, endpoints_key: str, endpoint_fields: set[str]) -> Iterator[str]:
    yield from _keys(spec, MONITOR_SPEC | {endpoints_key}, "spec")
    if "selector" not in spec:
        yield "spec.selector: required"
    else:
        yield from _selector(spec["selector"], "spec.selector")
    if "namespaceSelector" in spec:
        yield from _namespace_selector(spec["namespaceSelector"], "spec.namespaceSelector")
    for p in spec.get("scrapeProtocols", []):
        if p not in SCRAPE_PROTOCOLS:
            yield f"spec.scrapeProtocols: {p!r}"
    yield from _endpoints(spec.get(endpoints_key), endpoint_fields, f"spec.{endpoints_key}")


def _namespace_selector(sel: object, where: str) -> Iterator[str]:
    yield from _keys(sel, NAMESPACE_SELECTOR, where)
    if not isinstance(sel, dict):
        return
    if "any" in sel and not isinstance(sel["any"], bool):
        yield f"{where}.any: expected a boolean"
    names = sel.get("matchNames", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and DNS_LABEL.match(n) for n in names):
        yield f"{where}.matchNames: expected a list of namespace names, got {names!r}"


def _service_monitor(spec: dict) -> Iterator[str]:
    yield from _monitor(spec, "endpoints", ENDPOINT)


def _pod_monitor(spec: dict) -> Iterator[str]:
    yield from _monitor(spec, "podMetricsEndpoints", POD_ENDPOINT)


def _prometheus_rule(spec: dict) -> Iterator[str]:
    yield from _keys(spec, {"groups"}, "spec")
    groups = spec.get("groups")
    if not isinstance(groups, list) or not groups:
        yield "spec.groups: expected a non-empty list"
        return
    for i, g in enumerate(groups):
        w = f"spec.groups[{i}]"
        yield from _keys(g, {"name", "interval", "rules", "partial_response_strategy", "limit", "query_offset",
                             "labels"}, w)
        if not isinstance(g, dict):
            continue
        if not g.get("name"):
            yield f"{w}.name: required"
        if "interval" in g:
            yield from _duration(g["interval"], f"{w}.interval")
        for j, r in enumerate(g.get("rules") or []):
            rw = f"{w}.rules[{j}]"
            yield from _keys(r, {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rw)
            if isinstance(r, dict) and (("record" in r) == ("alert" in r) or "expr" not in r):
                yield f"{rw}: exactly one of record and alert, and expr"


def _alertmanager_config(spec: dict) -> Iterator[str]:
    yield from _keys(spec, {"route", "receivers", "inhibitRules", "muteTimeIntervals", "timeIntervals"}, "spec")
    receivers = spec.get("receivers") or []
    names = set()
    for i, r in enumerate(receivers):
        w = f"spec.receivers[{i}]"
        yield from _keys(r, {"name"} | RECEIVER_KINDS, w)
        names.add(r.get("name"))
        for j, h in enumerate(r.get("webhookConfigs") or []):
            hw = f"{w}.webhookConfigs[{j}]"
            yield from _keys(h, WEBHOOK, hw)
            if ("url" in h) == ("urlSecret" in h):
                yield f"{hw}: exactly one of url and urlSecret"
            if "urlSecret" in h:
                yield from _keys(h["urlSecret"], {"name", "key", "optional"}, f"{hw}.urlSecret")
    yield from _route(spec.get("route"), names, "spec.route", top=True)
    for i, ir in enumerate(spec.get("inhibitRules") or []):
        w = f"spec.inhibitRules[{i}]"
        yield from _keys(ir, {"sourceMatch", "targetMatch", "equal"}, w)
        for k in ("sourceMatch", "targetMatch"):
            yield from _matchers(ir.get(k) or [], f"{w}.{k}")


def _route(route: object, receivers: set, where: str, top: bool = False) -> Iterator[str]:
    if not isinstance(route, dict):
        yield f"{where}: expected an object"
        return
    yield from _keys(route, ROUTE, where)
    if top and "receiver" not in route:
        yield f"{where}.receiver: required at the top"
    if "receiver" in route and route["receiver"] not in receivers:
        yield f"{where}.receiver: no receiver named {route['receiver']!r}"
    for k in ("groupWait", "groupInterval", "repeatInterval"):
        if k in route:
            yield from _duration(route[k], f"{where}.{k}")
    yield from _matchers(route.get("matchers") or [], f"{where}.matchers")
    for i, sub in enumerate(route.get("routes") or []):
        yield from _route(sub, receivers, f"{where}.routes[{i}]")


def _matchers(ms: list, where: str) -> Iterator[str]:
    for i, m in enumerate(ms):
        yield from _keys(m, MATCHER, f"{where}[{i}]")
        if isinstance(m, dict):
            if not m.get("name") or "value" not in m:
                yield f"{where}[{i}]: name and value required"
            if m.get("matchType", "=") not in ("=", "!=", "=~", "!~"):
                yield f"{where}[{i}].matchType: {m.get('matchType')!r}"
