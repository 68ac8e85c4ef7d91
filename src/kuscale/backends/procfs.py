"""Which cgroup a process is in, from `/proc/<pid>/cgroup`: what the NVML backend needs to
charge a GPU process to its pod, and what the Kubernetes resolver falls back on.

A v2 path is relative to the reader's cgroup namespace. The agent's container has its own
namespace where the runtime gives it one (containerd's default on cgroup v2): there its own
cgroup reads `/`, another pod's process reads `/../../burstable/pod<uid>/<id>`, and the node's
tree it mounted from the host shows in mountinfo with a root of `/../../..`. The namespace's
root is then found once, as the cgroup that many levels below the mount that holds this
process, and every path read is mapped under it, so it names the same cgroup on the node."""

from __future__ import annotations

import posixpath
from pathlib import Path

from kuscale.backends.base import BackendError


class ProcessCgroupError(BackendError):
    """A process's cgroup cannot be read, or its line names no usable cgroup."""


_namespace_roots: dict[Path, str | None] = {}


def cgroup_of_process(pid: int, mode: str, proc: Path = Path("/proc")) -> str:
    """The cgroup of a process in the CPU hierarchy (`mode` as the backend names it),
    relative to its root, from `/proc/<pid>/cgroup` (`ID:controllers:path`; v2: `0::path`)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError as err:
        raise ProcessCgroupError(f"cannot read /proc/{pid}/cgroup: {err.strerror}") from None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if mode == "cgroup-v1" and "cpu" in controllers.split(","):
            relative = _inside(path.strip().lstrip("/"))
        elif mode == "cgroup-v2" and hierarchy == "0" and not controllers:
            relative = _on_the_node(path.strip(), proc)
        else:
            continue
        if relative is None:
            break
        return relative
    raise ProcessCgroupError(f"process {pid} has no usable {mode} cpu line in /proc/{pid}/cgroup")


def _inside(relative: str) -> str | None:
    """The path itself where it names a cgroup below the root and climbs nowhere."""
    return relative if relative and ".." not in relative.split("/") else None


def _on_the_node(path: str, proc: Path) -> str | None:
    """A v2 path as this process's namespace shows it, as a path under the node's root."""
    root = namespace_root(proc)
    if not root:
        return _inside(path.lstrip("/"))
    joined = posixpath.normpath(posixpath.join(root, path.lstrip("/")))
    return _inside(joined) if not joined.startswith("..") else None


def namespace_root(proc: Path = Path("/proc")) -> str | None:
    """Where this process's cgroup namespace starts under the mounted v2 hierarchy ('' where
    the namespace is the node's; None where it cannot be told); found once per process."""
    if proc not in _namespace_roots:
        _namespace_roots[proc] = _find_namespace_root(proc)
    return _namespace_roots[proc]


def _find_namespace_root(proc: Path) -> str | None:
    """From the v2 mounts this process sees (the last one mounted at a place is the one that
    shows there): one whose root climbs above the namespace is the node's tree."""
    try:
        mountinfo = (proc / "self" / "mountinfo").read_text()
        own = int((proc / "self").readlink().name)
    except (OSError, ValueError):
        return ""
    visible: dict[str, str] = {}
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) >= 5 and tail.startswith("cgroup2 "):
            visible[fields[4].encode().decode("unicode_escape")] = fields[3]
    for mountpoint, root in visible.items():
        steps = root.strip("/").split("/")
        if set(steps) == {".."}:
            return _holding(Path(mountpoint), len(steps), own)
    return ""


def _holding(mount: Path, depth: int, pid: int) -> str | None:
    """The cgroup `depth` levels below `mount` whose cgroup.procs lists `pid`."""
    for candidate in mount.glob("/".join(["*"] * depth)):
        try:
            if str(pid) in (candidate / "cgroup.procs").read_text().split():
                return candidate.relative_to(mount).as_posix()
        except OSError:
            continue
    return None
