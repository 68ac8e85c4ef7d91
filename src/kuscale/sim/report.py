"""`kuscale sim`: every chosen policy on the same demand, a table, JSON, plots and a report."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from kuscale.model import RESOURCES
from kuscale.plotting import plot_bars, plot_timeline
from kuscale.sim.metrics import evaluate
from kuscale.sim.oracle import ORACLE, OracleError, binding_bounds, bounds, oracle_trace
from kuscale.sim.run import Trace, simulate
from kuscale.sim.scenario import Scenario

LONG_RUN_POD_TICKS = 200_000
"""Runs with more pod-periods than this show a progress bar."""
PLOTTED_PODS = 3


@dataclass(slots=True)
class Comparison:
    scenario: Scenario
    metrics: dict[str, dict[str, Any]]
    traces: dict[str, Trace]
    bound: dict[str, Any] | None = None
    """The oracle's least unmet demand per resource (plain and token-weighted), or None."""
    bound_note: str = ""
    """Why there is no bound, when there is none."""

    def as_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "seed": self.scenario.seed,
            "gpu_layer": "gemini" if self.scenario.gemini else "vgpu",
            "pods": len(self.scenario.pods),
            "duration_seconds": self.scenario.duration,
            "period_seconds": self.scenario.period,
            "oracle": self.bound if self.bound is not None else {"unavailable": self.bound_note},
            "policies": self.metrics,
        }


def compare(
    scenario: Scenario, policies: list[str], console: Console, require_oracle: bool = True
) -> Comparison:
    """Run each policy on one draw of demand, so differences are the policies' alone, and
    measure each against the oracle's bound on the same draw.

    The oracle is solved even when it is not among `policies`, for the bound. A scenario it
    cannot solve raises OracleError where `require_oracle` and the oracle is among
    `policies`; otherwise the comparison goes on without it and says why."""
    demand = scenario.demand()
    metrics: dict[str, dict[str, Any]] = {}
    traces: dict[str, Trace] = {}
    long_run = scenario.ticks * len(scenario.pods) > LONG_RUN_POD_TICKS
    comparison = Comparison(scenario, metrics, traces)
    try:
        oracle = oracle_trace(scenario, demand)
        comparison.bound = {
            "exact": oracle.exact,
            **bounds(scenario, demand),
            **binding_bounds(scenario, demand),
        }
    except OracleError as err:
        if require_oracle and ORACLE in policies:
            raise
        comparison.bound_note = str(err)
        policies = [name for name in policies if name != ORACLE]
    with Progress(console=console, transient=True, disable=not long_run) as progress:
        for name in policies:
            if name == ORACLE:
                trace = oracle
            else:
                task = progress.add_task(f"{scenario.name} · {name}", total=scenario.ticks)

                def advance(done: int, task: TaskID = task) -> None:
                    progress.update(task, completed=done)

                trace = simulate(scenario, name, demand, advance)
            traces[name] = trace
            metrics[name] = _with_excess(evaluate(trace), comparison.bound)
    return comparison


def _with_excess(metrics: dict[str, Any], bound: dict[str, Any] | None) -> dict[str, Any]:
    """Each resource's unmet demand above the oracle's, in percentage points."""
    for r in RESOURCES:
        entry = metrics[r.label]
        for key in ("unmet_demand_fraction", "token_weighted_unmet_fraction"):
            best = None if bound is None else bound[r.label][key]
            excess = None
            if best is not None and entry[key] is not None:
                excess = 100.0 * (entry[key] - best)
            entry[key.replace("fraction", "excess_points")] = excess
    for key, points in (
        ("priced_unmet_fraction", "priced_unmet_excess_points"),
        ("coupled_progress", "coupled_progress_vs_bound_points"),
    ):
        best = None if bound is None else bound[key]
        value = metrics[key]
        metrics[points] = None if best is None or value is None else 100.0 * (value - best)
    return metrics


def _fraction(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def _unmet(metrics: dict[str, Any], resource: str) -> str:
    entry = metrics.get(resource, {})
    return _against(entry.get("unmet_demand_fraction"), entry.get("unmet_demand_excess_points"))


def _against(value: float | None, points: float | None) -> str:
    """A fraction, with how far it lies from the oracle's bound, in points."""
    if value is None or points is None:
        return _fraction(value)
    return f"{_fraction(value)} ({points:+.1f})"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:g} s"


Cell = Callable[[dict[str, Any]], str]

COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("CPU unmet (vs oracle)", lambda m: _unmet(m, "cpu")),
    ("CPU idle·starved", lambda m: _fraction(m["cpu"]["idle_while_starved_fraction"])),
    ("CPU slack", lambda m: _fraction(m["cpu"]["slack_fraction"])),
    ("GPU unmet (vs oracle)", lambda m: _unmet(m, "gpu")),
    ("GPU idle·starved", lambda m: _fraction(m["gpu"]["idle_while_starved_fraction"])),
    ("GPU slack", lambda m: _fraction(m["gpu"]["slack_fraction"])),
    (
        "priced unmet (vs oracle)",
        lambda m: _against(m["priced_unmet_fraction"], m["priced_unmet_excess_points"]),
    ),
    (
        "progress (vs oracle)",
        lambda m: _against(m["coupled_progress"], m["coupled_progress_vs_bound_points"]),
    ),
    ("overspend", lambda m: _fraction(m["budget_overspend_fraction"])),
    ("react p50", lambda m: _seconds(m["reaction_seconds_median"])),
    ("react p95", lambda m: _seconds(m["reaction_seconds_p95"])),
    ("changes/pod·h", lambda m: f"{m['limit_changes_per_pod_hour']:.0f}"),
    ("decide", lambda m: f"{1e3 * m['decide_seconds_per_tick']:.2f} ms"),
)


def table(comparison: Comparison) -> Table:
    scenario = comparison.scenario
    result = Table(
        title=f"{scenario.name}: {len(scenario.pods)} pods, {scenario.duration:g} s, "
        f"seed {scenario.seed}" + (", GPU shared as Gemini does" if scenario.gemini else "")
    )
    result.add_column("policy")
    for heading, _ in COLUMNS:
        result.add_column(heading, justify="right")
    for name, metrics in comparison.metrics.items():
        result.add_row(name, *(cell(metrics) for _, cell in COLUMNS))
    return result


def markdown_table(comparison: Comparison) -> str:
    lines = [
        "| policy | " + " | ".join(h for h, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for name, metrics in comparison.metrics.items():
        lines.append(f"| {name} | " + " | ".join(cell(metrics) for _, cell in COLUMNS) + " |")
    return "\n".join(lines)


def plotted_pods(trace: Trace) -> list[int]:
    """The pods whose demand varies most: the ones where policies differ."""
    spread = trace.demand.astype(np.float64).std(axis=0).sum(axis=1)
    return sorted(np.argsort(-spread, kind="stable")[:PLOTTED_PODS].tolist())


def timeline_rows(trace: Trace, pods: list[int]) -> list[dict[str, Any]]:
    rows = []
    times = trace.scenario.times()
    for pod in pods:
        for resource in RESOURCES:
            if not trace.uses[pod, resource]:
                continue
            for tick in np.flatnonzero(trace.alive[:, pod]).tolist():
                limit = float(trace.limit[tick, pod, resource])
                rows.append(
                    {
                        "t": float(times[tick]),
                        "pod": trace.names[pod],
                        "resource": resource.label,
                        "demand": float(trace.demand[tick, pod, resource]),
                        "usage": float(trace.usage[tick, pod, resource]),
                        "limit": None if np.isnan(limit) else limit,
                    }
                )
    return rows


def plot_policy(trace: Trace, path: Path) -> None:
    plot_timeline(
        timeline_rows(trace, plotted_pods(trace)),
        path,
        f"kuscale sim · {trace.scenario.name} · {trace.policy}",
    )


def write_json(comparison: Comparison, path: Path) -> None:
    path.write_text(json.dumps(comparison.as_json(), indent=2) + "\n", encoding="utf-8")


def _fractions(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics drawn as bars; a resource no pod used has none."""
    bars = {
        f"{r.label} {short}": metrics[r.label][key]
        for r in RESOURCES
        for short, key in (("unmet", "unmet_demand_fraction"), ("slack", "slack_fraction"))
        if metrics[r.label][key] is not None
    }
    return bars | {"overspend": metrics["budget_overspend_fraction"]}


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def write_report(comparison: Comparison, directory: Path) -> Path:
    """A Markdown report with the table, a bar chart of the metrics and a timeline per
    policy, all in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    scenario = comparison.scenario
    bars = directory / "metrics.png"
    plot_bars(
        {name: _fractions(m) for name, m in comparison.metrics.items()},
        bars,
        f"{scenario.name}: fractions per policy (lower is better)",
    )
    sections = [
        f"# kuscale sim: {scenario.name}",
        "",
        scenario.description,
        "",
        f"{len(scenario.pods)} pods on {scenario.cores} cores and {plural(scenario.gpus, 'GPU')}, "
        f"{scenario.duration:g} s in periods of {scenario.period:g} s, seed {scenario.seed}. "
        "Every policy saw the same demand.",
        "",
        markdown_table(comparison),
        "",
        "Unmet: share of demand not served. Slack: share of the limits left unused. "
        "Overspend: tokens spent beyond reservations and saved burst credit, as a share of "
        "the reservations. Reaction: seconds from a demand increase until the limit covers "
        "95 % of it (an increase never covered counts its whole spell).",
        "",
        f"![metrics]({bars.name})",
        "",
    ]
    for name, trace in comparison.traces.items():
        figure = directory / f"timeline-{name}.png"
        plot_policy(trace, figure)
        sections += [f"## {name}", "", f"![{name}]({figure.name})", ""]
    report = directory / "report.md"
    report.write_text("\n".join(sections), encoding="utf-8")
    return report
