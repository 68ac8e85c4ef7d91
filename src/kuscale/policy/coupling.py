"""Telling a pipeline from what it measures, and splitting its budget when the budget binds.

A coupled pod (a trainer whose input pipeline feeds its GPU, an inference server whose
preprocessing feeds its model) gets work done at the served fraction of its scarcest
resource, and uses the others only as far as that progress needs. Its use is then always in
the proportion its work asks: whichever resource holds it back, the others wait with it. So
the one split of a binding budget that wastes nothing buys its resources in the proportion it
uses them; a CPU cut to buy GPU time idles that GPU time, and a GPU cut to buy CPU leaves the
CPU waiting.

A real agent never sees a label, so the pod is told by its measurements: between two ticks
in which one resource stayed pinned at its limit and the other stayed below its own, the
pinned one's use moved with its limit, by a = log(use after / use before), and the free
one's use by b. For a pipeline b follows a (the free resource waits on the pinned one); for
resources used independently b does not follow a: it is the free resource's own noise, or
the opposite of a where the budget moved to the free resource because it asked for more.
The slope of b on a, β = cov(a, b) / var(a) over the recent such pairs (every sum decayed
by `DECAY` per pair), is about 1 for a pipeline and about 0 or below for independent
resources: noise in b averages out, a large move weighs more than a small one, and a drift
both uses share for a while (a free resource's own slow swing while the pinned one's credit
drains) falls into the intercept, not the slope. A pod is coupled once β is at least one
half and `CONFIDENCE` standard errors above 0 (the error σ/√(n·var a), σ² the pairs'
residual variance), over moves worth at least `EVIDENCE` (n·var a: about three moves of
10 %). A noisy pod takes more moves to tell; a pod whose limits never move while one
resource is pinned gives no evidence and keeps the default split, which is right for
independent resources.
"""

from __future__ import annotations

import math

import numpy as np

from kuscale.model import Resource
from kuscale.policy.base import BoolArray, FloatArray
from kuscale.policy.memory import PodRows
from kuscale.policy.podstage import solve_within, spend_curves
from kuscale.rows import row_sum

USED = 1.0
"""Percent: a resource used less than this says nothing of a proportion."""
DECAY = 0.99
"""Each new pair keeps this much of the sums before it: about the last hundred pairs count."""
EVIDENCE = 3 * math.log(1.1) ** 2
COUPLED_AT = 0.5
CONFIDENCE = 3.0

_CPU, _GPU = Resource.CPU, Resource.GPU
_USAGE, _PINNED = slice(0, 2), slice(2, 4)
_SUMS = slice(4, 10)
"""Decayed sums over the pairs: n, Σa, Σb, Σa², Σb², Σab."""


class CouplingEvidence:
    """Each CPU+GPU pod's elasticity evidence, remembered by pod key across ticks."""

    def __init__(self) -> None:
        self.memory = PodRows((10,))

    def observe(
        self, keys: tuple[str, ...], usage: FloatArray, pinned: BoolArray, uses: BoolArray
    ) -> BoolArray:
        """Add this tick's pairs; which pods are coupled now."""
        coupled = np.zeros(usage.shape[0], dtype=bool)
        both = uses[:, _CPU] & uses[:, _GPU]
        if not both.any():
            return coupled
        chosen = tuple(key for key, take in zip(keys, both.tolist(), strict=True) if take)
        self.memory.keep_only(chosen)
        rows = self.memory.rows(chosen)
        state = self.memory.data[rows]
        now_usage, now_pinned = usage[both][:, [_CPU, _GPU]], pinned[both][:, [_CPU, _GPU]]
        moved, followed = moves(state[:, _USAGE], state[:, _PINNED] > 0, now_usage, now_pinned)
        seen = ~np.isnan(moved)
        a, b = moved[seen], followed[seen]
        terms = np.stack([np.ones_like(a), a, b, a * a, b * b, a * b], axis=1)
        state[seen, _SUMS] = DECAY * state[seen, _SUMS] + terms
        state[:, _USAGE] = now_usage
        state[:, _PINNED] = now_pinned
        self.memory.data[rows] = state
        coupled[both] = told_coupled(state[:, _SUMS])
        return coupled


