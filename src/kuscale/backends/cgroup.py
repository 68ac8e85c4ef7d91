"""CPU backends over the kernel's cgroup files, v1 and v2, and the detection of which is here.

v1 keeps usage in the cpuacct hierarchy and quota/throttling in the cpu hierarchy (which may
be mounted together or apart); v2 keeps all of it in one directory.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kuscale.backends.base import BackendError, CounterError, RangeError
from kuscale.backends.batch import Counts
from kuscale.backends.files import (
    MAX_COUNTER,
    DescriptorCache,
    confine,
    parse_counts,
    parse_int,
    parse_key,
    parse_keyed,
    parse_keyed_many,
    read_text,
    write_text,
)
from kuscale.backends.kernelset import CgroupFiles, KernelCgroupSet
from kuscale.backends.pressure import Pressure, PressureTrigger, read_pressure
from kuscale.model import MAX_SHARES, MIN_SHARES, CpuCounters, is_decimal

MIN_QUOTA_US = 1000
MAX_QUOTA_US = (1 << 44) - 1
MIN_PERIOD_US = 1000
MAX_PERIOD_US = 1_000_000
DEFAULT_PERIOD_US = 100_000


def node_cpu_capacity() -> float:
    """Cores this agent's cpuset allows, in percent."""
    return float(len(os.sched_getaffinity(0)) * 100)


def limit_to_quota(limit: float, period_us: int) -> int:
    """quota_us = L / 100 × period_us, refused when outside what the kernel accepts."""
    if not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
        raise RangeError(f"CFS period {period_us} µs is outside [{MIN_PERIOD_US}, {MAX_PERIOD_US}]")
    if not math.isfinite(limit):
        raise RangeError(f"limit {limit} is not a finite number")
    quota = round(limit / 100.0 * period_us)
    if not MIN_QUOTA_US <= quota <= MAX_QUOTA_US:
        raise RangeError(f"limit {limit:.3f}% gives quota {quota} µs, outside the kernel's range")
    return quota


def quota_to_limit(quota_us: int, period_us: int) -> float | None:
    """The limit a quota gives; a period the kernel would never hold is refused (a file
    with garbage), never divided by."""
    if not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
        raise RangeError(f"CFS period {period_us} µs is outside [{MIN_PERIOD_US}, {MAX_PERIOD_US}]")
    if quota_us < 0:
        return None
    return quota_us * 100.0 / period_us


PERIOD_CACHE_SIZE = 65536
MAX_USAGE_USEC = MAX_COUNTER // 1000
"""v2 counts usage in µs, kept in ns: a larger count is garbage."""


