"""The `kuscale` command: agent, launch, status, demo, sim, and the helpers they start."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from kuscale.actuators.resize import ResizeActuator
    from kuscale.kubernetes.agent import KubernetesAgent

from kuscale import faults
from kuscale.actuators.base import CpuActuator
from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.base import BackendError, CpuBackend
from kuscale.config import POLICY_NAMES, ConfigError, load_config
from kuscale.kubernetes import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET
from kuscale.local.statedir import StateDir, StateDirError
from kuscale.logs import setup_logging
from kuscale.model import InvalidSpec, Original, validate_pod_name, validate_tokens
from kuscale.originals import OriginalsRecord, RecordError

log = logging.getLogger("kuscale")

STALE_PERIODS = 3


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        return validate_tokens(int(text))
    except (ValueError, InvalidSpec):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


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


def _pod_name(text: str) -> str:
    try:
        return validate_pod_name(text)
    except InvalidSpec as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _default_name(command: Sequence[str]) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", Path(command[0]).name.lower()).strip("-")[:50] or "pod"
    return f"{base}-{uuid.uuid4().hex[:6]}"


KUBERNETES_RECORD_DIR = Path("/var/lib/kuscale/originals")


def _record_dir(args: argparse.Namespace) -> Path:
    if args.record_dir is not None:
        return Path(args.record_dir)
    if getattr(args, "state_dir", None) is not None:
        return StateDir(args.state_dir).originals
    return KUBERNETES_RECORD_DIR


def _add_agent_parser(agent: argparse.ArgumentParser) -> None:
    mode = agent.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--local",
        action="store_true",
        help="manage workloads on this machine (the embedded default)",
    )
    mode.add_argument(
        "--kubernetes",
        action="store_true",
        help="manage the pods the kubelet gave kuscale.com/token, and advertise the tokens",
    )
    agent.add_argument("--state-dir", type=Path, help="local mode's state dir (required there)")
    agent.add_argument(
        "--record-dir",
        type=Path,
        help="where what every pod had before kuscale is recorded, for a restarted agent and "
        f"`kuscale restore` (default: STATE/originals locally, {KUBERNETES_RECORD_DIR} on "
        "Kubernetes, a hostPath)",
    )
    _add_kubelet_options(agent)
    agent.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="local mode: GPUs behind the vGPU layer (0: none); Kubernetes: [gpu_layer] gpus",
    )
    agent.add_argument("--gpu-root", type=Path, help="vGPU layer root (default STATE/vgpu)")
    agent.add_argument(
        "--metrics-address",
        default="127.0.0.1:9091",
        help="HOST:PORT for /metrics and /healthz ('' to turn off)",
    )
    agent.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="this node's name: the metrics' node label, and whose pods to manage "
        "(default: $NODE_NAME, as the DaemonSet sets it from the downward API, else the host)",
    )
    agent.add_argument("--record", type=Path, help="write every tick to this JSON-lines file")
    agent.add_argument(
        "--record-max-mb",
        type=float,
        default=64.0,
        help="rotate the recording past this size (keeps two files)",
    )
    _add_agent_options(agent)


def _add_kubelet_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubelet-dir",
        type=Path,
        default=DEVICE_PLUGIN_DIR,
        help="the kubelet's device-plugin directory (its kubelet.sock is there)",
    )


def _add_pod_resources_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=POD_RESOURCES_SOCKET,
        help="the kubelet's pod-resources API",
    )


def _add_kubelet_options(agent: argparse.ArgumentParser) -> None:
    """Where `agent --kubernetes` finds the kubelet and the API server."""
    agent.add_argument("--kubeconfig", type=Path, help="default: the in-cluster account")
    _add_kubelet_dir(agent)
    _add_pod_resources_socket(agent)
    agent.add_argument(
        "--tokens",
        type=int,
        help="tokens to advertise (default: what the node's capacity costs; 0: no device plugin)",
    )
    agent.add_argument(
        "--actuator",
        choices=("cgroup", "resize"),
        default="cgroup",
        help="how limits reach a pod: its cgroups directly (fast), or the pods/resize "
        "subresource (slower, visible in the pod's spec; --kubernetes only)",
    )


def _add_agent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--period", type=_seconds, help="seconds between decisions")
    parser.add_argument("--policy", choices=POLICY_NAMES, help="allocation rule")
    parser.add_argument(
        "--monitor-only",
        action="store_true",
        default=None,
        help="measure and export, write no limit",
    )


def _add_deviceplugin_parser(plugin: argparse.ArgumentParser) -> None:
    _add_kubelet_dir(plugin)
    plugin.add_argument(
        "--tokens",
        type=int,
        help="tokens to advertise (default: what the node's cores and --gpus cost)",
    )
    plugin.add_argument("--gpus", type=int, default=0, help="GPUs on this node, for the default")
    plugin.add_argument("--config", type=Path, help="TOML configuration file (for the prices)")


def _add_pod_cgroups_parser(pod_cgroups: argparse.ArgumentParser) -> None:
    which = pod_cgroups.add_mutually_exclusive_group(required=True)
    which.add_argument("--uid", help="the pod's UID (metadata.uid)")
    which.add_argument("--pid", type=int, help="a process of one of the pod's containers")
    pod_cgroups.add_argument("--qos", help="the pod's status.qosClass (with --uid)")
    pod_cgroups.add_argument(
        "--container-id",
        action="append",
        default=[],
        help="a status.containerStatuses[].containerID, e.g. containerd://<64 hex>; repeatable",
    )
    pod_cgroups.add_argument("--driver", choices=("auto", "systemd", "cgroupfs"), default="auto")
    pod_cgroups.add_argument(
        "--cgroup-root", type=Path, help="the CPU hierarchy's root (default: the mounted one)"
    )


def _add_kubernetes_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that speak to a kubelet or read its cgroups."""
    _add_deviceplugin_parser(
        sub.add_parser("deviceplugin", help="advertise the node's tokens to the kubelet")
    )
    token_pods = sub.add_parser(
        "token-pods", help="the pods on this node the kubelet gave tokens, and how many"
    )
    _add_pod_resources_socket(token_pods)
    token_pods.add_argument("--node", help="also ask the API server for this node's pods")
    token_pods.add_argument(
        "--kubeconfig", type=Path, help="with --node (default: the in-cluster account)"
    )
    _add_pod_cgroups_parser(
        sub.add_parser(
            "pod-cgroups",
            help="where a Kubernetes pod's cgroups are, as the agent resolves them",
        )
    )


