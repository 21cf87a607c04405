"""grayguard.registry: the adaptive TTL, node records and keys, the snapshot file, and the etcd client against a
real etcd (localstack.etcd.EtcdProc): leases, compare-and-create, prefix reads and watches, classified errors."""

from __future__ import annotations

import http.server
import json
import math
import random
import socket
import statistics
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grayguard.localstack.etcd import EtcdProc
from grayguard.localstack.procs import wait_until
from grayguard.registry import (
    DEFAULT_PREFIX,
    Entry,
    GpuInfo,
    NodeRecord,
    RecordError,
    Registry,
    RegistryError,
    Snapshot,
    SnapshotError,
    adaptive_ttl,
    first_ttl,
    node_key,
    node_records,
    nodes_prefix,
    parse_node_key,
)


# --- adaptive TTL -------------------------------------------------------------------------------
def test_adaptive_ttl_is_mean_plus_two_stddevs_of_the_last_five_intervals():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    expect = 3.0 * (1 + 2 * statistics.pstdev(xs) / 3.0)  # the article: mean x (1 + 2 x stddev/mean)
    assert adaptive_ttl(xs, lo=0.1, hi=100) == pytest.approx(expect) == pytest.approx(3 + 2 * math.sqrt(2))
    assert adaptive_ttl([100.0, 100.0, *xs], lo=0.1, hi=1000) == pytest.approx(expect)  # older ones are dropped


@pytest.mark.parametrize(("intervals", "expect"), [
    ([2.0, 2.0, 2.0], 5.0),  # a steady 2 s heartbeat: mean + 0, clamped up to lo
    ([20.0, 40.0, 60.0, 20.0, 90.0], 60.0),  # clamped down to hi
    ([], 60.0),  # no interval measured and no first TTL given: hi
    ([3.0], 60.0),  # one interval: still no spread
])
def test_adaptive_ttl_clamps_and_its_default(intervals, expect):
    assert adaptive_ttl(intervals, lo=5.0, hi=60.0) == expect


@pytest.mark.parametrize(("intervals", "first", "expect"), [
    ([], 8.0, 8.0),  # nothing measured: the first TTL, not hi
    ([3.0], 8.0, 8.0),  # one interval: still no spread
    ([], 2.0, 5.0),  # clamped up to lo...
    ([], 90.0, 60.0),  # ...and down to hi
    ([2.0, 2.0], 8.0, 5.0),  # two intervals: measured, the first TTL no longer counts
])
def test_adaptive_ttl_uses_the_first_ttl_until_two_intervals_are_measured(intervals, first, expect):
    assert adaptive_ttl(intervals, lo=5.0, hi=60.0, first=first) == expect


@pytest.mark.parametrize(("heartbeat", "timeout", "lo", "hi", "expect"), [
    (2.0, 2.0, 5.0, 60.0, 8.0),  # the exporter's defaults: 3 rounds of 2 s + one 2 s call, not 60 s
    (2.0, 0.5, 5.0, 60.0, 6.5),  # a round is the heartbeat when the call is shorter...
    (1.0, 3.0, 5.0, 60.0, 12.0),  # ...and the whole timeout of a call that hangs when it is longer
    (0.3, 0.2, 2.0, 60.0, 2.0),  # clamped up to lo
    (10.0, 2.0, 5.0, 20.0, 20.0),  # clamped down to hi
])
def test_first_ttl_is_three_rounds_and_a_call_within_the_bounds(heartbeat, timeout, lo, hi, expect):
    assert first_ttl(heartbeat, timeout, lo=lo, hi=hi) == pytest.approx(expect)


@pytest.mark.parametrize(("heartbeat", "timeout", "lo", "hi"), [
    (0.0, 1.0, 5.0, 60.0), (-1.0, 1.0, 5.0, 60.0), (math.nan, 1.0, 5.0, 60.0), (2.0, -1.0, 5.0, 60.0),
    (2.0, math.inf, 5.0, 60.0), (2.0, 1.0, 10.0, 5.0),
])
def test_first_ttl_rejects_bad_arguments(heartbeat, timeout, lo, hi):
    with pytest.raises(ValueError):
        first_ttl(heartbeat, timeout, lo=lo, hi=hi)


