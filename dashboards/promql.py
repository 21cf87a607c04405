"""PromQL text for the dashboards, and the reverse: template substitution and metric names of an expression (pure)."""

from __future__ import annotations

import re

from grayguard.rules.render import vllm_selector

# Values a test or a linter puts in place of Grafana's template variables.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__range_s": "3600",
                    "__interval_ms": "15000"}


def matchers(**labels: str) -> str:
    """Label matchers; a value starting with '~' is a regex match: matchers(pool="$pool", node="~$node")."""
    parts = []
    for k, v in labels.items():
        op, val = ("=~", v[1:]) if v.startswith("~") else ("=", v)
        parts.append(f'{k}{op}"{val}"')
    return ", ".join(parts)


def series(name: str, m: str = "") -> str:
    """A grayguard or recorded series with matchers."""
    return f"{name}{{{m}}}" if m else name


def vllm(prefix: str, name: str, m: str = "") -> str:
    """A vLLM series (name without prefix) under rules.vllm_prefix naming."""
    return vllm_selector(prefix, name, m)


def quantile(q: float, buckets: str, by: str = "") -> str:
    """histogram_quantile over a bucket selector, summed by `by` (plus le), over $__rate_interval."""
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({buckets}[$__rate_interval])))"


def zero_fill(expr: str, witness: str, label: str | None = None, value: str = "none", on: str = "") -> str:
    """expr, or 0 where expr has no sample but `witness` has one (matched on the labels `on`).

    For counters whose series only appear with the first event (errors, XIDs, canaries): no series means
    none happened while the component was scraped, so 0 is the truth there, while a missing component
    (no witness) still shows no data (absent is not zero). `label` names the 0 series (e.g. kind="none").
    """
    zero = f"0 * ({witness})"
    if label:
        zero = f'label_replace({zero}, "{label}", "{value}", "", "")'
    return f"({expr})\nor on ({on}) {zero}"


def node_info(m: str = "") -> str:
    """One series per node the controller tracks, labelled pool, node and instance (grayguard_node_info).

    Its `instance` is the node's series key; scraped without honor_labels Prometheus moves it to exported_instance
    (the controller's own address takes its place), so that one is read first. The max drops job and the target's
    instance: two replicas exporting the same node are one node.
    """
    info = f"grayguard_node_info{{{m}}}" if m else "grayguard_node_info"
    return f'max by (pool, node, instance) (label_replace({info}, "instance", "$1", "exported_instance", "(.+)"))'


def named(expr: str, nodes: str, pool: str) -> str:
    """expr (keyed by pool and instance) with each node's HAProxy server name as label `node`, joined from
    grayguard_node_info, kept to the nodes the matchers `nodes` select. An instance the controller does not track
    (the controller down or not scraped, a vLLM that is no server of the backend) keeps its series, named by its
    instance: without the controller the vLLM panels still show every node (absent is not zero). `pool` selects
    the info of every node of the pools shown."""
    return (f"(\n  {expr}\n)\n* on (pool, instance) group_left (node)\n{node_info(nodes)}\n"
            f"or on (pool, instance)\nlabel_replace(\n  (\n    {expr}\n  )\n  unless on (pool, instance)\n"
            f'  {node_info(pool)},\n  "node", "$1", "instance", "(.+)"\n)')


# ---- the reverse: what a rendered expression reads ------------------------------------------------------

# $1 is no variable (label_replace's capture group): a name starts with a letter or _, as Grafana's own do
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[(\w+)\]\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
            "bool", "inf", "nan", "atan2", "start", "end"}


def substitute(expr: str, values: dict[str, str]) -> str:
    """expr with Grafana's $var, ${var} and [[var]] replaced from values (plus GRAFANA_BUILTINS)."""
    full = {**GRAFANA_BUILTINS, **values}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in full:
            raise KeyError(f"no value for template variable ${name} in {expr!r}")
        return full[name]
    return _VAR.sub(repl, expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: bare names, and __name__ matchers (a `vllm[:_]x` regex
    counts as `vllm:x`). Functions, keywords, label names and durations are not names."""
    names = set()
    for op, val in _NAME_MATCHER.findall(expr):
        names.add(val.replace("vllm[:_]", "vllm:") if op == "=~" else val)
    text = _STRING.sub('""', expr)
    prev = None
    while prev != text:  # innermost first: nested braces do not occur, brackets can (subqueries)
        prev = text
        text = _BRACES.sub(" ", text)
        text = _BRACKETS.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    for m in _IDENT.finditer(text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def label_values_selector(query: str) -> str | None:
    """The selector of a Grafana `label_values(selector, label)` variable query; None for other queries."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query, re.S)
    return m.group(1) if m else None
