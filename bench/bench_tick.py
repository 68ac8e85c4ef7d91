"""One monitor tick (sample → decide → actuate → export) at 10, 110 and 1000 pods.

Pods live in cgroup v1 trees shaped like the kernel's, on tmpfs, so the cost measured is the
agent's own: file reads and writes, the policy, the snapshot. Between ticks (untimed) the
fixture plays the kernel: each pod's demand swings with its own phase, it gets at most its
quota, and the periods in which it wanted more count as throttled, so limits move and get
written. Taking turns with the ticks, the floor: the same tree's reads, and as many quota
writes as the tick made, bare, through kept descriptors. Ten pods are also measured on this
machine's real cgroups when they are writable.

Run with `make bench`; prints microseconds per pod per tick, the tick-to-floor ratios (also
with the policy's own time, measured inside the same ticks, taken out: what the rest of the
tick costs, whatever rule it runs), the Python work each pod adds beyond its kernel I/O
(between 110 and 1000 pods, so that fixed costs cancel) and resident memory.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.backends.vgpu import VgpuLayer
from kuscale.config import AgentConfig, PolicyConfig, ResourceConfig
from kuscale.model import PodSpec
from kuscale.monitor import Monitor, PodAdded
from kuscale.policy import Observation, make_policy
from kuscale.sim.run import TimedPolicy

PERIOD = 0.5


def make_tree(root: Path, pods: int) -> CgroupV1:
    for i in range(pods):
        cpu, acct = root / "cpu" / f"pod-{i}", root / "cpuacct" / f"pod-{i}"
        cpu.mkdir(parents=True)
        acct.mkdir(parents=True)
        (cpu / "cpu.cfs_quota_us").write_text("-1\n")
        (cpu / "cpu.cfs_period_us").write_text("100000\n")
        (cpu / "cpu.shares").write_text("1024\n")
        (cpu / "cpu.stat").write_text("nr_periods 0\nnr_throttled 0\nthrottled_time 0\n")
        (cpu / "cgroup.procs").write_text("")
        (acct / "cpuacct.usage").write_text("0\n")
    return CgroupV1(root / "cpu", root / "cpuacct")


CFS_PERIODS = round(PERIOD / 0.1)
"""The kernel's 100 ms CFS periods in one agent period."""


class FixtureKernel:
    """The counters a kernel would keep for the tree's pods, advanced between ticks."""

    def __init__(self, root: Path, pods: int) -> None:
        self.root = root
        self.pods = pods
        self.usage_ns = [0] * pods
        self.periods = 0
        self.throttled = [0] * pods
        self.quotas = [-1] * pods
        self.writes: list[int] = []
        """Per advance: the quotas the tick before it changed."""

    def advance(self, tick: int) -> None:
        """Each pod wants between 5 % and 95 % of a core, with its own phase; it gets at
        most its quota, and every CFS period is throttled while it wants more."""
        self.periods += CFS_PERIODS
        changed = 0
        for i in range(self.pods):
            quota = self._quota(i)
            changed += quota != self.quotas[i]
            self.quotas[i] = quota
            wanted = 50 + 45 * math.sin(tick / 20 + i)
            limit = math.inf if quota < 0 else quota / 1000
            if wanted > limit:
                self.throttled[i] += CFS_PERIODS
            self.usage_ns[i] += int(min(wanted, limit) / 100 * PERIOD * 1e9)
        self.writes.append(changed)
        self.rewrite()

    def rewrite(self) -> None:
        """The kernel's side of a period without its time passing: the same quota reads
        and counter writes as `advance`, which leave the caches as a tick finds them."""
        for i in range(self.pods):
            self._quota(i)
            (self.root / "cpuacct" / f"pod-{i}" / "cpuacct.usage").write_text(
                f"{self.usage_ns[i]}\n"
            )
            (self.root / "cpu" / f"pod-{i}" / "cpu.stat").write_text(
                f"nr_periods {self.periods}\nnr_throttled {self.throttled[i]}\nthrottled_time 0\n"
            )

    def _quota(self, pod: int) -> int:
        return int((self.root / "cpu" / f"pod-{pod}" / "cpu.cfs_quota_us").read_text())


