"""The interface between the monitor and whatever carries a pod's CPU limit to the kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kuscale.backends.batch import CgroupSet
from kuscale.model import Held, PodSpec


class CpuActuator(Protocol):
    mode: str

    def inspect(self, spec: PodSpec) -> Held:
        """What the pod has now, read without changing anything. Raises when the pod cannot
        be managed this way."""
        ...

    def hold(self, spec: PodSpec, held: Held) -> None:
        """Take the pod over, `held` being what it had before kuscale (read by `inspect`,
        or recorded by an agent before this one): make its own limit the one that binds.
        Raises having changed nothing when that fails part way."""
        ...

    def quantize(self, held: Held, limit: float) -> float:
        """The limit the pod would hold if asked for `limit` (percent): rounding and the
        API's rules may make it differ, and the pod is charged for what it holds."""
        ...

    def cgroup_set(self, cgroups: Sequence[str]) -> CgroupSet | None:
        """Where a pod's limit is its own cgroup's quota, held exactly as asked: a writer for
        many pods' cgroups at once, and the monitor quantizes nothing. None where each pod
        is written (and quantized) on its own."""
        ...

    def write(self, spec: PodSpec, held: Held, limit: float) -> None:
        """Ask for `limit`; the pod then holds what `quantize` says of the same `limit`."""
        ...

    def release(self, spec: PodSpec, held: Held) -> None:
        """Give back what `hold` found, in the order the kernel accepts."""
        ...
