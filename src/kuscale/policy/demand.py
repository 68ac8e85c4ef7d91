"""Demand estimation, separate from the decision.

A pod that is not starved demands what it uses. A starved pod's usage reads as its limit, so
it says nothing of how much more it wants: the estimate then grows geometrically from the
limit for as long as starvation lasts (a burst from 10 % to a core is caught in a few ticks,
where a fixed step takes tens). Growth needs the pod to have held about what was estimated:
where the budget or the node cut the limit below the estimate, starvation was expected and
says nothing new, so the estimate holds; growing it anyway would let one resource's runaway
estimate take the budget its other resource needs. The tick starvation ends, the pod has
shown it needs no more than the limit it held, so the estimate falls back to at most that
limit at once, then towards usage. Decreases are damped: each quiet tick removes only part
of the excess, so one idle sample does not cut a pod that is about to need its limit again.

A quiet estimate never sinks into the band where usage counts as pinned (twice the pin
tolerance above usage), nor below usage plus a margin of the pod's spread. Otherwise a
steady or noisy pod's limit sinks until its own steady usage or noise pins it, the estimate
doubles, and the pod pays for a spike it did not need, over and over: a sawtooth that, in
the simulator, drained burst credit and took the budget other resources needed.
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
    spread: FloatArray,
    margin: float,
    pin_tolerance: float,
) -> FloatArray:
    """d = min(max(u, L, d_prev)·growth, ceiling) when starved (max(d_prev, u) where the limit
    was cut below d_prev·(1 − tol)), else
    min(max(u + damping·(min(d_prev, L) − u)⁺, u·(1 + 2·tol), u + margin·spread), ceiling)."""
    grown = np.minimum(np.maximum(np.maximum(usage, limits), previous) * growth, ceiling)
    cut = limits < previous * (1.0 - pin_tolerance)
    grown = np.where(cut, np.maximum(previous, usage), grown)
    damped = usage + damping * np.maximum(np.minimum(previous, limits) - usage, 0.0)
    floor = np.maximum(usage * (1.0 + 2.0 * pin_tolerance), usage + margin * spread)
    quiet = np.maximum(damped, floor)
    return np.where(starved, np.maximum(grown, usage), np.minimum(quiet, ceiling))