class Floor:
    """The kernel I/O a tick cannot avoid, bare, on the same tree: per pod a pread of
    `cpuacct.usage` and of `cpu.stat`, and as many quotas written (a pwrite and, as a
    regular file must be, an ftruncate) as the tick wrote, through kept descriptors. The
    quotas written are those the files hold, so the tree's state does not change.

    Apart, timed in the same pass where the tick does it: the pread of
    `cpu.cfs_period_us` before each quota write, which kuscale does so that a period
    another writer changed never turns the quota into another limit. It is kernel I/O the
    tick does, not Python work, but not in the floor a tick is held to."""

    def __init__(self, root: Path, kernel: FixtureKernel) -> None:
        self.kernel = kernel
        pods = range(kernel.pods)
        self.reads = [
            os.open(root / tree / f"pod-{i}" / name, os.O_RDONLY)
            for i in pods
            for tree, name in (("cpuacct", "cpuacct.usage"), ("cpu", "cpu.stat"))
        ]
        self.quotas = [
            os.open(root / "cpu" / f"pod-{i}" / "cpu.cfs_quota_us", os.O_WRONLY) for i in pods
        ]
        self.periods = [
            os.open(root / "cpu" / f"pod-{i}" / "cpu.cfs_period_us", os.O_RDONLY) for i in pods
        ]

    def measure(self, writes: int) -> tuple[float, float]:
        """The floor's duration, and the period reads'."""
        values = [str(quota).encode() for quota in self.kernel.quotas[:writes]]
        started = time.perf_counter()
        for fd in self.reads:
            os.pread(fd, 4096, 0)
        read = time.perf_counter()
        for fd in self.periods[:writes]:
            os.pread(fd, 4096, 0)
        writing = time.perf_counter()
        for fd, value in zip(self.quotas, values, strict=False):
            os.pwrite(fd, value, 0)
            os.ftruncate(fd, len(value))
        done = time.perf_counter()
        return read - started + done - writing, writing - read

    def close(self) -> None:
        for fd in self.reads + self.quotas + self.periods:
            os.close(fd)


BENCH_CONFIG = AgentConfig(
    period=PERIOD,
    policy_config=PolicyConfig(
        cpu=ResourceConfig(price=1.0, min=1.0, overcommit=5.0),
        gpu=ResourceConfig(price=3.0, min=1.0),
        burst_factor=0.05,
        burst_seconds=600.0,
    ),
)
"""The default rule, with a 1 % CPU and GPU minimum (the kernel's 1 ms quota per 100 ms), a node
overcommitted 5x so that 1000 pods fit this 2-core machine's admission, and burst credit
(as in the shipped scenarios), so that limits follow each pod's swings and get written."""


def monitor_for(
    cgroups: CgroupV1 | CgroupV2,
    pods: int,
    prefix: str = "",
    policy: TimedPolicy | None = None,
    gpu: VgpuLayer | None = None,
) -> Monitor:
    """Every pod admitted and ticked once; with `gpu`, each holds a vGPU of that layer."""
    monitor = Monitor(cgroups, gpu, BENCH_CONFIG, policy=policy)
    for i in range(pods):
        vgpu_id = None
        if gpu is not None:
            vgpu_id = f"pod-{i}"
            gpu.create(vgpu_id)
        spec = PodSpec(
            name=f"pod-{i}", tokens=20 + i % 60, cgroup=f"{prefix}pod-{i}", vgpu_id=vgpu_id
        )
        monitor.submit(PodAdded(spec))
    monitor.tick(0.0)
    refused = len(monitor.registry.completed)
    if refused:
        raise SystemExit(f"{refused} of {pods} pods were refused; the benchmark needs them all")
    return monitor


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class FixtureRun(NamedTuple):
    """Per tick: its duration, its policy's share of it, its floor's duration and its period
    reads'; and the median number of quotas a tick wrote."""

    ticks: list[float]
    policy: list[float]
    floors: list[float]
    periods: list[float]
    writes: int


