"""Live signals, pure: a slow node seen while its requests run, not when they finish (issue 13), judged by one
sequential test (issue 33). The 30 s window is judged by the same test, one value a new sample (policy._window:
per_obs the window's samples that share their requests, its noise widened by its own sampling noise).

The exporter beside each node reads its vLLM every second and exports, over the last few seconds, the mean
inter-token latency of the tokens vLLM produced and the median TTFT of its last probes (docs/exporters.md,
"live fast path"). The policy compares the node's live ITL at its load with its peers' (controller/loadmodel.py,
controller/peers.py); here x = ln(ratio), one a tick, is judged by one test over the ticks:

    Z_n = (mean of the last n x - ln live_drift) * sqrt(max(1, n / W)) / sigma,   Z = max over n in HORIZONS

- sigma: the node's noise on the live ITL: the comparison's learned noise, floored at min_spread (scoring.Noise),
  widened by the sampling noise of the token gaps its value is a mean of (gaps, scoring.sampled_noise);
- W = WINDOW_TICKS: the ticks whose values share their samples (the exporter's 5 s window at a 1 s tick): n ticks
  are n / W observations, not n, so one noisy window counts once, not five times;
- live_drift: the allowance; a healthy node averages below it, so its evidence stays negative;
- the scan over horizons is the test for a gap of any size: a 2x node shows in one tick, a 1.25x one over
  tens (a generalized likelihood ratio over the change's start, on the horizons 1..55).

It cuts at Z >= ln(live_cut_ratio / live_drift) / min_spread (3.1 noise widths: one tick at 1.5x in a pool as
quiet as min_spread; with a second witness, the shipped ratio cuts in a noisier pool too, as long as Z is at least
DEGRADE_AT, 2) and asks for a quarantine at Z >= quarantine_score (or the cut's level if higher) over at least W
ticks (one tick with GPU evidence), which waits for that witness (witness: GPU evidence or the probes agreeing).
A cut ends at the first calm value (x within one noise width of the allowance), and the history goes with it: the
next cut needs evidence of its own. A tick without a live value (no token produced, no peers, stale) holds what was
known, a cut included, until a value of its own comes: absent is not zero (a cut node keeps weight 1, so it is
measured again; its probes' median, which released it before 2026-12-06, let a sick node in a noisy pool go).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from itertools import accumulate

from grayguard.config import ThresholdsConfig
from grayguard.controller.peers import Score
from grayguard.controller.scoring import DEGRADE_AT, Noise, against_noise, weight_factor
from grayguard.controller.signals import WINDOW_TICKS as WINDOW_TICKS  # re-exported: one live observation's ticks
from grayguard.controller.signals import evolve

LIVE_WINDOW_S = 5.0  # the exporter's live window (exporters/live.py): the span a live value is a mean over
HORIZONS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25, 30, 36, 45, 55)  # ticks: about 1.25x apart past 5


@functools.cache
def _scaled(per_obs: int) -> tuple[tuple[int, float], ...]:
    """Each horizon with the square root of the observations its values hold (per_obs values share one)."""
    return tuple((n, math.sqrt(max(1.0, n / per_obs))) for n in HORIZONS)


@dataclass(frozen=True)
class LiveMemory:
    """One live signal's memory for one node (a part of NodeState)."""

    cut: bool = False  # the weight cut is in force
    z: float = 0.0  # the score that set the cut (its factor holds while the node has no data)
    noise: Noise = field(default_factory=Noise)  # the comparison's learned noise (scoring.Noise)
    # the last ln(ratio), most recent last, at most HORIZONS[-1]; not in the state file (rewritten every tick for
    # every node): a restarted controller gathers it anew, a quarantine at most WINDOW_TICKS ticks later
    xs: tuple[float, ...] = ()

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


def gaps(itl: float | None, batch: float | None, window: float = LIVE_WINDOW_S) -> float | None:
    """How many token gaps a live ITL is the mean of: its decode batch (every decoding sequence adds one second of
    gaps a second) over the ITL, across the exporter's live window; None when either is unknown."""
    if itl is None or batch is None or not (itl > 0 and batch >= 0) or not math.isfinite(batch):
        return None
    return batch * window / itl


def witness(corroborated: bool, probe_ratio: float | None, noise: float | None, t: ThresholdsConfig) -> bool:
    """A second witness of a latency test's evidence: GPU evidence (corroborated), or the node's probes, their median
    `live_probe_confirm` x its peers' in the comparison's noise (in_noise). A quarantine request takes one
    (policy._witnessed; no probe data: the evidence alone), and with one the shipped ratio cuts in a pool noisier
    than min_spread (evidence of at least DEGRADE_AT widths there)."""
    return corroborated or (probe_ratio is not None
                            and probe_ratio >= in_noise(t.live_probe_confirm, noise, t.min_spread))


