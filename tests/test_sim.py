"""The simulator: scenarios and their errors, determinism, metrics, and `kuscale sim`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kuscale.cli import main
from kuscale.sim.located import ScenarioError
from kuscale.sim.metrics import evaluate, reaction_seconds
from kuscale.sim.node import SimGpu, SimNode, SimPod
from kuscale.sim.run import simulate
from kuscale.sim.scenario import (
    Scenario,
    load_scenario,
    parse_scenario,
    shipped_names,
    shipped_path,
)
from kuscale.workload import Schedule

BASE = """\
node: {cores: 2, gpus: 1}
duration: 60
seed: 3
pods:
  - name: web
    tokens: 100
"""


def scenario(pod_lines: str, base: str = BASE, directory: Path = Path()) -> Scenario:
    return parse_scenario(base + pod_lines, "test.yaml", directory)


def shortened(name: str, seconds: float) -> Scenario:
    return replace(load_scenario(shipped_path(name)), duration=seconds)


def test_eight_scenarios_ship_and_load() -> None:
    names = shipped_names()
    assert len(names) >= 8
    for name in names:
        loaded = load_scenario(shipped_path(name))
        assert loaded.description
        assert loaded.pods
    assert len(load_scenario(shipped_path("many-small-pods")).pods) == 110
    assert len(load_scenario(shipped_path("stress-1000")).pods) == 1000


@pytest.mark.parametrize(
    ("shape", "check"),
    [
        ("{shape: constant, value: 40}", lambda d: np.allclose(d, 40)),
        ("{shape: step, steps: [[0, 10], [30, 90]]}", lambda d: d[29] == 10 and d[30] == 90),
        (
            "{shape: square, low: 10, high: 80, period: 20, duty: 0.25}",
            lambda d: d[0] == 80 and d[5] == 10 and d[20] == 80,
        ),
        ("{shape: ramp, from: 0, to: 60, end: 60}", lambda d: d[0] == 0 and d[30] == 30),
        ("{shape: sine, mean: 50, amplitude: 40, period: 60}", lambda d: d.max() <= 90),
        (
            "{shape: bursts, base: 5, peak: 150, on: [2, 5], off: [5, 10]}",
            lambda d: set(np.unique(d)) == {5.0, 150.0},
        ),
    ],
)
def test_every_shape_samples_what_it_says(shape: str, check: object) -> None:
    demand = scenario(f"    cpu: {shape}\n").demand()[:, 0, 0]
    assert demand.min() >= 0
    assert callable(check) and check(demand)


def test_a_csv_trace_is_held_between_rows(tmp_path: Path) -> None:
    (tmp_path / "trace.csv").write_text("time,demand\n0,10\n20,70\n40,30\n")
    demand = scenario("    cpu: {shape: trace, file: trace.csv}\n", directory=tmp_path).demand()
    assert demand[[0, 19, 20, 39, 40, 59], 0, 0].tolist() == [10, 10, 70, 70, 30, 30]


def test_the_same_seed_gives_the_same_numbers_bit_for_bit() -> None:
    first = shortened("many-small-pods", 60)
    runs = [evaluate(simulate(first, "kuscale")) for _ in range(2)]
    for run in runs:
        run.pop("decide_seconds_per_tick")
    assert runs[0] == runs[1]
    other = replace(first, seed=first.seed + 1)
    assert not np.array_equal(first.demand(), other.demand())


@pytest.mark.parametrize(
    ("pod_lines", "message"),
    [
        (
            "    cpu: {shape: constant, value: 10}\n    colour: red\n",
            ":8: pods[0].colour: unknown key (known here: coupled, cpu, end, gpu,",
        ),
        ("    cpu: {shape: constant, value: -5}\n", ":7: pods[0].cpu.value: must be at least 0"),
        ("    cpu: {shape: constant, value: 500}\n", "pods[0].cpu: peak demand 500 %"),
        ("    cpu: {shape: wobble}\n", "pods[0].cpu.shape: unknown shape 'wobble'"),
        ("    cpu: {shape: sine, mean: 10, amplitude: 20, period: 5}\n", "negative"),
        ("    cpu: {shape: constant, value: 10}\n    gpu: {shape: constant, value: 101}\n", "gpu"),
        ("    cpu: {shape: constant, value: 10}\n    replicas: 0\n", "pods[0].replicas"),
    ],
)
def test_bad_scenarios_name_the_file_line_and_field(pod_lines: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=r"test\.yaml") as caught:
        scenario(pod_lines)
    assert message in str(caught.value)


def test_bad_tokens_and_top_level_keys_are_named() -> None:
    with pytest.raises(ScenarioError, match=r"test.yaml:6: pods\[0\].tokens"):
        scenario("    cpu: {shape: constant, value: 10}\n", base=BASE.replace("100", "-1"))
    with pytest.raises(ScenarioError, match=r"test\.yaml:1: nodes: unknown key"):
        scenario("    cpu: {shape: constant, value: 10}\n", base="nodes: 3\n" + BASE)
    with pytest.raises(ScenarioError, match="config"):
        scenario(
            "    cpu: {shape: constant, value: 10}\n",
            base="config: {policy: {growth: 0.5}}\n" + BASE,
        )


def test_a_csv_that_does_not_parse_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("time,demand\n0,10\n5,lots\n")
    with pytest.raises(ScenarioError, match=r"bad.csv:3: expected 'seconds,percent'"):
        scenario("    cpu: {shape: trace, file: bad.csv}\n", directory=tmp_path).demand()
    (tmp_path / "back.csv").write_text("0,10\n5,20\n4,30\n")
    with pytest.raises(ScenarioError, match=r"back.csv:3: time 4 does not increase"):
        scenario("    cpu: {shape: trace, file: back.csv}\n", directory=tmp_path)


def test_reaction_counts_until_the_limit_covers_the_new_demand() -> None:
    demand = np.array([10.0, 10, 100, 100, 100, 100, 10, 10])[:, None, None]
    limit = np.array([20.0, 20, 20, 50, 96, 100, 100, 30])[:, None, None]
    alive = np.ones((8, 1), dtype=bool)
    uses = np.array([[True]])
    assert reaction_seconds(demand, limit, alive, uses, 1.0) == [2.0]
    never = np.full((8, 1, 1), 20.0)
    assert reaction_seconds(demand, never, alive, uses, 1.0) == [4.0]


def test_kuscale_meets_more_demand_than_static_within_budget_on_a_burst() -> None:
    run = shortened("idle-then-burst", 400)
    results = {name: evaluate(simulate(run, name)) for name in ("kuscale", "static", "vpa")}
    unmet = {name: m["cpu"]["unmet_demand_fraction"] for name, m in results.items()}
    assert unmet["kuscale"] < unmet["static"]
    assert unmet["kuscale"] < unmet["vpa"]
    assert results["kuscale"]["budget_overspend_fraction"] < 1e-6
    assert results["static"]["budget_overspend_fraction"] < 1e-6
    assert set(results["kuscale"]["gpu"].values()) == {None}


def test_a_budget_bound_pod_is_never_left_holding_more_than_it_can_pay_for() -> None:
    metrics = evaluate(simulate(load_scenario(shipped_path("diurnal-web")), "kuscale"))
    assert metrics["budget_overspend_fraction"] == 0.0


def test_baselines_that_ignore_tokens_are_charged_for_them() -> None:
    run = shortened("full-node", 300)
    metrics = evaluate(simulate(run, "autothrottle"))
    assert metrics["budget_overspend_fraction"] > 0.1


def test_pods_arrive_and_leave_on_time() -> None:
    trace = simulate(shortened("arrivals", 900), "kuscale")
    job = trace.names.index("job-0")
    assert np.isnan(trace.limit[199, job, 0])
    assert not np.isnan(trace.limit[200, job, 0])
    assert trace.usage[700:, job].sum() == 0


def test_sim_cli_lists_compares_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == shipped_names()
    out = tmp_path / "out.json"
    code = main(
        [
            "sim",
            "--scenario",
            "training-phases",
            "--duration",
            "120",
            "--policy",
            "kuscale,static",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "report"),
            "--plot",
            str(tmp_path / "plot.png"),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["scenario"] == "training-phases"
    kuscale = data["policies"]["kuscale"]
    for key in ("unmet_demand_fraction", "slack_fraction"):
        assert 0 <= kuscale["cpu"][key] <= 1
        assert 0 <= kuscale["gpu"][key] <= 1
    for key in (
        "budget_overspend_fraction",
        "reaction_seconds_median",
        "reaction_seconds_p95",
        "limit_changes_per_pod_hour",
        "decide_seconds_per_tick",
    ):
        assert key in kuscale
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| kuscale |" in report and "| static |" in report
    assert (tmp_path / "report" / "metrics.png").stat().st_size > 0
    assert (tmp_path / "plot-kuscale.png").stat().st_size > 0


def test_a_report_on_a_node_without_gpus_leaves_the_gpu_out(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["sim", "--scenario", "idle-then-burst", "--duration", "30", "--json", str(out)]
    assert main([*args, "--report", str(tmp_path / "report")]) == 0
    assert json.loads(out.read_text())["policies"]["vpa"]["gpu"]["unmet_demand_fraction"] is None
    assert "| vpa |" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "metrics.png").stat().st_size > 0


def test_sim_cli_refuses_bad_input_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "    cpu: {shape: constant, value: -1}\n")
    assert main(["sim", "--scenario-file", str(bad)]) == 2
    assert f"{bad}:7: pods[0].cpu.value" in capsys.readouterr().err
    bad.write_text("node: [\n")
    assert main(["sim", "--scenario-file", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["sim", "--scenario-file", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read scenario" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--scenario", "single-burst", "--policy", "nope"])


@pytest.mark.parametrize("policy", ["kuscale", "kuscale-2022", "static", "vpa", "autothrottle"])
def test_each_gpu_device_is_shared_on_its_own_and_never_above_100(policy: str) -> None:
    """Three trainers wanting 60 % each of GPU 0 get 100 % of it together, whatever GPU 1
    has idle: a client's share lives on its device."""
    multi = shortened("multi-gpu", 240)
    assert [pod.device for pod in multi.pods if pod.gpu is not None] == [0, 0, 0, 1]
    trace = simulate(multi, policy)
    peaks = evaluate(trace)["gpu_device_peak_percent"]
    assert len(peaks) == 2
    assert max(peaks) <= 100.0 + 1e-6
    if policy in ("static", "kuscale"):
        assert peaks[0] > 95.0, "GPU 0 is wanted at 180 %: a work-conserving share fills it"