def bench_fixture(pods: int, ticks: int) -> FixtureRun:
    """Tick after tick on a fixture tree, each followed by its floor.

    Tick and floor take turns on the same tree, each right after the fixture kernel
    rewrote its counters: the kernel's writes leave the files' pages out of the CPU's
    caches, and a floor measured on a tree nobody writes reads them hot, at a third of the
    cost a tick pays."""
    root = Path(tempfile.mkdtemp(prefix="kuscale-bench-", dir="/dev/shm"))
    try:
        cgroups = make_tree(root, pods)
        policy = TimedPolicy(make_policy(BENCH_CONFIG.policy, BENCH_CONFIG.policy_config))
        monitor = monitor_for(cgroups, pods, policy=policy)
        kernel = FixtureKernel(root, pods)
        kernel.advance(0)
        floor = Floor(root, kernel)
        durations, deciding, floors, periods = [], [], [], []
        try:
            for tick in range(1, ticks + 1):
                decided = policy.seconds
                started = time.perf_counter()
                monitor.tick(tick * PERIOD)
                durations.append(time.perf_counter() - started)
                deciding.append(policy.seconds - decided)
                kernel.advance(tick)
                bare, period_reads = floor.measure(kernel.writes[-1])
                floors.append(bare)
                periods.append(period_reads)
                kernel.rewrite()
        finally:
            floor.close()
        writes = round(statistics.median(kernel.writes[1:]))
        return FixtureRun(durations, deciding, floors, periods, writes)
    finally:
        shutil.rmtree(root)


