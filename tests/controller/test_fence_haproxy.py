"""The fencing epoch in a real HAProxy 2.6 (controller/haproxy.py, Fence): read in the batch's own connection; a batch
whose epoch is not HAProxy's is never sent; a claim sets the epoch and the batch waits CLAIM_WAIT_S; a restore goes
only where HAProxy has no epoch (it restarted); a writer paused after its read finds its connection closed by
HAProxy and its batch unsent. The rule on top of it: test_leader.py; with replicas, etcd and SIGSTOP:
test_outage_e2e.py."""

from __future__ import annotations

import socket
import time

import pytest

from grayguard.controller.haproxy import (
    CLAIM_WAIT_S,
    CLI_TIMEOUT_S,
    Command,
    Fence,
    FencedError,
    RuntimeClient,
    epoch_var,
    parse_var,
    write_backend,
)
from tests.support.ctl_helpers import servers
from tests.support.stack import require

pytestmark = pytest.mark.e2e
BE = "vllm_chat"
VAR = epoch_var("/gg", "all")


def weight(cmd_value: int) -> list[Command]:
    return [Command(BE, "node0", "weight", cmd_value)]


def client(hap, fence: Fence | None, clock=time.monotonic) -> RuntimeClient:
    c = RuntimeClient(hap.endpoint, 2.0, clock=clock)
    c.fence_for = lambda endpoint, lines: fence
    return c


@pytest.fixture
def hap(haproxy_factory):
    require("haproxy")
    return haproxy_factory({BE: servers(2)})


def claimed(hap, epoch: int) -> None:
    """epoch set in HAProxy by a claim (which writes nothing), and the claim's wait over."""
    with pytest.raises(FencedError):
        client(hap, Fence(VAR, epoch, claim_until=float("inf"))).apply(weight(100))
    assert gateway(hap) == epoch


def gateway(hap) -> int | None:
    return parse_var(RuntimeClient(hap.endpoint).execute([f"get var {VAR}"])[0])


def test_a_claim_sets_the_epoch_and_the_batch_follows_only_after_the_wait(hap):
    seen = []
    fence = Fence(VAR, 41, claim_until=float("inf"), seen=lambda ep, g: seen.append(g))
    a = client(hap, fence)
    with pytest.raises(FencedError) as e:
        a.apply(weight(50))  # HAProxy has no epoch and this is no restore: claim, write nothing yet
    assert e.value.claimed and gateway(hap) == 41 and seen == [None]
    assert RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 100
    with pytest.raises(FencedError, match="waits"):
        a.apply(weight(50))  # a connection that read the old epoch may still be sending: not yet
    time.sleep(CLAIM_WAIT_S)
    assert a.apply(weight(50))[0].ok and RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 50


def test_a_batch_under_another_epoch_is_never_sent_and_a_lease_less_writer_never_claims(hap):
    claimed(hap, 7)
    old = client(hap, Fence(VAR, 5))  # an older term, its lease unconfirmed: no claim
    with pytest.raises(FencedError, match="has epoch 7"):
        old.apply(weight(1))
    assert gateway(hap) == 7 and RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 100
    standby = client(hap, Fence(VAR, None, restore=True))  # a restore passes only where there is no epoch
    with pytest.raises(FencedError):
        standby.apply(weight(1))
    assert RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 100


def test_a_restore_goes_where_haproxy_has_no_epoch_and_a_claiming_restorer_sets_its_epoch_behind_it(hap):
    assert client(hap, Fence(VAR, None, restore=True)).apply(weight(30))[0].ok  # a standby, HAProxy restarted
    assert gateway(hap) is None
    assert client(hap, Fence(VAR, 9, claim_until=float("inf"), restore=True)).apply(weight(40))[0].ok
    assert gateway(hap) == 9 and RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 40
    with pytest.raises(FencedError):  # restores are over: HAProxy is steered by 9
        client(hap, Fence(VAR, None, restore=True)).apply(weight(1))


