"""controller/discovery.py over a fake registry seam: list then watch, departures with their last value, re-list on
compaction or a lost etcd (frozen meanwhile), the snapshot file, invalid records."""

from __future__ import annotations

import json
import queue
import threading

import pytest
from prometheus_client import CollectorRegistry

from grayguard.controller.discovery import Discovery
from grayguard.localstack.procs import wait_until
from grayguard.registry import Entry, NodeRecord, RegistryError, WatchEvent, node_key

PREFIX = "/grayguard/v1"


def rec(node: str, pool: str = "chat", state: str = "serving", port: int = 9000) -> NodeRecord:
    return NodeRecord(pool=pool, node=node, endpoint=f"10.0.0.1:{port}", exporter="10.0.0.1:9400", model="m",
                      state=state)


class FakeRegistry:
    """The Registry seam in memory: get_prefix, revision, watch_prefix; etcd can go down, lose events, compact."""

    url = "http://fake:2379"

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.rev = 1
        self.down = False
        self.compact = False
        self.events: queue.Queue[WatchEvent] = queue.Queue()
        self.lists = 0
        self.lock = threading.Lock()

    def _check(self):
        if self.down:
            raise RegistryError("unreachable", f"{self.url}: connection refused")

    def get_prefix(self, prefix):
        self._check()
        with self.lock:
            self.lists += 1
            return {k: Entry(k, v, self.rev, 1, 0) for k, v in self.kv.items() if k.startswith(prefix)}, self.rev

    def revision(self):
        self._check()
        return self.rev

    def watch_prefix(self, prefix, start_revision, stop, *, idle_timeout=30.0):
        while not stop.is_set():
            self._check()
            if self.compact:
                self.compact = False
                raise RegistryError("compacted", f"history before {self.rev} is compacted")
            try:
                ev = self.events.get(timeout=0.02)
            except queue.Empty:
                continue
            if ev.revision >= start_revision:
                yield ev

    def put(self, r: NodeRecord, *, quiet: bool = False, value: str | None = None):
        key = node_key(PREFIX, r.pool, r.node)
        with self.lock:
            self.rev += 1
            self.kv[key] = r.to_json() if value is None else value
            if not quiet:
                self.events.put(WatchEvent("put", key, self.kv[key], self.rev))

    def delete(self, pool: str, node: str, *, quiet: bool = False):
        key = node_key(PREFIX, pool, node)
        with self.lock:
            self.rev += 1
            prev = self.kv.pop(key)
            if not quiet:
                self.events.put(WatchEvent("delete", key, "", self.rev, prev))


@pytest.fixture
def disc_factory(tmp_path):
    made = []

    def make(reg, pools=("chat",), snapshot=True, **kw) -> Discovery:
        r = CollectorRegistry()
        d = Discovery(reg, PREFIX, pools, str(tmp_path / "members.json") if snapshot else None,
                      r, heartbeat_s=0.05, retry_s=0.02, max_retry_s=0.05, **kw)
        d.test_registry = r  # type: ignore[attr-defined]
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


def nodes(d: Discovery, pool="chat") -> dict[str, str]:
    v = d.view(pool)
    return {} if v is None else {n: r.state for n, r in v.nodes.items()}


def departed(d: Discovery, pool="chat") -> dict[str, str]:
    v = d.view(pool)
    return {} if v is None else {n: r.state for n, r in v.departed.items()}


def metric(d: Discovery, name: str, **labels) -> float | None:
    return d.test_registry.get_sample_value(name, labels)  # type: ignore[attr-defined]


def test_list_then_watch_and_departures_keep_their_last_value(disc_factory):
    reg = FakeRegistry()
    reg.put(rec("a"), quiet=True)
    reg.put(rec("b"), quiet=True)
    d = disc_factory(reg).start()
    assert d.wait_synced(2)
    assert nodes(d) == {"a": "serving", "b": "serving"} and d.view("chat").fresh
    reg.put(rec("c"))
    reg.put(rec("b", state="leaving"))
    reg.delete("chat", "b")  # a graceful leave: "leaving", then the key goes
    reg.delete("chat", "a")  # a crash: the key goes while it said "serving"
    wait_until(lambda: departed(d) == {"a": "serving", "b": "leaving"}, 2, what="departures")
    assert nodes(d) == {"c": "serving"}
    assert reg.lists == 1  # watched, not polled
    d.forget("chat", "a")
    assert departed(d) == {"b": "leaving"}
    reg.put(rec("b"))  # registered again: no longer departed
    wait_until(lambda: departed(d) == {} and "b" in nodes(d), 2, what="b back")
    assert metric(d, "grayguard_membership_nodes", pool="chat") == 2


