"""The default rule `kuscale`: demand estimation, the exact pod stage, the fair node stage."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from conftest import observation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from kuscale.config import PolicyConfig, ResourceConfig
from kuscale.policy.base import FloatArray, GpuLook, Observation, Starving
from kuscale.policy.default import KuscalePolicy
from kuscale.policy.demand import estimate_demand
from kuscale.policy.podstage import solve_within, spend_curves
from kuscale.policy.waterfill import water_fill

PRICES = np.array([1.0, 3.0])
MINIMUMS = np.array([10.0, 10.0])


def arr(*rows: list[float]) -> FloatArray:
    return np.array(rows, dtype=np.float64)


class TestDemand:
    def estimate(
        self, usage: float, limit: float, starved: bool, previous: float, spread: float = 0.0
    ) -> float:
        result = estimate_demand(
            arr([usage]),
            arr([limit]),
            np.array([[starved]]),
            arr([previous]),
            arr([200.0]),
            growth=2.0,
            damping=0.7,
            spread=arr([spread]),
            margin=2.0,
            pin_tolerance=0.05,
        )
        return float(result[0, 0])

    def test_a_starved_pod_doubles_from_its_limit(self) -> None:
        assert self.estimate(10.0, 10.0, True, 10.0) == 20.0
        assert self.estimate(20.0, 20.0, True, 20.0) == 40.0

    def test_growth_continues_from_the_estimate_while_starvation_lasts(self) -> None:
        assert self.estimate(78.0, 78.0, True, 80.0) == 160.0

    def test_a_limit_cut_below_the_estimate_holds_it(self) -> None:
        assert self.estimate(60.0, 60.0, True, 120.0) == 120.0

    def test_growth_stops_at_the_ceiling(self) -> None:
        assert self.estimate(100.0, 150.0, True, 150.0) == 200.0

    def test_the_estimate_falls_back_to_the_held_limit_when_starvation_ends(self) -> None:
        assert self.estimate(50.0, 60.0, False, 200.0) == pytest.approx(50.0 + 0.7 * 10.0)

    def test_one_quiet_sample_does_not_cut_a_pod(self) -> None:
        assert self.estimate(0.0, 110.0, False, 100.0) == pytest.approx(70.0)

    def test_a_noisy_pod_keeps_a_margin_of_its_spread(self) -> None:
        assert self.estimate(40.0, 42.0, False, 41.0, spread=5.0) == 50.0
        assert self.estimate(40.0, 100.0, False, 100.0, spread=5.0) == pytest.approx(82.0)

    def test_a_steady_pod_stays_out_of_the_pinned_band(self) -> None:
        assert self.estimate(100.0, 101.0, False, 101.0) == pytest.approx(110.0)

    def test_rising_usage_is_taken_at_once(self) -> None:
        assert self.estimate(90.0, 120.0, False, 30.0) == pytest.approx(99.0)


def pod_stage(
    demand: list[float],
    tokens: float,
    available: float,
    upper: tuple[float, float] = (200.0, 100.0),
    uses: tuple[bool, bool] = (True, True),
) -> FloatArray:
    curves = spend_curves(
        arr(demand),
        PRICES[None, :],
        PRICES[None, :] * 10.0,
        MINIMUMS[None, :],
        np.array([upper]),
        np.array([uses]),
    )
    limits = solve_within(curves, np.array([tokens]), np.array([available]))
    row: FloatArray = limits[0]
    return row


class TestPodStage:
    def test_budget_not_binding_gives_the_original_step(self) -> None:
        # A = 150, w = (10, 30): x = (50 + 150/20, 20 + 3·150/60) = (57.5, 27.5), 140 <= 300.
        assert pod_stage([50.0, 20.0], 300.0, 150.0) == pytest.approx([57.5, 27.5])

    def test_budget_binding_projects_exactly(self) -> None:
        # Same as the original's projected case: (112.5, 62.5) costs exactly 300.
        assert pod_stage([100.0, 50.0], 300.0, 300.0) == pytest.approx([112.5, 62.5])

    def test_upper_bound_frees_budget_for_the_other_resource(self) -> None:
        # GPU capped at 40 (costs 120); the budget no longer binds, so CPU takes its
        # unconstrained step 100 + 300/20 = 115 instead of the projected 112.5.
        limits = pod_stage([100.0, 50.0], 300.0, 300.0, upper=(200.0, 40.0))
        assert limits == pytest.approx([115.0, 40.0])

    def test_usage_above_budget_never_breaks_the_budget(self) -> None:
        limits = pod_stage([150.0, 20.0], 100.0, 100.0)
        assert limits == pytest.approx([70.0, 10.0])
        assert limits @ PRICES == pytest.approx(100.0)

    def test_a_cpu_only_pod_leaves_the_gpu_at_zero(self) -> None:
        assert pod_stage([50.0, 0.0], 30.0, 30.0, uses=(True, False)) == pytest.approx([30, 0])


def objective(x: FloatArray, demand: FloatArray, weights: FloatArray, available: float) -> float:
    return float((available * PRICES * x - weights * (x - demand) ** 2).sum())


def qp_optimum(
    demand: FloatArray,
    weights: FloatArray,
    lower: FloatArray,
    upper: FloatArray,
    budget: float,
    available: float,
    starts: list[FloatArray],
) -> float:
    """The same problem solved by a general solver (SLSQP), best of several starting points.

    Started from our answer too, the solver would move away from it if it were not optimal.
    Its points are checked for feasibility rather than its status trusted: where the feasible
    set is a single point it may step off it and report a failed line search, so the
    feasible starting points count as candidates too.
    """
    best = -np.inf
    for x0 in starts:
        result = minimize(
            lambda x: -objective(x, demand, weights, available),
            x0=x0,
            jac=lambda x: -(available * PRICES - 2 * weights * (x - demand)),
            bounds=list(zip(lower, upper, strict=True)),
            constraints=[
                {"type": "ineq", "fun": lambda x: budget - PRICES @ x, "jac": lambda x: -PRICES}
            ],
            method="SLSQP",
            options={"ftol": 1e-12, "maxiter": 200},
        )
        for x in (np.clip(result.x, lower, upper), x0):
            if PRICES @ x <= budget * (1 + 1e-7):
                best = max(best, objective(x, demand, weights, available))
    assert np.isfinite(best), "the solver found no feasible point"
    return best


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    demand = [draw(st.floats(0, 400)), draw(st.floats(0, 120))]
    upper = [draw(st.floats(10, 400)), draw(st.floats(10, 100))]
    tokens = draw(st.floats(40, 2000))
    return {
        "demand": np.array(demand),
        "upper": np.array(upper),
        "tokens": tokens,
        "static_v": draw(st.floats(0.5, 50)),
        "period": draw(st.sampled_from([0.1, 0.5, 1.0])),
    }


@settings(max_examples=150, deadline=None)
@given(pods())
def test_pod_stage_equals_a_general_qp_solver(case: dict[str, Any]) -> None:
    weights = PRICES * case["static_v"]
    available = case["tokens"] * case["period"]
    curves = spend_curves(
        case["demand"][None, :],
        PRICES[None, :],
        weights[None, :],
        MINIMUMS[None, :],
        case["upper"][None, :],
        np.array([[True, True]]),
    )
    ours = solve_within(curves, np.array([case["tokens"]]), np.array([available]))[0]
    assert ours @ PRICES <= case["tokens"] * (1 + 1e-9)
    assert np.all(ours >= MINIMUMS - 1e-9)
    assert np.all(ours <= np.maximum(case["upper"], MINIMUMS) + 1e-9)
    mine = objective(ours, case["demand"], weights, available)
    best = qp_optimum(
        case["demand"],
        weights,
        MINIMUMS,
        np.maximum(case["upper"], MINIMUMS),
        case["tokens"],
        available,
        starts=[MINIMUMS.copy(), ours.copy()],
    )
    assert mine >= best - 1e-6 * max(1.0, abs(best))
    assert mine == pytest.approx(best, rel=1e-6, abs=1e-6)


@st.composite
def nodes(draw: st.DrawFn) -> tuple[Observation, PolicyConfig]:
    n = draw(st.one_of(st.integers(1, 300), st.sampled_from([110, 300])))
    cores = draw(st.integers(max(1, n // 10 + 1), 64))
    gpus = draw(st.integers(0, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    uses = np.column_stack([np.ones(n, bool), rng.random(n) < 0.4 if gpus else np.zeros(n, bool)])
    gpu_pods = int(uses[:, 1].sum())
    if gpu_pods * 10 > gpus * 100:
        uses[:, 1] = False
    floor_cost = np.where(uses, PRICES * MINIMUMS, 0.0).sum(axis=1)
    tokens = floor_cost + rng.integers(0, 2000, n)
    capacity = np.array([cores * 100.0, gpus * 100.0])
    usage = np.where(uses, rng.random((n, 2)) * capacity.clip(max=400.0), 0.0)
    limits = np.where(uses, np.maximum(rng.random((n, 2)) * 300, 10.0), 0.0)
    config = PolicyConfig(
        burst_factor=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
        burst_seconds=draw(st.sampled_from([1.0, 30.0])),
        static_v=draw(st.sampled_from([10.0, 1.0, 0.0])),
        cpu=ResourceConfig(price=1.0, overcommit=draw(st.sampled_from([1.0, 1.5]))),
    )
    obs = Observation(
        period=draw(st.sampled_from([0.1, 0.5, 1.0])),
        elapsed=rng.uniform(0.05, 2.0, n),
        tokens=tokens.astype(np.float64),
        queue=rng.random(n) * tokens * 30,
        usage=usage,
        avg_usage=usage * rng.random((n, 2)),
        limits=limits,
        starved=(rng.random((n, 2)) < 0.5) & uses,
        demand=np.where(uses, rng.random((n, 2)) * 500, 0.0),
        uses=uses,
        capacity=capacity,
        weighted=np.array([draw(st.booleans()), False]),
    )
    return obs, config


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes())
def test_every_budget_bound_and_capacity_holds_on_random_nodes(
    node: tuple[Observation, PolicyConfig],
) -> None:
    obs, config = node
    policy = KuscalePolicy(config)
    decision = policy.decide(obs)
    for array in (decision.limits, decision.weights, decision.queue, decision.demand):
        assert np.all(np.isfinite(array))
    limits = decision.limits
    budget = obs.tokens + config.burst_factor * decision.queue / obs.period
    assert np.all((limits * PRICES).sum(axis=1) <= budget * (1 + 1e-9) + 1e-9)
    upper = policy.upper_bounds(obs.capacity)
    used = obs.uses
    assert np.all(limits[used] >= np.broadcast_to(MINIMUMS, limits.shape)[used] - 1e-9)
    assert np.all(limits <= upper + 1e-9)
    assert np.all(limits[~used] == 0.0)
    overcommit = np.array([config.cpu.overcommit, config.gpu.overcommit])
    shared = limits.sum(axis=0) <= obs.capacity * overcommit * (1 + 1e-9) + 1e-9
    assert obs.weighted is not None
    assert np.all(shared | obs.weighted)
    assert np.all(decision.queue >= 0)
    assert np.all(decision.queue <= obs.tokens * config.burst_seconds + 1e-9)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 500.0), st.integers(1, 1000)), min_size=1, max_size=300),
    st.floats(1.0, 5000.0),
)
def test_node_stage_is_weighted_max_min_fair(
    claims: list[tuple[float, int]], capacity: float
) -> None:
    desired = np.array([d for d, _ in claims])
    tokens = np.array([float(t) for _, t in claims])
    shares = water_fill(capacity, tokens, desired)
    fair = capacity * tokens / tokens.sum()
    assert np.all(shares >= np.minimum(desired, fair) * (1 - 1e-9) - 1e-9)
    assert np.all(shares <= desired + 1e-9)
    assert shares.sum() == pytest.approx(min(capacity, desired.sum()), rel=1e-9, abs=1e-9)
    below = shares < desired - 1e-9
    if below.any():
        levels = shares[below] / tokens[below]
        assert levels.max() - levels.min() <= 1e-6 * max(1.0, levels.max())


def test_full_node_is_split_by_tokens() -> None:
    obs = observation(
        usage=[[100.0, 0.0]] * 4,
        tokens=[300.0, 300.0, 300.0, 600.0],
        limits=[[100.0, 0.0]] * 4,
        starved=[[True, False]] * 4,
        demand=[[200.0, 0.0]] * 4,
        period=0.5,
    )
    limits = KuscalePolicy(PolicyConfig()).decide(obs).limits[:, 0]
    assert limits == pytest.approx([40.0, 40.0, 40.0, 80.0])


@pytest.mark.parametrize(
    ("tokens", "uses", "capacity", "committed", "reason"),
    [
        (30.0, [True, True], [200.0, 100.0], [0.0, 0.0], "cannot buy the minimum"),
        (300.0, [True, True], [200.0, 0.0], [0.0, 0.0], "has none"),
        (300.0, [True, False], [200.0, 100.0], [195.0, 0.0], "cpu is full"),
        (40.0, [True, True], [200.0, 100.0], [0.0, 0.0], None),
    ],
)
def test_admission(
    tokens: float,
    uses: list[bool],
    capacity: list[float],
    committed: list[float],
    reason: str | None,
) -> None:
    answer = KuscalePolicy(PolicyConfig()).admit(
        tokens, np.array(uses), np.array(capacity), np.array(committed)
    )
    if reason is None:
        assert answer is None
    else:
        assert answer is not None and reason in answer


def test_a_cpu_the_kernel_shares_by_tokens_is_left_to_the_kernel() -> None:
    """Limits carry budgets, cpu.shares carry fairness: four starved pods keep what their
    budgets buy, past the node's 200 %, and the GPU, which has no weights, is still shared."""
    starving = observation(
        usage=[[50.0, 50.0]] * 4,
        tokens=[300.0, 300.0, 300.0, 600.0],
        uses=[[True, True]] * 4,
        limits=[[50.0, 50.0]] * 4,
        starved=[[True, True]] * 4,
        demand=[[100.0, 100.0]] * 4,
    )
    weighted = replace(starving, weighted=np.array([True, False]))
    limits = KuscalePolicy(PolicyConfig()).decide(weighted).limits
    assert limits[:, 0].sum() > 200.0
    assert np.all(limits[:, 0] <= 200.0)
    assert limits[:, 1].sum() == pytest.approx(100.0)
    spend = (limits * PRICES).sum(axis=1)
    assert np.all(spend <= np.array([300.0, 300.0, 300.0, 600.0]) + 1e-9)
    unweighted = KuscalePolicy(PolicyConfig()).decide(starving).limits
    assert unweighted[:, 0].sum() == pytest.approx(200.0)