def test_gpu_pods_without_a_device_are_spread_by_their_order() -> None:
    base = BASE.replace("gpus: 1", "gpus: 2")
    pod = "    cpu: {shape: constant, value: 10}\n    gpu: {shape: constant, value: 30}\n"
    spread = scenario(
        pod + "  - name: b\n    tokens: 100\n" + pod + "  - name: c\n    tokens: 100\n" + pod,
        base,
    )
    assert [p.device for p in spread.pods] == [0, 1, 0]
    with pytest.raises(ScenarioError, match="device 2 is not one of the node's 2 GPUs"):
        scenario(pod.replace("value: 30}", "value: 30, device: 2}"), base)


def test_a_gemini_device_serves_requests_first_then_shares_the_rest_up_to_limits() -> None:
    """Two busy clients with REQUESTs 2:1 get the device 2:1; one idle leaves the other all
    of it up to its LIMIT: work-conserving, as gem-schd is over its window."""
    node = SimNode(cores=2, gpus=1, gemini=True)
    busy = Schedule.parse("0:100")
    for name in ("big", "small"):
        node.add(name, SimPod(cpu=Schedule.parse("0:10"), gpu=busy))
    gpu = SimGpu(node)
    assert gpu.weighted
    gpu.weigh("big", 200.0)
    gpu.weigh("small", 100.0)
    for name in ("big", "small"):
        gpu.write_limit(name, 90.0)
    gpu.commit()
    node.advance(1.0)
    assert node.granted[:, 1] == pytest.approx([200 / 3, 100 / 3], abs=0.01)
    node.limit[node.row("big"), 1] = 50.0
    node.advance(1.0)
    assert node.granted[:, 1] == pytest.approx([50.0, 50.0])
    gpu.remove("big")
    node.remove("big")
    gpu.commit()
    node.advance(1.0)
    assert node.granted[node.row("small"), 1] == pytest.approx(90.0)