def _add_sim_parser(sim: argparse.ArgumentParser) -> None:
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
    sim.add_argument("--duration", type=_seconds, help="replace the scenario's duration")
    sim.add_argument(
        "--gpu-layer",
        choices=("vgpu", "gemini"),
        help="replace the scenario's GPU layer: vgpu (limits alone, as the original's module) "
        "or gemini (REQUEST from tokens first, then work-conserving up to LIMIT)",
    )
    sim.add_argument("--json", type=Path, help="write the metrics as JSON")
    sim.add_argument("--plot", type=Path, help="PNG of a few pods over time (one per policy)")
    sim.add_argument("--report", type=Path, help="directory for a Markdown report with plots")


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

    _add_agent_parser(sub.add_parser("agent", help="run the node agent"))

    launch = sub.add_parser("launch", help="run a command in a cgroup the agent manages")
    launch.add_argument("--state-dir", type=Path, required=True)
    launch.add_argument("--tokens", type=_positive_int, required=True)
    launch.add_argument("--name", type=_pod_name)
    launch.add_argument("--gpu", action="store_true", help="give it a vGPU on the GPU layer")
    launch.add_argument("--cgroup-parent", default="kuscale")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")

    restore = sub.add_parser(
        "restore", help="give back everything an agent recorded, with no agent running"
    )
    record = restore.add_mutually_exclusive_group(required=True)
    record.add_argument("--state-dir", type=Path, help="a local agent's state dir")
    record.add_argument("--record-dir", type=Path, help="a Kubernetes agent's record dir")
    restore.add_argument(
        "--config", type=Path, help="the agent's config ([gpu_layer] root, Kubernetes mode)"
    )
    restore.add_argument(
        "--kubeconfig",
        type=Path,
        help="for pods held through pods/resize (default: the in-cluster account)",
    )

    status = sub.add_parser("status", help="show every pod the local agent manages")
    status.add_argument("--state-dir", type=Path, required=True)
    status.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="run three workloads under the agent and summarise")
    demo.add_argument("--duration", type=_seconds, default=30.0)
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
    _add_agent_options(demo)

    top = sub.add_parser("top", help="a live view of every pod")
    where = top.add_mutually_exclusive_group(required=True)
    where.add_argument("--state-dir", type=Path, help="a local agent's state dir")
    where.add_argument("--url", help="a remote agent's metrics URL, e.g. http://node:9091")
    top.add_argument("--sort", choices=("cpu", "gpu", "tokens", "queue", "name"), default="cpu")
    top.add_argument("--interval", type=_seconds, help="refresh (default: the agent's period)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")

    plot = sub.add_parser("plot", help="draw usage, limit and estimate from a recording")
    plot.add_argument("recording", type=Path)
    plot.add_argument("--out", type=Path, required=True, help="PNG file to write")

    _add_sim_parser(sub.add_parser("sim", help="compare policies on a simulated node"))

    _add_kubernetes_parsers(sub)

    emulator = sub.add_parser("gpu-emulator", help="emulate shared GPUs for local mode")
    emulator.add_argument("--state-dir", type=Path, required=True)
    emulator.add_argument("--devices", type=_positive_int, default=1, help="GPUs to emulate")
    emulator.add_argument(
        "--no-enforce",
        action="store_true",
        help="be the GPU only: another layer (Gemini's scheduler) decides who launches",
    )

    workload = sub.add_parser("workload", help="a synthetic workload of known demand")
    workload.add_argument("--cpu", default="0:100", help="schedule SECONDS:PERCENT,...")
    workload.add_argument("--gpu", help="GPU schedule (needs `launch --gpu`)")
    workload.add_argument("--duration", type=_seconds, default=60.0)
    workload.add_argument(
        "--start-at",
        type=float,
        help="CLOCK_MONOTONIC second the schedule starts at (default: now)",
    )
    return parser


