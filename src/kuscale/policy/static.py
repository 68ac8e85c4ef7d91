"""`static`: limits fixed at what a pod's tokens buy, the way fixed requests and HAMi- or
Gemini-style fixed GPU shares behave. It never reacts, so it never overspends."""

from __future__ import annotations

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.policy.base import BoolArray, Decision, FloatArray, Observation, WaitsForItsTick
from kuscale.tokens import advance_queue


class TokenBlind(WaitsForItsTick):
    """What the baselines share: they know nothing of tokens, so they admit every pod, keep
    limits within [minimum, node capacity], and keep a token queue only to charge them for
    what they hold, so the report can show their overspend."""

    def __init__(self, config: PolicyConfig, minimums: FloatArray | None = None) -> None:
        self.config = config
        self.settings = config.baselines
        self.prices = config.prices()
        self.minimums = config.minimums() if minimums is None else minimums

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        return None

    def decision(self, limits: FloatArray, demand: FloatArray, obs: Observation) -> Decision:
        ceiling = np.maximum(obs.capacity, self.minimums)
        queue = advance_queue(
            obs.queue,
            obs.tokens,
            obs.limits,
            np.where(obs.uses, self.prices, 0.0),
            obs.elapsed,
            obs.tokens * self.config.burst_seconds,
        )
        return Decision(
            limits=np.where(obs.uses, np.clip(limits, self.minimums, ceiling), 0.0),
            weights=np.zeros_like(obs.limits),
            queue=queue,
            demand=np.where(obs.uses, demand, 0.0),
        )


class StaticPolicy(TokenBlind):
    name = "static"

    def decide(self, obs: Observation) -> Decision:
        both = obs.uses.all(axis=1)
        cpu_share = np.where(both, self.settings.static_cpu_share, 1.0)
        shares = np.stack(
            [cpu_share, np.where(both, 1.0 - self.settings.static_cpu_share, 1.0)], axis=1
        )
        limits = obs.tokens[:, None] * shares / self.prices
        return self.decision(limits, limits, obs)
