"""Live signals, pure: a slow node seen while its requests run, not when they finish (issue 13).

The exporter beside each node reads its vLLM every second and exports, over the last few seconds, the mean
inter-token latency of the tokens vLLM produced and the median TTFT of its last probes (docs/exporters.md,
"live fast path"). Each is compared with the node's peers (controller/peers.py: leave-one-out score and
ratio to the peer median, within the peer group or speed-normalized). Two tests run on the ratio:

- a **fast test**: the ratio at or above `live_cut_ratio` with a peer score at or above `degrade_score` on
  `live_confirm_ticks` ticks in a row cuts the weight; at or above `live_quarantine_ratio` with a score at or
  above `quarantine_score` for `live_sustain_ticks` ticks quarantines;
- a **sequential test** for small persistent gaps (a 1.25-1.5x node that one tick cannot tell from noise):
  a one-sided CUSUM of log(ratio) - log(live_drift), S = max(0, S + log(ratio) - log(drift)), cuts at
  `live_cusum_cut` and quarantines at `live_cusum_quarantine`. A healthy node's log ratio averages about 0,
  below the drift, so S stays near 0; a node k times slower climbs by log(k / drift) a tick.

A node with no live value this tick (no token produced, no peers, stale) holds what it had: absent is not
zero. A calm tick (ratio below `live_calm_ratio`) halves S; a cut clears after `recover_ticks` calm ticks in
a row once S is below half of `live_cusum_cut`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controller.peers import Score
from controller.scoring import Noise, against_noise, weight_factor
from controller.signals import evolve
from grayguard.config import ThresholdsConfig


@dataclass(frozen=True)
class LiveMemory:
    """One live signal's memory for one node (a part of NodeState)."""

    hot: int = 0  # consecutive ticks at or above live_cut_ratio (and degrade_score)
    hot_q: int = 0  # consecutive ticks at or above live_quarantine_ratio (and quarantine_score)
    cusum: float = 0.0  # one-sided CUSUM of log(ratio / live_drift)
    cut: bool = False  # the weight cut is in force
    calm: int = 0  # consecutive calm ticks while cut
    z: float = 0.0  # the score that set the cut (its factor holds while the node has no data)
    noise: Noise = field(default_factory=Noise)  # the comparison's learned noise (scoring.Noise)

    def restarted(self) -> LiveMemory:
        """The memory of a node whose signals start over (back from a drain or a restart): the learned noise is the
        pool's, not the node's trouble, so it is kept."""
        return LiveMemory(noise=self.noise)


def in_noise(ratio: float, noise: float | None, min_spread: float) -> float:
    """A ratio to the peer median written for a fleet as quiet as min_spread, as many noise widths in this one's:
    ratio ** (noise / min_spread) when the learned noise is wider (1.5x at min_spread 0.1 is 4.1 widths; at a noise
    of 0.4 the same 4.1 widths are 5.1x), ratio itself otherwise."""
    if noise is None or noise <= min_spread:
        return ratio
    return ratio ** (noise / min_spread)


