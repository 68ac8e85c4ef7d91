"""The oracle: a bound no policy within the budget rules beats, on shipped and random work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kuscale.cli import main
from kuscale.sim import oracle
from kuscale.sim.metrics import evaluate
from kuscale.sim.oracle import OracleError, binding_bounds, bounds, oracle_trace, solve_oracle
from kuscale.sim.run import simulate
from kuscale.sim.scenario import (
    Scenario,
    load_scenario,
    parse_scenario,
    shipped_names,
    shipped_path,
)

RULE_KEEPERS = ("kuscale",)
"""The rule that keeps the oracle's budget rules by construction. `kuscale-2022` and
`static` raise limits to their minimums after spending the budget (and `static` admits pods
whose tokens cannot buy them), so they may spend past the rules; they are held to the bound
wherever they kept them."""
TOLERANCE = 1e-6


def assert_bounded(scenario: Scenario) -> None:
    """Every policy that kept the rules leaves at least the oracle's unmet demand."""
    demand = scenario.demand()
    best = bounds(scenario, demand)
    binding = binding_bounds(scenario, demand)
    assert evaluate(oracle_trace(scenario, demand))["within_rules"]
    for name in (*RULE_KEEPERS, "kuscale-2022", "static"):
        metrics = evaluate(simulate(scenario, name, demand))
        if name in RULE_KEEPERS:
            assert metrics["within_rules"], f"{name} broke the budget rules on {scenario.name}"
        elif not metrics["within_rules"]:
            continue
        for resource in ("cpu", "gpu"):
            for key, bound in best[resource].items():
                if bound is not None:
                    assert metrics[resource][key] >= bound - TOLERANCE, (
                        f"{name} beat the oracle's {key} on {scenario.name} {resource}"
                    )
        priced, progress = binding["priced_unmet_fraction"], binding["coupled_progress"]
        if priced is not None:
            assert metrics["priced_unmet_fraction"] >= priced - TOLERANCE, name
        if progress is not None:
            assert metrics["coupled_progress"] <= progress + TOLERANCE, name


SHIPPED = [name for name in shipped_names() if name != "stress-1000"]


@pytest.mark.parametrize("name", SHIPPED)
def test_no_policy_beats_the_oracle_on_a_shipped_scenario(name: str) -> None:
    assert_bounded(load_scenario(shipped_path(name)))


SHAPES = st.sampled_from(
    [
        "{shape: constant, value: %d, noise: 3}",
        "{shape: square, low: 5, high: %d, period: 20, duty: 0.4}",
        "{shape: bursts, base: 5, peak: %d, on: [2, 6], off: [3, 10]}",
        "{shape: sine, mean: %d, amplitude: 8, period: 30}",
    ]
)


@st.composite
def random_scenarios(draw: Any) -> Scenario:
    cores = draw(st.integers(1, 3))
    pods = []
    for index in range(draw(st.integers(1, 4))):
        cpu = draw(SHAPES) % draw(st.integers(10, 90 * cores))
        gpu = ""
        if draw(st.booleans()):
            gpu = ", gpu: " + draw(SHAPES) % draw(st.integers(10, 90))
            gpu += ", coupled: true" if draw(st.booleans()) else ""
        start = draw(st.sampled_from([0, 0, 10]))
        tokens = draw(st.integers(40, 300))
        pods.append(f"  - {{name: p{index}, tokens: {tokens}, start: {start}, cpu: {cpu}{gpu}}}")
    burst = draw(st.sampled_from(["0.0", "0.05", "0.5"]))
    seconds = draw(st.sampled_from([1, 30, 600]))
    text = (
        f"node: {{cores: {cores}, gpus: 1}}\nduration: 50\nseed: {draw(st.integers(0, 99))}\n"
        f"config: {{policy: {{burst_factor: {burst}, burst_seconds: {seconds}}}}}\n"
        "pods:\n" + "\n".join(pods) + "\n"
    )
    return parse_scenario(text, "random.yaml", Path())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_scenarios())
def test_no_policy_beats_the_oracle_on_random_work(scenario: Scenario) -> None:
    assert_bounded(scenario)


