"""Pipeline pods: the simulator's coupled model, the figures that judge a binding budget,
the oracle's bound on them, and the policy telling a pipeline from what it measures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kuscale.cli import main
from kuscale.config import PolicyConfig
from kuscale.policy import Observation
from kuscale.policy.coupling import (
    CouplingEvidence,
    in_step,
    keep_in_step,
    split_in_proportion,
)
from kuscale.policy.default import KuscalePolicy
from kuscale.sim.located import ScenarioError
from kuscale.sim.metrics import coupled_progress, evaluate, priced_unmet
from kuscale.sim.node import SimNode, SimPod
from kuscale.sim.oracle import binding_bounds, solve_oracle
from kuscale.sim.run import simulate
from kuscale.sim.scenario import load_scenario, parse_scenario, shipped_path
from kuscale.workload import Schedule

BASE = """\
node: {cores: 2, gpus: 1}
duration: 30
pods:
  - name: pipe
    tokens: 100
"""


def test_a_coupled_pod_uses_no_more_cpu_than_its_gpu_lets_it() -> None:
    """Held to half its GPU demand, a pipeline uses half its CPU demand; the CPU it leaves
    goes to a busy neighbour in the same step, and no CPU throttling is counted against
    it, since its CPU limit is not what holds it back."""
    node = SimNode(cores=1, gpus=1)
    node.add("pipe", SimPod(Schedule.parse("0:80"), Schedule.parse("0:60"), coupled=True))
    node.add("batch", SimPod(Schedule.parse("0:100")))
    node.limit[node.row("pipe")] = [80.0, 30.0]
    node.advance(1.0)
    assert node.granted[node.row("pipe")] == pytest.approx([40.0, 30.0])
    assert node.granted[node.row("batch"), 0] == pytest.approx(60.0)
    assert node.counters("pipe").nr_throttled == 0


def test_a_coupled_pod_held_by_its_cpu_is_throttled_and_idles_its_gpu() -> None:
    node = SimNode(cores=2, gpus=1)
    node.add("pipe", SimPod(Schedule.parse("0:100"), Schedule.parse("0:80"), coupled=True))
    node.limit[node.row("pipe")] = [25.0, 80.0]
    node.advance(1.0)
    assert node.granted[node.row("pipe")] == pytest.approx([25.0, 20.0])
    assert node.counters("pipe").nr_throttled == 10


def test_an_independent_pod_keeps_todays_model() -> None:
    node = SimNode(cores=2, gpus=1)
    node.add("free", SimPod(Schedule.parse("0:80"), Schedule.parse("0:60")))
    node.limit[node.row("free")] = [80.0, 30.0]
    node.advance(1.0)
    assert node.granted[node.row("free")] == pytest.approx([80.0, 30.0])


def test_a_coupled_pod_with_no_gpu_demand_progresses_at_its_cpu() -> None:
    node = SimNode(cores=2, gpus=1)
    node.add("pipe", SimPod(Schedule.parse("0:50"), Schedule.parse("0:0"), coupled=True))
    node.limit[node.row("pipe")] = [40.0, 10.0]
    node.advance(1.0)
    assert node.granted[node.row("pipe")] == pytest.approx([40.0, 0.0])
    demand, usage = np.array([[[50.0, 0.0]]]), np.array([[[40.0, 0.0]]])
    assert coupled_progress(
        demand, usage, np.ones((1, 1), bool), np.ones(1, bool), np.ones(1)
    ) == pytest.approx(0.8)


def test_coupled_is_refused_on_a_pod_without_a_gpu_with_its_path() -> None:
    with pytest.raises(ScenarioError, match=r"test\.yaml:6: pods\[0\]\.coupled: .*gpu"):
        parse_scenario(
            BASE + "    coupled: true\n    cpu: {shape: constant, value: 10}\n",
            "test.yaml",
            Path(),
        )
    with pytest.raises(ScenarioError, match=r"pods\[0\]\.coupled: must be true or false"):
        parse_scenario(
            BASE + "    coupled: maybe\n    cpu: {shape: constant, value: 10}\n"
            "    gpu: {shape: constant, value: 10}\n",
            "test.yaml",
            Path(),
        )


def test_the_trainers_ship_coupled_and_can_be_run_as_before() -> None:
    scenario = load_scenario(shipped_path("inference-spikes"))
    assert {p.name: p.coupled for p in scenario.pods} == {
        "inference": True,
        "trainer": True,
        "notebook": False,
    }
    assert not any(p.coupled for p in scenario.uncoupled().pods)


def test_priced_unmet_counts_a_gpu_point_at_the_gpu_price() -> None:
    demand = np.array([[[100.0, 50.0]]])
    usage = np.array([[[100.0, 25.0]]])
    prices = np.array([1.0, 3.0])
    # 25 GPU points unmet at 3 tokens, of 100 + 150 tokens of demand.
    assert priced_unmet(demand, usage, np.ones((1, 2), bool), prices) == pytest.approx(0.3)
    assert priced_unmet(np.zeros((1, 1, 2)), usage, np.ones((1, 2), bool), prices) is None


def test_progress_is_the_scarcest_fraction_weighted_by_tokens() -> None:
    demand = np.array([[[100.0, 50.0], [40.0, 40.0]], [[100.0, 50.0], [0.0, 0.0]]])
    usage = np.array([[[50.0, 50.0], [40.0, 20.0]], [[100.0, 50.0], [0.0, 0.0]]])
    alive = np.ones((2, 2), bool)
    tokens = np.array([100.0, 300.0])
    # Pod 0: 0.5 then 1.0, mean 0.75; pod 1: 0.5 in its one working period.
    expected = (100 * 0.75 + 300 * 0.5) / 400
    assert coupled_progress(demand, usage, alive, np.ones(2, bool), tokens) == pytest.approx(
        expected
    )
    assert coupled_progress(demand, usage, alive, np.zeros(2, bool), tokens) is None


BINDING = """\
node: {cores: 2, gpus: 1}
duration: 40
seed: 4
pods:
  - name: trainer
    tokens: 150
    coupled: true
    cpu: {shape: constant, value: 120, noise: 5}
    gpu: {shape: constant, value: 70, noise: 3}
  - name: web
    tokens: 100
    cpu: {shape: square, low: 20, high: 90, period: 10, duty: 0.5}
