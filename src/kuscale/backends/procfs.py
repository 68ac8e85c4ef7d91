"""Which cgroup a process is in, from `/proc/<pid>/cgroup`: what the NVML backend needs to
charge a GPU process to its pod, and what the Kubernetes resolver falls back on."""

from __future__ import annotations

from pathlib import Path

from kuscale.backends.base import BackendError


class ProcessCgroupError(BackendError):
    """A process's cgroup cannot be read, or its line names no usable cgroup."""


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
        cpu_v1 = mode == "cgroup-v1" and "cpu" in controllers.split(",")
        if cpu_v1 or (mode == "cgroup-v2" and hierarchy == "0" and not controllers):
            relative = path.strip().lstrip("/")
            if not relative or ".." in relative.split("/"):
                break
            return relative
    raise ProcessCgroupError(f"process {pid} has no usable {mode} cpu line in /proc/{pid}/cgroup")
