"""The controller's verdict as a versioned interface: the /status document and the desired-state document.

Both carry `"version": 1`, an integer: the major version of the document's format (docs/api.md, "Compatibility").
A reader accepts its own major version and ignores fields it does not know (a newer minor adds fields); it refuses
another major with VersionError and changes nothing. A document without `version` was written before the field
existed (/status before this release) and reads as version 1. The types below are the formats' definitions: the JSON
Schemas shipped in grayguard/schemas/ are rendered from them (`grayguard api schema status|desired`), and a reader
decodes into them. cluster_load_assignment() turns a /status pool into Envoy's EDS weights (docs/api.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from grayguard.vocab import EJECTED, STATES

VERSION = 1  # the major version this release writes and reads
DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
_STATES = ", ".join(STATES)


class VersionError(ValueError):
    """A document of a major version this release does not read (or whose version is not an integer)."""

    def __init__(self, what: str, got: object):
        self.got = got
        super().__init__(f"version: {what} version {got!r} is not supported: this release reads version {VERSION} "
                         f"(and documents without a version, as version 1); the document was left as it is")


def document_version(doc: Mapping[str, Any], what: str) -> int:
    """The document's major version: absent reads as 1 (written before the field existed); VersionError unless 1."""
    v = doc.get("version", 1)
    if type(v) is not int or v != VERSION:
        raise VersionError(what, v)
    return v


def _doc(text: str | bytes | Mapping[str, Any], what: str) -> Mapping[str, Any]:
    doc = json.loads(text) if isinstance(text, str | bytes) else text
    if not isinstance(doc, Mapping):
        raise ValueError(f"{what}: expected a JSON object")
    document_version(doc, what)
    return doc


def _d(text: str, **kw: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **kw)


# ---- /status, version 1 --------------------------------------------------------------------------------------------
class ShadowFinding(msgspec.Struct, kw_only=True):
    """What one detector in shadow mode asks for the node; nothing applies it."""

    detector: Annotated[str, _d("the detector's name in the config's `detectors` section")]
    factor: Annotated[float, _d("the weight factor (0-1) it asks for; 1: no cut")]
    quarantine: Annotated[str | None, _d("why it asks for a quarantine; null: it does not")]
    reason: str


class NodeStatus(msgspec.Struct, kw_only=True):
    """One node (an HAProxy server) as the controller holds it."""

    node: Annotated[str, _d("the node's name: its HAProxy server name")]
    state: Annotated[str, _d(f"one of {_STATES}; a new state may be added within version 1 (docs/api.md)")]
    since: Annotated[float, _d("Unix time the node entered its state")]
    weight: Annotated[int | None, _d("the weight the controller wants for it (0-256); null: not decided yet")]
    score: Annotated[float | None, _d("its robust z-score against its peers; null: unscored")]
    ratio_to_peers: Annotated[float | None, _d("its latency over the peer median; null: not measured")]
    latency_ema: Annotated[float | None, _d("its last 30 s window latency, seconds per token; null: none")]
    peer_median: Annotated[float | None, _d("its peers' median latency, seconds per token; null: none")]
    reason: Annotated[str, _d("why it is in its state, in words (for people: not a stable vocabulary)")]
    factors: Annotated[dict[str, float], _d("weight factors (0-1) in force, by signal; a signal absent: 1")]
    drain_cause: Annotated[str | None, _d("why it was drained (latency, probe, errors, gateway, seeded, kv_cache); "
                                          "null: not drained")]
    gone_since: Annotated[float | None, _d("Unix time it left HAProxy's backend; null: it is there")]
    unreachable: Annotated[bool, _d("drained, and its probes found no server (connect_error: a restart in place, a "
                                    "crash): once it answers again it comes back as a warm-up")] = False
    shadow: list[ShadowFinding]


class PoolStatus(msgspec.Struct, kw_only=True):
    """One pool: its backend, its cap and its nodes; the counts are null before its first decision."""

    pool: str
    backend: Annotated[str, _d("the HAProxy backend the pool's nodes are servers of")]
    ejected: Annotated[int | None, _d("nodes drained (quarantined or canary)")]
    max_ejected: Annotated[int | None, _d("the most nodes the safeguard lets it drain")]
    safeguard_engaged: Annotated[bool | None, _d("an outlier stays in rotation only because the cap binds")]
    nodes: list[NodeStatus]


class Leadership(msgspec.Struct, kw_only=True):
    """The replica's place in leader election (present only with a registry)."""

    id: Annotated[str, _d("this replica's id")]
    leads: Annotated[list[str], _d("the scopes it leads (`all`, or pools when sharded)")]
    leaders: Annotated[dict[str, str], _d("scope -> the replica that leads it, as last read")]
    lease_valid_for_s: Annotated[float | None, _d("seconds its lease is still valid; null: it leads nothing")]
    steering_without_registry: bool
    epochs: dict[str, int]
    shard_pools: bool


