"""`kuscale agent`: the node agent, on this machine's workloads or on a kubelet's pods."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kuscale.cli.shared import (
    KUBERNETES_RECORD_DIR,
    CliError,
    SubParsers,
    add_agent_options,
    add_kubelet_path,
    agent_config,
    node_tokens,
    record_dir,
)
from kuscale.originals import OriginalsRecord, RecordBusy, RecordError

if TYPE_CHECKING:
    from kuscale.exporter import MetricsExporter
    from kuscale.kubernetes.agent import KubernetesAgent

log = logging.getLogger("kuscale")
HANDOVER_POLL = 0.1
"""Seconds between a waiting agent's tries at the record (each try itself lasts 0.5 s)."""


def add_parser(sub: SubParsers) -> None:
    agent = sub.add_parser("agent", help="run the node agent")
    agent.set_defaults(handler=cmd_agent)
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
    add_agent_options(agent)


def _add_kubelet_options(agent: argparse.ArgumentParser) -> None:
    """Where `agent --kubernetes` finds the kubelet and the API server."""
    agent.add_argument("--kubeconfig", type=Path, help="default: the in-cluster account")
    add_kubelet_path(agent, "--kubelet-dir")
    add_kubelet_path(agent, "--pod-resources-socket")
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


def _kubernetes_api(args: argparse.Namespace) -> Any:
    """The API server's client, made before anything waits: bad settings fail at once."""
    from kubernetes.config import ConfigException

    from kuscale.kubernetes.apiserver import core_api

    if args.tokens is not None and args.tokens < 0:
        raise CliError(f"--tokens must be 0 or more, got {args.tokens}")
    try:
        return core_api(args.kubeconfig)
    except ConfigException as err:
        raise CliError(f"no Kubernetes credentials: {err}") from None


def _kubernetes_agent(
    args: argparse.Namespace,
    config: Any,
    core: Any,
    listeners: list[Callable[[dict[str, Any]], None]],
    record: OriginalsRecord,
) -> KubernetesAgent:
    from kuscale.kubernetes.agent import KubeletPaths, KubernetesAgent

    layer = config.gpu_layer
    gpus = layer.gpus if layer.kind == "vgpu" else 0
    tokens = args.tokens if args.tokens is not None else node_tokens(config, gpus)
    return KubernetesAgent(
        config,
        core,
        args.node_name,
        tokens or None,
        KubeletPaths(args.kubelet_dir, args.pod_resources_socket),
        listeners=listeners,
        resize=args.actuator == "resize",
        originals=record,
    )


def _locked_record(args: argparse.Namespace) -> OriginalsRecord:
    """The record of originals, held by this agent until it exits."""
    record = OriginalsRecord(record_dir(args))
    try:
        record.lock()
    except RecordError as err:
        raise CliError(str(err)) from None
    return record


def _handed_over_record(
    args: argparse.Namespace, exporter: MetricsExporter, stopping: threading.Event
) -> OriginalsRecord | None:
    """The record of originals, once the agent before this one has given it back: a rolling
    update starts the new pod beside the old one (maxSurge), and the new agent waits, healthy
    and ready, until the DaemonSet controller stops the old pod and its agent gives every
    limit back; then it takes the record and adopts the pods at once. None: stopped while
    waiting."""
    record = OriginalsRecord(record_dir(args))
    while not stopping.is_set():
        try:
            record.lock()
        except RecordBusy as err:
            if exporter.collector.waiting is None:
                log.info("%s: waiting until it gives the record back", err)
                exporter.collector.waiting = f"waiting for the agent before this one ({err})"
            stopping.wait(HANDOVER_POLL)
            continue
        except RecordError as err:
            raise CliError(str(err)) from None
        if exporter.collector.waiting is not None:
            log.info("took the record over from the agent before this one")
            exporter.collector.waiting = None
        return record
    return None


def _serve_metrics(exporter: MetricsExporter, address: str) -> None:
    """/metrics and /healthz from the start, so a probe sees an agent waiting its turn."""
    from kuscale.exporter import AddressError

    if not address:
        return
    try:
        host, port = exporter.serve(address)
        log.info("metrics on http://%s:%d/metrics, health on /healthz", host, port)
    except (AddressError, OSError) as err:
        log.error("metrics are off: cannot serve on %s: %s", address, err)


def cmd_agent(args: argparse.Namespace) -> int:
    from kuscale.backends.files import allow_open_files
    from kuscale.exporter import MetricsExporter
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
    config = agent_config(args)
    log.info(
        "up to %d files open (the tick keeps each pod's cgroup files open)", allow_open_files()
    )
    exporter = MetricsExporter(args.node_name)
    listeners: list[Callable[[dict[str, Any]], None]] = [exporter.on_tick]
    recorder = None
    if args.record:
        recorder = TickRecorder(args.record, int(args.record_max_mb * 2**20))
        listeners.append(recorder)
    _serve_metrics(exporter, args.metrics_address)
    stopping = threading.Event()
    agent: LocalAgent | KubernetesAgent | None = None

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stopping.set()
        if agent is not None:
            agent.monitor.submit(Stop())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if args.kubernetes:
            core = _kubernetes_api(args)
            record = _handed_over_record(args, exporter, stopping)
            if record is None:
                return 0
            agent = _kubernetes_agent(args, config, core, listeners, record)
        else:
            agent = LocalAgent(
                StateDir(args.state_dir),
                config,
                gpus=args.gpus,
                gpu_root=args.gpu_root,
                listeners=listeners,
                originals=_locked_record(args),
            )
        if stopping.is_set():
            agent.monitor.submit(Stop())
        log.info(
            "agent running on node %s: %s through the %s actuator, policy %s, period %.3g s%s",
            args.node_name,
            agent.cgroups.mode,
            agent.monitor.actuator.mode,
            config.policy,
            config.period,
            " (monitor only)" if config.monitor_only else "",
        )
        agent.run()
    finally:
        exporter.close()
        if recorder is not None:
            recorder.close()
    return 0