@given(st.floats(0.05, 30.0), st.floats(0.0, 30.0), st.floats(1.0, 10.0), st.floats(10.0, 120.0))
def test_first_ttl_outlasts_two_lost_keep_alives_within_its_bounds(heartbeat, timeout, lo, hi):
    ttl = first_ttl(heartbeat, timeout, lo=lo, hi=hi)
    assert lo <= ttl <= hi
    # two keep-alives that hang their whole timeout, the third sent a round later and answered within its
    # timeout, all before the first lease runs out (unless hi caps it)
    assert ttl >= min(hi, heartbeat + 2 * max(heartbeat, timeout) + timeout)


@pytest.mark.parametrize("bad", [[1.0, 0.0], [1.0, -2.0], [1.0, math.nan], [math.inf, 1.0]])
def test_adaptive_ttl_rejects_intervals_that_are_not_positive_and_finite(bad):
    with pytest.raises(ValueError, match="positive finite"):
        adaptive_ttl(bad)


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 10.0), (10.0, 5.0), (1.0, math.inf)])
def test_adaptive_ttl_rejects_bad_bounds(lo, hi):
    with pytest.raises(ValueError):
        adaptive_ttl([1.0, 2.0], lo=lo, hi=hi)


@given(st.lists(st.floats(0.01, 50.0), min_size=2, max_size=12), st.floats(0.5, 5.0), st.floats(5.0, 100.0))
def test_adaptive_ttl_stays_in_bounds_and_covers_every_interval_of_its_window(xs, lo, hi):
    ttl = adaptive_ttl(xs, lo=lo, hi=hi)
    assert lo <= ttl <= hi
    # Samuelson: over 5 samples no one is more than 2 population stddevs from the mean, so mean + 2 stddev
    # is at least the longest recent interval: a cadence that repeats its worst gap is never evicted.
    assert ttl >= min(hi, max(xs[-5:])) - 1e-9


# --- keys and records ---------------------------------------------------------------------------
def record(**kw) -> NodeRecord:
    base = dict(pool="chat", node="node3", endpoint="10.0.0.13:8000", exporter="10.0.0.13:9400",
                model="meta-llama/Llama-3.1-8B-Instruct", version="0.11.0",
                gpu=GpuInfo("NVIDIA H100 80GB HBM3", 2, ("00000000:18:00.0", "00000000:2A:00.0"), (0,)),
                max_concurrency=64, registered_at=1_790_000_000.5, ttl_s=5)
    return NodeRecord(**{**base, **kw})


def test_node_keys_round_trip_and_names_must_be_haproxy_safe():
    key = node_key(DEFAULT_PREFIX, "chat", "node3")
    assert key == "/grayguard/v1/nodes/chat/node3" and key.startswith(nodes_prefix())
    assert parse_node_key(DEFAULT_PREFIX, key) == ("chat", "node3")
    assert node_key("/gg", "a-b_c.d:e", "n.1") == "/gg/nodes/a-b_c.d:e/n.1"
    for bad in ("node 3", "node;3", "node\n3", "a/b", "", "x" * 65):
        with pytest.raises(ValueError, match="HAProxy-safe"):
            node_key(DEFAULT_PREFIX, "chat", bad)
    for prefix in ("grayguard", "/grayguard/", "/a b"):
        with pytest.raises(ValueError, match="prefix"):
            node_key(prefix, "chat", "n")
    for key in ("/grayguard/v1/nodes/chat", "/grayguard/v1/nodes/chat/n/x", "/other/nodes/chat/n",
                "/grayguard/v1/nodes/chat/n;x"):
        with pytest.raises(ValueError):
            parse_node_key(DEFAULT_PREFIX, key)


def test_a_record_round_trips_through_json_with_every_field():
    r = record()
    doc = json.loads(r.to_json())
    assert doc == {"pool": "chat", "node": "node3", "endpoint": "10.0.0.13:8000", "exporter": "10.0.0.13:9400",
                   "model": "meta-llama/Llama-3.1-8B-Instruct", "version": "0.11.0",
                   "gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 2,
                           "pci_bus_ids": ["00000000:18:00.0", "00000000:2A:00.0"], "numa_nodes": [0]},
                   "max_concurrency": 64, "registered_at": 1_790_000_000.5, "ttl_s": 5, "state": "serving",
                   "agent": ""}
    assert NodeRecord.from_json(r.to_json()) == r
    assert NodeRecord.from_json(json.dumps({**doc, "future_field": [1]})) == r  # newer writers: ignored
    assert r.leaving().state == "leaving" and r.leaving().to_json() != r.to_json()
    assert record(endpoint="[fd00::13]:8000", max_concurrency=None, version="").endpoint == "[fd00::13]:8000"
    assert NodeRecord.from_json(record(agent="10.0.0.13:9401").to_json()).agent == "10.0.0.13:9401"


