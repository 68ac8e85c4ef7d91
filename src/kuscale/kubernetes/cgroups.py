"""Where a Kubernetes pod's cgroups are, from what the API server says of it.

The kubelet names a pod's cgroup from its QoS class and UID, and the runtime names each
container's cgroup from its ID (DESIGN.md §5; the kubelet's cgroupfs and systemd cgroup
managers, and the naming containerd, CRI-O and Docker use under each driver):

- cgroupfs: pod `kubepods/burstable/pod<uid>`; container `<id>` for containerd and Docker,
  `crio-<id>` for CRI-O;
- systemd: pod `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice`
  with the UID's `-` as `_`; container `cri-containerd-<id>.scope`, `crio-<id>.scope` or
  `docker-<id>.scope`.

Guaranteed pods sit directly under `kubepods` (`kubepods-pod<uid>.slice`), BestEffort ones
under `besteffort`. The paths are the same under cgroup v1 and v2; only the hierarchy's root
differs, which the CPU backend already knows. Where a name cannot be derived (an unknown
runtime, a layout nobody documented), `/proc/<pid>/cgroup` of one of the pod's processes
says where it is. Every path resolved here ends in a pod or container leaf: the QoS slices
belong to the kubelet and are never returned, so never written.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kuscale.backends.base import BackendError, CpuBackend
from kuscale.backends.procfs import ProcessCgroupError, cgroup_of_process

log = logging.getLogger(__name__)


class ResolutionError(Exception):
    """A pod's cgroups cannot be found from what is known of it; the caller skips the pod."""


class Driver(StrEnum):
    CGROUPFS = "cgroupfs"
    SYSTEMD = "systemd"


class QosClass(StrEnum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


class Runtime(StrEnum):
    CONTAINERD = "containerd"
    CRIO = "cri-o"
    DOCKER = "docker"


_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_QOS_PARENT = {
    QosClass.GUARANTEED: "",
    QosClass.BURSTABLE: "burstable",
    QosClass.BEST_EFFORT: "besteffort",
}
_CGROUPFS_PREFIX = {Runtime.CONTAINERD: "", Runtime.CRIO: "crio-", Runtime.DOCKER: ""}
_SYSTEMD_PREFIX = {
    Runtime.CONTAINERD: "cri-containerd-",
    Runtime.CRIO: "crio-",
    Runtime.DOCKER: "docker-",
}
_POD_LEAF = re.compile(
    r"pod[0-9a-f-]{36}|kubepods(-burstable|-besteffort)?-pod[0-9a-f_]{36}\.slice"
)


def parse_uid(uid: str) -> str:
    """A pod UID as the API server gives it: a lower-case UUID, nothing a path could abuse."""
    if not _UID.fullmatch(uid):
        raise ResolutionError(f"pod UID {uid!r} is not a UUID")
    return uid


def parse_qos(value: str) -> QosClass:
    try:
        return QosClass(value)
    except ValueError:
        raise ResolutionError(f"unknown QoS class {value!r}") from None


def parse_container_id(value: str) -> tuple[Runtime, str]:
    """`containerd://<64 hex>` as in a pod's `status.containerStatuses[].containerID`."""
    scheme, sep, digest = value.partition("://")
    if not sep:
        raise ResolutionError(f"container ID {value!r} has no runtime scheme")
    try:
        runtime = Runtime(scheme)
    except ValueError:
        raise ResolutionError(f"container ID {value!r} is from an unknown runtime") from None
    if not _CONTAINER_ID.fullmatch(digest):
        raise ResolutionError(f"container ID {value!r} is not 64 hex digits")
    return runtime, digest


def pod_cgroup(uid: str, qos: QosClass, driver: Driver) -> str:
    """The pod's cgroup, relative to the CPU hierarchy's root."""
    parent = _QOS_PARENT[qos]
    if driver is Driver.CGROUPFS:
        return "/".join(part for part in ("kubepods", parent, f"pod{uid}") if part)
    unit = uid.replace("-", "_")
    if not parent:
        return f"kubepods.slice/kubepods-pod{unit}.slice"
    return f"kubepods.slice/kubepods-{parent}.slice/kubepods-{parent}-pod{unit}.slice"


def container_cgroup(pod: str, runtime: Runtime, digest: str, driver: Driver) -> str:
    if driver is Driver.CGROUPFS:
        return f"{pod}/{_CGROUPFS_PREFIX[runtime]}{digest}"
    return f"{pod}/{_SYSTEMD_PREFIX[runtime]}{digest}.scope"


def detect_driver(tree: CpuBackend) -> Driver:
    """The kubelet's cgroup driver, from the top of the hierarchy it made."""
    if tree.exists("kubepods.slice"):
        return Driver.SYSTEMD
    if tree.exists("kubepods"):
        return Driver.CGROUPFS
    raise ResolutionError("neither kubepods.slice nor kubepods is in the cgroup hierarchy")


@dataclass(frozen=True, slots=True)
class PodCgroups:
    """A pod's own cgroup and its containers' leaves, relative to the hierarchy's root."""

    pod: str
    containers: tuple[str, ...]

    def write_order(self, raising: bool) -> tuple[str, ...]:
        """On cgroup v1 a child's quota may not exceed its parent's: raise the pod before its
        containers, lower the containers before the pod."""
        if raising:
            return (self.pod, *self.containers)
        return (*self.containers, self.pod)


def resolve(
    tree: CpuBackend, uid: str, qos: str, container_ids: list[str], driver: Driver
) -> PodCgroups:
    """The pod's cgroups as the kubelet and runtime named them; containers whose cgroup does
    not exist (not started yet, or a runtime's layout that differs) are left out, logged."""
    pod = pod_cgroup(parse_uid(uid), parse_qos(qos), driver)
    if not _exists(tree, pod):
        raise ResolutionError(f"pod {uid}: no cgroup {pod}")
    containers = []
    for value in container_ids:
        runtime, digest = parse_container_id(value)
        path = container_cgroup(pod, runtime, digest, driver)
        if _exists(tree, path):
            containers.append(path)
        else:
            log.info("pod %s: container cgroup %s not found; skipped", uid, path)
    return PodCgroups(pod, tuple(containers))


def resolve_from_process(tree: CpuBackend, pid: int, proc: Path = Path("/proc")) -> PodCgroups:
    """The fallback: a container process's cgroup is a leaf under its pod's cgroup."""
    try:
        leaf = cgroup_of_process(pid, tree.mode, proc)
    except ProcessCgroupError as err:
        raise ResolutionError(str(err)) from None
    pod, _, _ = leaf.rpartition("/")
    if not _POD_LEAF.fullmatch(pod.rpartition("/")[2]):
        raise ResolutionError(f"process {pid} is in {leaf}, not in a pod's container cgroup")
    if not _exists(tree, leaf):
        raise ResolutionError(f"process {pid}: {leaf} is not in the cgroup hierarchy")
    return PodCgroups(pod, (leaf,))


def _exists(tree: CpuBackend, cgroup: str) -> bool:
    try:
        return tree.exists(cgroup)
    except BackendError as err:
        raise ResolutionError(str(err)) from None
