"""Water-filling: exact weighted max-min fair shares."""

from __future__ import annotations

import numpy as np
import pytest

from kuscale.policy.waterfill import water_fill


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def test_everyone_fits() -> None:
    assert water_fill(200.0, arr(1, 1), arr(50, 60)).tolist() == [50.0, 60.0]


def test_equal_weights_split_equally() -> None:
    assert water_fill(200.0, arr(1, 1, 1), arr(200, 200, 200)) == pytest.approx([200 / 3] * 3)


def test_weights_split_proportionally() -> None:
    shares = water_fill(200.0, arr(300, 300, 300, 600), arr(200, 200, 200, 200))
    assert shares == pytest.approx([40, 40, 40, 80])


def test_a_small_claim_is_kept_and_its_leftover_shared() -> None:
    shares = water_fill(100.0, arr(1, 1, 2), arr(10, 100, 100))
    assert shares == pytest.approx([10, 30, 60])


def test_floors_hold() -> None:
    shares = water_fill(100.0, arr(1, 99), arr(100, 100), floors=arr(10, 10))
    assert shares == pytest.approx([10, 90])
