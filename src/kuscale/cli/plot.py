"""`kuscale plot`: usage, limit and estimate over time, drawn from an agent's recording."""

from __future__ import annotations

import argparse
from pathlib import Path

from kuscale.cli.shared import CliError, SubParsers


def add_parser(sub: SubParsers) -> None:
    plot = sub.add_parser("plot", help="draw usage, limit and estimate from a recording")
    plot.set_defaults(handler=cmd_plot)
    plot.add_argument("recording", type=Path)
    plot.add_argument("--out", type=Path, required=True, help="PNG file to write")


def cmd_plot(args: argparse.Namespace) -> int:
    from kuscale.plotting import plot_timeline
    from kuscale.record import RecordingError, read_recording

    try:
        rows = read_recording(args.recording)
    except RecordingError as err:
        raise CliError(str(err)) from None
    plot_timeline(rows, args.out, f"kuscale recording · {args.recording.name}")
    print(f"plot written to {args.out}")
    return 0
