"""The demo on a simulated node: summary, JSON and plot from the real monitor and policy."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from kuscale.config import AgentConfig
from kuscale.demo import DEMO_WORKLOADS, run_demo, summarise


def test_simulated_demo_writes_summary_and_plot(tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "summary.json", tmp_path / "plot.png"
    with (tmp_path / "out.txt").open("w") as out:
        run_demo(
            AgentConfig(period=0.5),
            20.0,
            json_path,
            plot_path,
            simulate=True,
            console=Console(file=out),
        )
    result = json.loads(json_path.read_text())
    assert result["mode"] == "simulated"
    assert set(result["pods"]) == {w.name for w in DEMO_WORKLOADS}
    trainer = result["pods"]["trainer"]
    assert {"cpu", "gpu", "budget_overspend_fraction"} <= set(trainer)
    for key in (
        "mean_usage",
        "mean_limit",
        "unmet_demand_fraction",
        "slack_fraction",
        "throttled_tick_fraction",
    ):
        assert trainer["cpu"][key] >= 0.0
    assert plot_path.stat().st_size > 10_000


def test_summary_arithmetic() -> None:
    rows = [
        {
            "pod": "p",
            "resource": "cpu",
            "tokens": 100,
            "demand": 50.0,
            "usage": 40.0,
            "limit": 40.0,
            "starved": True,
            "spend": 40.0,
        },
        {
            "pod": "p",
            "resource": "cpu",
            "tokens": 100,
            "demand": 50.0,
            "usage": 50.0,
            "limit": 150.0,
            "starved": False,
            "spend": 150.0,
        },
    ]
    entry = summarise(rows)["p"]
    assert entry["cpu"]["unmet_demand_fraction"] == 10.0 / 100.0
    assert entry["cpu"]["slack_fraction"] == 100.0 / 190.0
    assert entry["cpu"]["throttled_tick_fraction"] == 0.5
    assert entry["budget_overspend_fraction"] == 50.0 / 200.0
