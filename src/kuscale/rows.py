"""Sums, minima and counts along a short last axis: a pod's resources or breakpoints.

numpy reduces along an axis of two or four entries with a loop per row that costs ten times
a few whole-column operations (51 µs against 4 µs for 1000 pods' four breakpoints of two
resources, here). These give the same bits as numpy's reductions: its sum starts from 0.0
and adds the entries in order, so a sum of negative zeros is +0.0; its minimum takes them in
order, so a NaN anywhere gives NaN (a NaN's sign bit may differ: nothing reads it).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]


def row_sum(values: FloatArray) -> FloatArray:
    """`values.sum(axis=-1)`."""
    total: FloatArray = 0.0 + values[..., 0]
    for column in range(1, values.shape[-1]):
        total = total + values[..., column]
    return total


def row_min(values: FloatArray) -> FloatArray:
    """`values.min(axis=-1)` of a non-empty last axis."""
    least: FloatArray = values[..., 0]
    for column in range(1, values.shape[-1]):
        least = np.minimum(least, values[..., column])
    return least


def row_count(mask: BoolArray) -> IntArray:
    """`mask.sum(axis=-1)`: how many are True in each row."""
    count: NDArray[np.int64] = mask[..., 0].astype(np.int64)
    for column in range(1, mask.shape[-1]):
        count = count + mask[..., column]
    return count