@pytest.mark.parametrize(("change", "field"), [
    ({"pool": "chat pool"}, "pool"), ({"node": None}, "node"), ({"endpoint": "10.0.0.13"}, "endpoint"),
    ({"endpoint": "10.0.0.13:0"}, "endpoint"), ({"endpoint": "a b:80"}, "endpoint"),
    ({"exporter": "h:99999"}, "exporter"), ({"model": ""}, "model"), ({"model": "m\n"}, "model"),
    ({"version": 11}, "version"), ({"gpu": {"count": -1}}, "gpu.count"), ({"gpu": {"count": True}}, "gpu.count"),
    ({"gpu": {"pci_bus_ids": "x"}}, "gpu.pci_bus_ids"), ({"gpu": {"numa_nodes": [-1]}}, "gpu.numa_nodes[0]"),
    ({"gpu": []}, "gpu"), ({"max_concurrency": 0}, "max_concurrency"), ({"registered_at": -1}, "registered_at"),
    ({"registered_at": "now"}, "registered_at"), ({"ttl_s": 2.5}, "ttl_s"), ({"state": "gone"}, "state"),
    ({"agent": "10.0.0.13"}, "agent"), ({"agent": 9401}, "agent"),
])
def test_a_bad_record_is_refused_naming_the_field(change, field):
    doc = {**json.loads(record().to_json()), **change}
    with pytest.raises(RecordError) as e:
        NodeRecord.from_json(json.dumps(doc))
    assert str(e.value).startswith(f"{field}:")


@pytest.mark.parametrize("text", ["", "nul", "[1]", '"x"', '{"pool": "chat"}', '{"registered_at": NaN}'])
def test_what_is_not_a_record_object_is_refused(text):
    with pytest.raises(RecordError):
        NodeRecord.from_json(text)


def test_node_records_keeps_the_valid_ones_and_says_why_for_the_others():
    good = record()
    def entry(key, value):
        return Entry(key=key, value=value, mod_revision=1, create_revision=1, lease=7)
    entries = {k: entry(k, v) for k, v in {
        node_key(DEFAULT_PREFIX, "chat", "node3"): good.to_json(),
        node_key(DEFAULT_PREFIX, "chat", "node4"): good.to_json(),  # its key and its record disagree
        node_key(DEFAULT_PREFIX, "chat", "node5"): "{garbage",
        "/grayguard/v1/nodes/chat/a/b": good.to_json(),
    }.items()}
    records, bad = node_records(DEFAULT_PREFIX, entries)
    assert records == {node_key(DEFAULT_PREFIX, "chat", "node3"): good}
    assert set(bad) == set(entries) - set(records)
    assert "node4" in bad[node_key(DEFAULT_PREFIX, "chat", "node4")] and "not JSON" in bad[
        node_key(DEFAULT_PREFIX, "chat", "node5")]


# --- snapshot -----------------------------------------------------------------------------------
def test_snapshot_round_trips_and_a_missing_file_is_none(tmp_path):
    snap = Snapshot(tmp_path / "sub" / "registry.json")
    assert snap.load() is None
    records = {node_key(DEFAULT_PREFIX, "chat", n): record(node=n) for n in ("node1", "node2")}
    snap.save(records, 42)
    assert snap.load() == (records, 42)
    snap.save({}, 43)
    assert snap.load() == ({}, 43)
    assert [p.name for p in snap.path.parent.iterdir()] == ["registry.json"]  # no temp file left


@pytest.mark.parametrize("content", [b"\xff\xfe", b"{", b"[]", b'{"format": "other"}',
                                     b'{"format": "grayguard-registry-snapshot/1", "revision": -1, "records": {}}',
                                     b'{"format": "grayguard-registry-snapshot/1", "revision": 1, '
                                     b'"records": {"k": {"pool": "chat"}}}'])