class _CgroupTree:
    """Shared by v1 and v2: cgroup directories under one or two roots.

    The CFS period of each cgroup is read once and remembered for reading limits: kuscale
    owns the quota, not the period. A v1 quota is written against the period read afresh
    through a kept descriptor (a pread), so a period another writer changed never turns the
    quota into a different limit; v2 writes quota and period together.
    """

    mode = ""
    counter_roles: tuple[str, ...] = ()
    """The files a sample reads, in the order `counters_from` takes them."""
    throttled_key = ""
    """cpu.stat's time throttled, summed over CPUs, in `throttled_scale` ns."""
    throttled_scale = 1
    period_role = ""
    """The file a quota's period is read from afresh at each write; "" where the tree
    remembers the period."""

    def __init__(self, cpu_root: Path, usage_root: Path) -> None:
        self.cpu_root = cpu_root
        self.usage_root = usage_root
        self._cpu_dir = str(cpu_root)
        self._usage_dir = str(usage_root)
        self._capacity = node_cpu_capacity()
        self._periods: dict[str, int] = {}
        self.descriptors = DescriptorCache(truncate=not is_cgroup_mount(cpu_root))

    def _roots(self) -> tuple[Path, ...]:
        if self.cpu_root == self.usage_root:
            return (self.cpu_root,)
        return (self.cpu_root, self.usage_root)

    def capacity(self) -> float:
        return self._capacity

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(confine(self.cpu_root, cgroup))

    def is_empty(self, cgroup: str) -> bool:
        """Opened afresh each time: v1 keeps a pid list per open file, so a pread repeats it."""
        return not read_text(confine(self.cpu_root, cgroup) + "/cgroup.procs").strip()

    def create(self, cgroup: str) -> None:
        """Make the cgroup in every hierarchy this backend reads, parents included."""
        for root in self._roots():
            try:
                os.makedirs(confine(root, cgroup), exist_ok=True)
            except OSError as err:
                raise BackendError(f"cannot create cgroup {cgroup} under {root}: {err}") from err

    def attach(self, cgroup: str, pid: int) -> None:
        for root in self._roots():
            write_text(confine(root, cgroup) + "/cgroup.procs", str(pid))

    def forget(self, cgroup: str) -> None:
        """Nothing was opened for a path `confine` refuses, so there is nothing to close."""
        self._periods.pop(cgroup, None)
        for root in self._roots():
            with contextlib.suppress(BackendError):
                self.descriptors.forget(confine(root, cgroup))

    def remove(self, cgroup: str) -> None:
        """Remove an empty cgroup; one already gone is fine."""
        self._periods.pop(cgroup, None)
        for root in self._roots():
            self.descriptors.forget(confine(root, cgroup))
            try:
                os.rmdir(confine(root, cgroup))
            except FileNotFoundError:
                continue
            except OSError as err:
                raise BackendError(f"cannot remove cgroup {cgroup} under {root}: {err}") from err

    def files_of(self, cgroup: str) -> CgroupFiles:
        """The cgroup's files a tick touches, confined under the roots."""
        raise NotImplementedError

    def sample(self, files: CgroupFiles) -> CpuCounters:
        raise NotImplementedError

    def write_quota(self, files: CgroupFiles, limit: float | None) -> None:
        raise NotImplementedError

    def read(self, cgroup: str) -> CpuCounters:
        return self.sample(self.files_of(cgroup))

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        self.write_quota(self.files_of(cgroup), limit)

    def read_throttled(self, cgroup: str) -> tuple[int, int]:
        return self.throttled(self.files_of(cgroup))

    def throttled(self, files: CgroupFiles) -> tuple[int, int]:
        """nr_throttled and the time throttled in ns from cpu.stat, through the descriptor
        the tick keeps open: the watch between ticks reads this one file per pod."""
        text = self.descriptors.read(files.stat)
        throttled = parse_key(text, self.throttled_key, files.stat) * self.throttled_scale
        return parse_key(text, "nr_throttled", files.stat), throttled

    def cgroup_set(self, cgroups: Sequence[str]) -> KernelCgroupSet:
        """The tick's reads and writes of many cgroups, through descriptors kept open."""
        return KernelCgroupSet(self, cgroups)

    def counters_from(self, texts: list[list[bytes]]) -> tuple[Counts, ...] | None:
        raise NotImplementedError

    def quota_texts(self, quotas: Counts, periods: Counts) -> list[bytes]:
        raise NotImplementedError

    def known_period(self, files: CgroupFiles) -> int:
        return self._period(files.cgroup)

    def quotas(self, limits: NDArray[np.float64], periods: NDArray[np.int64]) -> NDArray[np.int64]:
        """`limit_to_quota` of many limits; -1 where it would refuse one."""
        with np.errstate(invalid="ignore", over="ignore"):
            quotas = np.rint(limits / 100.0 * periods)
            fits = (
                np.isfinite(quotas)
                & (periods >= MIN_PERIOD_US)
                & (periods <= MAX_PERIOD_US)
                & (quotas >= MIN_QUOTA_US)
                & (quotas <= MAX_QUOTA_US)
            )
        return np.where(fits, quotas, -1).astype(np.int64)

    def _read_period(self, cgroup: str) -> int:
        raise NotImplementedError

    def _period(self, cgroup: str) -> int:
        period = self._periods.get(cgroup)
        if period is None:
            if len(self._periods) >= PERIOD_CACHE_SIZE:
                self._periods.clear()
            period = self._periods[cgroup] = self._read_period(cgroup)
        return period


