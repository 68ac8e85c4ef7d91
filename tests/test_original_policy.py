"""The kuscale-2022 rule against values worked out by hand from DESIGN.md §3."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import observation

from kuscale.config import PolicyConfig
from kuscale.policy.base import Decision
from kuscale.policy.original import OriginalPolicy

BOTH = [[True, True]]


def decide(config: PolicyConfig | None = None, **kwargs: Any) -> Decision:
    return OriginalPolicy(config or PolicyConfig()).decide(observation(**kwargs))


def test_unconstrained_step_adds_budget_over_twice_the_weight() -> None:
    # A = R·T = 150, w = p·V = 10: x = 50 + 150 / 20 = 57.5, and 57.5 · 0.5 <= 150 fits.
    result = decide(usage=[[50.0, 0.0]], tokens=[300.0], period=0.5)
    assert result.limits[0, 0] == pytest.approx(57.5)
    assert result.limits[0, 1] == 0.0
    assert result.weights[0, 0] == pytest.approx(10.0)


def test_projection_onto_the_budget_for_one_resource() -> None:
    # A = 30; x = 50 + 1.5 = 51.5 does not fit; projected: 50 + (30 - 50) = 30.
    result = decide(usage=[[50.0, 0.0]], tokens=[30.0])
    assert result.limits[0, 0] == pytest.approx(30.0)


def test_projection_splits_the_surplus_by_price_over_weight() -> None:
    # w = (10, 30); free x = (115, 65) costs 310 > 300. Surplus 300 - 250 = 50,
    # Σ p²/w = 0.4, c = 125: x = (100 + 12.5, 50 + 12.5), costing exactly 300.
    result = decide(usage=[[100.0, 50.0]], tokens=[300.0], uses=BOTH)
    assert result.limits[0] == pytest.approx([112.5, 62.5])
    assert float(result.limits[0] @ np.array([1.0, 3.0])) == pytest.approx(300.0)


def test_usage_above_budget_is_cut_and_the_minimum_breaks_the_budget() -> None:
    # Surplus 100 - (150 + 60) = -110, c = -275: x = (122.5, -7.5) -> GPU raised to 10.
    # The original spends 122.5 + 30 = 152.5 > 100 here; the default rule will not.
    result = decide(usage=[[150.0, 20.0]], tokens=[100.0], uses=BOTH)
    assert result.limits[0] == pytest.approx([122.5, 10.0])


def test_minimum_limit_is_ten() -> None:
    result = decide(usage=[[0.0, 0.0]], tokens=[10.0])
    assert result.limits[0, 0] == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("queue", "limit", "expected"),
    [
        (0.0, 50.0, 50.0),  # 0 + 100 - 50
        (90.0, 50.0, 100.0),  # capped at Q_max = R
        (10.0, 150.0, 0.0),  # floored at 0
    ],
)
def test_token_queue_update(queue: float, limit: float, expected: float) -> None:
    result = decide(usage=[[0.0, 0.0]], tokens=[100.0], queue=[queue], limits=[[limit, 0.0]])
    assert result.queue[0] == pytest.approx(expected)


def test_burst_factor_spends_the_queue() -> None:
    # k = 1, Q after the update = 100 (capped): A = 100 + 100 = 200,
    # x = 40 + 200 / 20 = 50, and 50 <= 200 fits.
    config = PolicyConfig(burst_factor=1.0)
    result = decide(
        config, usage=[[40.0, 0.0]], tokens=[100.0], queue=[100.0], limits=[[10.0, 0.0]]
    )
    assert result.queue[0] == pytest.approx(100.0)
    assert result.limits[0, 0] == pytest.approx(50.0)


def test_usage_based_weights() -> None:
    # avg = (9, 19), u = (9, 39): S = 30, W = 15·(10/10 + 20/40) = 22.5,
    # w = (22.5·1·30/10, 22.5·3·30/20) = (67.5, 101.25).
    config = PolicyConfig(static_v=0.0)
    result = decide(
        config, usage=[[9.0, 39.0]], avg_usage=[[9.0, 19.0]], tokens=[1000.0], uses=BOTH
    )
    assert result.weights[0] == pytest.approx([67.5, 101.25])


def test_pods_are_independent_and_vectorised() -> None:
    alone = decide(usage=[[50.0, 0.0]], tokens=[30.0])
    together = decide(usage=[[50.0, 0.0], [50.0, 0.0]], tokens=[30.0, 300.0], period=1.0)
    assert together.limits[0, 0] == pytest.approx(alone.limits[0, 0])
    assert together.limits[1, 0] == pytest.approx(50.0 + 300.0 / 20.0)
