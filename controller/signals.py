"""Non-latency signals, each a pure function: probe, errors, KV outlier, KV-cache saturation, hardware evidence.

The detectors (probe, errors, kv_outlier) each return the node's updated per-signal memory and their Finding: a
weight factor in [0, 1] with its reason, and a quarantine request with its priority. The policy multiplies the
factors, owns the state machine, and arbitrates the quarantine requests (see docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from grayguard.config import ThresholdsConfig
from grayguard.frozen import dict_init as dict_init  # re-exported: the policy's and the tests' import
from grayguard.frozen import evolve as evolve  # re-exported: the controller's memories are copied with it
from grayguard.vocab import PROBE_ANSWERED as PROBE_ANSWERED  # re-exported: the old name
from grayguard.vocab import PROBE_FAILURES, PROBE_FAULTS, PROBE_WAITED, Detector, ProbeResult

WINDOW_TICKS = 5  # the exporter's live window (exporters/live.py, 5 s) over the tick (1 s): one live observation
PROBE_CUDA = ProbeResult.CUDA_ERROR  # quarantines at once
PROBE_BAD = ProbeResult.BAD_RESPONSE  # quarantines at once when hardware evidence corroborates it


class Finding(NamedTuple):
    """What one detector asks for one node this tick: a weight factor (1.0: no cut) with its reason, and a quarantine
    (its reason; None: none) with its priority among the pool's candidates (the evidence in noise widths, how many
    times its peers' a probe or a cache is; inf: a hard fault, a failing probe or an open error circuit). A shadowed
    detector's findings are reported (NodeDecision.shadow) and acted on by nobody."""

    detector: str  # grayguard.vocab.Detector
    factor: float = 1.0
    quarantine: str | None = None
    reason: str = ""
    priority: float = math.inf

    def asks(self) -> tuple[str, ...]:
        """What it asks for: "cut", "quarantine", both or neither (the logs', the metrics' and replay's word)."""
        return tuple(a for a, on in (("cut", self.factor < 1.0), ("quarantine", self.quarantine is not None)) if on)


NOTHING = {d: Finding(d) for d in Detector}  # each detector's finding of a node with nothing to ask (most, most ticks)


@dataclass(frozen=True)
class SignalMemory:
    """Per-node memory of the non-latency signals (a part of NodeState)."""

    probe_bad: int = 0  # consecutive failed probes, counted per tick when the exporter's count is absent
    probe_good: int = 0  # consecutive good probes
    probe_slow: bool = False  # slow-probe degrade in force
    probe_slow_run: int = 0  # consecutive slow probes
    errors: bool = False  # the error share's cut in force (its last value above error_ratio)
    kv_saturated: bool = False
    kv_hot: int = 0  # consecutive ticks the KV cache was an outlier against the peers' (kv_outlier)
    # the last probe counted: when it was sent (NodeInput.probe_at) and the result it was counted as. The exporter
    # shows a probe still waiting past its slow threshold as slow, then its end (slow, or a timeout: counted again)
    probe_at: float | None = None
    probe_seen: str = ""
    # the share of the node's recent probes slow or timed out (vocab.PROBE_WAITED), and failed (PROBE_FAILURES): means
    # over its last PROBE_SHARE_PROBES or so (each new probe moves them by 1 / PROBE_SHARE_PROBES). Its peers' shares
    # say what run of either the node could have by luck (policy.peer_shares, probe_run_needed)
    probe_waited_share: float = 0.0
    probe_failed_share: float = 0.0
    # the timed-out probes of the current run of failures that were counted as load (like_peers: they waited in a
    # queue, policy.queued_not_failed): the exporter's count of the run less these is the node's own
    probe_excused: int = 0