class CgroupV1(_CgroupTree):
    mode = "cgroup-v1"
    counter_roles = ("usage", "stat")
    period_role = "period"
    throttled_key = "throttled_time"
    throttled_scale = 1

    def counters_from(self, texts: list[list[bytes]]) -> tuple[Counts, ...] | None:
        usage = parse_counts(texts[0])
        stat = parse_keyed_many(texts[1], (b"nr_periods", b"nr_throttled", b"throttled_time"))
        return None if usage is None or stat is None else (usage, *stat)

    def quota_texts(self, quotas: Counts, periods: Counts) -> list[bytes]:
        return [b"%d" % quota for quota in quotas.tolist()]

    def files_of(self, cgroup: str) -> CgroupFiles:
        cpu = confine(self._cpu_dir, cgroup)
        return CgroupFiles(
            cgroup=cgroup,
            stat=cpu + "/cpu.stat",
            usage=confine(self._usage_dir, cgroup) + "/cpuacct.usage",
            quota=cpu + "/cpu.cfs_quota_us",
            period=cpu + "/cpu.cfs_period_us",
        )

    def sample(self, files: CgroupFiles) -> CpuCounters:
        usage = parse_int(self.descriptors.read(files.usage), files.usage)
        stat = parse_keyed(self.descriptors.read(files.stat), files.stat)
        return CpuCounters(
            usage_ns=usage,
            nr_periods=stat.get("nr_periods", 0),
            nr_throttled=stat.get("nr_throttled", 0),
            throttled_ns=stat.get("throttled_time", 0),
        )

    def _read_period(self, cgroup: str) -> int:
        path = confine(self.cpu_root, cgroup) + "/cpu.cfs_period_us"
        return parse_int(read_text(path), path)

    def read_limit(self, cgroup: str) -> float | None:
        path = confine(self.cpu_root, cgroup) + "/cpu.cfs_quota_us"
        text = read_text(path).strip()
        try:
            quota = int(text)
        except ValueError as err:
            raise BackendError(f"{path} holds {text[:40]!r}, not a quota") from err
        self._periods.pop(cgroup, None)
        return quota_to_limit(quota, self._period(cgroup))

    def write_quota(self, files: CgroupFiles, limit: float | None) -> None:
        """Against the period read afresh through a kept descriptor: cpu.cfs_period_us is a
        file of its own, which another writer may change."""
        if limit is None:
            value = "-1"
        else:
            period = parse_int(self.descriptors.read(files.period), files.period)
            value = str(limit_to_quota(limit, period))
        self.descriptors.write(files.quota, value)

    def read_shares(self, cgroup: str) -> int:
        path = confine(self.cpu_root, cgroup) + "/cpu.shares"
        return parse_int(read_text(path), path)

    def write_shares(self, cgroup: str, shares: int) -> None:
        if not MIN_SHARES <= shares <= MAX_SHARES:
            raise RangeError(f"cpu.shares {shares} is outside [{MIN_SHARES}, {MAX_SHARES}]")
        write_text(confine(self.cpu_root, cgroup) + "/cpu.shares", str(shares))


class CgroupV2(_CgroupTree):
    mode = "cgroup-v2"
    counter_roles = ("stat",)
    period_role = ""
    throttled_key = "throttled_usec"
    throttled_scale = 1000

    def counters_from(self, texts: list[list[bytes]]) -> tuple[Counts, ...] | None:
        stat = texts[0]
        if not stat or b"usage_usec" not in stat[0].split()[0::2]:
            return None
        keys = (b"usage_usec", b"nr_periods", b"nr_throttled", b"throttled_usec")
        values = parse_keyed_many(stat, keys)
        if (
            values is None
            or (values[0] > MAX_USAGE_USEC).any()
            or (values[3] > MAX_USAGE_USEC).any()
        ):
            return None
        return values[0] * 1000, values[1], values[2], values[3] * 1000

    def quota_texts(self, quotas: Counts, periods: Counts) -> list[bytes]:
        return [b"%d %d" % pair for pair in zip(quotas.tolist(), periods.tolist(), strict=True)]

    def create(self, cgroup: str) -> None:
        """v2 gives a child the cpu files only when every ancestor delegates the controller."""
        parts = cgroup.split("/")
        for depth in range(1, len(parts) + 1):
            parent = (
                confine(self.cpu_root, "/".join(parts[: depth - 1]))
                if depth > 1
                else (str(self.cpu_root))
            )
            write_text(parent + "/cgroup.subtree_control", "+cpu")
            super().create("/".join(parts[:depth]))

    def files_of(self, cgroup: str) -> CgroupFiles:
        cpu = confine(self._cpu_dir, cgroup)
        return CgroupFiles(cgroup=cgroup, stat=cpu + "/cpu.stat", quota=cpu + "/cpu.max")

    def sample(self, files: CgroupFiles) -> CpuCounters:
        path = files.stat
        stat = parse_keyed(self.descriptors.read(path), path)
        if "usage_usec" not in stat:
            raise BackendError(f"{path} has no usage_usec")
        if stat["usage_usec"] > MAX_USAGE_USEC:
            raise CounterError(f"{path}: usage_usec is past any counter the kernel keeps")
        return CpuCounters(
            usage_ns=stat["usage_usec"] * 1000,
            nr_periods=stat.get("nr_periods", 0),
            nr_throttled=stat.get("nr_throttled", 0),
            throttled_ns=stat.get("throttled_usec", 0) * 1000,
        )

    def _cpu_max(self, cgroup: str) -> tuple[int, int]:
        """cpu.max as (quota µs or -1 for max, period µs)."""
        path = confine(self.cpu_root, cgroup) + "/cpu.max"
        fields = read_text(path).split()
        if (
            len(fields) != 2
            or not is_decimal(fields[1])
            or not (fields[0] == "max" or is_decimal(fields[0]))
        ):
            raise BackendError(
                f"{path} holds {' '.join(fields)[:40]!r}, not '<quota|max> <period>'"
            )
        quota = -1 if fields[0] == "max" else int(fields[0])
        return quota, int(fields[1])

    def _read_period(self, cgroup: str) -> int:
        return self._cpu_max(cgroup)[1]

    def read_limit(self, cgroup: str) -> float | None:
        quota, period = self._cpu_max(cgroup)
        self._periods[cgroup] = period
        return quota_to_limit(quota, period)

    def read_shares(self, cgroup: str) -> int:
        path = confine(self.cpu_root, cgroup) + "/cpu.weight"
        return weight_to_shares(parse_int(read_text(path), path))

    def write_shares(self, cgroup: str, shares: int) -> None:
        if not MIN_SHARES <= shares <= MAX_SHARES:
            raise RangeError(f"cpu.shares {shares} is outside [{MIN_SHARES}, {MAX_SHARES}]")
        write_text(confine(self.cpu_root, cgroup) + "/cpu.weight", str(shares_to_weight(shares)))

    def write_quota(self, files: CgroupFiles, limit: float | None) -> None:
        period = self._period(files.cgroup)
        quota = "max" if limit is None else str(limit_to_quota(limit, period))
        self.descriptors.write(files.quota, f"{quota} {period}")

    def read_pressure(self, cgroup: str) -> Pressure:
        return read_pressure(confine(self._cpu_dir, cgroup) + "/cpu.pressure")

    def pressure_trigger(self, cgroup: str, stall_us: int, window_us: int) -> PressureTrigger:
        """A trigger that fires when the cgroup's tasks stall `stall_us` in `window_us`."""
        return PressureTrigger(
            confine(self._cpu_dir, cgroup) + "/cpu.pressure", stall_us, window_us
        )