def test_with_gemini_the_policy_leaves_the_device_to_its_weights() -> None:
    """Limits carry budgets and may add up past the device; tokens decide under contention
    and an idle pod's share goes to the busy one."""
    base = BASE.replace("duration: 60", "duration: 120\nconfig:\n  gpu_layer: {kind: gemini}")
    pod = (
        "    cpu: {shape: constant, value: 10}\n"
        "    gpu: {shape: square, low: %s, high: 90, period: 120, duty: 0.5}\n"
    )
    weighted = scenario(
        pod % 90 + "  - name: small\n    tokens: 200\n" + pod % 0,
        base.replace("tokens: 100", "tokens: 400"),
    )
    trace = simulate(weighted, "kuscale")
    busy, alone = slice(20, 60), slice(80, 120)
    usage, limit = trace.usage[:, :, 1], trace.limit[:, :, 1]
    assert usage[busy, 0].mean() / usage[busy, 1].mean() == pytest.approx(2.0, rel=0.15)
    assert usage[busy].sum(axis=1).mean() > 97.0
    assert limit[busy].sum(axis=1).mean() > 110.0, "limits carry budgets, not the device"
    assert usage[alone, 0].mean() > 85.0
    assert evaluate(trace)["budget_overspend_fraction"] == 0.0


@pytest.mark.parametrize("layer", ["vgpu", "gemini"])
@pytest.mark.parametrize("name", ["inference-spikes", "gpu-tenants", "two-gpu-training"])
def test_the_gpu_scenarios_run_on_either_gpu_layer(name: str, layer: str) -> None:
    run = shortened(name, 120).on_gpu_layer(layer)
    assert run.gemini is (layer == "gemini")
    metrics = evaluate(simulate(run, "kuscale"))
    assert metrics["within_rules"] and metrics["budget_overspend_fraction"] == 0.0
    assert max(metrics["gpu_device_peak_percent"]) <= 100.0 + 1e-3  # usage is float32
    assert metrics["gpu"]["idle_while_starved_fraction"] <= 0.02


def test_sim_cli_replaces_the_gpu_layer(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = ["sim", "--scenario", "inference-spikes", "--duration", "30", "--policy", "kuscale"]
    assert main([*argv, "--gpu-layer", "gemini", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_layer"] == "gemini"
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_layer"] == "vgpu"
    with pytest.raises(SystemExit):
        main([*argv, "--gpu-layer", "hami"])
