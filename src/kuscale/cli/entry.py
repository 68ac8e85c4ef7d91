"""The `kuscale` command: agent, launch, status, demo, sim, and the helpers they start."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kuscale import faults
from kuscale.backends.base import BackendError
from kuscale.cli import agent, demo, helpers, kubelet, launch, plot, restore, sim, status, top
from kuscale.cli.shared import CliError
from kuscale.config import ConfigError
from kuscale.local.statedir import StateDirError
from kuscale.logs import setup_logging
from kuscale.model import InvalidSpec

LONG_RUNNING = ("agent", "gpu-emulator", "deviceplugin")
"""The commands that log their events by default; the others only their warnings."""
SIM_EXTRA = ("scipy", "matplotlib")
"""What `kuscale[sim]` adds for `sim`, `demo` and `plot`; the agent's image has neither."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kuscale", description=__doc__)
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more log detail, like klog's -v (the agent logs events by default)",
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (agent, launch, restore, status, demo, top, plot, sim):
        command.add_parser(sub)
    kubelet.add_parsers(sub)
    helpers.add_parsers(sub)
    return parser


def arm_faults() -> None:
    try:
        faults.arm_from_environment()
    except faults.FaultError as err:
        raise CliError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(
        args.verbose,
        args.log_format == "json",
        base=1 if args.command in LONG_RUNNING else 0,
    )
    try:
        arm_faults()
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except ModuleNotFoundError as err:
        if err.name not in SIM_EXTRA:
            raise
        print(
            f"kuscale {args.command}: error: it needs {err.name}, which the agent's install "
            "leaves out: pip install 'kuscale[sim]'",
            file=sys.stderr,
        )
        return 2
    except (CliError, ConfigError, BackendError, InvalidSpec, StateDirError, OSError) as err:
        print(f"kuscale {args.command}: error: {err}", file=sys.stderr)
        return 2