def test_a_compacted_watch_lists_again_and_the_diff_gives_the_departures(disc_factory):
    reg = FakeRegistry()
    for n in "abc":
        reg.put(rec(n), quiet=True)
    d = disc_factory(reg).start()
    assert d.wait_synced(2)
    reg.delete("chat", "a", quiet=True)  # missed: the watch's history is gone
    reg.put(rec("d"), quiet=True)
    reg.compact = True
    wait_until(lambda: nodes(d) == {"b": "serving", "c": "serving", "d": "serving"}, 2, what="the re-list")
    assert departed(d) == {"a": "serving"}
    assert metric(d, "grayguard_discovery_relists_total", reason="compacted") == 1
    assert d.up


def test_etcd_down_freezes_the_snapshot_and_a_new_discovery_starts_from_the_file(disc_factory, tmp_path):
    reg = FakeRegistry()
    for n in "abc":
        reg.put(rec(n), quiet=True)
    d = disc_factory(reg).start()
    assert d.wait_synced(2)
    wait_until(lambda: (tmp_path / "members.json").exists(), 2, what="the snapshot file")
    reg.down = True
    wait_until(lambda: metric(d, "grayguard_registry_up") == 0, 2, what="registry_up 0")
    view = d.view("chat")
    assert not view.fresh and set(view.nodes) == {"a", "b", "c"}  # frozen, nothing removed
    wait_until(lambda: d.snapshot_age() > 0.2, 2, what="the snapshot ageing")
    assert metric(d, "grayguard_registry_snapshot_age_seconds") > 0.2
    assert metric(d, "grayguard_discovery_errors_total", kind="unreachable") >= 1

    # a controller restarted now: etcd is down, the file is all it has
    d2 = disc_factory(FakeRegistry(), snapshot=True)
    d2.registry.down = True
    d2.start()
    assert not d2.wait_synced(0.3)
    assert nodes(d2) == {"a": "serving", "b": "serving", "c": "serving"} and not d2.view("chat").fresh

    # etcd back: the list reconciles; only what really went is a departure
    reg.delete("chat", "c", quiet=True)
    reg.down = False
    wait_until(lambda: d.up and nodes(d) == {"a": "serving", "b": "serving"}, 3, what="the reconcile")
    assert departed(d) == {"c": "serving"}
    assert metric(d, "grayguard_discovery_relists_total", reason="reconnect") >= 1
    wait_until(lambda: d.snapshot_age() < 0.2, 2, what="the snapshot current again")
    wait_until(lambda: json.loads((tmp_path / "members.json.departed").read_text())["records"], 2,
               what="the departures written")


def test_no_view_without_snapshot_or_etcd(disc_factory):
    reg = FakeRegistry()
    reg.down = True
    d = disc_factory(reg, snapshot=False).start()
    assert not d.wait_synced(0.2)
    assert d.view("chat") is None and metric(d, "grayguard_registry_up") == 0


def test_an_invalid_record_is_ignored_and_the_last_valid_one_stands(disc_factory):
    reg = FakeRegistry()
    reg.put(rec("a"), quiet=True)
    d = disc_factory(reg).start()
    assert d.wait_synced(2)
    reg.put(rec("a"), value='{"pool": "chat", "node": "a"}')  # no endpoint
    wait_until(lambda: metric(d, "grayguard_discovery_invalid_records") == 1, 2, what="the invalid record counted")
    assert nodes(d) == {"a": "serving"}
    reg.compact = True  # a re-list sees the same invalid value: the key is still there, nothing departs
    wait_until(lambda: metric(d, "grayguard_discovery_relists_total", reason="compacted") == 1, 2, what="re-list")
    assert nodes(d) == {"a": "serving"} and departed(d) == {}


def test_departures_of_pools_membership_does_not_manage_are_not_kept(disc_factory):
    reg = FakeRegistry()
    reg.put(rec("a", pool="static"), quiet=True)
    d = disc_factory(reg).start()
    assert d.wait_synced(2)
    reg.delete("static", "a")
    wait_until(lambda: d.state.revision == reg.rev, 2, what="the delete seen")
    assert d.view("static").departed == {}


def test_a_dry_run_never_writes_the_snapshot(disc_factory, tmp_path):
    reg = FakeRegistry()
    reg.put(rec("a"), quiet=True)
    d = disc_factory(reg, readonly=True).start()
    assert d.wait_synced(2)
    d.stop()
    assert not (tmp_path / "members.json").exists()


def test_every_membership_series_is_documented():
    from pathlib import Path

    from grayguard.controller.membersync import MembershipMetrics

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    r = CollectorRegistry()
    Discovery(FakeRegistry(), PREFIX, ["chat"], None, r)
    MembershipMetrics(r)
    names = {f.name + "_total" if f.type == "counter" else f.name
             for c in list(r._collector_to_names) for f in c.describe()}
    assert len(names) == 16  # the membership step's expired_kept and view_untrusted among them
    for name in sorted(names):
        assert f"`{name}`" in doc, name
