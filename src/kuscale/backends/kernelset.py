"""The kernel trees' cgroup set: a tick's reads and writes at the speed of the system calls.

Per file kept open, one pread or pwrite in a tight pass over the set, and the answers of
all cgroups parsed at once. The checked path (one cgroup at a time, through the tree's
descriptor cache, with its retries and its errors) answers for any cgroup whose call failed
or whose file held what the kernel does not write, so every failure and every piece of
garbage is told exactly as when cgroups are asked one by one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
from numpy.typing import NDArray

from kuscale.backends.base import BackendError
from kuscale.backends.batch import (
    CounterArrays,
    Counts,
    Failures,
    Limits,
    OneAtATime,
    Positions,
    counts,
)
from kuscale.backends.files import DescriptorCache, parse_counts, parse_keyed_many
from kuscale.model import CpuCounters

BUFFER = 4096
"""Bytes read per file: every cpu.stat, cpuacct.usage and period file is far shorter."""

RESERVE_MARGIN = 256
"""Descriptors kept beyond a set's own, for the one-cgroup calls between its passes."""

Texts = list[bytes | None]
"""One file's contents per cgroup asked; None where the call failed."""


@dataclass(frozen=True, slots=True)
class CgroupFiles:
    """The files of one cgroup a tick reads and writes, resolved and confined once."""

    cgroup: str
    stat: str
    quota: str
    usage: str = ""
    """v1's cpuacct.usage; v2 keeps usage in cpu.stat."""
    period: str = ""
    """v1's cpu.cfs_period_us; v2 writes the period with the quota in cpu.max."""


class KernelTree(Protocol):
    """What the set needs of a cgroup tree: its descriptors, its checked one-cgroup calls,
    and how its files are laid out."""

    descriptors: DescriptorCache
    counter_roles: tuple[str, ...]
    """The files a sample reads, in the order `counters_from` takes them."""
    period_role: str
    """The file a quota's period is read from afresh at each write, or "" where the tree
    remembers the period."""

    def files_of(self, cgroup: str) -> CgroupFiles: ...

    def sample(self, files: CgroupFiles) -> CpuCounters: ...

    throttled_key: str
    throttled_scale: int

    def throttled(self, files: CgroupFiles) -> tuple[int, int]: ...

    def write_quota(self, files: CgroupFiles, limit: float | None) -> None: ...

    def is_empty(self, cgroup: str) -> bool: ...

    def counters_from(self, texts: list[list[bytes]]) -> tuple[Counts, ...] | None:
        """usage_ns, nr_periods, nr_throttled and the time throttled in ns of every cgroup,
        from its files' contents in `counter_roles` order; None where any is not what the
        kernel writes."""
        ...

    def known_period(self, files: CgroupFiles) -> int:
        """The period the tree remembers (where it has no file of its own)."""
        ...

    def quotas(self, limits: NDArray[np.float64], periods: Counts) -> NDArray[np.int64]:
        """Each limit's quota, or -1 where the kernel would refuse it."""
        ...

    def quota_texts(self, quotas: Counts, periods: Counts) -> list[bytes]:
        """What the quota file takes, for each quota and the period it was made for."""
        ...