def test_without_burst_credit_a_quiet_pod_holds_its_reservation() -> None:
    """Credit that can never be spent is worth nothing, so holding it as headroom is free."""
    quiet = observation(usage=[[20.0, 0.0]], tokens=[150.0], limits=[[30.0, 0.0]])
    limits = KuscalePolicy(PolicyConfig(burst_factor=0.0)).decide(quiet).limits
    assert limits[0, 0] == pytest.approx(150.0)


@pytest.mark.parametrize(("fill", "holds_reservation"), [(1.0, True), (0.0, False)])
def test_with_burst_credit_only_what_would_overflow_is_held(
    fill: float, holds_reservation: bool
) -> None:
    config = PolicyConfig(burst_factor=0.05, burst_seconds=60.0)
    quiet = observation(
        usage=[[20.0, 0.0]], tokens=[150.0], limits=[[30.0, 0.0]], queue=[fill * 150.0 * 60.0]
    )
    limit = float(KuscalePolicy(config).decide(quiet).limits[0, 0])
    assert (limit >= 150.0 - 1e-9) is holds_reservation
    assert limit * 1.0 <= 150.0 + 0.05 * fill * 150.0 * 60.0 + 1e-9


def test_headroom_shrinks_with_the_credit_a_pod_has_left() -> None:
    """Tokens go to demand first: a pod with little credit left holds little headroom
    above its demand estimate, one with a full queue (short of overflowing) the original's."""
    config = PolicyConfig(burst_factor=0.05, burst_seconds=60.0)
    headroom = []
    for fill in (0.0, 0.25, 0.9):
        quiet = observation(
            usage=[[40.0, 0.0]], tokens=[150.0], limits=[[50.0, 0.0]], queue=[fill * 9000.0]
        )
        decision = KuscalePolicy(config).decide(quiet)
        headroom.append(float(decision.limits[0, 0] - decision.demand[0, 0]))
    assert headroom[0] < 0.2, "the tick's own saving is all it has"
    assert 0.0 < headroom[1] < headroom[2]