def _config(args: argparse.Namespace, **extra: Any) -> Any:
    overrides = {
        "period": args.period,
        "policy": args.policy,
        "monitor_only": args.monitor_only,
        **extra,
    }
    return load_config(args.config, overrides)


def _node_tokens(config: Any, gpus: int) -> int:
    """The tokens a node advertises by default: what its cores and GPUs cost."""
    from kuscale.backends.cgroup import node_cpu_capacity
    from kuscale.deviceplugin.plugin import node_tokens

    prices = config.policy_config.prices()
    return node_tokens(node_cpu_capacity() / 100.0, gpus, float(prices[0]), float(prices[1]))


def _kubernetes_agent(
    args: argparse.Namespace, config: Any, listeners: list[Callable[[dict[str, Any]], None]]
) -> KubernetesAgent:
    from kubernetes.config import ConfigException

    from kuscale.kubernetes.agent import KubeletPaths, KubernetesAgent
    from kuscale.kubernetes.apiserver import core_api

    if args.tokens is not None and args.tokens < 0:
        raise CliError(f"--tokens must be 0 or more, got {args.tokens}")
    layer = config.gpu_layer
    gpus = layer.gpus if layer.kind == "vgpu" else 0
    tokens = args.tokens if args.tokens is not None else _node_tokens(config, gpus)
    try:
        core = core_api(args.kubeconfig)
    except ConfigException as err:
        raise CliError(f"no Kubernetes credentials: {err}") from None
    return KubernetesAgent(
        config,
        core,
        args.node_name,
        tokens or None,
        KubeletPaths(args.kubelet_dir, args.pod_resources_socket),
        listeners=listeners,
        resize=args.actuator == "resize",
        originals=_locked_record(args),
    )