def told_coupled(sums: FloatArray) -> BoolArray:
    """From each pod's decayed sums (n, Σa, Σb, Σa², Σb², Σab): β ≥ `COUPLED_AT` and
    `CONFIDENCE` standard errors above 0, over moves worth at least `EVIDENCE`."""
    n, sa, sb, saa, sbb, sab = sums.T
    count = np.maximum(n, 1e-12)
    spread_a = saa - sa * sa / count
    spread_b = sbb - sb * sb / count
    together = sab - sa * sb / count
    enough = (spread_a >= EVIDENCE) & (n > 2.0)
    slope = together / np.where(enough, spread_a, 1.0)
    residual = np.maximum(spread_b - slope * together, 0.0) / np.maximum(n - 2.0, 1.0)
    error = np.sqrt(residual / np.where(enough, spread_a, 1.0))
    return np.asarray(
        enough & (slope >= COUPLED_AT) & (slope >= CONFIDENCE * error), dtype=np.bool_
    )


def moves(
    before: FloatArray, pinned_before: BoolArray, after: FloatArray, pinned_after: BoolArray
) -> tuple[FloatArray, FloatArray]:
    """Per pod (columns CPU, GPU): how far the use of the resource that stayed pinned moved
    (log ratio), and how far the use of the one that stayed free did; NaN where not exactly
    one resource stayed pinned and the other free, or a use is too small to say."""
    held = pinned_before & pinned_after
    free = ~pinned_before & ~pinned_after
    valid = (held.sum(axis=1) == 1) & (free.sum(axis=1) == 1)
    valid &= (before >= USED).all(axis=1) & (after >= USED).all(axis=1)
    ratio = np.log(np.maximum(after, USED) / np.maximum(before, USED))
    moved = np.where(valid, np.where(held, ratio, 0.0).sum(axis=1), np.nan)
    followed = np.where(valid, np.where(free, ratio, 0.0).sum(axis=1), np.nan)
    return moved, followed


def in_step(demand: FloatArray, usage: FloatArray, starved: BoolArray) -> FloatArray:
    """A coupled pod's demand, in the proportion it uses its resources: where a resource is
    starved and estimated to need g times what it uses (the most of any starved one), every
    free resource needs g times what it uses, and no margin above that: it cannot use more
    until the starved one gets it. A pod starved nowhere keeps its estimates."""
    used = np.maximum(usage, USED)
    growth = np.maximum(np.where(starved, demand / used, 1.0).max(axis=1, keepdims=True), 1.0)
    grown = np.where(starved, demand, usage * growth)
    return np.asarray(np.where(starved.any(axis=1, keepdims=True), grown, demand), np.float64)


def split_in_proportion(
    demand: FloatArray,
    prices: FloatArray,
    budget: FloatArray,
    lower: FloatArray,
    upper: FloatArray,
    uses: BoolArray,
) -> tuple[FloatArray, BoolArray]:
    """Limits that buy every resource the same fraction of its demand with the whole budget,
    within bounds, and where the budget binds (it cannot buy the demand). That is the pod
    stage's objective with each resource weighed p_r / d_r: its solution x_r = d_r·(1 + c)
    moves every limit by the same fraction c of its demand, and the exact budget search
    holds the spend to the budget with the bounds in place."""
    asked = np.where(uses, demand, 0.0)
    cost = row_sum(np.where(uses, prices, 0.0) * asked)
    binding = cost > budget
    weights = np.where(uses, prices / np.maximum(asked, USED), 1.0)
    curves = spend_curves(asked, prices, weights, lower, upper, uses)
    return solve_within(curves, budget, np.full(budget.shape, np.inf)), binding


def keep_in_step(
    limits: FloatArray, desired: FloatArray, coupled: BoolArray, lower: FloatArray
) -> FloatArray:
    """Where the node stage cut one resource of a coupled pod below what it desired, the
    others are cut to the same fraction (never below `lower`): the pod could not use them,
    and the tokens they would cost stay in its queue."""
    wanted = desired > 0
    ratio = np.where(wanted, np.minimum(limits / np.where(wanted, desired, 1.0), 1.0), 1.0)
    kept = np.maximum(desired * ratio.min(axis=1, keepdims=True), lower)
    return np.where(coupled[:, None] & wanted, np.minimum(limits, kept), limits)
