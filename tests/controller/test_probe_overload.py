"""An overload's timeouts are load, in a pool whose engines give no live ITL too (issue 33, twenty-second round).

Found running the default suite's cases on pools whose engine has no live fast path (`python -m grayguard.bench
.probeinterval`'s kind of pool, the Triton profile of docs/engines.md: no live ITL, TTFT, prompt rate or decode
batch): in pool_overload (3x traffic for 30 s, every queue grows, probes time out everywhere) 1-7 healthy nodes of
4-32 were drained when the overload ended. Two faults of the model, both fixed here:
- the exporter's count of consecutive failures went on through the timeouts counted as load (rule 5), so the first
  timeout counted after them was a run of 20 and more;
- without a live ITL no timeout was load: the runs grew through the overload, and once most peers' probes answered
  again their share no longer asked a run that long of the nodes whose queues emptied last.
"""

from __future__ import annotations

from grayguard.config import ThresholdsConfig
from grayguard.controller import signals
from grayguard.controller.policy import NodeInput, Policy, decide_pool
from grayguard.controller.signals import SignalMemory
from grayguard.vocab import State

T = ThresholdsConfig()


def _probe(m: SignalMemory, k: int, result: str, failures: int | None, excused: bool, needed: int = 5):
    return signals.probe(m, result, None if result == "timeout" else 0.03, failures, 0.03, T, like_peers=excused,
                         failed_run_needed=needed, probe_at=1000.0 + k)


def test_the_exporters_count_of_a_run_less_its_excused_timeouts_is_the_nodes():
    m = SignalMemory()
    for k in range(20):  # queued with the pool: excused, counted by the exporter all the same
        m, f = _probe(m, k, "timeout", k + 1, excused=True)
        assert f.quarantine is None
    assert m.probe_excused == 20
    for k, count in ((20, 21), (21, 22)):
        m, f = _probe(m, k, "timeout", count, excused=False)
        assert f.quarantine is None  # its own run: 1, then 2 of the 5 needed (before: 21 >= 5, drained)
    assert m.probe_bad == 2
    m, f = _probe(m, 22, "timeout", 23, excused=False)
    m, f = _probe(m, 23, "timeout", 24, excused=False)
    m, f = _probe(m, 24, "timeout", 25, excused=False)
    assert m.probe_bad == 5 and f.quarantine and "5 consecutive failed probes" in f.quarantine


def test_a_probe_seen_again_is_not_excused_twice_and_an_answer_ends_the_run():
    m, _ = _probe(SignalMemory(), 0, "timeout", 1, excused=True)
    m, _ = _probe(m, 0, "timeout", 1, excused=True)  # the same probe read on a second tick
    assert m.probe_excused == 1
    m, _ = _probe(m, 1, "ok", 0, excused=False)
    assert m.probe_excused == 0 and m.probe_bad == 0


def test_an_exporter_whose_count_restarted_below_the_excused_starts_a_new_run():
    m = SignalMemory()
    for k in range(10):
        m, _ = _probe(m, k, "timeout", k + 1, excused=True)
    m, f = _probe(m, 10, "timeout", 1, excused=False)  # the exporter restarted: its count is 1
    assert m.probe_excused == 0 and m.probe_bad == 1 and f.quarantine is None
    m, f = _probe(m, 11, "timeout", 2, excused=False, needed=2)
    assert m.probe_bad == 2 and f.quarantine  # counted from the restart, not hidden by the 10 before it


def test_without_the_exporters_count_an_excused_timeout_is_never_added():
    m = SignalMemory()
    m, _ = _probe(m, 0, "timeout", None, excused=False)
    m, _ = _probe(m, 1, "timeout", None, excused=True)
    m, f = _probe(m, 2, "timeout", None, excused=False, needed=3)
    assert m.probe_bad == 2 and f.quarantine is None


def _pool(results: dict[str, str], failures: dict[str, int], k: int) -> dict[str, NodeInput]:
    """A pool whose engine gives no live ITL: the 30 s window (alike), the probes and their send times."""
    return {n: NodeInput(base_weight=100, latency=0.02, request_rate=5.0, latency_at=1000.0 + 5 * (k // 5),
                         probe_result=r, probe_ttft=None if r == "timeout" else (0.5 if r == "slow" else 0.03),
                         probe_failures=failures[n], probe_at=1000.0 + k - 0.5) for n, r in results.items()}


def _drive(schedule, nodes: int, ticks: int) -> dict[str, list[str]]:
    """Each node's state at every tick; schedule(node index, tick) is its probe's result."""
    prev: dict = {}
    names = [f"n{i}" for i in range(nodes)]
    failures = dict.fromkeys(names, 0)
    seen: dict[str, list[str]] = {n: [] for n in names}
    for k in range(ticks):
        res = {n: schedule(i, k) for i, n in enumerate(names)}
        for n, r in res.items():  # the exporter's count of consecutive failures
            failures[n] = failures[n] + 1 if r == "timeout" else 0
        d = decide_pool(prev, _pool(res, failures, k), Policy(), 1000.0 + k)
        prev = {n: nd.state for n, nd in d.nodes.items()}
        for n in names:
            seen[n].append(prev[n].state)
    return seen


def test_an_overload_of_a_pool_without_live_itl_drains_no_one_as_its_queues_empty_one_by_one():
    # 30 s of timeouts everywhere, then node i's queue empties at 30 + 2 i s (the last of 8 at 44 s)
    seen = _drive(lambda i, k: "timeout" if k < 30 + 2 * i else "ok", nodes=8, ticks=60)
    assert all(State.QUARANTINED not in states for states in seen.values()), \
        {n: s.index(State.QUARANTINED) for n, s in seen.items() if State.QUARANTINED in s}


def test_a_hung_node_of_a_pool_without_live_itl_is_still_drained_on_its_second_failure():
    seen = _drive(lambda i, k: "timeout" if i == 0 and k >= 10 else "ok", nodes=8, ticks=20)
    assert seen["n0"][10] != State.QUARANTINED and seen["n0"][11] == State.QUARANTINED


def test_its_own_timeout_does_not_make_its_peers_probes_queue():
    # four nodes: n0 hangs, one peer's probe is slow each tick in turn. With n0's own timeout, half the pool's probes
    # waited, and the pool was taken for queued: n0's timeouts were load. Its peers' (one of three) are not
    seen = _drive(lambda i, k: "timeout" if i == 0 and k >= 10 else "slow" if i == 1 + k % 3 else "ok",
                  nodes=4, ticks=20)
    assert State.QUARANTINED in seen["n0"][10:13]
