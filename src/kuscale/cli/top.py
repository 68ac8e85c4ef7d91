"""`kuscale top`: a live view of every pod, from a local state dir or a remote /metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kuscale.cli.shared import CliError, SubParsers, seconds


def add_parser(sub: SubParsers) -> None:
    top = sub.add_parser("top", help="a live view of every pod")
    top.set_defaults(handler=cmd_top)
    where = top.add_mutually_exclusive_group(required=True)
    where.add_argument("--state-dir", type=Path, help="a local agent's state dir")
    where.add_argument("--url", help="a remote agent's metrics URL, e.g. http://node:9091")
    top.add_argument("--sort", choices=("cpu", "gpu", "tokens", "queue", "name"), default="cpu")
    top.add_argument("--interval", type=seconds, help="refresh (default: the agent's period)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")


def cmd_top(args: argparse.Namespace) -> int:
    from kuscale.top import MetricsSource, Source, StateDirSource, TopError, run_top

    source: Source = StateDirSource(args.state_dir) if args.state_dir else MetricsSource(args.url)
    try:
        run_top(source, args.sort, args.once, args.interval, Console())
    except TopError as err:
        raise CliError(str(err)) from None
    return 0
