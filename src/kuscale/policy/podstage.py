"""The pod stage: the original objective, made safe by bounds and an exact budget.

For each pod, maximise Σ_r [A·p_r·x_r − w_r·(x_r − d_r)²] subject to Σ_r p_r·x_r ≤ B and
lo_r ≤ x_r ≤ hi_r. Stationarity gives x_r(c) = clamp(d_r + p_r·c/w_r, lo_r, hi_r) with one
scalar c ≤ A/2 per pod (c = (A − μ)/2, μ the budget's multiplier). The spend
g(c) = Σ_r p_r·x_r(c) is piecewise linear and nondecreasing, with breakpoints where a resource
reaches a bound; c is found exactly by evaluating g at those breakpoints and interpolating
inside the segment that holds B. All pods at once, with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kuscale.policy.base import BoolArray, FloatArray
from kuscale.rows import row_count, row_min, row_sum


@dataclass(frozen=True, slots=True)
class SpendCurves:
    """Every pod's spend g(c) as a piecewise linear curve: its breakpoints and the spend at
    each. They depend on the pods' demand, prices, weights and bounds, not on the budget, so
    one set of curves answers any number of budgets.

    The per-resource quantities are kept by resource, (m, n), with the pods on the last
    axis: every limit computed from them then runs along the pods, where (n, m) steps along
    two resources at a time, at three to five times the cost for a thousand pods."""

    demand: FloatArray
    slope: FloatArray
    lower: FloatArray
    upper: FloatArray
    breaks: FloatArray
    spend: FloatArray
    uses: BoolArray


def spend_curves(
    demand: FloatArray,
    prices: FloatArray,
    weights: FloatArray,
    lower: FloatArray,
    upper: FloatArray,
    uses: BoolArray,
) -> SpendCurves:
    """`weights` and `demand` are (n, m); `prices` and bounds (n, m), or (m,) where every pod
    has the same."""
    p = np.where(uses, prices, 0.0)
    w = np.where(uses, weights, 1.0)
    lo = np.where(uses, lower, 0.0)
    hi = np.where(uses, np.maximum(upper, lower), 0.0)
    d = np.where(uses, demand, 0.0)
    slope = np.where(uses, p / w, 0.0)
    safe_slope = np.where(uses, slope, 1.0)
    breaks = np.concatenate([(lo - d) / safe_slope, (hi - d) / safe_slope], axis=1)
    used_twice = np.concatenate([uses, uses], axis=1)
    first = row_min(np.where(used_twice, breaks, np.inf))[:, None]
    breaks = np.sort(np.where(used_twice, breaks, first), axis=1)
    d, slope, lo, hi, p = (np.ascontiguousarray(a.T) for a in (d, slope, lo, hi, p))
    spend = row_sum(np.moveaxis(p * _limits_at(breaks, d, slope, lo, hi), 1, -1))
    return SpendCurves(d, slope, lo, hi, breaks, np.ascontiguousarray(spend.T), uses)


def solve_within(curves: SpendCurves, budget: FloatArray, available: FloatArray) -> FloatArray:
    """Limits (n, m) for every pod under budget B and available A, both (n,); resources a
    pod does not use get 0. A pod whose budget cannot buy its lower bounds gets its lower
    bounds (admission refuses such pods; this keeps the arithmetic total)."""
    level = np.minimum(_crossing(curves.breaks, curves.spend, budget), available / 2.0)
    limits = _limits_at(level[:, None], curves.demand, curves.slope, curves.lower, curves.upper)
    return np.where(curves.uses, limits[0].T, 0.0)


def _limits_at(
    levels: FloatArray, d: FloatArray, slope: FloatArray, lo: FloatArray, hi: FloatArray
) -> FloatArray:
    """x_r(c) for each pod at each of its levels c (n, k), from quantities by resource
    (m, n): shape (k, m, n)."""
    x = d + slope * np.ascontiguousarray(levels.T)[:, None, :]
    return np.asarray(np.clip(x, lo, hi), dtype=np.float64)


def _crossing(breaks: FloatArray, spend: FloatArray, budget: FloatArray) -> FloatArray:
    """The c where g(c) = B per pod, inside the segment [c_k, c_k+1] that holds B.

    Below the first breakpoint every resource sits at its lower bound and above the last at
    its upper bound, so a budget below g(c_0) gives a level under c_0 (all at lower bounds)
    and one above g(c_last) gives a level over c_last (all at upper bounds).
    """
    k_last = breaks.shape[1] - 1
    k = row_count(spend <= budget[:, None]) - 1
    rows = np.arange(breaks.shape[0])
    inner = np.clip(k, 0, k_last - 1)
    c0, c1 = breaks[rows, inner], breaks[rows, inner + 1]
    g0, g1 = spend[rows, inner], spend[rows, inner + 1]
    rise = g1 - g0
    step = np.where(rise > 0, (budget - g0) / np.where(rise > 0, rise, 1.0), 0.0)
    level = c0 + step * (c1 - c0)
    level = np.where(k < 0, breaks[:, 0] - 1.0, level)
    return np.asarray(np.where(k >= k_last, breaks[:, -1] + 1.0, level), dtype=np.float64)
