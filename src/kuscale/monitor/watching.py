"""The watch between ticks: every ready pod's throttle count, read several times a period; a
pod throttled since the last look may have its CPU limit raised at once by the policy's fast
path, within its budget, instead of waiting for the next tick."""

from __future__ import annotations

import numpy as np

from kuscale.model import RESOURCES, Resource
from kuscale.monitor.actuating import WRITE_RESOLUTION, Actuation
from kuscale.monitor.events import TickStats, log
from kuscale.monitor.pods import PodState
from kuscale.monitor.sampling import Sampler
from kuscale.monitor.table import PodTable
from kuscale.policy import Policy
from kuscale.policy.base import BoolArray, FloatArray, Starving

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
        look to the policy's fast path and write what it raises. A pod whose cgroup cannot
        be read, or whose counter went backwards, is skipped until the next tick."""
        starving = self._throttled()
        if not starving:
            return
        limits = self.policy.raise_starved(self._starving(starving))
        if limits is None:
            return
        c = self.table.columns
        for pod, raised in zip(starving, limits[:, CPU].tolist(), strict=True):
            before = float(c.limit[pod.row, CPU])
            if raised <= before + WRITE_RESOLUTION:
                continue
            self.actuation.write(pod, CPU, raised)
            if c.limit[pod.row, CPU] > before:
                self.stats.fast_raises += 1
                c.raised_mark[pod.row] = c.throttle_mark[pod.row]
                log.debug("pod %s throttled at %.1f %%: raised to %.1f %%", pod.key, before, raised)

    def _throttled(self) -> list[PodState]:
        """The managed pods whose throttle count rose since the last look."""
        ready = self.sampler.ready()
        which = ready.managed
        if not which:
            return []
        counts, failed = ready.counters.read_throttled(which)
        for i, err in failed.items():
            log.debug("watch skips pod %s: %s", ready.pods[which[i]].key, err)
        read = np.ones(len(which), dtype=np.bool_)
        read[list(failed)] = False
        rows = ready.rows[which][read]
        counts = counts[read]
        c = self.table.columns
        rose = counts > c.throttle_mark[rows]
        c.throttle_mark[rows] = counts
        positions = np.array(which, dtype=np.int64)[read][rose]
        return [ready.pods[i] for i in positions.tolist()]

    def _starving(self, pods: list[PodState]) -> Starving:
        c = self.table.columns
        rows = np.array([p.row for p in pods], dtype=np.int64)
        uses = c.uses[rows]
        running = self.sampler.ready().running_rows
        held = np.zeros(len(RESOURCES))
        for resource in RESOURCES:
            holding = c.limit[running[c.uses[running, resource]], resource]
            if holding.size:
                held[resource] = np.cumsum(holding)[-1]
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
