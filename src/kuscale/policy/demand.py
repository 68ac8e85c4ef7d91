"""Demand estimation, separate from the decision.

A pod that is not starved demands what it uses. A starved pod's usage reads as its limit, so
it says nothing of how much more it wants: the estimate then grows geometrically from the
limit for as long as starvation lasts (a burst from 10 % to a core is caught in a few ticks,
where a fixed step takes tens). The tick starvation ends, the pod has shown it needs no more
than the limit it held, so the estimate falls back to at most that limit at once, then
towards usage. Decreases are damped: each quiet tick removes only part of the excess, so one
idle sample does not cut a pod that is about to need its limit again.
"""

from __future__ import annotations

import numpy as np

from kuscale.policy.base import BoolArray, FloatArray


def estimate_demand(
    usage: FloatArray,
    limits: FloatArray,
    starved: BoolArray,
    previous: FloatArray,
    ceiling: FloatArray,
    growth: float,
    damping: float,
) -> FloatArray:
    """d = min(max(u, L, d_prev)·growth, ceiling) when starved,
    else u + damping·(min(d_prev, L) − u)⁺."""
    grown = np.minimum(np.maximum(np.maximum(usage, limits), previous) * growth, ceiling)
    damped = usage + damping * np.maximum(np.minimum(previous, limits) - usage, 0.0)
    return np.where(starved, np.maximum(grown, usage), np.minimum(damped, ceiling))