def _locked_record(args: argparse.Namespace) -> OriginalsRecord:
    """The record of originals, held by this agent until it exits."""
    record = OriginalsRecord(_record_dir(args))
    try:
        record.lock()
    except RecordError as err:
        raise CliError(str(err)) from None
    return record


def cmd_agent(args: argparse.Namespace) -> int:
    from kuscale.backends.files import allow_open_files
    from kuscale.exporter import AddressError, MetricsExporter
    from kuscale.local.agent import LocalAgent
    from kuscale.local.statedir import StateDir
    from kuscale.monitor import Stop
    from kuscale.record import TickRecorder

    if args.gpus < 0:
        raise CliError("--gpus must be 0 or more")
    if args.record_max_mb <= 0:
        raise CliError("--record-max-mb must be above 0")
    if args.local and args.state_dir is None:
        raise CliError("--local needs --state-dir")
    if args.local and args.actuator != "cgroup":
        raise CliError("--actuator resize needs --kubernetes: local workloads have no pod spec")
    config = _config(args)
    log.info(
        "up to %d files open (the tick keeps each pod's cgroup files open)", allow_open_files()
    )
    exporter = MetricsExporter(args.node_name)
    listeners: list[Callable[[dict[str, Any]], None]] = [exporter.on_tick]
    recorder = None
    if args.record:
        recorder = TickRecorder(args.record, int(args.record_max_mb * 2**20))
        listeners.append(recorder)
    agent: LocalAgent | KubernetesAgent
    if args.kubernetes:
        agent = _kubernetes_agent(args, config, listeners)
    else:
        agent = LocalAgent(
            StateDir(args.state_dir),
            config,
            gpus=args.gpus,
            gpu_root=args.gpu_root,
            listeners=listeners,
            originals=_locked_record(args),
        )
    if args.metrics_address:
        try:
            host, port = exporter.serve(args.metrics_address)
            log.info("metrics on http://%s:%d/metrics, health on /healthz", host, port)
        except (AddressError, OSError) as err:
            log.error("metrics are off: cannot serve on %s: %s", args.metrics_address, err)

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.monitor.submit(Stop())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "agent running on node %s: %s through the %s actuator, policy %s, period %.3g s%s",
        args.node_name,
        agent.cgroups.mode,
        agent.monitor.actuator.mode,
        config.policy,
        config.period,
        " (monitor only)" if config.monitor_only else "",
    )
    try:
        agent.run()
    finally:
        exporter.close()
        if recorder is not None:
            recorder.close()
    return 0


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


def cmd_restore(args: argparse.Namespace) -> int:
    """The operator's escape hatch after a crash or an uninstall: every recorded pod gets
    back what it had, straight from the record, the way the agent held it; refused while an
    agent holds the record."""
    from kuscale.backends.cgroup import detect
    from kuscale.backends.vgpu import VgpuLayer
    from kuscale.originals import give_back

    directory = _record_dir(args)
    record = OriginalsRecord(directory)
    if not directory.is_dir():
        print(f"nothing recorded in {directory}")
        return 0
    try:
        record.lock()
    except RecordError as err:
        raise CliError(f"{err}: stop it first (a clean stop gives everything back)") from None
    gpu_root = StateDir(args.state_dir).vgpu if args.state_dir is not None else None
    if args.config is not None:
        layer = load_config(args.config).gpu_layer
        gpu_root = Path(layer.root) if layer.kind == "vgpu" else None
    gpu = VgpuLayer(gpu_root) if gpu_root is not None and gpu_root.is_dir() else None
    cgroups = detect()
    actuators = RestoreActuators(cgroups, args.kubeconfig)
    failed = 0
    with record.launching():
        for original in record.entries():
            try:
                present = give_back(original, actuators.of(original), cgroups, gpu)
                faults.reached("restore.given_back")
                record.drop(original.key)
                faults.reached("restore.dropped")
            except (BackendError, RecordError, CliError) as err:
                failed += 1
                print(f"{original.key}: not given back: {err}", file=sys.stderr)
                continue
            if present:
                print(f"{original.key}: given back (cgroup {original.cgroup})")
            else:
                print(f"{original.key}: gone meanwhile, dropped from the record")
    return 1 if failed else 0