ONE_POD = """\
node: {cores: 2, gpus: 0}
duration: 20
config: {policy: {burst_factor: %s, burst_seconds: 100}}
pods:
  - {name: steady, tokens: 30, cpu: {shape: constant, value: 50}}
"""


def test_a_pod_without_burst_credit_gets_what_its_tokens_buy() -> None:
    scenario = parse_scenario(ONE_POD % "0.0", "one.yaml", Path())
    solution = solve_oracle(scenario, scenario.demand())
    assert solution.served[:, 0, 0] == pytest.approx(np.full(20, 30.0))
    assert solution.exact


def test_saved_credit_serves_a_burst_as_fast_as_the_burst_factor_lets_it() -> None:
    text = """\
node: {cores: 2, gpus: 0}
duration: 20
config: {policy: {burst_factor: 1.0, burst_seconds: 100}}
pods:
  - {name: later, tokens: 30, cpu: {shape: step, steps: [[0, 10], [10, 60]]}}
"""
    scenario = parse_scenario(text, "burst.yaml", Path())
    served = solve_oracle(scenario, scenario.demand()).served[:, 0, 0]
    assert served[:10] == pytest.approx(np.full(10, 10.0))
    # Ten quiet periods at the minimum limit save 10 × (30 − 10) = 200 tokens; the burst
    # wants 10 × 30 above the reservation, so the credit buys 200 of its 300.
    assert served.sum() == pytest.approx(10 * 10.0 + 10 * 30.0 + 200.0)


def test_windows_loosen_the_bound_never_tighten_it(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = load_scenario(shipped_path("idle-then-burst"))
    demand = scenario.demand()
    exact = solve_oracle(scenario, demand)
    monkeypatch.setattr(oracle, "WINDOW_CELLS", 100)
    windowed = solve_oracle(scenario, demand)
    assert exact.exact and not windowed.exact
    assert windowed.served.sum() >= exact.served.sum() - TOLERANCE
    metrics = evaluate(oracle_trace(scenario, demand))
    assert metrics["budget_overspend_fraction"] is None


def test_a_run_too_large_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = load_scenario(shipped_path("stress-1000"))
    with pytest.raises(OracleError, match=r"stress-1000.*--duration"):
        solve_oracle(scenario, np.zeros((scenario.ticks, len(scenario.pods), 2)))
    assert main(["sim", "--scenario", "stress-1000", "--policy", "oracle"]) == 2
    assert "--duration" in capsys.readouterr().err


def test_a_solver_failure_is_an_oracle_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failed:
        status, x, message = 4, None, "numerical difficulties"

    monkeypatch.setattr(oracle, "linprog", lambda *args, **kwargs: Failed())
    scenario = parse_scenario(ONE_POD % "0.0", "one.yaml", Path())
    with pytest.raises(OracleError, match=r"one.*numerical difficulties"):
        solve_oracle(scenario, scenario.demand())


def test_sim_shows_every_policy_beside_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    assert main(["sim", "--scenario", "single-burst", "--duration", "60", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["oracle"]["exact"] is True
    assert "oracle" in result["policies"]
    for metrics in result["policies"].values():
        cpu = metrics["cpu"]
        assert cpu["unmet_demand_excess_points"] >= -TOLERANCE * 100
        assert cpu["token_weighted_unmet_excess_points"] is not None
        assert 0.0 <= cpu["idle_while_starved_fraction"] <= 1.0


@pytest.mark.parametrize("chosen", [[], ["--policy", "static"]])
def test_without_a_bound_the_comparison_goes_on_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chosen: list[str]
) -> None:
    monkeypatch.setattr(oracle, "MAX_CELLS", 10)
    out = tmp_path / "metrics.json"
    args = ["sim", "--scenario", "single-burst", "--duration", "30", "--json", str(out)]
    assert main(args + chosen) == 0
    result = json.loads(out.read_text())
    assert "--duration" in result["oracle"]["unavailable"]
    assert "oracle" not in result["policies"]
    assert result["policies"]["static"]["cpu"]["unmet_demand_excess_points"] is None
