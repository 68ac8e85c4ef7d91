"""The fast path: the pod's CPU limit written straight to its own cgroup.

A container's leaf keeps the quota the kubelet gave it from its `limits.cpu`, and under
cgroup v1 the kernel refuses a parent's quota below a child's (EINVAL): the pod could never
be lowered below its largest container's limit. Taking a pod over therefore lifts its
containers' quotas first (children before the parent on the way down), so the pod's quota is
the one that binds and its `cpu.stat` counts all of its throttling. Giving it back restores
the pod first and then its containers (the parent before its children on the way up).
"""

from __future__ import annotations

from collections.abc import Sequence

from kuscale.backends.base import BackendError, CgroupGone, CpuBackend
from kuscale.backends.batch import CgroupSet, cgroup_set
from kuscale.model import ContainerLimit, Held, PodSpec


class CgroupActuator:
    def __init__(self, cgroups: CpuBackend) -> None:
        self.cgroups = cgroups
        self.mode = "cgroup"

    def inspect(self, spec: PodSpec) -> Held:
        return Held(
            self.cgroups.read_limit(spec.cgroup),
            tuple(ContainerLimit(leaf, self.cgroups.read_limit(leaf)) for leaf in spec.containers),
        )

    def hold(self, spec: PodSpec, held: Held) -> None:
        lifted: list[ContainerLimit] = []
        try:
            for container in held.containers:
                if container.limit is not None:
                    self.cgroups.write_limit(container.name, None)
                    lifted.append(container)
        except BackendError:
            self._put_back(lifted)
            raise

    def quantize(self, held: Held, limit: float) -> float:
        return limit

    def cgroup_set(self, cgroups: Sequence[str]) -> CgroupSet:
        return cgroup_set(self.cgroups, cgroups)

    def write(self, spec: PodSpec, held: Held, limit: float) -> None:
        self.cgroups.write_limit(spec.cgroup, limit)

    def release(self, spec: PodSpec, held: Held) -> None:
        self.cgroups.write_limit(spec.cgroup, held.pod)
        self._put_back(held.containers)

    def _put_back(self, containers: Sequence[ContainerLimit]) -> None:
        """Every container that had a quota gets it back; one that has exited is passed."""
        failures = []
        for container in containers:
            if container.limit is None:
                continue
            try:
                self.cgroups.write_limit(container.name, container.limit)
            except CgroupGone:
                continue
            except BackendError as err:
                failures.append(str(err))
        if failures:
            raise BackendError("; ".join(failures))
