"""Reading the counters of many cgroups at once into arrays, and writing their limits.

The monitor samples every ready pod each tick, reads every pod's throttle count several
times between ticks, and writes the limits that changed. A backend that can answer for all
of them at once (the simulator, from its own arrays; the kernel trees, through paths
resolved once) offers `cgroup_set`; any other is read one cgroup at a time. Failures are per
cgroup: the others' values stand. The watch reads every GPU pod's busy time at every look
in the same way: `busy_set` where the GPU backend answers for all at once, else one client
at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from kuscale.backends.base import BackendError, CpuBackend, GpuBackend
from kuscale.model import CpuCounters

Counts = NDArray[np.int64]
Handle = TypeVar("Handle")
T = TypeVar("T")
Failures = dict[int, BackendError]
"""Position in the request → why that cgroup could not be read; its values are 0."""
Positions = Sequence[int] | NDArray[np.int64]
"""Which cgroups of a set to ask, by their place in it, in any order."""
Limits = Sequence[float] | NDArray[np.float64]
"""A limit in percent per cgroup asked."""


@dataclass(frozen=True, slots=True)
class CounterArrays:
    """Cumulative CPU counters, one entry per cgroup asked for, in the order asked."""

    usage_ns: Counts
    nr_periods: Counts
    nr_throttled: Counts
    failed: Failures
    throttled_ns: Counts | None = None
    """Time throttled in ns, summed over CPUs; None where the reader does not give it."""


class CgroupSet(Protocol):
    """A fixed list of cgroups whose counters are read together; `which` picks positions
    in that list, and every answer follows its order."""

    def read(self, which: Positions) -> CounterArrays: ...

    def read_throttled(self, which: Positions) -> tuple[Counts, Counts, Failures]:
        """nr_throttled and the time throttled in ns (summed over CPUs): the watch's one
        read per pod."""
        ...

    def empty(self, which: Positions) -> tuple[NDArray[np.bool_], Failures]:
        """True where no process is left in the cgroup (for cgroups kuscale made)."""
        ...

    def write_limits(self, which: Positions, limits: Limits) -> Failures:
        """Each cgroup's limit in percent, checked against the kernel's range first."""
        ...


@runtime_checkable
class BatchCpuBackend(Protocol):
    def cgroup_set(self, cgroups: Sequence[str]) -> CgroupSet: ...


class OneAtATime(Generic[Handle]):
    """A cgroup set answered one cgroup at a time, each through its handle: its name for any
    backend, or what a backend resolved once for it. A handle that is an error (a name that
    could not be resolved) fails alone, on every call."""

    def __init__(
        self,
        cgroups: Sequence[str],
        handles: Sequence[Handle | BackendError],
        read: Callable[[Handle], CpuCounters],
        read_throttled: Callable[[Handle], tuple[int, int]],
        write_limit: Callable[[Handle, float], None],
        is_empty: Callable[[str], bool],
    ) -> None:
        self.cgroups = list(cgroups)
        self.handles = list(handles)
        self._read = read
        self._read_throttled = read_throttled
        self._write_limit = write_limit
        self._is_empty = is_empty

    def _each(
        self, which: Positions, call: Callable[[Handle, int], T], failure: T
    ) -> tuple[list[T], Failures]:
        """`call` on each handle picked, with its position in `which`; its answers,
        `failure` where it failed."""
        answers: list[T] = []
        failed: Failures = {}
        handles = self.handles
        for i, index in enumerate(which):
            handle = handles[index]
            try:
                if isinstance(handle, BackendError):
                    raise handle
                answers.append(call(handle, i))
            except BackendError as err:
                failed[i] = err
                answers.append(failure)
        return answers, failed

    def read(self, which: Positions) -> CounterArrays:
        read = self._read
        answers, failed = self._each(which, lambda handle, _: read(handle), CpuCounters(0))
        return CounterArrays(
            counts([c.usage_ns for c in answers]),
            counts([c.nr_periods for c in answers]),
            counts([c.nr_throttled for c in answers]),
            failed,
            counts([c.throttled_ns for c in answers]),
        )

    def read_throttled(self, which: Positions) -> tuple[Counts, Counts, Failures]:
        read = self._read_throttled
        answers, failed = self._each(which, lambda handle, _: read(handle), (0, 0))
        return counts([a[0] for a in answers]), counts([a[1] for a in answers]), failed

    def empty(self, which: Positions) -> tuple[NDArray[np.bool_], Failures]:
        """Asked by name: the kernel keeps no counter of it, and the file is opened afresh."""
        is_empty, cgroups = self._is_empty, self.cgroups
        answers, failed = self._each(which, lambda _, i: is_empty(cgroups[which[i]]), False)
        return np.array(answers, dtype=np.bool_), failed

    def write_limits(self, which: Positions, limits: Limits) -> Failures:
        write = self._write_limit
        return self._each(which, lambda handle, i: write(handle, float(limits[i])), None)[1]


def each_cgroup(backend: CpuBackend, cgroups: Sequence[str]) -> OneAtATime[str]:
    """Any backend's cgroups, each asked by name."""
    return OneAtATime(
        cgroups,
        cgroups,
        backend.read,
        backend.read_throttled,
        backend.write_limit,
        backend.is_empty,
    )


def counts(values: list[int]) -> Counts:
    """Counters gathered in a list, as one array."""
    return np.array(values, dtype=np.int64)


def cgroup_set(backend: CpuBackend, cgroups: Sequence[str]) -> CgroupSet:
    """The backend's own batch reader and writer where it has one, else one cgroup at a
    time."""
    if isinstance(backend, BatchCpuBackend):
        return backend.cgroup_set(cgroups)
    return each_cgroup(backend, cgroups)


class BusySet(Protocol):
    """A fixed list of GPU clients whose busy time is read together."""

    def read(self, which: Positions) -> tuple[Counts, Failures]:
        """Cumulative busy ns of each client picked; 0 and a failure where it is gone."""
        ...


@runtime_checkable
class BatchGpuBackend(Protocol):
    def busy_set(self, vgpu_ids: Sequence[str]) -> BusySet: ...


class EachClient:
    """Any GPU backend's clients, each read by its id."""

    def __init__(self, backend: GpuBackend, vgpu_ids: Sequence[str]) -> None:
        self.backend = backend
        self.vgpu_ids = list(vgpu_ids)

    def read(self, which: Positions) -> tuple[Counts, Failures]:
        busy: list[int] = []
        failed: Failures = {}
        for i, index in enumerate(which):
            try:
                busy.append(self.backend.read(self.vgpu_ids[index]))
            except BackendError as err:
                failed[i] = err
                busy.append(0)
        return counts(busy), failed


def busy_set(backend: GpuBackend, vgpu_ids: Sequence[str]) -> BusySet:
    """The GPU backend's own batch reader where it has one, else one client at a time."""
    if isinstance(backend, BatchGpuBackend):
        return backend.busy_set(vgpu_ids)
    return EachClient(backend, vgpu_ids)
