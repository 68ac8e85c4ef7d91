"""What more than one command uses: the error a user can fix, argument types, the agent's
options and configuration, where the record lives, and the console reports print to."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, TypeAlias

from rich.console import Console

from kuscale.config import POLICY_NAMES, load_config
from kuscale.kubernetes import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET
from kuscale.local.statedir import StateDir
from kuscale.model import InvalidSpec, validate_pod_name, validate_tokens

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""Where each command module adds its parser."""

KUBERNETES_RECORD_DIR = Path("/var/lib/kuscale/originals")


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def positive_int(text: str) -> int:
    try:
        return validate_tokens(int(text))
    except (ValueError, InvalidSpec):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive {what}")
    return value


def seconds(text: str) -> float:
    return _positive(text, "number of seconds")


def milliseconds(text: str) -> float:
    return _positive(text, "number of milliseconds")


def pod_name(text: str) -> str:
    try:
        return validate_pod_name(text)
    except InvalidSpec as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def record_dir(args: argparse.Namespace) -> Path:
    if args.record_dir is not None:
        return Path(args.record_dir)
    if getattr(args, "state_dir", None) is not None:
        return StateDir(args.state_dir).originals
    return KUBERNETES_RECORD_DIR


KUBELET_PATHS = {
    "--kubelet-dir": (
        DEVICE_PLUGIN_DIR,
        "the kubelet's device-plugin directory (its kubelet.sock is there)",
    ),
    "--pod-resources-socket": (POD_RESOURCES_SOCKET, "the kubelet's pod-resources API"),
}
"""Where the commands that speak to a kubelet find it: option → (default, help)."""


def add_kubelet_path(parser: argparse.ArgumentParser, option: str) -> None:
    default, help_text = KUBELET_PATHS[option]
    parser.add_argument(option, type=Path, default=default, help=help_text)


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--period", type=seconds, help="seconds between decisions")
    parser.add_argument("--policy", choices=POLICY_NAMES, help="allocation rule")
    parser.add_argument(
        "--monitor-only",
        action="store_true",
        default=None,
        help="measure and export, write no limit",
    )


def agent_config(args: argparse.Namespace, **extra: Any) -> Any:
    """The configuration file with the options of `add_agent_options` laid over it."""
    overrides = {
        "period": args.period,
        "policy": args.policy,
        "monitor_only": args.monitor_only,
        **extra,
    }
    return load_config(args.config, overrides)


def node_tokens(config: Any, gpus: int) -> int:
    """The tokens a node advertises by default: what its cores and GPUs cost."""
    from kuscale.backends.cgroup import node_cpu_capacity
    from kuscale.deviceplugin.plugin import node_tokens as tokens_for

    prices = config.policy_config.prices()
    return tokens_for(node_cpu_capacity() / 100.0, gpus, float(prices[0]), float(prices[1]))


def report_console() -> Console:
    """The terminal's width on a terminal; elsewhere (a log, CI) wide enough for the tables,
    which rich would otherwise squeeze into 80 columns and cut."""
    console = Console()
    return console if console.is_terminal else Console(width=160)