def probe(m: SignalMemory, result: str | None, ttft: float | None, failures: int | None,
          peer_ttft: float | None, t: ThresholdsConfig,
          evidence: tuple[str, ...] = (), measured: bool = False,
          like_peers: bool = False, run_needed: int | None = None,
          failed_run_needed: int | None = None, probe_at: float | None = None) -> tuple[SignalMemory, Finding]:
    """Failing probes quarantine; slow probes degrade a node the live signals do not measure; a cold start
    (`starting`) is not a fault.

    evidence: what the GPU reports (hardware evidence, signals.evidence; () none), which corroborates: one slow
    probe is not taken for noise, a slow-probe cut asks for a quarantine (slow first tokens on hardware that says
    it is sick), and one bad response (garbage text, a broken stream) quarantines at once, like a CUDA error:
    HAProxy cannot see a 200 with broken text, so every tick waited for a second bad probe delivers garbage.
    Without corroboration a bad response is one failure among `probe_consecutive` (a single
    broken stream can be the network's fault; the exporter's class does not tell garbage from that).

    measured: the live signals measure the node's speed (its live ITL is scored against its peers': its engine has a
    fast path, it decoded in the live window and so did enough peers in rotation; or its load puts it at capacity, so
    its slowness is its load), at its own load: a slow probe is then no evidence of its own (a 1-token request's
    first token is mostly the queue it met, which the live signals judge at the node's load, seconds later and on
    far more tokens), so it starts no run and clears none, unless the GPU reports trouble (corroborated: a throttled or
    link-degraded GPU answering a slow probe is the fault's first sign, seconds before the live window moves). A node
    they do not measure (an engine without a fast path, a node that decodes nothing, a live ITL with too few peers
    decoding to be compared: a small pool with nodes in slow start) is judged by its probes.
    like_peers: the node decodes now, and its live signals are like its peers' (policy.like_peers_now): a probe that
    timed out waited in a queue its peers have too (a saturated pool), which is load, not a failure: it counts no
    failure. A hung node decodes nothing, so its timeouts still count.
    run_needed: slow probes in a row that cut (default probe_consecutive; the policy passes more where the
    node's peers get slow probes too: probe_run_needed). failed_run_needed: the same for failed probes, which
    quarantine: a run of failures the node's peers have too at their share now is not the node's (every probe of a
    pool failing is the probe's path: a wrong model name, a rotated key; draining a third of the pool for it made
    things worse than doing nothing). A CUDA error still quarantines at once.
    probe_at: when the probe shown was sent (None: unknown). Runs count probes, not ticks: the probe a tick read
    before, with the result it was counted as, moves no count (a probe every 5 s read on five 1 s ticks was a run of
    five); its findings are asked again as they stand (level-triggered).
    """
    corroborated = bool(evidence)
    if result is None or result == ProbeResult.STARTING:  # no data, or a cold start: hold what we knew
        return m, _slow_probes(m, "probe slow (held)", ttft, peer_ttft, t, evidence)
    new = probe_at is None or probe_at != m.probe_at or result != m.probe_seen
    seen = {}  # what a new probe changes besides the runs, written in the memory's one copy
    if new:
        seen["probe_waited_share"] = learned_share(m.probe_waited_share, result in PROBE_WAITED)
        seen["probe_failed_share"] = learned_share(m.probe_failed_share, result in PROBE_FAILURES)
        if probe_at is not None:
            seen["probe_at"], seen["probe_seen"] = probe_at, result
    # the exporter's count restarted below the excused timeouts (a restart): its run is a new one
    excused = m.probe_excused if failures is None or failures >= m.probe_excused else 0
    if result == ProbeResult.TIMEOUT and like_peers:
        m = evolve(m, probe_good=0, probe_excused=excused + int(new), **seen)
        return m, _slow_probes(m, "probe slow (held)", ttft, peer_ttft, t, evidence)
    if excused != m.probe_excused:
        seen["probe_excused"] = excused
    # the node's run of failed probes, the one that quarantines: the exporter's count of consecutive failures less the
    # timeouts of that run counted as load (a pool whose probes all queued through an overload had runs of 20 and
    # more, which drained the nodes whose queues emptied last once their peers' probes answered again); without the
    # exporter's count, counted here a probe at a time (an excused timeout never added)
    bad = failures - excused if failures is not None else (m.probe_bad + int(new) if result in PROBE_FAULTS else 0)
    if result == PROBE_CUDA:
        return evolve(m, probe_bad=bad, probe_good=0, **seen), \
            Finding(Detector.PROBE, quarantine="probe: CUDA error (the engine answers with a GPU fault)")
    if result == PROBE_BAD and corroborated:
        return evolve(m, probe_bad=bad, probe_good=0, **seen), \
            Finding(Detector.PROBE, quarantine="probe: bad response while the GPU reports trouble (one strike)")
    if result in PROBE_FAILURES:
        m = evolve(m, probe_bad=bad, probe_good=0, **seen)
        if bad >= (failed_run_needed or t.probe_consecutive):
            return m, Finding(Detector.PROBE, quarantine=f"probe: {bad} consecutive failed probes (last: {result})")
        return m, NOTHING[Detector.PROBE]
    # answered: slow when the exporter says so (its threshold is absolute) and it is slower than the peers' probes, of
    # a node the live signals do not measure or whose GPU reports trouble; a run of them cuts the weight. A probe far
    # slower than its peers' that the exporter calls ok is left to the live signals, which measure the node's speed
    # (on the real fleet it was one probe queued behind a long prompt)
    if m.probe_excused:  # an answer ends the run of failures, and what was excused in it
        seen["probe_excused"] = 0
    slower = ttft is not None and (peer_ttft is None or ttft >= t.live_probe_confirm * peer_ttft)
    slow = result == ProbeResult.SLOW and slower and (corroborated or not measured)
    if new and slow:  # a probe counted already moves no run
        run = m.probe_slow_run + 1
        m = evolve(m, probe_bad=0, probe_good=0, probe_slow_run=run, **seen,
                   probe_slow=m.probe_slow or run >= (1 if corroborated else run_needed or t.probe_consecutive))
    elif new and slower and m.probe_slow:  # still slower than the peers: not a good probe
        m = evolve(m, probe_bad=0, probe_good=0, probe_slow_run=0, **seen)
    elif new:
        good = m.probe_good + 1
        m = evolve(m, probe_bad=0, probe_good=good, probe_slow_run=0, **seen,
                   probe_slow=m.probe_slow and good < t.probe_ok_to_clear)
    if not m.probe_slow:
        return m, NOTHING[Detector.PROBE]
    what = f"{ttft * 1000:.0f} ms" if ttft is not None else "slow"
    peers = f" vs peers {peer_ttft * 1000:.0f} ms" if peer_ttft else ""
    return m, _slow_probes(m, f"probe slow ({what}{peers})", ttft, peer_ttft, t, evidence)