class KernelCgroupSet:
    """A fixed list of cgroups of one kernel tree (see the module's docstring)."""

    def __init__(self, tree: KernelTree, cgroups: Sequence[str]) -> None:
        handles: list[CgroupFiles | BackendError] = []
        for cgroup in cgroups:
            try:
                handles.append(tree.files_of(cgroup))
            except BackendError as err:
                handles.append(err)
        self.tree = tree
        self.handles = handles
        self.checked = OneAtATime(
            cgroups, handles, tree.sample, tree.throttled, tree.write_quota, tree.is_empty
        )
        self._generation = -1
        self._fds: dict[str, list[int]] = {}
        self._every = list(range(len(handles)))
        files_read = len(tree.counter_roles) + bool(tree.period_role)
        tree.descriptors.reserve(len(handles) * files_read + RESERVE_MARGIN)

    def _descriptors(self, role: str, writing: bool = False) -> list[int]:
        """The role's descriptor per cgroup, -1 where none could be opened (the checked
        path then says why); taken again from the cache once it closed any, since a closed
        number soon names another file. A cache that closes descriptors while they are
        being taken (it holds fewer than the set needs) is not trusted with this call:
        every cgroup then goes by the checked path."""
        cache = self.tree.descriptors
        for _ in range(2):
            if cache.generation != self._generation:
                self._fds.clear()
                self._generation = cache.generation
            fds = self._fds.get(role)
            if fds is not None:
                return fds
            fds = [self._open(handle, role, writing) for handle in self.handles]
            if cache.generation == self._generation:
                self._fds[role] = fds
                return fds
        return [-1] * len(self.handles)

    def _open(self, handle: CgroupFiles | BackendError, role: str, writing: bool) -> int:
        if isinstance(handle, BackendError):
            return -1
        path: str = getattr(handle, role)
        cache = self.tree.descriptors
        try:
            return cache.writer(path) if writing else cache.reader(path)
        except BackendError:
            return -1

    def _read_all(self, role: str, which: list[int]) -> tuple[Texts, bool]:
        """The role's file of each cgroup asked, and whether every call answered."""
        fds = self._asked_fds(self._descriptors(role), which)
        pread = os.pread
        try:
            return [pread(fd, BUFFER, 0) for fd in fds], True
        except OSError:
            texts = [_pread_or_none(fd) for fd in fds]
            return texts, None not in texts

    def _asked_fds(self, fds: list[int], asked: list[int]) -> list[int]:
        """The descriptors of the cgroups asked, in the order asked; a tick asks every
        cgroup in its order, which needs no gathering (checked by value: a gathered list
        costs three times the comparison)."""
        return fds if asked == self._every else list(map(fds.__getitem__, asked))

    def read(self, which: Positions) -> CounterArrays:
        asked = list(which)
        answers = [self._read_all(role, asked) for role in self.tree.counter_roles]
        texts = [role for role, _ in answers]
        if all(whole for _, whole in answers):
            values = self.tree.counters_from(cast(list[list[bytes]], texts))
            if values is not None:
                usage, periods, throttled, throttled_ns = values
                return CounterArrays(usage, periods, throttled, {}, throttled_ns)
        return self._read_apart(asked, texts)

    def _read_apart(self, asked: list[int], texts: list[Texts]) -> CounterArrays:
        """Some call failed, or some file holds what the kernel does not write. The
        cgroups whose calls answered are parsed together again (a gone cgroup among a
        thousand costs one call, not a thousand); where that fails too, each on its own;
        any that still does not answer is asked alone by the checked path, which says which
        cgroup and why."""
        columns = np.zeros((4, len(asked)), dtype=np.int64)
        answered = [i for i in range(len(asked)) if all(role[i] is not None for role in texts)]
        together = None
        if len(answered) < len(asked):
            together = self.tree.counters_from([_picked(role, answered) for role in texts])
        if together is not None:
            columns[:, answered] = together
            done = set(answered)
            apart = [i for i in range(len(asked)) if i not in done]
        else:
            apart = list(range(len(asked)))
        failed: Failures = {}
        for i in apart:
            own = [_picked(role, [i]) for role in texts]
            values = self.tree.counters_from(own) if all(own) else None
            if values is not None:
                columns[:, i] = [value[0] for value in values]
                continue
            alone = self.checked.read([asked[i]])
            assert alone.throttled_ns is not None
            columns[:, i] = (
                alone.usage_ns[0],
                alone.nr_periods[0],
                alone.nr_throttled[0],
                alone.throttled_ns[0],
            )
            if alone.failed:
                failed[i] = alone.failed[0]
        return CounterArrays(columns[0], columns[1], columns[2], failed, columns[3])

    def read_throttled(self, which: Positions) -> tuple[Counts, Counts, Failures]:
        asked = list(which)
        texts, whole = self._read_all("stat", asked)
        if whole:
            keys = (b"nr_throttled", self.tree.throttled_key.encode())
            values = parse_keyed_many(cast(list[bytes], texts), keys)
            if values is not None:
                return values[0], values[1] * self.tree.throttled_scale, {}
        return self.checked.read_throttled(asked)

    def empty(self, which: Positions) -> tuple[NDArray[np.bool_], Failures]:
        return self.checked.empty(which)

    def write_limits(self, which: Positions, limits: Limits) -> Failures:
        """Quotas the kernel would refuse, and writes that fail, go through the checked
        path, which refuses or retries them one by one."""
        asked = list(which)
        wanted = np.asarray(limits, dtype=np.float64)
        periods = self._periods(asked)
        quotas = self.tree.quotas(wanted, periods)
        refused = np.flatnonzero(quotas < 0).tolist()
        places = list(range(len(asked)))
        if refused:
            places = np.flatnonzero(quotas >= 0).tolist()
            quotas, periods = quotas[places], periods[places]
        fds = self._descriptors("quota", writing=True)
        texts = self.tree.quota_texts(quotas, periods)
        chosen = [asked[i] for i in places] if refused else asked
        unwritten = _unwritten(self._asked_fds(fds, chosen), texts, self._truncate)
        failed = sorted(refused + [places[i] for i in unwritten])
        if not failed:
            return {}
        failures = self.checked.write_limits(
            [asked[i] for i in failed], [float(wanted[i]) for i in failed]
        )
        return {failed[n]: err for n, err in failures.items()}

    def _periods(self, asked: list[int]) -> Counts:
        """Each cgroup's CFS period: read afresh where the tree keeps it in a file of its
        own, else what the tree remembers; 0 where it cannot be known here (the checked
        write then tries, and says why)."""
        role = self.tree.period_role
        if not role:
            return counts([self._known_period(index) for index in asked])
        texts, whole = self._read_all(role, asked)
        values = parse_counts(cast(list[bytes], texts)) if whole else None
        return counts([_count_or_zero(text) for text in texts]) if values is None else values

    def _known_period(self, index: int) -> int:
        handle = self.handles[index]
        if isinstance(handle, BackendError):
            return 0
        try:
            return self.tree.known_period(handle)
        except BackendError:
            return 0

    @property
    def _truncate(self) -> bool:
        return self.tree.descriptors.truncate


