"""`kuscale demo`: three workloads under the agent on this machine, summarised."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from kuscale.cli.shared import (
    CliError,
    SubParsers,
    add_agent_options,
    agent_config,
    report_console,
    seconds,
)


def add_parser(sub: SubParsers) -> None:
    demo = sub.add_parser("demo", help="run three workloads under the agent and summarise")
    demo.set_defaults(handler=cmd_demo)
    demo.add_argument("--duration", type=seconds, default=30.0)
    demo.add_argument("--json", type=Path, dest="json_path")
    demo.add_argument("--plot", type=Path, dest="plot_path")
    demo.add_argument("--simulate", action="store_true", help="use a simulated node")
    demo.add_argument(
        "--gpu-layer",
        choices=("emulator", "gemini"),
        default="emulator",
        help="who holds the GPU pod to its share: the emulator itself, or the real Gemini",
    )
    demo.add_argument(
        "--gemini-bin", type=Path, help="where gem-schd and gem-pmgr are (for --gpu-layer gemini)"
    )
    add_agent_options(demo)


def _unwind_on_sigterm() -> None:
    """SIGTERM unwinds the stack like Ctrl-C, so every `finally` gives back what it set."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def cmd_demo(args: argparse.Namespace) -> int:
    from kuscale.demo import run_demo
    from kuscale.local.gemini import GeminiRuntimeError

    if (args.gpu_layer == "gemini") != (args.gemini_bin is not None):
        raise CliError("--gpu-layer gemini and --gemini-bin DIR go together")
    config = agent_config(args, period=args.period or 0.5)
    console = report_console()
    _unwind_on_sigterm()
    try:
        run_demo(
            config,
            args.duration,
            args.json_path,
            args.plot_path,
            args.simulate,
            console,
            args.gemini_bin,
        )
    except (GeminiRuntimeError, RuntimeError) as err:
        raise CliError(str(err)) from None
    except KeyboardInterrupt:
        print("demo interrupted: its workloads, agent and cgroups were stopped and removed")
        return 130
    return 0
