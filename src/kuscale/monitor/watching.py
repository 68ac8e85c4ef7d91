"""The watch between ticks: every ready pod's throttle count, read several times a period; a
pod throttled since the last look may have its CPU limit raised at once by the policy's fast
path, within its budget, instead of waiting for the next tick. Each GPU pod's busy time is
read as well: a pod pinned at its GPU limit since the last look is raised the same way,
where the layer has no weights out of what its device leaves unheld or unused."""

from __future__ import annotations

import logging

import numpy as np

from kuscale import faults
from kuscale.backends.base import BackendError, CpuBackend, GpuBackend
from kuscale.backends.batch import BusySet, busy_set
from kuscale.backends.pressure import (
    MIN_WINDOW_US,
    PressureSource,
    PressureTrigger,
    wait_for_pressure,
)
from kuscale.model import RESOURCES, Resource
from kuscale.monitor.actuating import WRITE_RESOLUTION, Actuation
from kuscale.monitor.events import TickStats, log
from kuscale.monitor.sampling import Ready, Sampler
from kuscale.monitor.table import PodTable
from kuscale.policy import Policy
from kuscale.policy.base import BoolArray, FloatArray, GpuLook, IntArray, Starving

CPU, GPU = Resource.CPU, Resource.GPU
PRESSURE_WINDOW_US = MIN_WINDOW_US
"""The kernel's shortest PSI window, 500 ms: a trigger fires within tens of ms of a stall."""
PRESSURE_STALL_US = 20_000
"""A pod whose tasks waited 20 ms for CPU within the window wakes the watch: a busy loop held
to a tenth of a core stalls that long in about 25 ms, an idle pod never does."""


class PressureWake:
    """What the loop sleeps on between ticks where cgroup v2 has PSI: one trigger on each
    managed pod's cpu.pressure, kept in step with the pods. The kernel wakes the loop when a
    pod stalls for CPU, so an idle node costs no reads at all; the watch then looks as it
    would have polled. Where any trigger cannot be registered, the watch polls instead."""

    def __init__(self, cpu: CpuBackend, enabled: bool) -> None:
        self.cpu = cpu
        self.source = cpu if enabled and isinstance(cpu, PressureSource) else None
        self.triggers: dict[str, PressureTrigger] = {}
        self.refused: str | None = None

    @property
    def mode(self) -> str:
        return "poll" if self.source is None or self.refused else "pressure"

    def follow(self, cgroups: list[str]) -> bool:
        """Triggers on exactly these cgroups; False where the watch must poll meanwhile."""
        if self.source is None or self.refused:
            return False
        wanted = set(cgroups)
        for cgroup in [c for c in self.triggers if c not in wanted]:
            self.triggers.pop(cgroup).close()
        for cgroup in wanted.difference(self.triggers):
            try:
                self.triggers[cgroup] = self.source.pressure_trigger(
                    cgroup, PRESSURE_STALL_US, PRESSURE_WINDOW_US
                )
            except BackendError as err:
                if self.cpu.exists(cgroup):
                    self.refused = str(err)
                    log.info("the watch polls: no PSI trigger here (%s)", err)
                    self.close()
                return False
        return True

    def wait(self, wake: int, timeout: float) -> tuple[bool, bool]:
        """Until a pod stalls, `wake` is written or `timeout` passes: (stalled, woken)."""
        fired, woken = wait_for_pressure(list(self.triggers.values()), timeout, wake)
        return bool(fired), woken

    def close(self) -> None:
        for trigger in self.triggers.values():
            trigger.close()
        self.triggers.clear()