def _unwritten(fds: list[int], texts: list[bytes], truncate: bool) -> list[int]:
    """Each text written whole at offset 0 of its file (and, in a fixture tree of regular
    files, the rest cut off, which the kernel's files do not need), in one tight pass; the
    places of those that failed, found on a second, careful pass when any did."""
    pwrite, ftruncate = os.pwrite, os.ftruncate
    try:
        if truncate:
            for fd, text in zip(fds, texts, strict=True):
                pwrite(fd, text, 0)
                ftruncate(fd, len(text))
        else:
            for fd, text in zip(fds, texts, strict=True):
                pwrite(fd, text, 0)
    except OSError:
        return [
            i
            for i, (fd, text) in enumerate(zip(fds, texts, strict=True))
            if not _written(fd, text, truncate)
        ]
    return []


def _written(fd: int, text: bytes, truncate: bool) -> bool:
    try:
        os.pwrite(fd, text, 0)
        if truncate:
            os.ftruncate(fd, len(text))
    except OSError:
        return False
    return True


def _picked(texts: Texts, places: list[int]) -> list[bytes]:
    """The answered texts at `places`."""
    return [text for i in places if (text := texts[i]) is not None]


def _pread_or_none(fd: int) -> bytes | None:
    try:
        return os.pread(fd, BUFFER, 0)
    except OSError:
        return None


def _count_or_zero(text: bytes | None) -> int:
    """One period file's counter; 0 where it failed or is garbage."""
    if text is None:
        return 0
    values = parse_counts([text])
    return 0 if values is None else int(values[0])