def test_a_starved_pod_leaps_to_what_its_budget_buys() -> None:
    starved = observation(
        usage=[[10.0, 0.0]], tokens=[150.0], limits=[[10.0, 0.0]], starved=[[True, False]]
    )
    config = PolicyConfig(burst_factor=0.05, burst_seconds=60.0)
    # The period at 10 % saved 140 tokens: the budget is 150 + 0.05 × 140.
    assert KuscalePolicy(config).decide(starved).limits[0, 0] == pytest.approx(157.0)


def test_a_leap_takes_only_the_budget_the_other_resource_uses() -> None:
    """A pinned GPU may leap only into what the pod's CPU uses leaves of its budget: the
    CPU estimate's margin above its use is headroom, which demand comes before."""
    policy = KuscalePolicy(PolicyConfig())
    demand = arr([40.0, 100.0])
    usage = arr([36.0, 50.0])
    starved = np.array([[False, True]])
    limits = arr([45.0, 50.0])
    capped = policy.leap_within_budget(
        demand, usage, starved, limits, PRICES[None, :], np.array([240.0])
    )
    # 240 tokens less the CPU's 36 leave 204, which buy 68 % of the GPU.
    assert capped[0] == pytest.approx([40.0, 68.0])
    kept = policy.leap_within_budget(
        demand, usage, starved, arr([45.0, 80.0]), PRICES[None, :], np.array([240.0])
    )
    assert kept[0, 1] == pytest.approx(80.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(20.0, 1000.0),
            st.floats(10.0, 100.0),
            st.floats(0.0, 100.0),
            st.booleans(),
            st.integers(0, 1),
        ),
        min_size=1,
        max_size=8,
    ),
    st.floats(0.0, 500.0),
)
def test_the_gpu_fast_path_keeps_budgets_devices_and_what_others_use(
    pods: list[tuple[float, float, float, bool, int]], queue: float
) -> None:
    """Pinned pods are raised within their budgets; the others only lowered, never below
    their use or minimum; a device held within its capacity stays within it."""
    config = PolicyConfig(burst_factor=0.2, burst_seconds=30.0)
    policy = KuscalePolicy(config)
    tokens = np.array([p[0] for p in pods])
    gpu = np.array([min(p[1], p[0] / 3.2) for p in pods])
    limits = np.stack([np.full(len(pods), 10.0), np.maximum(gpu, 10.0)], axis=1)
    usage = np.minimum([p[2] for p in pods], limits[:, 1])
    pinned = np.array([p[3] for p in pods]) & (usage >= 0.95 * limits[:, 1])
    device = np.array([p[4] for p in pods], dtype=np.int64)
    look = GpuLook(
        period=1.0,
        tokens=tokens,
        queue=np.full(len(pods), queue),
        limits=limits,
        uses=np.ones((len(pods), 2), dtype=bool),
        usage=usage,
        spread=np.zeros(len(pods)),
        pinned=pinned,
        device=device,
        device_capacity=np.array([100.0, 100.0]),
        capacity=np.array([200.0, 100.0]),
    )
    shares = policy.raise_pinned_gpu(look)
    budget = policy.budget(tokens, look.queue, 1.0)
    assert (shares[pinned] >= limits[pinned, 1] - 1e-9).all()
    assert (shares[~pinned] <= limits[~pinned, 1] + 1e-9).all()
    raised = shares > limits[:, 1] + 1e-9
    assert (10.0 + 3.0 * shares[raised] <= budget[raised] * (1 + 1e-9) + 1e-9).all()
    floor = np.maximum(usage * (1 + 2 * config.pin_tolerance), 10.0)
    lowered = shares < limits[:, 1] - 1e-9
    assert (shares[lowered] >= np.minimum(floor, limits[:, 1])[lowered] - 1e-9).all()
    for d in (0, 1):
        before, after = limits[device == d, 1].sum(), shares[device == d].sum()
        assert after <= max(before, 100.0) + 1e-6


@pytest.mark.parametrize(
    ("shortfall", "expected"),
    [
        (1.0, 55.0),  # pinned by its own noise: twice the pin tolerance, not a doubling
        (30.0, 80.0),  # short by 30 points: raised by 30
        (400.0, 200.0),  # a burst: to the cap at once, not in doublings
        (np.nan, 100.0),  # its first look, no evidence yet: `fast_growth`
    ],
)
def test_a_fast_raise_is_sized_by_how_short_the_pod_was(shortfall: float, expected: float) -> None:
    policy = KuscalePolicy(PolicyConfig(burst_factor=0.0))
    starving = Starving(
        period=1.0,
        tokens=np.array([500.0]),
        queue=np.zeros(1),
        limits=np.array([[50.0, 0.0]]),
        uses=np.array([[True, False]]),
        capacity=np.array([200.0, 0.0]),
        held=np.array([50.0, 0.0]),
        weighted=np.array([True, False]),
        shortfall=np.array([shortfall]),
    )
    assert policy.raise_starved(starving)[0, 0] == pytest.approx(expected)