def shares_to_weight(shares: int) -> int:
    """v1 cpu.shares to v2 cpu.weight, the kubelet's mapping of [2, 262144] onto [1, 10000]."""
    return 1 + (shares - MIN_SHARES) * 9999 // (MAX_SHARES - MIN_SHARES)


def weight_to_shares(weight: int) -> int:
    """The fewest shares `shares_to_weight` maps back to `weight`, rounding up: rounded down,
    a weight read, recorded as shares and given back came back one lower (100 as 99)."""
    return MIN_SHARES - (-(weight - 1) * (MAX_SHARES - MIN_SHARES) // 9999)


@dataclass(frozen=True, slots=True)
class Mount:
    path: Path
    fstype: str
    options: frozenset[str]


def read_mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Mount]:
    """Cgroup mounts from mountinfo: `... mountpoint ... - fstype source superoptions`."""
    mounts = []
    for line in mountinfo.read_text().splitlines():
        head, sep, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(tail_fields) < 3:
            continue
        if tail_fields[0] in ("cgroup", "cgroup2"):
            path = Path(fields[4].encode().decode("unicode_escape"))
            mounts.append(Mount(path, tail_fields[0], frozenset(tail_fields[2].split(","))))
    return mounts


def is_cgroup_mount(path: Path) -> bool:
    """True when `path` is where a cgroup filesystem is mounted (not a fixture tree)."""
    try:
        return any(m.path == path for m in read_mounts())
    except OSError:
        return False


def detect(mounts: list[Mount] | None = None) -> CgroupV1 | CgroupV2:
    """Pick the hierarchy that has the cpu controller: v1 if mounted there, else v2."""
    mounts = read_mounts() if mounts is None else mounts
    v1_cpu = next((m.path for m in mounts if m.fstype == "cgroup" and "cpu" in m.options), None)
    v1_acct = next(
        (m.path for m in mounts if m.fstype == "cgroup" and "cpuacct" in m.options), None
    )
    if v1_cpu and v1_acct:
        return CgroupV1(v1_cpu, v1_acct)
    for mount in mounts:
        if mount.fstype != "cgroup2":
            continue
        try:
            controllers = (mount.path / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in controllers:
            return CgroupV2(mount.path, mount.path)
    raise BackendError("no cgroup hierarchy with the cpu controller is mounted")
