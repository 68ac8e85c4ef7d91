"""`static`: limits fixed at what a pod's tokens buy, the way fixed requests and HAMi- or
Gemini-style fixed GPU shares behave. It never reacts, so it never overspends."""

from __future__ import annotations

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.policy.base import BoolArray, Decision, FloatArray, Observation
from kuscale.tokens import advance_queue


def bounded(limits: FloatArray, minimums: FloatArray, obs: Observation) -> FloatArray:
    """Keep limits within [minimum, node capacity], and 0 for resources a pod does not use."""
    return np.where(obs.uses, np.clip(limits, minimums, np.maximum(obs.capacity, minimums)), 0.0)


def charged_queue(obs: Observation, prices: FloatArray, burst_seconds: float) -> FloatArray:
    """The token queue of a rule that knows nothing of tokens: kept only to be reported."""
    return advance_queue(
        obs.queue,
        obs.tokens,
        obs.limits,
        np.where(obs.uses, prices, 0.0),
        obs.elapsed,
        obs.tokens * burst_seconds,
    )


class StaticPolicy:
    name = "static"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.prices = config.prices()
        self.minimums = config.minimums()
        self.cpu_share = config.baselines.static_cpu_share

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        return None

    def decide(self, obs: Observation) -> Decision:
        both = obs.uses.all(axis=1)
        cpu_share = np.where(both, self.cpu_share, 1.0)
        shares = np.stack([cpu_share, np.where(both, 1.0 - self.cpu_share, 1.0)], axis=1)
        limits = bounded(obs.tokens[:, None] * shares / self.prices, self.minimums, obs)
        return Decision(
            limits=limits,
            weights=np.zeros_like(limits),
            queue=charged_queue(obs, self.prices, self.config.burst_seconds),
            demand=np.where(obs.uses, limits, 0.0),
        )