def test_reads_are_not_fenced_and_a_batch_writes_one_backend():
    assert write_backend(["show servers state", "get weight a/b"]) is None
    assert write_backend(["set server be1/n0 weight 3", "enable agent be1/n0", "show stat"]) == "be1"
    assert write_backend(["add server be1/n1 127.0.0.1:1 weight 100 check"]) == "be1"
    with pytest.raises(Exception, match="one backend"):
        write_backend(["set server be1/n0 weight 3", "set server be2/n0 weight 3"])


def test_a_writer_paused_after_its_read_sends_nothing(hap):
    """The client's own check (its clock, right before the send) and HAProxy's (the connection's idle timeout)."""
    claimed(hap, 3)
    t = [0.0]

    def jumpy() -> float:  # each reading 0.6 s after the last: the send comes 0.6 s after the read (> EPOCH_READ_S)
        t[0] += 0.6
        return t[0]
    with pytest.raises(FencedError, match="read"):
        client(hap, Fence(VAR, 3), clock=jumpy).apply(weight(11))
    assert RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 100

    # HAProxy's side, whatever the writer's clock says: a fenced connection idle for CLI_TIMEOUT_S is closed
    s = socket.socket(socket.AF_UNIX)
    s.connect(hap.endpoint.removeprefix("unix:"))
    s.sendall(f"prompt\nset timeout cli {CLI_TIMEOUT_S}\nget var {VAR}\n".encode())
    buf = b""
    while buf.count(b"\n> ") < 3:
        buf += s.recv(4096)
    assert parse_var(buf.decode()) == 3
    time.sleep(CLI_TIMEOUT_S + 0.6)  # paused (SIGSTOP) between the read and the batch
    try:
        s.sendall(f"set server {BE}/node0 weight 12\nquit\n".encode())
        s.recv(4096)
    except OSError:
        pass
    s.close()
    assert RuntimeClient(hap.endpoint).get_weight(BE, "node0")[0] == 100


def test_a_socket_below_admin_level_is_named_at_startup_and_its_batches_are_errors(tmp_path, hap):
    """With registry.url every write is fenced: an HAProxy that cannot keep the epoch is said before the first tick
    (cmd_controller.fencing_checks), and a fenced batch there is an `unsupported` error, never a silent no-op."""
    from grayguard.config import parse_config
    from grayguard.controller.cmd_controller import fencing_checks
    from grayguard.controller.leader import Leadership
    from grayguard.controller.loop import Controller
    from grayguard.controller.metrics import ControllerMetrics
    from grayguard.localstack.haproxy import HaproxyProc, haproxy_config
    from tests.support.ctl_helpers import PROM, FakeProm
    from tests.support.fake_etcd import Client, FakeEtcd

    d = tmp_path / "operator"
    d.mkdir()
    low = HaproxyProc(d, haproxy_config(d / "admin.sock", {BE: servers(2)}, "leastconn").replace("level admin",
                                                                                                   "level operator"))
    low.start()
    try:
        with pytest.raises(Exception, match="unsupported|cannot keep|did not set"):
            client(low, Fence(VAR, 5, claim_until=float("inf"))).apply(weight(50))
        cfg = parse_config({"prometheus": {"url": PROM}, "haproxy": {"endpoints": [low.endpoint, hap.endpoint]},
                            "pools": [{"name": "chat", "backend": BE}], "state_file": None,
                            "registry": {"url": "http://127.0.0.1:2379"}})
        lead = Leadership(Client(FakeEtcd(time.monotonic)), "a", ["chat"], 5, prefix="/gg")
        ctl = Controller(cfg, FakeProm({}, []), [RuntimeClient(low.endpoint), RuntimeClient(hap.endpoint)],
                         metrics=ControllerMetrics.create(), leadership=lead)
        problems = fencing_checks(ctl)
        assert len(problems) == 1 and low.endpoint in problems[0] and "level admin" in problems[0]
    finally:
        low.stop()
