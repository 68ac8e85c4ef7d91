"""The token queue: unspent reservation accumulates as burst credit, up to a cap."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kuscale.rows import row_sum

FloatArray = NDArray[np.float64]


def spend_rate(limits: FloatArray, prices: FloatArray) -> FloatArray:
    """Tokens per second each pod's current limits cost: Σ_r p_r·L_r."""
    return row_sum(limits * prices)


def advance_queue(
    queue: FloatArray,
    tokens: FloatArray,
    limits: FloatArray,
    prices: FloatArray,
    elapsed: FloatArray,
    cap: FloatArray,
) -> FloatArray:
    """Q ← clamp(Q + R·Δt − Σ_r p_r·L_r·Δt, 0, Q_max), per pod.

    The limits are those the pod held during Δt: a pod is charged for what it was given,
    not for what it used, since an allocation is what others could not have.
    """
    gained = (tokens - spend_rate(limits, prices)) * elapsed
    return np.clip(queue + gained, 0.0, cap)
