"""`kuscale restore`: the operator's escape hatch after a crash or an uninstall."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kuscale import faults
from kuscale.actuators.base import CpuActuator
from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.base import BackendError, CpuBackend, GpuBackend
from kuscale.cli.shared import CliError, SubParsers, record_dir
from kuscale.config import load_config
from kuscale.local.statedir import StateDir
from kuscale.model import Original
from kuscale.originals import OriginalsRecord, RecordError

if TYPE_CHECKING:
    from kuscale.actuators.resize import ResizeActuator


def add_parser(sub: SubParsers) -> None:
    restore = sub.add_parser(
        "restore", help="give back everything an agent recorded, with no agent running"
    )
    restore.set_defaults(handler=cmd_restore)
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


def cmd_restore(args: argparse.Namespace) -> int:
    """Every recorded pod gets back what it had, straight from the record, the way the agent
    held it; refused while an agent holds the record."""
    from kuscale.backends.cgroup import detect
    from kuscale.backends.vgpu import VgpuLayer

    directory = record_dir(args)
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
    with record.launches_held():
        failed = _give_back_every_entry(record, actuators, cgroups, gpu)
        record.unlock()  # inside the launch lock: a launch after this sees no agent
    return 1 if failed else 0


def _give_back_every_entry(
    record: OriginalsRecord,
    actuators: RestoreActuators,
    cgroups: CpuBackend,
    gpu: GpuBackend | None,
) -> int:
    """Each entry given back and dropped, or left with the reason; how many were left."""
    from kuscale.originals import give_back

    failed = 0
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
    return failed


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