def evidence(xs: tuple[float, ...], sigma: float, drift: float, least: int = WINDOW_TICKS,
             per_obs: int = WINDOW_TICKS) -> tuple[float, int, float, int]:
    """(Z, n, Z', n'): the strongest evidence that the last n values of xs (n in HORIZONS) sit above ln(drift), in
    noise widths, (mean - ln drift) x sqrt(max(1, n / per_obs)) / sigma, and the strongest over n >= least;
    -inf and 0 where there is none. per_obs: the values that share one observation's samples. The n does not depend
    on sigma: evidence in other widths is Z x sigma / them."""
    best = best_least = -math.inf
    at = at_least = 0
    sums, ld = list(accumulate(reversed(xs))), math.log(drift)  # sums[n - 1]: the sum of the last n
    for n, root in _scaled(per_obs):
        if n > len(xs):
            break
        z = (sums[n - 1] / n - ld) * root / sigma
        if z > best:
            best, at = z, n
        if n >= least and z > best_least:
            best_least, at_least = z, n
    return best, at, best_least, at_least


def assess(m: LiveMemory, sc: Score | None, t: ThresholdsConfig, what: str, corroborated: bool = False,
           noise: float | None = None, probe_ratio: float | None = None, spread: float | None = None,
           now: float = 0.0, per_obs: int = WINDOW_TICKS, unit: str = "tick"
           ) -> tuple[LiveMemory, float, str, str | None]:
    """(memory, weight factor, reason, quarantine reason or None) for one signal of one node, on one new value: the
    live ITL each tick, or the 30 s window on each new sample (per_obs: the values that share one observation's
    samples, WINDOW_TICKS ticks of the live window, 6 samples of a 30 s window evaluated every 5 s; unit: what one
    value is called in the reasons).

    corroborated: the GPU reports trouble; one tick's evidence may then ask for a quarantine (as it shortens the
    30 s window's). noise: the pool's learned noise on this signal (scoring.pool_noise), None: unknown;
    spread: the pool's spread this tick, which the node's memory of the noise learns at `now` (None: not this
    tick). probe_ratio: the node's probe TTFT median over its peers' (None: unknown), the second witness.
    """
    learned = m.noise.learn(spread, now)  # goes into the one copy of the memory this call makes
    if sc is None or not math.isfinite(sc.ratio) or sc.ratio <= 0:  # no value: what was known holds
        if learned is not m.noise:
            m = evolve(m, noise=learned)
        return m, (weight_factor(m.z) if m.cut else 1.0), (f"{what} (held)" if m.cut else ""), None
    sigma, ld = max(noise or 0.0, t.min_spread), math.log(t.live_drift)
    cut_at = math.log(t.live_cut_ratio / t.live_drift) / t.min_spread
    ratio, x = sc.ratio, math.log(sc.ratio)
    xs = m.xs[1:] + (x,) if len(m.xs) >= HORIZONS[-1] else m.xs + (x,)
    # no horizon's evidence exceeds that of the largest value over the whole history: below every level the test
    # acts on (most nodes, most ticks), the scan would change nothing, and is skipped
    bound = max(0.0, max(xs) - ld) * math.sqrt(max(1.0, len(xs) / per_obs)) / sigma
    if not m.cut and bound < min(cut_at, DEGRADE_AT):
        return evolve(m, noise=learned, xs=xs), 1.0, "", None
    z, witnessed = against_noise(sc.z, ratio, noise, t.min_spread), witness(corroborated, probe_ratio, noise, t)
    e, n, eq, nq = evidence(xs, sigma, t.live_drift, least=1 if corroborated else per_obs, per_obs=per_obs)
    fires = e >= cut_at
    if not fires and witnessed and sigma > t.min_spread and e >= DEGRADE_AT:
        fires = e * sigma / t.min_spread >= cut_at  # a witness: the shipped ratio cuts, whatever the noise
    if m.cut and x - ld < sigma:  # a calm tick ends the cut, and its evidence with it
        return LiveMemory(noise=learned), 1.0, "", None
    cut = fires or m.cut
    # a cut cuts at least by half, and deepens but never eases until a calm tick ends it: a cut firing again at a lower
    # score than the one it held raised the weight of the slower of two otherwise equal nodes (tests/controller/
    # test_decide_fuzz.py: a node that gets slower never gains weight)
    zz = max(z, DEGRADE_AT + 1.0, m.z if m.cut else 0.0) if fires else (m.z if cut else 0.0)
    m = evolve(m, noise=learned, cut=cut, z=zz, xs=xs)
    reason = f"{what} {ratio:.2f}x peer median (score {z:.1f}, evidence {e:.1f} over {n} {unit}(s))" if cut else ""
    quarantine = None
    if eq >= max(t.quarantine_score, cut_at):
        quarantine = f"{what} {math.exp(sum(xs[-nq:]) / nq):.2f}x peer median over {nq} {unit}(s) (evidence {eq:.1f})"
    return m, (weight_factor(zz) if cut else 1.0), reason, quarantine
