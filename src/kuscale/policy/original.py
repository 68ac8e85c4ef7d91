"""The original KuScale rule (2022), per pod, per tick, as DESIGN.md §3 states it.

It is kept exactly, weaknesses included (no upper bound, pods solved one by one, a starved
pod grows by a fixed step), so that the default rule can be compared with it on the same work.
"""

from __future__ import annotations

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.policy.base import BoolArray, Decision, FloatArray, Observation, WaitsForItsTick
from kuscale.rows import row_sum
from kuscale.tokens import advance_queue

USAGE_WEIGHT_SCALE = 15.0
"""The constant in the original's usage-based weight W = 15·Σ_r (avg_r + 1)/(u_r + 1)."""


def static_weights(prices: FloatArray, static_v: float) -> FloatArray:
    """w_r = p_r·V: a fixed trade-off between tracking error and token spend."""
    return prices * static_v


def usage_weights(
    usage: FloatArray, avg_usage: FloatArray, prices: FloatArray, uses: BoolArray
) -> FloatArray:
    """The original's usage-based weights (V <= 0); sums run over the resources a pod uses.

    S = Σ_r (avg_r + 1), W = 15·Σ_r (avg_r + 1)/(u_r + 1), w_r = W·p_r·S/(avg_r + 1).
    """
    shifted_avg = np.where(uses, avg_usage + 1.0, 0.0)
    total = row_sum(shifted_avg)[:, None]
    scale = USAGE_WEIGHT_SCALE * row_sum(shifted_avg / (usage + 1.0))[:, None]
    return np.where(uses, scale * prices * total / np.maximum(shifted_avg, 1.0), 1.0)


def dynamic_weights(obs: Observation, prices: FloatArray, static_v: float) -> FloatArray:
    """Step 3 of the rule, shared by both policies: static for V > 0, else usage-based."""
    if static_v > 0:
        return np.where(obs.uses, static_weights(prices, static_v), 1.0)
    return usage_weights(obs.usage, obs.avg_usage, prices, obs.uses)


class OriginalPolicy(WaitsForItsTick):
    """`kuscale-2022`: each pod alone maximises Σ_r [A·p_r·x_r − w_r·(x_r − u_r)²]."""

    name = "kuscale-2022"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.prices = config.prices()
        self.minimums = config.minimums()

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        """The original admits every pod; the monitor still refuses a GPU pod without a GPU."""
        return None

    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        prices = np.where(obs.uses, self.prices, 0.0)
        queue = advance_queue(
            obs.queue, obs.tokens, obs.limits, prices, obs.elapsed, obs.tokens * cfg.burst_seconds
        )
        weights = dynamic_weights(obs, prices, cfg.static_v)
        available = cfg.burst_factor * queue + obs.tokens * obs.period
        limits = self.step(obs.usage, prices, weights, available, obs.period)
        limits = np.where(obs.uses, np.maximum(limits, self.minimums), 0.0)
        return Decision(
            limits=limits,
            weights=np.where(obs.uses, weights, 0.0),
            queue=queue,
            demand=np.where(obs.uses, obs.usage, 0.0),
        )

    @staticmethod
    def step(
        usage: FloatArray,
        prices: FloatArray,
        weights: FloatArray,
        available: FloatArray,
        period: float,
    ) -> FloatArray:
        """Steps 5-6: the unconstrained maximiser, else its projection onto the budget."""
        free = usage + prices * available[:, None] / (2.0 * weights)
        fits = row_sum(prices * free) * period <= available
        surplus = available / period - row_sum(prices * usage)
        projected = usage + (prices / weights) * (surplus / row_sum(prices**2 / weights))[:, None]
        return np.where(fits[:, None], free, projected)
