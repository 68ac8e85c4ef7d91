"""`kuscale sim`: policies compared on a simulated node, against the clairvoyant bound."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kuscale.cli.shared import CliError, SubParsers, report_console, seconds
from kuscale.config import POLICY_NAMES

SIM_POLICIES = (*POLICY_NAMES, "oracle")
"""The simulator's rules: the agent's, and the clairvoyant bound."""


def _policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SIM_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; choose from {', '.join(SIM_POLICIES)}"
        )
    return list(dict.fromkeys(names))


def add_parser(sub: SubParsers) -> None:
    sim = sub.add_parser("sim", help="compare policies on a simulated node")
    sim.set_defaults(handler=cmd_sim)
    chosen = sim.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--list", action="store_true", help="list the shipped scenarios")
    chosen.add_argument("--scenario", help="a shipped scenario's name")
    chosen.add_argument("--scenario-file", type=Path, help="a scenario YAML file")
    sim.add_argument(
        "--policy",
        type=_policies,
        help=f"P[,P...] from {', '.join(SIM_POLICIES)} (default: all; the oracle is "
        "left out, with a note, where a run is too large for it)",
    )
    sim.add_argument("--seed", type=int, help="replace the scenario's seed")
    sim.add_argument("--duration", type=seconds, help="replace the scenario's duration")
    sim.add_argument(
        "--gpu-layer",
        choices=("vgpu", "gemini"),
        help="replace the scenario's GPU layer: vgpu (limits alone, as the original's module) "
        "or gemini (REQUEST from tokens first, then work-conserving up to LIMIT)",
    )
    sim.add_argument("--json", type=Path, help="write the metrics as JSON")
    sim.add_argument("--plot", type=Path, help="PNG of a few pods over time (one per policy)")
    sim.add_argument("--report", type=Path, help="directory for a Markdown report with plots")


def sim_scenario(args: argparse.Namespace) -> Any:
    """The scenario `kuscale sim` names, with --seed, --duration and --gpu-layer applied;
    None for --list."""
    from dataclasses import replace

    from kuscale.sim.located import ScenarioError
    from kuscale.sim.scenario import load_scenario, shipped_names, shipped_path

    try:
        if args.list:
            for name in shipped_names():
                print(f"{name}  {load_scenario(shipped_path(name)).description}")
            return None
        scenario = load_scenario(args.scenario_file or shipped_path(args.scenario))
    except ScenarioError as err:
        raise CliError(str(err)) from None
    if args.seed is not None:
        scenario = replace(scenario, seed=args.seed)
    if args.duration is not None:
        if args.duration < scenario.period:
            raise CliError(f"--duration must be at least one period ({scenario.period:g} s)")
        scenario = replace(scenario, duration=args.duration)
    if args.gpu_layer is not None:
        scenario = scenario.on_gpu_layer(args.gpu_layer)
    return scenario


def cmd_sim(args: argparse.Namespace) -> int:
    from kuscale.sim.oracle import OracleError
    from kuscale.sim.report import compare, plot_policy, table, write_json, write_report

    scenario = sim_scenario(args)
    if scenario is None:
        return 0
    console = report_console()
    try:
        comparison = compare(
            scenario, args.policy or list(SIM_POLICIES), console, require_oracle=bool(args.policy)
        )
    except OracleError as err:
        raise CliError(str(err)) from None
    if comparison.bound_note:
        console.print(f"no oracle bound: {comparison.bound_note}")
    console.print(table(comparison))
    if args.json:
        write_json(comparison, args.json)
        console.print(f"metrics written to {args.json}")
    if args.plot:
        for name, trace in comparison.traces.items():
            path = args.plot
            if len(comparison.traces) > 1:
                path = args.plot.with_name(f"{args.plot.stem}-{name}{args.plot.suffix or '.png'}")
            plot_policy(trace, path)
            console.print(f"plot written to {path}")
    if args.report:
        console.print(f"report written to {write_report(comparison, args.report)}")
    return 0
