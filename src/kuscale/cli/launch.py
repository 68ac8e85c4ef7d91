"""`kuscale launch`: run a command in a cgroup a local agent manages."""

from __future__ import annotations

import argparse
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

from kuscale.cli.shared import CliError, SubParsers, pod_name, positive_int
from kuscale.model import InvalidSpec, validate_pod_name


def add_parser(sub: SubParsers) -> None:
    launch = sub.add_parser("launch", help="run a command in a cgroup the agent manages")
    launch.set_defaults(handler=cmd_launch)
    launch.add_argument("--state-dir", type=Path, required=True)
    launch.add_argument("--tokens", type=positive_int, required=True)
    launch.add_argument("--name", type=pod_name)
    launch.add_argument("--gpu", action="store_true", help="give it a vGPU on the GPU layer")
    launch.add_argument("--cgroup-parent", default="kuscale")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")


def _default_name(command: Sequence[str]) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", Path(command[0]).name.lower()).strip("-")[:50] or "pod"
    return f"{base}-{uuid.uuid4().hex[:6]}"


def cmd_launch(args: argparse.Namespace) -> int:
    from kuscale.backends.cgroup import detect
    from kuscale.local.launch import exec_in_cgroup, prepare
    from kuscale.local.statedir import StateDir

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise CliError("no command: use `kuscale launch ... -- COMMAND ARGS...`")
    try:
        validate_pod_name(args.cgroup_parent)
    except InvalidSpec as err:
        raise CliError(f"--cgroup-parent: {err}") from None
    state = StateDir(args.state_dir).ensure()
    cgroups = detect()
    name = args.name or _default_name(command)
    spec = prepare(state, cgroups, args.cgroup_parent, name, args.tokens, args.gpu, command)
    exec_in_cgroup(state, cgroups, spec, command)