class RestoreActuators:
    """The actuator each entry was held by: the cgroups, or the API server's resize through
    the kubeconfig or the in-cluster account, connected once, when an entry first asks."""

    def __init__(self, cgroups: CpuBackend, kubeconfig: Path | None) -> None:
        self.cgroup = CgroupActuator(cgroups)
        self.kubeconfig = kubeconfig
        self._resize: ResizeActuator | CliError | None = None

    def of(self, original: Original) -> CpuActuator:
        if original.actuator == "cgroup":
            return self.cgroup
        if self._resize is None:
            self._resize = self._connect()
        if isinstance(self._resize, CliError):
            raise self._resize
        return self._resize

    def _connect(self) -> ResizeActuator | CliError:
        from kubernetes.config import ConfigException

        from kuscale.actuators.resize import ResizeActuator
        from kuscale.kubernetes.apiserver import core_api

        try:
            return ResizeActuator(core_api(self.kubeconfig))
        except ConfigException as err:
            return CliError(f"its limits were resized through the API server: {err}")


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


def report_console() -> Console:
    """The terminal's width on a terminal; elsewhere (a log, CI) wide enough for the tables,
    which rich would otherwise squeeze into 80 columns and cut."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def cmd_demo(args: argparse.Namespace) -> int:
    from kuscale.demo import run_demo
    from kuscale.local.gemini import GeminiRuntimeError

    if (args.gpu_layer == "gemini") != (args.gemini_bin is not None):
        raise CliError("--gpu-layer gemini and --gemini-bin DIR go together")
    config = _config(args, period=args.period or 0.5)
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


def cmd_deviceplugin(args: argparse.Namespace) -> int:
    from kuscale.deviceplugin.plugin import DevicePluginServer, TokenPlugin

    if args.gpus < 0:
        raise CliError("--gpus must be 0 or more")
    if args.tokens is not None and args.tokens <= 0:
        raise CliError(f"--tokens must be a positive integer, got {args.tokens}")
    if not args.kubelet_dir.is_dir():
        raise CliError(f"{args.kubelet_dir} is not a directory (is the kubelet's mounted?)")
    tokens = args.tokens or _node_tokens(load_config(args.config, {}), args.gpus)
    server = DevicePluginServer(TokenPlugin(tokens), args.kubelet_dir)
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stopped.set())
    server.start()
    log.info("serving %d tokens on %s", tokens, server.socket)
    stopped.wait()
    server.stop()
    return 0


def cmd_token_pods(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError
    from yaml import YAMLError

    from kuscale.kubernetes.apiserver import NodePods, core_api
    from kuscale.kubernetes.podresources import PodResourcesError, list_token_holders

    try:
        holders = list_token_holders(args.pod_resources_socket)
    except PodResourcesError as err:
        raise CliError(str(err)) from None
    if args.node is None:
        for holder in holders:
            containers = ",".join(holder.containers)
            print(f"{holder.namespace}/{holder.name}  {holder.tokens} tokens  ({containers})")
        return 0
    try:
        pods = NodePods(core_api(args.kubeconfig), args.node)
        pods.sync()
    except (ApiException, ConfigException, HTTPError, YAMLError, ValueError) as err:
        raise CliError(f"cannot list node {args.node}'s pods: {err}") from None
    for holder in holders:
        view = pods.get(holder.namespace, holder.name)
        known = f"uid {view.uid}  {view.qos}" if view else "unknown to the API server"
        print(f"{holder.namespace}/{holder.name}  {holder.tokens} tokens  {known}")
    return 0


def cmd_pod_cgroups(args: argparse.Namespace) -> int:
    from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
    from kuscale.kubernetes.cgroups import (
        Driver,
        ResolutionError,
        detect_driver,
        resolve,
        resolve_from_process,
    )

    root: Path | None = args.cgroup_root
    if root is None:
        tree: CgroupV1 | CgroupV2 = detect()
    elif (root / "cgroup.controllers").exists():
        tree = CgroupV2(root, root)
    else:
        tree = CgroupV1(root, root)
    try:
        if args.pid is not None:
            cgroups = resolve_from_process(tree, args.pid)
        elif args.qos is None:
            raise CliError("--uid needs --qos (the pod's status.qosClass)")
        else:
            driver = detect_driver(tree) if args.driver == "auto" else Driver(args.driver)
            cgroups = resolve(tree, args.uid, args.qos, args.container_id, driver)
    except ResolutionError as err:
        raise CliError(str(err)) from None
    print(f"pod        {tree.cpu_root}/{cgroups.pod}")
    for container in cgroups.containers:
        print(f"container  {tree.cpu_root}/{container}")
    return 0


def cmd_gpu_emulator(args: argparse.Namespace) -> int:
    from kuscale.gpuemu.emulator import GpuEmulator
    from kuscale.local.statedir import StateDir

    state = StateDir(args.state_dir).ensure()
    emulator = GpuEmulator(
        state.vgpu, state.gpu_socket, devices=args.devices, enforce=not args.no_enforce
    )

    async def serve_until_terminated() -> None:
        """SIGTERM cancels the server inside the loop, so every task ends in order."""
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await emulator.serve()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_until_terminated())
    return 0


def _unwind_on_sigterm() -> None:
    """SIGTERM unwinds the stack like Ctrl-C, so every `finally` gives back what it set."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def cmd_workload(args: argparse.Namespace) -> int:
    from kuscale.gpuemu.client import GpuClientError, from_environment
    from kuscale.gpuemu.gemini import GeminiError, gate_from_environment
    from kuscale.workload import Schedule, run

    try:
        cpu = Schedule.parse(args.cpu)
        gpu = Schedule.parse(args.gpu) if args.gpu else None
    except ValueError as err:
        raise CliError(str(err)) from None
    try:
        socket_path, vgpu_id, device = from_environment()
        gate = gate_from_environment() if gpu is not None else None
        run(cpu, gpu, args.duration, socket_path, vgpu_id, args.start_at, device, gate)
    except (GpuClientError, GeminiError, ValueError) as err:
        raise CliError(str(err)) from None
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from kuscale.top import MetricsSource, Source, StateDirSource, TopError, run_top

    source: Source = StateDirSource(args.state_dir) if args.state_dir else MetricsSource(args.url)
    try:
        run_top(source, args.sort, args.once, args.interval, Console())
    except TopError as err:
        raise CliError(str(err)) from None
    return 0


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


def _sim_scenario(args: argparse.Namespace) -> Any:
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

    scenario = _sim_scenario(args)
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


COMMANDS = {
    "agent": cmd_agent,
    "launch": cmd_launch,
    "status": cmd_status,
    "restore": cmd_restore,
    "demo": cmd_demo,
    "top": cmd_top,
    "plot": cmd_plot,
    "sim": cmd_sim,
    "deviceplugin": cmd_deviceplugin,
    "pod-cgroups": cmd_pod_cgroups,
    "token-pods": cmd_token_pods,
    "gpu-emulator": cmd_gpu_emulator,
    "workload": cmd_workload,
}


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
        base=1 if args.command in ("agent", "gpu-emulator", "deviceplugin") else 0,
    )
    try:
        arm_faults()
        return COMMANDS[args.command](args)
    except (CliError, ConfigError, BackendError, InvalidSpec, StateDirError, OSError) as err:
        print(f"kuscale {args.command}: error: {err}", file=sys.stderr)
        return 2
