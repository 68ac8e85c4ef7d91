"""Reading the counters of many cgroups at once into arrays, and writing their limits.

The monitor samples every ready pod each tick, reads every pod's throttle count several
times between ticks, and writes the limits that changed. A backend that can answer for all
of them at once (the simulator, from its own arrays; the kernel trees, through paths
resolved once) offers `cgroup_set`; any other is read one cgroup at a time. Failures are per
cgroup: the others' values stand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from kuscale.backends.base import BackendError, CpuBackend

Counts = NDArray[np.int64]
Failures = dict[int, BackendError]
"""Position in the request → why that cgroup could not be read; its values are 0."""


@dataclass(frozen=True, slots=True)
class CounterArrays:
    """Cumulative CPU counters, one entry per cgroup asked for, in the order asked."""

    usage_ns: Counts
    nr_periods: Counts
    nr_throttled: Counts
    failed: Failures


class CgroupSet(Protocol):
    """A fixed list of cgroups whose counters are read together; `which` picks positions
    in that list, and every answer follows its order."""

    def read(self, which: Sequence[int]) -> CounterArrays: ...

    def read_throttled(self, which: Sequence[int]) -> tuple[Counts, Failures]:
        """nr_throttled alone: the watch's one read per pod."""
        ...

    def empty(self, which: Sequence[int]) -> tuple[NDArray[np.bool_], Failures]:
        """True where no process is left in the cgroup (for cgroups kuscale made)."""
        ...

    def write_limits(self, which: Sequence[int], limits: Sequence[float]) -> Failures:
        """Each cgroup's limit in percent, checked against the kernel's range first."""
        ...


@runtime_checkable
class BatchCpuBackend(Protocol):
    def cgroup_set(self, cgroups: Sequence[str]) -> CgroupSet: ...


class EachCgroup:
    """Any backend's counters, read one cgroup at a time."""

    def __init__(self, backend: CpuBackend, cgroups: Sequence[str]) -> None:
        self.backend = backend
        self.cgroups = list(cgroups)

    def read(self, which: Sequence[int]) -> CounterArrays:
        usage, periods, throttled = [0] * len(which), [0] * len(which), [0] * len(which)
        failed: Failures = {}
        read, cgroups = self.backend.read, self.cgroups
        for i, index in enumerate(which):
            try:
                counters = read(cgroups[index])
            except BackendError as err:
                failed[i] = err
                continue
            usage[i], periods[i] = counters.usage_ns, counters.nr_periods
            throttled[i] = counters.nr_throttled
        return CounterArrays(counts(usage), counts(periods), counts(throttled), failed)

    def read_throttled(self, which: Sequence[int]) -> tuple[Counts, Failures]:
        values = [0] * len(which)
        failed: Failures = {}
        read, cgroups = self.backend.read_throttled, self.cgroups
        for i, index in enumerate(which):
            try:
                values[i] = read(cgroups[index])
            except BackendError as err:
                failed[i] = err
        return counts(values), failed

    def empty(self, which: Sequence[int]) -> tuple[NDArray[np.bool_], Failures]:
        return empty_each(self.backend.is_empty, self.cgroups, which)

    def write_limits(self, which: Sequence[int], limits: Sequence[float]) -> Failures:
        failed: Failures = {}
        for i, (index, limit) in enumerate(zip(which, limits, strict=True)):
            try:
                self.backend.write_limit(self.cgroups[index], limit)
            except BackendError as err:
                failed[i] = err
        return failed


def empty_each(
    is_empty: Callable[[str], bool], cgroups: Sequence[str], which: Sequence[int]
) -> tuple[NDArray[np.bool_], Failures]:
    """Whether each cgroup is empty, asked one at a time: the kernel keeps no counter of it."""
    answers = np.zeros(len(which), dtype=np.bool_)
    failed: Failures = {}
    for i, index in enumerate(which):
        try:
            answers[i] = is_empty(cgroups[index])
        except BackendError as err:
            failed[i] = err
    return answers, failed


def counts(values: list[int]) -> Counts:
    """Counters gathered in a list, as one array."""
    return np.array(values, dtype=np.int64)


def cgroup_set(backend: CpuBackend, cgroups: Sequence[str]) -> CgroupSet:
    """The backend's own batch reader and writer where it has one, else one cgroup at a
    time."""
    if isinstance(backend, BatchCpuBackend):
        return backend.cgroup_set(cgroups)
    return EachCgroup(backend, cgroups)