class Status(msgspec.Struct, kw_only=True):
    """The controller's /status document."""

    version: Annotated[int, _d("the format's major version; absent (written before the field existed): 1")] = VERSION
    last_tick: Annotated[float | None, _d("Unix time of the last tick; null: none yet")]
    dry_run: Annotated[bool, _d("true: the controller decides and writes nothing")]
    pools: list[PoolStatus]
    leadership: Leadership | None = None


# ---- the desired-state document, version 1 -------------------------------------------------------------------------
class DesiredServer(msgspec.Struct, kw_only=True):
    """One server as the leader wants it."""

    weight: Annotated[int, _d("its HAProxy weight", ge=0, le=256)]
    drain: Annotated[bool, _d("drained: no new requests")]
    state: Annotated[str, _d(f"the state behind it (for logs): one of {_STATES}")]


class Desired(msgspec.Struct, kw_only=True):
    """One pool's HAProxy backend as the leader wants it: etcd's <prefix>/desired/<pool> (controller/desired.py)."""

    version: Annotated[int, _d("the format's major version")] = VERSION
    pool: str
    backend: str
    servers: Annotated[dict[str, DesiredServer], _d("server name -> what it should be; a server left out is held "
                                                     "as it is")]
    agent_off: Annotated[list[str], _d("servers whose agent check is disabled")] = []


TYPES: dict[str, type] = {"status": Status, "desired": Desired}
TITLES = {"status": "grayguard controller /status, version 1",
          "desired": "grayguard desired-state document (etcd <prefix>/desired/<pool>), version 1"}


def load_status(text: str | bytes | Mapping[str, Any]) -> Status:
    """A /status document read as version 1; VersionError for another major, ValueError for a malformed one."""
    doc = _doc(text, "/status")
    try:
        return msgspec.convert(doc, Status)
    except msgspec.ValidationError as e:
        raise ValueError(f"/status: {e}") from None


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a document: "status" or "desired"."""
    generated = msgspec.json.schema(TYPES[name])
    top = generated["$defs"][TYPES[name].__name__]["properties"]["version"]
    top["const"] = VERSION  # this schema is version 1's: another major has its own file
    schema = {"$schema": DRAFT,
              "$id": f"https://github.com/grayguard/grayguard/blob/main/grayguard/schemas/{name}.v{VERSION}.json",
              "title": TITLES[name],
              "description": "Stable: docs/api.md. Within a major version fields may be added (readers ignore those "
                             "they do not know); a removal, a rename or a change of meaning takes a new version.",
              **generated}
    return json.loads(json.dumps(schema))


def render(name: str) -> str:
    """The schema as the shipped file holds it."""
    return json.dumps(json_schema(name), indent=2, ensure_ascii=False) + "\n"


def schema_file(name: str) -> Path:
    return SCHEMA_DIR / f"{name}.v{VERSION}.json"


# ---- another router: the same verdict from Prometheus (docs/api.md) ------------------------------------------------
# each node's weight with its address (grayguard_node_info's instance: the node's series key, its vLLM address)
WEIGHT_QUERY = "grayguard_node_weight * on (pool, node) group_left (instance) grayguard_node_info"
# the nodes drained now (quarantined or canary): weight 0 and out of rotation
DRAINED_QUERY = 'grayguard_node_state{state=~"quarantined|canary"} == 1'


# ---- another router: Envoy EDS -------------------------------------------------------------------------------------
def cluster_load_assignment(status: Status, pool: str, addresses: Mapping[str, tuple[str, int]], cluster: str,
                            default_weight: int = 100) -> dict[str, Any]:
    """Envoy's ClusterLoadAssignment (EDS, v3 JSON) for one pool: every node of `addresses` (node -> (ip, port), the
    router's own endpoint list) with grayguard's weight. A node in rotation with a weight of 1-256 keeps it (Envoy
    needs at least 1 and divides by the sum, as HAProxy does). A drained node, or one at weight 0, stays listed as
    DRAINING at weight 1: Envoy sends it no new requests and lets the open ones finish. A node grayguard does not
    report (not in /status, or weight null) gets default_weight: absent is not zero."""
    p = next((x for x in status.pools if x.pool == pool), None)
    nodes = {n.node: n for n in p.nodes} if p else {}
    endpoints = []
    for name, (ip, port) in sorted(addresses.items()):
        n = nodes.get(name)
        weight = default_weight if n is None or n.weight is None else n.weight
        out = n is not None and (n.state in EJECTED or weight == 0)  # an unknown state: by its weight
        lb = {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}, "hostname": name},
              "load_balancing_weight": 1 if out else weight}
        if out:
            lb["health_status"] = "DRAINING"
        endpoints.append(lb)
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": endpoints}]}
