"""What the dashboards take from the grayguard config: windows, thresholds, job names, vLLM naming (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from grayguard.config import Config, RulesConfig, ThresholdsConfig
from grayguard.rules.render import pool_engines

_T, _R = ThresholdsConfig(), RulesConfig()
_TICK_S = Config.__dataclass_fields__["tick_interval_s"].default


@dataclass(frozen=True)
class DashboardConfig:
    """Knobs the dashboards are rendered with; the defaults are the controller's and the rules' defaults."""

    control_window: str = _R.control_window  # suffix of the controller's recorded signals (rate30s)
    human_window: str = _R.human_window  # suffix of the long-window recorded series (rate5m)
    quarantine_score: float = _T.quarantine_score  # drawn on the peer-score panel
    live_cut_ratio: float = _T.live_cut_ratio  # drawn on the ratio panels: one value there cuts the weight
    live_drift: float = _T.live_drift  # drawn there too: below it a node gathers no evidence
    live_batch_slope: float = _T.live_batch_slope  # the live ITL ratio panel compares ITLs at equal batch
    live_probe_confirm: float = _T.live_probe_confirm  # probe median ratio a live quarantine needs (described)
    kv_outlier_ratio: float = _T.kv_outlier_ratio  # KV usage ratio to the peers' that quarantines (described)
    kv_outlier_min: float = _T.kv_outlier_min  # ...at least this full (drawn on the KV panel)
    kv_saturated: float = _T.kv_saturated  # drawn on the KV panel: no new traffic from here
    controller_job: str = _R.controller_job  # controller series without a pool label are selected by job
    controller_stale_s: float = _R.controller_stale_s  # drawn on the last-successful-tick panel
    probe_failures: int = _R.probe_failures  # drawn on the consecutive-probe-failures panel
    tick_interval_s: float = _TICK_S  # drawn on the tick-duration panel: a longer tick skips the next one
    vllm_prefix: str = _R.vllm_prefix  # "vllm:", "vllm_" or "any" (rules.vllm_prefix)
    engines: tuple[str, ...] = ("vllm",)  # the pools' engines (pools[].engine): the per-node panels read their series
    refresh: str = "30s"  # dashboard auto-refresh
    time_from: str = "now-3h"  # default time range

    @property
    def control(self) -> str:
        """Suffix of the control-window recorded series, e.g. rate30s."""
        return f"rate{self.control_window}"

    @property
    def human(self) -> str:
        """Suffix of the human-window recorded series, e.g. rate5m."""
        return f"rate{self.human_window}"

    @classmethod
    def from_config(cls, cfg: Config) -> DashboardConfig:
        """The dashboard knobs of a validated grayguard config."""
        t, r = cfg.thresholds, cfg.rules
        return cls(control_window=r.control_window, human_window=r.human_window,
                   quarantine_score=t.quarantine_score,
                   live_cut_ratio=t.live_cut_ratio, live_drift=t.live_drift, live_probe_confirm=t.live_probe_confirm,
                   live_batch_slope=t.live_batch_slope,
                   kv_outlier_ratio=t.kv_outlier_ratio, kv_outlier_min=t.kv_outlier_min, kv_saturated=t.kv_saturated,
                   controller_job=r.controller_job, controller_stale_s=r.controller_stale_s,
                   probe_failures=r.probe_failures, tick_interval_s=cfg.tick_interval_s,
                   vllm_prefix=r.vllm_prefix, engines=tuple(pool_engines(cfg)))