def _slow_probes(m: SignalMemory, reason: str, ttft: float | None, peer_ttft: float | None, t: ThresholdsConfig,
                 evidence: tuple[str, ...]) -> Finding:
    """The slow-probe cut while it is in force (m.probe_slow); with GPU evidence it asks for a quarantine too (slow
    first tokens on hardware that says it is sick), ranked by how many times its peers' the node's last probe took
    (the least a slow probe is, live_probe_confirm, when either is unknown)."""
    if not m.probe_slow:
        return NOTHING[Detector.PROBE]
    if not evidence or t.cut_factor >= 1.0:
        return Finding(Detector.PROBE, t.cut_factor, None, reason)
    ratio = ttft / peer_ttft if ttft and peer_ttft else t.live_probe_confirm
    return Finding(Detector.PROBE, t.cut_factor, f"{reason} with GPU evidence: {', '.join(evidence)}", reason, ratio)


# how far a probe's send time may lie from the controller's now to be taken for one (NodeInput.probe_at): a probe's
# deadline, its interval and the clocks' skew are seconds; a value that is no recent time (a probe-result query of
# one's own that counts series: 2 for ever) names no probe, and every tick counts, as without a time
PROBE_AT_HORIZON_S = 600.0


def probe_identity(probe_at: float | None, now: float) -> float | None:
    """The send time of the probe a node shows, if it can be one (within PROBE_AT_HORIZON_S of now); else None."""
    if probe_at is None or not abs(probe_at - now) <= PROBE_AT_HORIZON_S:
        return None
    return probe_at


# the probes a node's learned shares of slow and of failed probes are a mean over (SignalMemory.probe_waited_share):
# about half a minute at the shipped probe a second, long enough that a share of a few percent shows between its
# slow probes, short enough to follow the pool's load
PROBE_SHARE_PROBES = 30


def learned_share(share: float, hit: bool) -> float:
    """A node's share of probes of a kind after one more probe (hit: of that kind): an exponential mean over about
    PROBE_SHARE_PROBES probes."""
    return share + ((1.0 if hit else 0.0) - share) / PROBE_SHARE_PROBES


# how unlikely a run of slow (or failed) probes must be for one of a pool's healthy nodes, given their share of such
# probes, to be taken for evidence (probe_run_needed): per pool and tick, so that a large pool is not cut more often
# by luck; at a tick a second, one run by luck in about three hours of a pool whose probes are that slow all along
PROBE_RUN_CHANCE = 1e-4


def probe_run_needed(slow_share: float | None, least: int, nodes: int = 1) -> int:
    """Slow probes in a row that cut a node whose peers get slow probes at this share (policy.peer_shares: their
    last probes', or their learned shares if higher): the run one of the pool's `nodes` healthy nodes would have by
    chance at most PROBE_RUN_CHANCE of the time, share ** k <= PROBE_RUN_CHANCE / nodes, and never fewer than
    `least` (probe_consecutive). A quiet pool keeps `least` (in a 4-node pool a share up to 0.5 %: 2); a loaded one,
    whose probes queue behind long prompts here and there, asks more (4 nodes: 4 at 5 %, 5 at 10 %, 9 at 30 %; 32
    nodes: 6 at 10 %); a pool whose every peer's probe is slow (share 1) tells nothing about this node: no run is
    evidence then."""
    if slow_share is None or slow_share <= 0.0:
        return least
    if slow_share >= 1.0:
        return 1 << 30
    chance = PROBE_RUN_CHANCE / max(1, nodes)
    return max(least, math.ceil(math.log(chance) / math.log(slow_share) - 1e-9))


