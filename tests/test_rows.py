"""The short-axis reductions give numpy's bits, signed zeros and NaNs included."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kuscale.rows import row_count, row_min, row_sum

SPECIAL = st.sampled_from([-0.0, 0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e300, 5e-324])
VALUES = st.one_of(SPECIAL, st.floats(allow_nan=True, allow_infinity=True))
SHAPES = st.tuples(st.integers(0, 40), st.integers(1, 3), st.integers(1, 5)).map(
    lambda shape: shape[:1] + shape[2:] if shape[1] == 1 else shape
)


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """Equal bit for bit, signed zeros included; a NaN matches any NaN (numpy's own
    reductions do not keep a NaN's sign the same way from one loop to another)."""
    if ours.shape != theirs.shape:
        return False
    if ours.dtype.kind != "f":
        return ours.tobytes() == theirs.tobytes()
    nan = np.isnan(ours)
    return bool((nan == np.isnan(theirs)).all() and ours[~nan].tobytes() == theirs[~nan].tobytes())


@given(arrays(np.float64, SHAPES, elements=VALUES))
def test_row_sum_and_min_are_numpys(values: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        assert same_bits(row_sum(values), values.sum(axis=-1))
        assert same_bits(row_min(values), values.min(axis=-1))


@given(arrays(np.bool_, SHAPES))
def test_row_count_is_numpys(mask: np.ndarray) -> None:
    assert same_bits(row_count(mask), mask.sum(axis=-1))
