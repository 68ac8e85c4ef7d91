"""`autothrottle`: the per-service controller ("Captain") of Autothrottle (NSDI 2024), per pod.

As the paper describes it: each controller watches its CFS throttle ratio against a target.
When the ratio exceeds three times the target it scales the quota up by 1 + (ratio − 3 ×
target); otherwise it scales down towards the recent maximum usage plus a margin. The
application-level learner that picks targets is out of scope: the target is fixed. Autothrottle
manages CPU only; here the GPU share gets the same controller, with "pinned at the limit"
counting as a throttled period.
"""

from __future__ import annotations

import math

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.policy.base import Decision, FloatArray, Observation
from kuscale.policy.memory import PodRows
from kuscale.policy.static import TokenBlind


class AutothrottlePolicy(TokenBlind):
    name = "autothrottle"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.recent: PodRows | None = None
        self.slot = 0

    def decide(self, obs: Observation) -> Decision:
        recent_max = self._remember(obs)
        excess = obs.throttle_ratio() - 3.0 * self.settings.autothrottle_target
        limits = np.where(
            excess > 0,
            obs.limits * (1.0 + excess),
            recent_max * (1.0 + self.settings.autothrottle_margin),
        )
        return self.decision(limits, recent_max, obs)

    def _remember(self, obs: Observation) -> FloatArray:
        """Record this tick's usage in a ring of one window; return each pod's maximum."""
        if self.recent is None:
            window = max(1, math.ceil(self.settings.autothrottle_window / obs.period))
            self.recent = PodRows((window, 2))
        keys = obs.pod_keys()
        if self.slot == 0:
            self.recent.keep_only(keys)
        rows = self.recent.rows(keys)
        self.recent.data[rows, self.slot] = obs.usage
        self.slot = (self.slot + 1) % self.recent.shape[0]
        return np.asarray(self.recent.data[rows].max(axis=1), dtype=np.float64)