def errors(m: SignalMemory, ratio: float | None, t: ThresholdsConfig) -> tuple[SignalMemory, Finding]:
    """The error share of the requests the node finished over the control window, one value a sample: above
    error_ratio it cuts the weight by cut_factor, at or above circuit_error_ratio it opens the node's circuit (a
    quarantine: drained, then canaries). The share is already a rate over the window's requests, so its value acts
    as it comes; counting ticks would count the same sample again. No value (no request finished): the cut holds."""
    if ratio is None:
        return m, (Finding(Detector.ERRORS, t.cut_factor, None, "errors (held)") if m.errors
                   else NOTHING[Detector.ERRORS])
    if ratio >= t.circuit_error_ratio:
        return m, Finding(Detector.ERRORS, quarantine=f"errors: {ratio:.0%} of requests failed (circuit open)")
    cut = ratio > t.error_ratio
    if cut != m.errors:  # a quiet node keeps its memory: no copy
        m = evolve(m, errors=cut)
    return m, (Finding(Detector.ERRORS, t.cut_factor, None, f"errors {ratio:.1%}") if cut
               else NOTHING[Detector.ERRORS])


def kv_cache(m: SignalMemory, usage: float | None, t: ThresholdsConfig) -> tuple[SignalMemory, bool]:
    """Saturated (with hysteresis): no new traffic until the cache drains. Absent data holds the flag."""
    if usage is None:
        return m, m.kv_saturated
    sat = usage >= t.kv_saturated or (m.kv_saturated and usage > t.kv_drained)
    return (m if sat == m.kv_saturated else evolve(m, kv_saturated=sat)), sat


def evidence(gpu_throttled: bool | None, pcie_degraded: bool | None, ecc: bool | None,
             xid: bool | None) -> tuple[str, ...]:
    """Names of the hardware evidence present this tick."""
    if not (gpu_throttled or pcie_degraded or ecc or xid):
        return ()
    names = (("GPU throttling under load", gpu_throttled), ("PCIe link below its maximum under load", pcie_degraded),
             ("uncorrectable ECC errors", ecc), ("XID errors", xid))
    return tuple(n for n, flag in names if flag)


def kv_outlier(m: SignalMemory, usage: float | None, peer_usage: float | None,
               t: ThresholdsConfig, load_share: float = 1.0,
               held: int = WINDOW_TICKS) -> tuple[SignalMemory, Finding]:
    """A KV cache far fuller than the peers' (the median of their usage) at a like share of traffic, held for
    `held` ticks in a row (one observation of the live window, WINDOW_TICKS): a quarantine request (no cut).

    A node whose KV budget shrank (another process holding GPU memory, a leak, a smaller
    gpu_memory_utilization) fills its cache with a fraction of its peers' requests; the rest wait for a slot, so
    their first tokens come late while the per-token latency looks normal. Saturation alone (kv_cache) is load
    and only pauses new traffic; usage kv_outlier_ratio times the peers' (and at least kv_outlier_min) is not a
    share of load. Absent data (the node's or its peers') holds the count; any tick below the bar resets it.

    load_share: the node's prompt tokens/s over its peers' median, at least 1: a node prefilling twice its peers'
    prompt tokens holds twice their contexts (a tenant's 8k-token prompts), so its peers' usage is scaled by it: a
    fuller cache in proportion is its load, not a smaller budget. A node with a shrunk budget serves less under
    leastconn, so its share is 1.
    """
    if t.kv_outlier_ratio <= 0 or usage is None or peer_usage is None:
        return m, NOTHING[Detector.KV_OUTLIER]
    hot = usage >= max(t.kv_outlier_min, t.kv_outlier_ratio * peer_usage * load_share)
    run = m.kv_hot + 1 if hot else 0
    if run != m.kv_hot:
        m = evolve(m, kv_hot=run)
    if run >= held:
        why = (f"KV cache {usage:.0%} full vs its peers' {peer_usage:.0%} for {run} ticks: less room for the "
               f"KV cache than its peers (GPU memory taken or a KV budget that shrank), requests wait for a slot")
        # ranked by how many times its peers' usage it holds
        return m, Finding(Detector.KV_OUTLIER, 1.0, why, why, usage / max(peer_usage, 1e-3))
    return m, NOTHING[Detector.KV_OUTLIER]
