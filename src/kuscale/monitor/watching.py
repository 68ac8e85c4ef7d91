"""The watch between ticks: every ready pod's throttle count, read several times a period; a
pod throttled since the last look may have its CPU limit raised at once by the policy's fast
path, within its budget, instead of waiting for the next tick."""

from __future__ import annotations

import logging

import numpy as np

from kuscale import faults
from kuscale.model import RESOURCES, Resource
from kuscale.monitor.actuating import WRITE_RESOLUTION, Actuation
from kuscale.monitor.events import TickStats, log
from kuscale.monitor.sampling import Ready, Sampler
from kuscale.monitor.table import PodTable
from kuscale.policy import Policy
from kuscale.policy.base import BoolArray, FloatArray, IntArray, Starving

CPU = Resource.CPU


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
