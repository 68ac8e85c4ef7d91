"""`kuscale status`: every pod a local agent manages, from the status it writes each tick."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kuscale.cli.shared import CliError, SubParsers

STALE_PERIODS = 3
"""Periods without a new status after which the agent is said to be maybe stopped."""


def add_parser(sub: SubParsers) -> None:
    status = sub.add_parser("status", help="show every pod the local agent manages")
    status.set_defaults(handler=cmd_status)
    status.add_argument("--state-dir", type=Path, required=True)
    status.add_argument("--json", action="store_true")


def cmd_status(args: argparse.Namespace) -> int:
    from kuscale.local.statedir import StateDir
    from kuscale.views import status_lines

    state = StateDir(args.state_dir)
    snapshot = state.read_status()
    if snapshot is None:
        raise CliError(
            f"no agent has written a status in {args.state_dir} "
            f"(start one with `kuscale agent --local --state-dir {args.state_dir}`)"
        )
    try:
        age = time.time() - float(snapshot.get("time", 0))
        snapshot["age_seconds"] = age
        snapshot["stale"] = age > STALE_PERIODS * float(snapshot.get("period", 1.0))
        lines = status_lines(snapshot)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CliError(f"{state.status} holds a status kuscale cannot show: {err!r}") from None
    if args.json:
        print(json.dumps(snapshot, indent=2))
        return 0
    if snapshot["stale"]:
        print(f"warning: the agent has not written a status for {age:.1f} s; it may be stopped")
    print("\n".join(lines))
    return 0