def assess(m: LiveMemory, sc: Score | None, t: ThresholdsConfig, what: str, sustain: int | None = None,
           noise: float | None = None, probe_ratio: float | None = None, spread: float | None = None,
           now: float = 0.0) -> tuple[LiveMemory, float, str, str | None]:
    """(memory, weight factor, reason, quarantine reason or None) for one live signal of one node this tick.

    sustain: ticks in a row at the quarantine ratio that quarantine (default live_sustain_ticks; the policy passes
    evidence_sustain_ticks when the GPU reports trouble, as it does for the 30 s window's outlier).
    noise: the pool's learned noise on this signal (scoring.pool_noise), None: unknown; spread: the pool's spread
    this tick, which the node's memory of the noise learns at `now` (None: not this tick). A noise wider than
    min_spread is the score's spread (scoring.against_noise), scales the CUSUM's steps (one step of a fleet twice
    as noisy counts half) and the cut ratio (in_noise), and calm is judged in it too.
    probe_ratio: the node's probe TTFT median over its peers' (None: unknown), the second witness. A tick without a
    live value holds the memory (absent is not zero), but a cut node that decodes nothing is measured by its probes
    alone (a cut takes its traffic, and with it the tokens that would show it back to normal): a tick its probes are
    below live_cut_ratio x its peers' counts as calm, so a cut that accumulated no evidence (S below half of
    live_cusum_cut) ends. Probes that agree (at least live_probe_confirm x the peers', in noise widths as the cut
    ratio) let the shipped live_cut_ratio cut whatever the noise.
    """
    step = 1.0 if noise is None or noise <= t.min_spread else t.min_spread / noise  # one noise width in min_spreads
    probes_like_peers = probe_ratio is not None and probe_ratio < t.live_cut_ratio
    probes_agree = probe_ratio is not None and probe_ratio >= in_noise(t.live_probe_confirm, noise, t.min_spread)
    learned = m.noise.learn(spread, now)
    if learned is not m.noise:
        m = evolve(m, noise=learned)
    if sc is None or not math.isfinite(sc.ratio) or sc.ratio <= 0:
        if m.cut and probes_like_peers:
            calm = m.calm + 1
            if calm >= t.recover_ticks and m.cusum < t.live_cusum_cut / 2:
                return evolve(m, cut=False, calm=0, hot=0, hot_q=0, z=0.0), 1.0, "", None
            m = evolve(m, calm=calm)
        return m, (weight_factor(m.z) if m.cut else 1.0), (f"{what} (held)" if m.cut else ""), None
    ratio, z = sc.ratio, against_noise(sc.z, sc.ratio, noise, t.min_spread)
    ceiling = 2.0 * t.live_cusum_quarantine  # bounded, so that S falls back within a few calm ticks
    # in units of the noise: a fleet twice as noisy as min_spread moves S half as far for the same ratio
    cusum = min(ceiling, max(0.0, m.cusum + step * math.log(ratio) - math.log(t.live_drift)))
    quiet = ratio < t.live_calm_ratio or (noise is not None and z < t.degrade_score - t.hysteresis)
    if quiet:  # a calm tick halves what is left, so a recovered node is not held for tens of ticks
        cusum /= 2.0
    # the cut's ratio is live_cut_ratio in a fleet as quiet as min_spread, and as many noise widths in a noisier one
    # (the probes agreeing, a second witness, it is live_cut_ratio whatever the noise)
    cut_ratio = t.live_cut_ratio if probes_agree else in_noise(t.live_cut_ratio, noise, t.min_spread)
    hot = m.hot + 1 if ratio >= cut_ratio and z >= t.degrade_score else 0
    hot_q = m.hot_q + 1 if ratio >= t.live_quarantine_ratio and z >= t.quarantine_score else 0
    fires = hot >= t.live_confirm_ticks or cusum >= t.live_cusum_cut
    calm = m.calm + 1 if m.cut and quiet else 0
    # a cut holds while its evidence does: the CUSUM at half the cut or more, or a tick not quiet. One hot tick
    # leaves little in S, so a spike's cut ends at the first quiet tick; a fault's ticks fill S and hold it
    cut = fires or (m.cut and (not quiet or cusum >= t.live_cusum_cut / 2))
    zz = max(z, t.degrade_score + 1.0) if fires else (m.z if cut else 0.0)  # a cut cuts at least by half
    if (hot, hot_q, cusum, cut, calm if cut else 0, zz) != (m.hot, m.hot_q, m.cusum, m.cut, m.calm, m.z):
        m = evolve(m, hot=hot, hot_q=hot_q, cusum=cusum, cut=cut, calm=calm if cut else 0, z=zz)  # else: no copy
    reason = f"{what} {ratio:.2f}x peer median (score {z:.1f}, cusum {cusum:.1f})" if cut else ""
    quarantine = None
    if hot_q >= (t.live_sustain_ticks if sustain is None else sustain):
        quarantine = f"{what} {ratio:.2f}x peer median, score {z:.1f} for {hot_q} tick(s)"
    elif cusum >= t.live_cusum_quarantine:
        quarantine = f"{what} persistently {ratio:.2f}x peer median (cusum {cusum:.1f})"
    return m, (weight_factor(zz) if cut else 1.0), reason, quarantine
