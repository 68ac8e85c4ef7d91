"""Every shipped scenario the oracle can solve, on both GPU layers, in one Markdown table:
the figures a binding budget is judged by (priced unmet and coupled progress, each against
the oracle's bound) beside the per-resource unmet demand, GPU idle while starved and
overspend, for `kuscale`, `kuscale-2022` and `static` on the same demand.

Run with `make sim-table` (or `python bench/sim_table.py --scenario NAME ...`).
"""

from __future__ import annotations

import argparse
import io
from typing import Any

from rich.console import Console

from kuscale.sim.report import compare
from kuscale.sim.scenario import Scenario, load_scenario, shipped_names, shipped_path

POLICIES = ("kuscale", "kuscale-2022", "static")
TOO_LARGE_FOR_THE_ORACLE = ("stress-1000",)


def _points(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def _with_bound(value: float | None, bound: float | None) -> str:
    if value is None:
        return "—"
    if bound is None:
        return _points(value)
    return f"{_points(value)} ({100 * (value - bound):+.1f})"


def rows(scenario: Scenario, label: str) -> list[str]:
    quiet = Console(file=io.StringIO())
    comparison = compare(scenario, [*POLICIES], quiet)
    bound: dict[str, Any] = comparison.bound or {}
    lines = []
    for name in POLICIES:
        metrics = comparison.metrics[name]
        cells = [
            label,
            name,
            _with_bound(metrics["priced_unmet_fraction"], bound.get("priced_unmet_fraction")),
            _with_bound(metrics["coupled_progress"], bound.get("coupled_progress")),
            _points(metrics["cpu"]["unmet_demand_fraction"]),
            _points(metrics["gpu"]["unmet_demand_fraction"]),
            _points(metrics["gpu"]["idle_while_starved_fraction"]),
            _points(metrics["budget_overspend_fraction"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    bounds = [
        label,
        "oracle bound",
        _points(bound.get("priced_unmet_fraction")),
        _points(bound.get("coupled_progress")),
        _points(bound.get("cpu", {}).get("unmet_demand_fraction")),
        _points(bound.get("gpu", {}).get("unmet_demand_fraction")),
        "",
        "",
    ]
    lines.append("| " + " | ".join(bounds) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", action="append", help="only these (default: all)")
    parser.add_argument("--uncoupled", action="store_true", help="every pod independent")
    args = parser.parse_args()
    names = args.scenario or [n for n in shipped_names() if n not in TOO_LARGE_FOR_THE_ORACLE]
    print(
        "| scenario | policy | priced unmet % (vs bound) | progress % (vs bound) "
        "| CPU unmet % | GPU unmet % | GPU idle·starved % | overspend % |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        scenario = load_scenario(shipped_path(name))
        if args.uncoupled:
            scenario = scenario.uncoupled()
        layers = ("vgpu", "gemini") if scenario.gpus else ("vgpu",)
        for layer in layers:
            label = name if layer == "vgpu" else f"{name} (Gemini)"
            for line in rows(scenario.on_gpu_layer(layer), label):
                print(line, flush=True)


if __name__ == "__main__":
    main()
