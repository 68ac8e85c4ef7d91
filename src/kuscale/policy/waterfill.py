"""Weighted max-min fair sharing (water-filling), exact, in O(n log n).

Each claimant i gets x_i = clamp(θ·w_i, floor_i, cap_i) with one level θ chosen so the
shares add up to the capacity. A claimant wanting less than its weighted share keeps what it
wants, and what it leaves goes to the others in proportion to their weights. The same rule
serves the node stage (tokens as weights) and the simulated kernel (cpu.shares as weights).
"""

from __future__ import annotations

import numpy as np

from kuscale.policy.base import FloatArray, IntArray


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


def rebalance_devices(
    held: FloatArray,
    wanted: FloatArray,
    spare: FloatArray,
    weights: FloatArray,
    device: IntArray,
    rooms: FloatArray,
) -> FloatArray:
    """New shares where some claimants want `wanted` more and others can give up `spare`,
    device by device: a device's unheld room goes first, then the spare, taken from each
    giver in proportion to what it can give; the claimants share it by weight."""
    shares = held.copy()
    for d, room in enumerate(rooms.tolist()):
        on = (device == d) & ((wanted > 0) | (spare > 0))
        if not wanted[on].any():
            continue
        free = max(room - float(held[device == d].sum()), 0.0)
        given = float(spare[on].sum())
        granted = water_fill(free + given, weights[on], wanted[on])
        taken = min(max(float(granted.sum()) - free, 0.0), given)
        fraction = taken / given if given > 0 else 0.0
        shares[on] = held[on] + granted - spare[on] * fraction
    return shares
