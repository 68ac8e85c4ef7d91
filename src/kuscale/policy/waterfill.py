"""Weighted max-min fair sharing (water-filling), exact, in O(n log n).

Each claimant i gets x_i = clamp(θ·w_i, floor_i, cap_i) with one level θ chosen so the
shares add up to the capacity. A claimant wanting less than its weighted share keeps what it
wants, and what it leaves goes to the others in proportion to their weights. The same rule
serves the node stage (tokens as weights) and the simulated kernel (cpu.shares as weights).
"""

from __future__ import annotations

import numpy as np

from kuscale.policy.base import FloatArray


def water_fill(
    capacity: float, weights: FloatArray, caps: FloatArray, floors: FloatArray | None = None
) -> FloatArray:
    """Shares of `capacity`; all caps if they fit, all floors if even those do not.

    f(θ) = Σ floor_i + Σ_i w_i·(max(θ − a_i, 0) − max(θ − b_i, 0)) with a_i = floor_i/w_i and
    b_i = cap_i/w_i is piecewise linear and nondecreasing; its value at every breakpoint comes
    from two cumulative sums, and θ from a linear step inside the segment that holds capacity.
    """
    floors = np.zeros_like(caps) if floors is None else np.minimum(floors, caps)
    if caps.sum() <= capacity:
        return caps.astype(np.float64, copy=True)
    if floors.sum() >= capacity:
        return floors.astype(np.float64, copy=True)
    points = np.concatenate([floors / weights, caps / weights])
    slopes = np.concatenate([weights, -weights])
    order = np.argsort(points, kind="stable")
    points, slopes = points[order], slopes[order]
    slope = np.cumsum(slopes)
    values = floors.sum() + points * slope - np.cumsum(slopes * points)
    k = int(np.searchsorted(values, capacity, side="right")) - 1
    level = points[k] + (capacity - values[k]) / slope[k] if slope[k] > 0 else points[k]
    shares: FloatArray = np.clip(level * weights, floors, caps)
    return shares
