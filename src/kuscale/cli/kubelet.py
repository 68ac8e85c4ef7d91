"""The commands that speak to a kubelet or read its cgroups: `deviceplugin`, `token-pods`
and `pod-cgroups`."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from kuscale.cli.shared import (
    CliError,
    SubParsers,
    add_kubelet_path,
    node_tokens,
)
from kuscale.config import load_config

log = logging.getLogger("kuscale")


def add_parsers(sub: SubParsers) -> None:
    _add_deviceplugin_parser(sub)
    _add_token_pods_parser(sub)
    _add_pod_cgroups_parser(sub)


def _add_deviceplugin_parser(sub: SubParsers) -> None:
    plugin = sub.add_parser("deviceplugin", help="advertise the node's tokens to the kubelet")
    plugin.set_defaults(handler=cmd_deviceplugin)
    add_kubelet_path(plugin, "--kubelet-dir")
    plugin.add_argument(
        "--tokens",
        type=int,
        help="tokens to advertise (default: what the node's cores and --gpus cost)",
    )
    plugin.add_argument("--gpus", type=int, default=0, help="GPUs on this node, for the default")
    plugin.add_argument("--config", type=Path, help="TOML configuration file (for the prices)")


def _add_token_pods_parser(sub: SubParsers) -> None:
    token_pods = sub.add_parser(
        "token-pods", help="the pods on this node the kubelet gave tokens, and how many"
    )
    token_pods.set_defaults(handler=cmd_token_pods)
    add_kubelet_path(token_pods, "--pod-resources-socket")
    token_pods.add_argument("--node", help="also ask the API server for this node's pods")
    token_pods.add_argument(
        "--kubeconfig", type=Path, help="with --node (default: the in-cluster account)"
    )


def _add_pod_cgroups_parser(sub: SubParsers) -> None:
    pod_cgroups = sub.add_parser(
        "pod-cgroups",
        help="where a Kubernetes pod's cgroups are, as the agent resolves them",
    )
    pod_cgroups.set_defaults(handler=cmd_pod_cgroups)
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


def cmd_deviceplugin(args: argparse.Namespace) -> int:
    from kuscale.deviceplugin.plugin import DevicePluginServer, TokenPlugin

    if args.gpus < 0:
        raise CliError("--gpus must be 0 or more")
    if args.tokens is not None and args.tokens <= 0:
        raise CliError(f"--tokens must be a positive integer, got {args.tokens}")
    if not args.kubelet_dir.is_dir():
        raise CliError(f"{args.kubelet_dir} is not a directory (is the kubelet's mounted?)")
    tokens = args.tokens or node_tokens(load_config(args.config, {}), args.gpus)
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
