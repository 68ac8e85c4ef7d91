"""The watch between ticks: every ready pod's throttle count, read several times a period; a
pod throttled since the last look may have its CPU limit raised at once by the policy's fast
path, within its budget, instead of waiting for the next tick."""

from __future__ import annotations

import logging

import numpy as np

from kuscale import faults
from kuscale.backends.base import BackendError, CpuBackend
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
from kuscale.policy.base import BoolArray, FloatArray, IntArray, Starving

CPU = Resource.CPU
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
    ) -> None:
        self.table = table
        self.sampler = sampler
        self.actuation = actuation
        self.policy = policy
        self.stats = stats
        self.period = period
        self.reach = reach
        self.weighted = weighted

    def managed_cgroups(self) -> list[str]:
        """The cgroups of the pods the watch may raise: those the pressure triggers follow."""
        ready = self.sampler.ready()
        return [ready.pods[i].spec.cgroup for i in ready.managed.tolist()]

    def look(self) -> None:
        """Read every managed pod's throttle counter; hand those throttled since the last
        look to the policy's fast path and write, all at once, what it raises. A pod whose
        cgroup cannot be read is skipped until the next tick."""
        ready = self.sampler.ready()
        positions = self._throttled(ready)
        if not positions.size:
            return
        rows = ready.rows[positions]
        limits = self.policy.raise_starved(self._starving(rows))
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

    def _throttled(self, ready: Ready) -> IntArray:
        """Positions among the ready pods of the managed ones whose throttle count rose
        since the last look."""
        which = ready.managed
        if not which.size:
            return which
        counts, failed = ready.counters.read_throttled(which)
        read = np.ones(which.size, dtype=np.bool_)
        for i, err in failed.items():
            log.debug("watch skips pod %s: %s", ready.pods[which[i]].key, err)
            read[i] = False
        if failed:
            which, counts = which[read], counts[read]
        rows = ready.rows[which]
        c = self.table.columns
        rose = counts > c.throttle_mark[rows]
        c.throttle_mark[rows] = counts
        return which[rose]

    def _starving(self, rows: IntArray) -> Starving:
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
            limits=np.where(uses, c.limit[rows], 0.0),
            uses=uses,
            capacity=self.reach,
            held=held,
            weighted=self.weighted,
        )