def bench_watch(pods: int, passes: int, gpu: bool = False) -> list[float]:
    """One watch pass between ticks: every pod's cpu.stat read through the descriptors the
    tick keeps open, nobody throttled (the common case: nothing to raise); with `gpu`, each
    pod's vGPU busy time as well (a layer without weights), nobody pinned."""
    root = Path(tempfile.mkdtemp(prefix="kuscale-bench-", dir="/dev/shm"))
    try:
        layer = VgpuLayer(root / "vgpu", gpus=max(1, pods // 10)) if gpu else None
        monitor = monitor_for(make_tree(root / "cpu", pods), pods, gpu=layer)
        monitor.tick(PERIOD)
        durations = []
        for index in range(passes):
            started = time.perf_counter()
            monitor.watch(PERIOD + index * 1e-3)
            durations.append(time.perf_counter() - started)
        return durations
    finally:
        shutil.rmtree(root)


def bench_memory(pods: int, ticks: int) -> list[tuple[int, float]]:
    root = Path(tempfile.mkdtemp(prefix="kuscale-bench-", dir="/dev/shm"))
    try:
        cgroups = make_tree(root, pods)
        monitor = monitor_for(cgroups, pods)
        kernel = FixtureKernel(root, pods)
        marks = []
        for tick in range(1, ticks + 1):
            kernel.advance(tick)
            monitor.tick(tick * PERIOD)
            if tick in (100, 1000, ticks // 2, ticks):
                marks.append((tick, current_rss_mib()))
        return marks
    finally:
        shutil.rmtree(root)


def bench_real(pods: int, ticks: int) -> list[float] | None:
    try:
        cgroups = detect()
        parent = f"kuscale-bench-{uuid.uuid4().hex[:6]}"
        for i in range(pods):
            cgroups.create(f"{parent}/pod-{i}")
    except (BackendError, OSError) as err:
        print(f"real cgroups: skipped ({err})")
        return None
    try:
        monitor = monitor_for(cgroups, pods, prefix=f"{parent}/")
        durations = []
        for tick in range(1, ticks + 1):
            started = time.perf_counter()
            monitor.tick(tick * PERIOD)
            durations.append(time.perf_counter() - started)
        return durations
    finally:
        for i in range(pods):
            cgroups.remove(f"{parent}/pod-{i}")
        cgroups.remove(parent)


def random_observation(pods: int, seed: int = 1) -> Observation:
    """A busy node: a third of the pods use a GPU, half are starved, the node is full."""
    rng = np.random.default_rng(seed)
    uses = np.column_stack([np.ones(pods, bool), rng.random(pods) < 1 / 3])
    usage = np.where(uses, rng.random((pods, 2)) * 100, 0.0)
    return Observation(
        period=PERIOD,
        elapsed=np.full(pods, PERIOD),
        tokens=rng.integers(50, 1000, pods).astype(np.float64),
        queue=rng.random(pods) * 100,
        usage=usage,
        avg_usage=usage,
        limits=np.where(uses, np.maximum(usage, 10.0), 0.0),
        starved=(rng.random((pods, 2)) < 0.5) & uses,
        demand=usage,
        uses=uses,
        capacity=np.array([pods * 20.0, max(100.0, pods * 5.0)]),
    )


def bench_policy(name: str, pods: int, repeats: int) -> list[float]:
    policy = make_policy(name, PolicyConfig())
    obs = random_observation(pods)
    durations = []
    for _ in range(repeats):
        started = time.perf_counter()
        policy.decide(obs)
        durations.append(time.perf_counter() - started)
    return durations


def report(label: str, pods: int, durations: list[float]) -> None:
    median = statistics.median(durations)
    p95 = sorted(durations)[int(0.95 * (len(durations) - 1))]
    print(
        f"{label:<26} {pods:>5} pods  median {median * 1e3:8.3f} ms  "
        f"p95 {p95 * 1e3:8.3f} ms  {median / pods * 1e6:7.1f} µs/pod"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--memory-ticks", type=int, default=10_000)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; period {PERIOD} s; agent policy kuscale")
    for name in ("kuscale", "kuscale-2022"):
        for pods in (110, 1000):
            report(f"policy {name} alone", pods, bench_policy(name, pods, 1000))
    medians = {}
    for pods in (10, 110, 1000):
        run = bench_fixture(pods, args.ticks)
        report("fixture v1 tree (tmpfs)", pods, run.ticks)
        report("  its policy", pods, run.policy)
        report(f"  its kernel I/O ({run.writes} writes)", pods, run.floors)
        report("  its period reads", pods, run.periods)
        rest = [tick - policy for tick, policy in zip(run.ticks, run.policy, strict=True)]
        medians[pods] = [
            statistics.median(durations) for durations in (run.ticks, run.floors, run.periods, rest)
        ]
    for pods, (tick_s, floor_s, _, rest_s) in medians.items():
        print(
            f"tick-to-floor ratio at {pods} pods: {tick_s / floor_s:.2f} "
            f"({rest_s / floor_s:.2f} without its policy's own time)"
        )
    python = [tick_s - floor_s - period_s for tick_s, floor_s, period_s, _ in medians.values()]
    print(
        "Python work per pod beyond its kernel I/O (floor and period reads), "
        f"110 to 1000 pods: {(python[2] - python[1]) / 890 * 1e6:.2f} µs"
    )
    for pods in (110, 1000):
        report("watch pass, fixture tree", pods, bench_watch(pods, args.ticks * 5))
        report("  with the vGPU layer's busy time", pods, bench_watch(pods, args.ticks * 5, True))
    real = bench_real(10, args.ticks)
    if real is not None:
        report("real cgroup v1/v2", 10, real)
    marks = bench_memory(110, args.memory_ticks)
    print(
        "resident memory, 110 pods: "
        + ", ".join(f"{mib:.1f} MiB after {tick} ticks" for tick, mib in marks)
    )
    print(f"peak resident memory of the benchmark process: {rss_mib():.1f} MiB")


if __name__ == "__main__":
    main()