"""


def test_the_oracle_serves_a_coupled_pod_in_one_fraction() -> None:
    scenario = parse_scenario(BINDING, "binding.yaml", Path())
    demand = scenario.demand()
    served = solve_oracle(scenario, demand).served
    fractions = served[:, 0, :] / demand[:, 0, :]
    assert fractions[:, 0] == pytest.approx(fractions[:, 1], abs=1e-6)
    # 150 tokens buy the same fraction f of 120 CPU + 3 × 70 GPU: f = 150 / 330.
    assert fractions.mean() == pytest.approx(150 / 330, abs=0.02)


def test_the_binding_bounds_bound_every_policy_and_kuscale_keeps_close() -> None:
    scenario = parse_scenario(BINDING, "binding.yaml", Path())
    demand = scenario.demand()
    best = binding_bounds(scenario, demand)
    progress, priced = best["coupled_progress"], best["priced_unmet_fraction"]
    assert progress is not None and priced is not None
    assert progress == pytest.approx(150 / 330, abs=0.02)
    results = {name: evaluate(simulate(scenario, name, demand)) for name in ("kuscale", "static")}
    for metrics in results.values():
        assert metrics["coupled_progress"] <= progress + 1e-6
        assert metrics["priced_unmet_fraction"] >= priced - 1e-6
    assert results["kuscale"]["coupled_progress"] >= results["static"]["coupled_progress"]


def test_sim_json_carries_both_figures_and_their_bounds(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    scenario = tmp_path / "binding.yaml"
    scenario.write_text(BINDING)
    code = main(
        ["sim", "--scenario-file", str(scenario), "--policy", "kuscale,oracle", "--json", str(out)]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["oracle"]["coupled_progress"] > 0.4
    kuscale = data["policies"]["kuscale"]
    assert 0.0 < kuscale["priced_unmet_fraction"] < 1.0
    assert kuscale["priced_unmet_excess_points"] >= -1e-6
    assert kuscale["coupled_progress_vs_bound_points"] <= 1e-6


def pairs(evidence: CouplingEvidence, coupled: bool, ticks: int = 200, seed: int = 1) -> bool:
    """Feed a pod whose GPU is pinned at a limit that wanders; its CPU follows the GPU when
    coupled, or swings on its own. Returns whether it was told coupled at the end."""
    rng = np.random.default_rng(seed)
    gpu_limit = 40.0
    told = False
    for _ in range(ticks):
        gpu_limit = float(np.clip(gpu_limit * math.exp(rng.normal(0.0, 0.1)), 10.0, 90.0))
        noise = rng.normal(1.0, 0.05)
        cpu = (1.5 * gpu_limit if coupled else 60.0) * noise
        usage = np.array([[cpu, gpu_limit]])
        pinned = np.array([[False, True]])
        told = bool(evidence.observe(("pod",), usage, pinned, np.ones((1, 2), bool))[0])
    return told


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_pipeline_is_told_by_its_cpu_following_its_pinned_gpu(seed: int) -> None:
    assert pairs(CouplingEvidence(), coupled=True, seed=seed)
    assert not pairs(CouplingEvidence(), coupled=False, seed=seed)


def test_a_pod_whose_limits_never_move_gives_no_evidence() -> None:
    evidence = CouplingEvidence()
    usage = np.array([[60.0, 40.0]])
    for _ in range(50):
        told = evidence.observe(("pod",), usage, np.array([[False, True]]), np.ones((1, 2), bool))
    assert not told[0]


def test_a_pipeline_whose_budget_binds_buys_both_in_proportion() -> None:
    # Pinned on the GPU (estimated to need twice its use), the CPU will use twice its use,
    # and its margin above that is not bought.
    demand = in_step(np.array([[66.0, 80.0]]), np.array([[60.0, 40.0]]), np.array([[False, True]]))
    assert demand == pytest.approx(np.array([[120.0, 80.0]]))
    quiet = in_step(np.array([[66.0, 44.0]]), np.array([[60.0, 40.0]]), np.zeros((1, 2), bool))
    assert quiet == pytest.approx(np.array([[66.0, 44.0]]))
    prices = np.array([[1.0, 3.0]])
    lower, upper, uses = np.array([10.0, 10.0]), np.array([200.0, 100.0]), np.ones((1, 2), bool)
    limits, binding = split_in_proportion(demand, prices, np.array([180.0]), lower, upper, uses)
    assert binding[0]
    assert limits == pytest.approx(np.array([[60.0, 40.0]]))
    assert (prices * limits).sum() == pytest.approx(180.0)
    # A bound holds and the budget still does: the GPU at its minimum, the CPU the rest.
    tight = np.array([[200.0, 12.0]])
    limits, _ = split_in_proportion(tight, prices, np.array([100.0]), lower, upper, uses)
    assert limits == pytest.approx(np.array([[70.0, 10.0]]))


def test_a_resource_the_node_cut_leaves_the_other_cut_to_match() -> None:
    kept = keep_in_step(
        np.array([[60.0, 20.0], [60.0, 20.0]]),
        np.array([[60.0, 40.0], [60.0, 40.0]]),
        np.array([True, False]),
        np.array([10.0, 10.0]),
    )
    assert kept == pytest.approx(np.array([[30.0, 20.0], [60.0, 20.0]]))


def test_the_policy_splits_a_told_pipeline_in_proportion() -> None:
    policy = KuscalePolicy(PolicyConfig())
    policy.coupling.observe = lambda keys, usage, pinned, uses: np.array([True])  # type: ignore[method-assign]
    obs = Observation(
        period=1.0,
        elapsed=np.array([1.0]),
        tokens=np.array([150.0]),
        queue=np.zeros(1),
        usage=np.array([[60.0, 40.0]]),
        avg_usage=np.array([[60.0, 40.0]]),
        limits=np.array([[70.0, 40.0]]),
        starved=np.array([[False, True]]),
        demand=np.array([[66.0, 40.0]]),
        uses=np.ones((1, 2), bool),
        capacity=np.array([200.0, 100.0]),
    )
    limits = policy.decide(obs).limits[0]
    assert limits[0] / limits[1] == pytest.approx(60.0 / 40.0, rel=0.02)
    assert limits[0] + 3 * limits[1] == pytest.approx(150.0, rel=0.01)