def test_a_corrupt_snapshot_is_set_aside_with_a_clear_error(tmp_path, content):
    path = tmp_path / "registry.json"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match="corrupt.*set aside as .*registry.json.corrupt"):
        Snapshot(path).load()
    assert not path.exists() and (tmp_path / "registry.json.corrupt").read_bytes() == content
    assert Snapshot(path).load() is None  # the next start is clean


def test_a_failed_save_leaves_the_old_snapshot_whole(tmp_path, monkeypatch):
    snap = Snapshot(tmp_path / "registry.json")
    snap.save({"k": record()}, 1)
    def fail(*_a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("grayguard.registry.os.replace", fail)
    with pytest.raises(OSError):
        snap.save({}, 2)
    monkeypatch.undo()
    assert snap.load() == ({"k": record()}, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]


# --- the client against a real etcd -------------------------------------------------------------
@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    proc = EtcdProc(tmp_path_factory.mktemp("etcd")).start()
    yield proc
    proc.stop()


@pytest.fixture
def reg(etcd):
    r = Registry(etcd.url, timeout=2.0)
    yield r
    r.close()


def test_put_get_prefix_and_delete_on_etcd_34_gateway(reg, etcd):
    assert reg._gw.api_path == "/v3/" and etcd_version(etcd).startswith("3.")
    reg.put("/t1/nodes/chat/a", "1")
    reg.put("/t1/nodes/chat/b", "żółw")  # UTF-8 survives (etcd3gw alone would encode latin-1)
    reg.put("/t1/nodesx", "outside")
    entries, rev = reg.get_prefix("/t1/nodes/")
    assert {k: e.value for k, e in entries.items()} == {"/t1/nodes/chat/a": "1", "/t1/nodes/chat/b": "żółw"}
    assert rev == reg.revision() and max(e.mod_revision for e in entries.values()) <= rev
    assert reg.get("/t1/nodes/chat/a").value == "1" and reg.get("/t1/none") is None
    assert reg.delete("/t1/nodes/chat/a") is True and reg.delete("/t1/nodes/chat/a") is False


def etcd_version(etcd: EtcdProc) -> str:
    import urllib.request
    with urllib.request.urlopen(f"{etcd.url}/version", timeout=2) as resp:
        return json.loads(resp.read())["etcdserver"]


def test_leases_keep_alive_revoke_and_a_put_on_a_gone_lease(reg):
    lease = reg.grant(5)
    reg.put("/t2/k", "v", lease=lease)
    assert reg.get("/t2/k").lease == lease
    assert 1 <= reg.keep_alive(lease) <= 5
    assert reg.revoke(lease) is True
    assert reg.get("/t2/k") is None  # revoking deletes the lease's keys at once
    assert reg.keep_alive(lease) == 0 and reg.revoke(lease) is False
    with pytest.raises(RegistryError) as e:
        reg.put("/t2/k", "v", lease=lease)
    assert e.value.kind == "lease_gone"
    with pytest.raises(ValueError):
        reg.grant(0)


def test_an_unrefreshed_lease_expires_and_takes_its_key(reg):
    lease = reg.grant(2)
    reg.put("/t3/k", "v", lease=lease)
    start = time.monotonic()
    wait_until(lambda: reg.get("/t3/k") is None, 10, 0.1, "the key to expire")
    assert 1.0 <= time.monotonic() - start <= 5.0


def test_a_jittery_heartbeat_below_the_adaptive_ttl_does_not_evict(reg):
    rng = random.Random(7)
    intervals = [rng.uniform(0.2, 1.3) for _ in range(8)]  # up to 6.5x apart
    ttl = math.ceil(adaptive_ttl(intervals[:5], lo=1.0, hi=30.0))
    assert all(x < ttl for x in intervals)
    lease = reg.grant(ttl)
    reg.put("/t4/k", "v", lease=lease)
    for x in intervals:
        time.sleep(x)
        assert reg.keep_alive(lease) > 0
        assert reg.get("/t4/k") is not None
    reg.revoke(lease)


def test_compare_and_create_writes_only_when_absent(reg):
    lease = reg.grant(5)
    assert reg.create("/t5/leader", "a", lease=lease) is True
    assert reg.create("/t5/leader", "b") is False
    assert reg.get("/t5/leader").value == "a"
    reg.revoke(lease)
    assert reg.create("/t5/leader", "b") is True  # the holder's lease went: the next one wins


def collect(reg, prefix, start, stop, out, errors, **kw):
    try:
        for ev in reg.watch_prefix(prefix, start, stop, **kw):
            out.append(ev)
    except RegistryError as e:
        errors.append(e)


def test_watch_prefix_sees_every_change_in_order_across_idle_reopens_and_stops_at_once(reg):
    _, rev = reg.get_prefix("/t6/")
    stop, events, errors = threading.Event(), [], []
    t = threading.Thread(target=collect, args=(reg, "/t6/", rev + 1, stop, events, errors),
                         kwargs={"idle_timeout": 0.5})
    t.start()
    reg.put("/t6/a", "1")
    time.sleep(1.3)  # two idle reopens: nothing skipped, nothing repeated
    reg.put("/t6/a", "2")
    reg.put("/t6x", "outside the prefix")
    reg.delete("/t6/a")
    wait_until(lambda: len(events) >= 3, 5, 0.05, "three events")
    started = time.monotonic()
    stop.set()
    t.join(3)
    assert not t.is_alive() and time.monotonic() - started < 1.0 and errors == []
    assert [(e.kind, e.key, e.value, e.prev_value) for e in events] == [
        ("put", "/t6/a", "1", None), ("put", "/t6/a", "2", "1"), ("delete", "/t6/a", "", "2")]
    assert [e.revision for e in events] == sorted({e.revision for e in events})


def test_watch_from_a_compacted_revision_says_compacted(reg):
    for i in range(3):
        reg.put("/t7/k", str(i))
    rev = reg.revision()
    reg._gw.post(reg._gw.get_url("/kv/compaction"), json={"revision": rev, "physical": True})
    stop, events, errors = threading.Event(), [], []
    collect(reg, "/t7/", 2, stop, events, errors)
    assert events == [] and errors[0].kind == "compacted"


def test_calls_never_hang_and_failures_are_classified(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(RegistryError) as e:
        Registry(f"http://127.0.0.1:{port}", timeout=1).get("/k")
    assert e.value.kind == "unreachable"

    mute = socket.socket()  # accepts connections, never answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        start = time.monotonic()
        with pytest.raises(RegistryError) as e:
            Registry(f"http://127.0.0.1:{mute.getsockname()[1]}", timeout=0.5).keep_alive(1)
        assert e.value.kind == "timeout" and time.monotonic() - start < 3
    finally:
        mute.close()

    for status, body, kind in ((200, b"<html>not etcd</html>", "garbage"), (404, b"", "garbage"),
                               (200, b'{"header": {}}', "garbage"),
                               (400, b'{"error": "bad", "code": 3, "message": "bad"}', "rejected")):
        with _serve(status, body) as url, pytest.raises(RegistryError) as e:
            Registry(url, timeout=1).get_prefix("/x/")
        assert e.value.kind == kind, (status, body)


class _serve:
    """A local HTTP server answering every POST with status and body."""

    def __init__(self, status: int, body: bytes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_watch_on_an_etcd_that_dies_ends_with_an_error_and_one_that_lost_its_data_says_compacted(tmp_path):
    proc = EtcdProc(tmp_path).start()
    reg = Registry(proc.url, timeout=1)
    try:
        for i in range(5):
            reg.put("/t8/k", str(i))
        _, rev = reg.get_prefix("/t8/")
        stop, events, errors = threading.Event(), [], []
        t = threading.Thread(target=collect, args=(reg, "/t8/", rev + 1, stop, events, errors))
        t.start()
        time.sleep(0.3)
        proc.kill()
        t.join(5)
        assert not t.is_alive() and errors[0].kind == "unreachable"
        proc.restart(wipe=True)  # a new, empty etcd at the same address: its revision went back
        errors.clear()
        collect(reg, "/t8/", rev + 1, stop, events, errors)
        assert errors[0].kind == "compacted" and "lost its data" in str(errors[0])
    finally:
        reg.close()
        proc.stop()