class Watch:
    def __init__(
        self,
        table: PodTable,
        sampler: Sampler,
        actuation: Actuation,
        policy: Policy,
        stats: TickStats,
        period: float,
        reach: FloatArray,
        weighted: BoolArray,
        gpu: GpuBackend | None = None,
        device_capacity: FloatArray | None = None,
        pinned_at: float = 1.0,
    ) -> None:
        self.table = table
        self.sampler = sampler
        self.actuation = actuation
        self.policy = policy
        self.stats = stats
        self.period = period
        self.reach = reach
        self.weighted = weighted
        self.gpu = gpu
        self.device_capacity = np.zeros(0) if device_capacity is None else device_capacity
        self.pinned_at = pinned_at
        self._clients: tuple[int, IntArray, BusySet] | None = None
        """The ready pods' GPU clients, for the membership they were gathered at."""

    def managed_cgroups(self) -> list[str]:
        """The cgroups of the pods the watch may raise: those the pressure triggers follow."""
        ready = self.sampler.ready()
        return [ready.pods[i].spec.cgroup for i in ready.managed.tolist()]

    def watches_gpu(self) -> bool:
        """True where GPU pods need looking at: no kernel stall wakes the loop for them."""
        return self.gpu is not None and self.sampler.ready().holding[GPU].size > 0

    def look(self, now: float) -> None:
        """The CPU's throttle counters, then the GPU's busy time where it is watched."""
        self._look_at_cpus(now)
        if self.watches_gpu():
            self._look_at_gpus(now)

    def _look_at_cpus(self, now: float) -> None:
        """Read every managed pod's throttle counters; hand those throttled since the last
        look to the policy's fast path, with how short each was, and write, all at once,
        what it raises. A pod whose cgroup cannot be read is skipped until the next tick."""
        ready = self.sampler.ready()
        positions, shortfall = self._throttled(ready, now)
        if not positions.size:
            return
        rows = ready.rows[positions]
        limits = self.policy.raise_starved(self._starving(rows, shortfall))
        if limits is None:
            return
        c = self.table.columns
        before = c.limit[rows, CPU]
        due = np.flatnonzero(limits[:, CPU] > before + WRITE_RESOLUTION)
        if not due.size:
            return
        raised = [ready.pods[i] for i in positions[due].tolist()]
        self.actuation.write_decided(
            raised,
            rows[due],
            limits[due],
            ready.writer,
            positions[due],
            (CPU,),
        )
        grew = rows[due][c.limit[rows[due], CPU] > before[due]]
        self.stats.fast_raises += grew.size
        faults.reached("watch.raised")
        c.raised_mark[grew] = c.throttle_mark[grew]
        if log.isEnabledFor(logging.DEBUG):
            for pod, i in zip(raised, due.tolist(), strict=True):
                log.debug(
                    "pod %s throttled at %.1f %%: raised to %.1f %%",
                    pod.key,
                    before[i],
                    c.limit[rows[i], CPU],
                )

    def _look_at_gpus(self, now: float) -> None:
        """Each ready GPU pod's use since the last look (since the tick, at the first look
        after one); those pinned at their limit go to the policy's GPU fast path, and every
        GPU limit it changed is written, with one reload of the layer."""
        ready = self.sampler.ready()
        c = self.table.columns
        positions, busy = self._gpu_busy(ready)
        if not positions.size:
            return
        rows = ready.rows[positions]
        since_tick = ~(c.gpu_look_at[rows] > c.last_update[rows])
        mark = np.where(since_tick, c.gpu_busy_ns[rows], c.gpu_look_ns[rows])
        elapsed = now - np.where(since_tick, c.last_update[rows], c.gpu_look_at[rows])
        c.gpu_look_ns[rows], c.gpu_look_at[rows] = busy, now
        timed = (elapsed > 0) & (busy >= mark)
        usage = np.where(timed, (busy - mark) * 100.0 / (np.where(timed, elapsed, 1.0) * 1e9), 0.0)
        limits = c.limit[rows, GPU]
        pinned = timed & (usage >= self.pinned_at * limits)
        if not pinned.any():
            return
        uses = c.uses[rows]
        look = GpuLook(
            period=self.period,
            tokens=c.tokens[rows],
            queue=c.queue[rows],
            limits=self._charged(rows, GPU),
            uses=uses,
            usage=usage,
            spread=c.spread[rows, GPU],
            pinned=pinned,
            device=c.device[rows],
            device_capacity=self.device_capacity,
            capacity=self.reach,
            weighted=bool(self.weighted[GPU]),
        )
        shares = self.policy.raise_pinned_gpu(look)
        if shares is not None:
            self._write_gpu(ready, positions, shares, limits)

    def _charged(self, rows: IntArray, raised: Resource) -> FloatArray:
        """What the pods hold of `raised` now, and the most they held of the rest since the
        tick: a raise is charged for the whole period, so it may take only the budget that
        the other resources' peaks leave."""
        c = self.table.columns
        limits = np.where(c.uses[rows], c.peak[rows], 0.0)
        limits[:, raised] = np.where(c.uses[rows, raised], c.limit[rows, raised], 0.0)
        return limits

    def _gpu_busy(self, ready: Ready) -> tuple[IntArray, IntArray]:
        """Positions of the ready pods with a GPU client, and their busy ns, read together
        (one batch where the backend has one); a client that cannot be read (gone since
        the last pass) is skipped until the next tick."""
        positions, clients = self._gpu_clients(ready)
        busy, failed = clients.read(np.arange(positions.size))
        for i, err in failed.items():
            log.debug("watch skips pod %s's GPU: %s", ready.pods[positions[i]].key, err)
        if not failed:
            return positions, busy
        kept = np.ones(positions.size, dtype=bool)
        kept[list(failed)] = False
        return positions[kept], busy[kept]

    def _gpu_clients(self, ready: Ready) -> tuple[IntArray, BusySet]:
        """The ready pods that hold a GPU share, gathered once per membership."""
        assert self.gpu is not None
        if self._clients is None or self._clients[0] != ready.membership:
            uses = self.table.columns.uses
            positions = [
                i
                for i, pod in enumerate(ready.pods)
                if pod.spec.vgpu_id is not None and uses[pod.row, GPU]
            ]
            ids = [str(ready.pods[i].spec.vgpu_id) for i in positions]
            picked = np.array(positions, dtype=np.int64)
            self._clients = (ready.membership, picked, busy_set(self.gpu, ids))
        return self._clients[1], self._clients[2]

    def _write_gpu(
        self, ready: Ready, positions: IntArray, shares: FloatArray, before: FloatArray
    ) -> None:
        """Write the GPU limits the fast path changed; count the pods it raised."""
        c = self.table.columns
        changed = np.flatnonzero(np.abs(shares - before) > WRITE_RESOLUTION)
        if not changed.size:
            return
        rows = ready.rows[positions[changed]]
        limits = np.zeros((changed.size, len(RESOURCES)))
        limits[:, GPU] = shares[changed]
        pods = [ready.pods[i] for i in positions[changed].tolist()]
        self.actuation.write_decided(pods, rows, limits, None, positions[changed], (GPU,))
        self.actuation.commit()
        self.stats.gpu_fast_raises += int((c.limit[rows, GPU] > before[changed]).sum())
        faults.reached("watch.raised")

    def _throttled(self, ready: Ready, now: float) -> tuple[IntArray, FloatArray]:
        """Positions among the ready pods of the managed ones whose throttle count rose
        since the last look, and how short each was: 100 × the time it spent throttled
        (summed over CPUs) over the wall time since the last look, percent of a core. A
        pod's threads held back for a whole period each wait on a CPU apiece, so that is
        what its demand exceeds its limit by; NaN where the pod was not looked at before."""
        which = ready.managed
        if not which.size:
            return which, np.zeros(0)
        counts, throttled_ns, failed = ready.counters.read_throttled(which)
        read = np.ones(which.size, dtype=np.bool_)
        for i, err in failed.items():
            log.debug("watch skips pod %s: %s", ready.pods[which[i]].key, err)
            read[i] = False
        if failed:
            which, counts, throttled_ns = which[read], counts[read], throttled_ns[read]
        rows = ready.rows[which]
        c = self.table.columns
        rose = counts > c.throttle_mark[rows]
        elapsed = now - c.throttle_look_at[rows]
        grew = np.maximum(throttled_ns - c.throttled_ns_mark[rows], 0)
        known = elapsed > 0
        shortfall = np.where(known, 100.0 * grew / (np.where(known, elapsed, 1.0) * 1e9), np.nan)
        c.throttle_mark[rows] = counts
        c.throttled_ns_mark[rows] = throttled_ns
        c.throttle_look_at[rows] = now
        return which[rose], shortfall[rose]

    def _starving(self, rows: IntArray, shortfall: FloatArray) -> Starving:
        c = self.table.columns
        uses = c.uses[rows]
        holding = self.sampler.ready().holding
        held = np.zeros(len(RESOURCES))
        for resource in RESOURCES:
            if holding[resource].size:
                held[resource] = np.cumsum(c.limit[holding[resource], resource])[-1]
        return Starving(
            period=self.period,
            tokens=c.tokens[rows],
            queue=c.queue[rows],
            limits=self._charged(rows, CPU),
            uses=uses,
            capacity=self.reach,
            held=held,
            weighted=self.weighted,
            shortfall=shortfall,
        )
