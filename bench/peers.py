"""The balancers users pick instead of grayguard, modelled from their sources, as bench.lb balancers (no controller).

- `PeakEwma`: Linkerd's proxy balancer (tower's `p2c` over `load::PeakEwma`, from Finagle): power of two choices
  on cost = Peak-EWMA latency x (pending + 1), the latency taken to the response's first body bytes.
- `LeastRequest`: Envoy's LEAST_REQUEST load balancer at its defaults (choice_count 2, active_request_bias 1.0).
- `EndpointPicker`: the Gateway API Inference Extension's endpoint picker (EPP): the least waiting queue, then the
  least KV-cache usage, from vLLM's /metrics refreshed every 50 ms, then a random pick.

Same interface as bench.lb's balancers: `pick(weights, drained, t)`, `started(i, t)`, `ended(i, t)`, plus the engine's
feedback hooks `first_byte(i, t, rtt)`, `failed_at_once(i, t, why)` and `refresh(t, gauges)` every `refresh_s`.
Weight-0, drained and absent servers are never picked (the engine's `drained` list covers them). Pure and
clock-free; each draws from its own seeded RNG, so a run is reproducible and a branched run continues the same draws.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from grayguard.bench.lb import _Stat

LINKERD_DEFAULT_RTT_S = 0.030  # linkerd2-proxy's EWMA_DEFAULT_RTT (tower itself takes it as a parameter)
LINKERD_DECAY_S = 10.0  # linkerd2-proxy's EWMA_DECAY: the Peak-EWMA's time constant
LINKERD_BACKOFF_MIN_S = 0.1  # linkerd2-proxy's outbound connect backoff: 100 ms doubling to 500 ms
LINKERD_BACKOFF_MAX_S = 0.5
EPP_REFRESH_S = 0.050  # the EPP's --refreshMetricsInterval default (DefaultRefreshMetricsInterval)
KUBELET_PROBE_S = 10.0  # a readiness probe's periodSeconds default
KUBELET_FAILURES = 3  # its failureThreshold default: a pod is NotReady after 3 failed probes


def _eligible(weights: Sequence[int], drained: Sequence[bool]) -> list[int]:
    return [i for i, w in enumerate(weights) if w > 0 and not drained[i]]


def _two(rng: random.Random, m: int) -> tuple[int, int]:
    """Two distinct positions in range(m), m >= 2 (tower's sample_floyd2)."""
    a = rng.randrange(m)
    b = rng.randrange(m - 1)
    return a, b + (b >= a)


class PeakEwma(_Stat):
    """Linkerd's balancer: P2C on Peak-EWMA cost (tower `p2c::Balance` over `load::PeakEwmaDiscover`).

    Per endpoint an RTT estimate, starting at Linkerd's default RTT (30 ms). A sample above the estimate replaces
    it at once (the peak); one below moves it toward the sample by 1 - exp(-elapsed / decay), elapsed since the
    estimate's last update. Reading the cost decays the estimate toward 0 the same way (tower's `load()` updates it
    with a zero sample) and restamps it. cost = estimate x (pending + 1), pending = requests sent that have not yet
    received their first body bytes (linkerd's `PendingUntilFirstData`): for vLLM's stream the first token, so the
    sample is the TTFT; a request that ends without any (client timeout, error) drops its handle then, and that wait
    is its sample. An HTTP 500 at once is a fast sample (its error body is the first data). pick: two distinct
    ready endpoints at random, the lower cost (the first on a tie); with one, that one.

    A refused connection fails the request that met it and makes the endpoint not ready (tower's P2C samples ready
    endpoints only) while linkerd reconnects with backoff (100 ms doubling to 500 ms): `refresh` every 100 ms tries the
    connect of each endpoint whose backoff elapsed (ready again when the port answers). Weights are not read (tower's
    P2C has none); Linkerd's failure accrual and retries are opt-in and are not modelled.
    """

    name = "peak_ewma"
    refresh_s = LINKERD_BACKOFF_MIN_S

    def __init__(self, n: int, seed: int = 0, default_rtt_s: float = LINKERD_DEFAULT_RTT_S,
                 decay_s: float = LINKERD_DECAY_S) -> None:
        super().__init__(n)
        self.rng = random.Random(seed * 1_000_003 + 17)
        self.decay_s = decay_s
        self.rtt = [default_rtt_s] * n  # seconds
        self.updated = [0.0] * n  # when each estimate was last updated (a sample or a cost read)
        self.pending = [0] * n  # requests without their first body bytes yet
        self.unready = [False] * n  # its connection failed: out of the ready set until a reconnect succeeds
        self.retry_at = [0.0] * n  # next reconnect attempt
        self.backoff = [0.0] * n  # current reconnect backoff

    def _update(self, i: int, t: float, rtt: float) -> float:
        """tower's RttEstimate::update: the peak replaces the estimate; a lower sample decays toward itself."""
        est = self.rtt[i]
        if est < rtt:
            est = rtt
        else:
            decay = math.exp(-max(0.0, t - self.updated[i]) / self.decay_s)
            est = est * decay + rtt * (1.0 - decay)
        self.rtt[i], self.updated[i] = est, t
        return est

    def cost(self, i: int, t: float) -> float:
        """Endpoint i's load at t (its estimate decays as it is read, as tower's load() does)."""
        return self._update(i, t, 0.0) * (self.pending[i] + 1)

    def pick(self, weights: Sequence[int], drained: Sequence[bool], t: float = 0.0) -> int | None:
        ready = [i for i in _eligible(weights, drained) if not self.unready[i]]
        if len(ready) < 2:
            return ready[0] if ready else None
        a, b = _two(self.rng, len(ready))
        a, b = ready[a], ready[b]
        return a if self.cost(a, t) <= self.cost(b, t) else b

    def started(self, i: int, t: float = 0.0) -> None:
        self.active[i] += 1
        self.stot[i] += 1
        self.pending[i] += 1

    def first_byte(self, i: int, t: float, rtt: float) -> None:
        """The first body bytes of a request on i came rtt seconds after it was sent (or it ended without any)."""
        self.pending[i] -= 1
        self._update(i, t, rtt)

    def ended(self, i: int, t: float = 0.0) -> None:
        self.active[i] -= 1

    def failed_at_once(self, i: int, t: float = 0.0, why: str = "") -> None:
        self.stot[i] += 1
        if why == "conn-failure":
            self.unready[i] = True
            self.backoff[i] = LINKERD_BACKOFF_MIN_S
            self.retry_at[i] = t + LINKERD_BACKOFF_MIN_S
        else:  # an answer (HTTP 500) at once: a fast sample
            self._update(i, t, 0.0)

    def refresh(self, t: float, gauges: Sequence[tuple[int, int, float] | None]) -> None:
        """Reconnect attempts due at t: gauges[i] is None where node i's port refuses connections."""
        for i, down in enumerate(self.unready):
            if down and self.retry_at[i] <= t + 1e-9:
                if gauges[i] is not None:
                    self.unready[i] = False
                else:
                    self.backoff[i] = min(LINKERD_BACKOFF_MAX_S, 2 * self.backoff[i])
                    self.retry_at[i] = t + self.backoff[i]


class LeastRequest(_Stat):
    """Envoy's LEAST_REQUEST at its defaults: choice_count 2, active_request_bias 1.0 (selection N_CHOICES).

    Equal weights: `choice_count` hosts drawn at random (with replacement, as Envoy's unweightedHostPick draws
    `random() % hosts`), the one with the fewest active requests (rq_active: until the response ends); the first drawn
    wins a tie. Unequal weights: Envoy's EDF schedule on weight / (active + 1)^bias, the dynamic weight taken when a
    host is picked. Envoy adds no outlier detection, health check or retry unless configured; none is modelled.
    """

    name = "least_request"

    def __init__(self, n: int, seed: int = 0, choice_count: int = 2, active_request_bias: float = 1.0) -> None:
        super().__init__(n)
        self.rng = random.Random(seed * 1_000_003 + 29)
        self.choices, self.bias = choice_count, active_request_bias
        self._deadline = [0.0] * n  # EDF: each host's next deadline
        self._edf_now = 0.0

    def pick(self, weights: Sequence[int], drained: Sequence[bool], t: float = 0.0) -> int | None:
        hosts = _eligible(weights, drained)
        if not hosts:
            return None
        if len({weights[i] for i in hosts}) > 1:
            return self._edf(hosts, weights)
        active, rng = self.active, self.rng
        best = None
        for _ in range(self.choices):
            i = hosts[rng.randrange(len(hosts))]
            if best is None or active[i] < active[best]:
                best = i
        return best

    def _edf(self, hosts: list[int], weights: Sequence[int]) -> int:
        dl = self._deadline
        i = min(hosts, key=lambda h: (max(dl[h], self._edf_now), h))
        self._edf_now = max(dl[i], self._edf_now)
        dl[i] = self._edf_now + (self.active[i] + 1) ** self.bias / weights[i]
        return i

    def started(self, i: int, t: float = 0.0) -> None:
        self.active[i] += 1
        self.stot[i] += 1

    def ended(self, i: int, t: float = 0.0) -> None:
        self.active[i] -= 1


class EndpointPicker(_Stat):
    """The Gateway API Inference Extension's endpoint picker (kubernetes-sigs/gateway-api-inference-extension).

    What it reads: each pod's vllm:num_requests_waiting and vllm:kv_cache_usage_perc (num_requests_running too),
    scraped every 50 ms (--refreshMetricsInterval); between refreshes it decides on the last scrape. A pod whose
    /metrics fails keeps its last values; a pod never scraped reads 0. Its filter chain (scheduling/filter.go):
    the least-queuing filter keeps the pods whose waiting queue lies in [min, min + (max - min) / pods] (integer
    division), then the least-KV-cache filter does the same on KV usage among them, then one survivor at random.
    A hung vLLM publishes no new stats: its gauges stay frozen (VirtualNode.vllm_gauges), so the picker keeps
    sending to it. The pod list is Kubernetes' Ready pods: a pod whose port refuses connections goes NotReady after
    3 failed readiness probes 10 s apart (kubelet defaults; modelled as 30 s of refusals) and Ready at the first
    answer. No response feedback, no retry (Envoy's default), and a hung pod stays Ready (its /health answers).
    """

    name = "epp"
    refresh_s = EPP_REFRESH_S

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n)
        self.rng = random.Random(seed * 1_000_003 + 41)
        self.snap: list[tuple[int, int, float]] = [(0, 0, 0.0)] * n  # (running, waiting, KV usage) last scraped
        self.refused_since: list[float | None] = [None] * n
        self.not_ready = [False] * n

    def refresh(self, t: float, gauges: Sequence[tuple[int, int, float] | None]) -> None:
        """A metrics refresh at t: gauges[i] is what node i's /metrics shows (None: it refused)."""
        for i, g in enumerate(gauges):
            if g is None:
                if self.refused_since[i] is None:
                    self.refused_since[i] = t
                elif t - self.refused_since[i] >= KUBELET_PROBE_S * KUBELET_FAILURES - 1e-9:
                    self.not_ready[i] = True
                continue
            self.snap[i] = g
            self.refused_since[i] = None
            self.not_ready[i] = False

    def pick(self, weights: Sequence[int], drained: Sequence[bool], t: float = 0.0) -> int | None:
        pods = [i for i in _eligible(weights, drained) if not self.not_ready[i]]
        if not pods:
            return None
        snap = self.snap
        qs = [snap[i][1] for i in pods]
        lo, hi = min(qs), max(qs)
        pods = [i for i in pods if snap[i][1] <= lo + (hi - lo) // len(pods)]
        kv = [snap[i][2] for i in pods]
        lo_kv, hi_kv = min(kv), max(kv)
        pods = [i for i in pods if snap[i][2] <= lo_kv + (hi_kv - lo_kv) / len(pods)]
        return pods[self.rng.randrange(len(pods))]

    def started(self, i: int, t: float = 0.0) -> None:
        self.active[i] += 1
        self.stot[i] += 1

    def ended(self, i: int, t: float = 0.0) -> None:
        self.active[i] -= 1


PEER_BALANCERS = {"peak_ewma": PeakEwma, "least_request": LeastRequest, "epp": EndpointPicker}
