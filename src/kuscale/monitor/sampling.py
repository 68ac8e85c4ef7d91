"""Each tick's measurement: every ready pod's counters read into arrays, turned into usage,
starvation and throttling over the interval since its last sample.

A pod whose counters cannot be read, or went backwards, is left out of this tick (and a
gone cgroup completes its pod); the others are measured as one array.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from kuscale.actuators.base import CpuActuator
from kuscale.backends.base import BackendError, CgroupGone, CpuBackend, GpuBackend, Unmanageable
from kuscale.backends.batch import CgroupSet, Failures, cgroup_set
from kuscale.model import RESOURCES, PodStatus, Resource
from kuscale.monitor.actuating import DirectWriter
from kuscale.monitor.events import TickStats, count_error, pod_event
from kuscale.monitor.lifecycle import Lifecycle
from kuscale.monitor.pods import PodState, Registry
from kuscale.monitor.table import NO_MARK, PodTable, take_rows
from kuscale.policy.base import BoolArray, FloatArray, IntArray

CPU, GPU = Resource.CPU, Resource.GPU


@dataclass(frozen=True, slots=True)
class Sample:
    """Pods with a trustworthy sample this tick, in the order they arrived."""

    pods: list[PodState]
    keys: tuple[str, ...]
    rows: IntArray
    positions: IntArray
    """Each pod's place among the ready pods, and in `writer`."""
    writer: DirectWriter | None
    elapsed: FloatArray
    usage: FloatArray
    starved: BoolArray
    throttled: FloatArray


@dataclass(frozen=True, slots=True)
class Ready:
    """The running pods that were ready when the membership last changed, gathered once."""

    membership: int
    pods: list[PodState]
    everyone: list[int]
    """Every pod's position: what a tick reads when none completed before it."""
    keys: tuple[str, ...]
    rows: IntArray
    owned: list[int]
    """Positions of the pods whose cgroups kuscale made (they complete when empty)."""
    managed: IntArray
    """Positions of the pods kuscale took over (the watch raises only these)."""
    waiting: list[PodState]
    """The running pods not ready yet, started again each tick."""
    holding: tuple[IntArray, ...]
    """Per resource, the rows of every running pod (ready or not) that uses it, in the
    order they arrived: what the node has promised sums over these."""
    counters: CgroupSet
    writer: DirectWriter | None
    """The actuator's writer for the same cgroups, where it writes them directly."""


def _keeper(keep: IntArray, size: int) -> Callable[[NDArray[Any]], NDArray[Any]]:
    """Picks the entries at `keep` of an array of `size`, or hands it back unchanged where
    all are kept: the common tick, which then copies nothing."""
    if keep.size == size:
        return lambda values: values
    return lambda values: values[keep]


Picked = TypeVar("Picked", list[PodState], tuple[str, ...])


def picked(items: Picked, places: IntArray) -> Picked:
    """The items at `places` (ascending), or all of them, unchanged, where none was left out:
    the common tick, which then builds no new list per pod."""
    if places.size == len(items):
        return items
    chosen = [items[i] for i in places.tolist()]
    return chosen if isinstance(items, list) else tuple(chosen)


class Sampler:
    def __init__(
        self,
        table: PodTable,
        registry: Registry,
        cpu: CpuBackend,
        gpu: GpuBackend | None,
        actuator: CpuActuator,
        lifecycle: Lifecycle,
        stats: TickStats,
        ceilings: FloatArray,
        pinned_at: float,
    ) -> None:
        self.table = table
        self.registry = registry
        self.cpu = cpu
        self.gpu = gpu
        self.actuator = actuator
        self.lifecycle = lifecycle
        self.stats = stats
        self.ceilings = ceilings
        self.pinned_at = pinned_at
        """Usage at this share of the limit counts as starved where nothing counts throttling."""
        self._ready: Ready | None = None

    def ready(self) -> Ready:
        """The running, ready pods, gathered again only after the membership changed."""
        membership = self.lifecycle.membership
        if self._ready is None or self._ready.membership != membership:
            running = list(self.registry.running.values())
            pods = [p for p in running if p.status is PodStatus.RUNNING]
            cgroups = [p.spec.cgroup for p in pods]
            writer = self.actuator.cgroup_set(cgroups)
            held = np.array([p.held is not None for p in pods], dtype=np.bool_)
            self._ready = Ready(
                membership=membership,
                pods=pods,
                everyone=list(range(len(pods))),
                keys=tuple(p.key for p in pods),
                rows=np.array([p.row for p in pods], dtype=np.int64),
                owned=[i for i, p in enumerate(pods) if p.spec.owned],
                managed=np.flatnonzero(held),
                holding=self._holding(running),
                waiting=[p for p in running if p.status is PodStatus.NOT_READY],
                counters=cgroup_set(self.cpu, cgroups),
                writer=None if writer is None else DirectWriter(writer, held),
            )
        return self._ready

    def _holding(self, running: list[PodState]) -> tuple[IntArray, ...]:
        rows = np.array([p.row for p in running], dtype=np.int64)
        uses = self.table.columns.uses[rows]
        return tuple(rows[uses[:, resource]] for resource in RESOURCES)

    def sample(self, now: float) -> Sample:
        """Start the pods not ready yet, complete the owned ones left empty, and measure the
        rest of the pods that were ready as the tick began."""
        ready = self.ready()
        self._start_waiting(ready.waiting, now)
        alive = np.ones(len(ready.pods), dtype=np.bool_)
        if ready.owned:
            empty, failed = ready.counters.empty(ready.owned)
            self._fail(ready, ready.owned, failed, alive)
            for i, index in enumerate(ready.owned):
                if empty[i] and alive[index]:
                    self.lifecycle.complete(ready.pods[index], "its last process exited")
                    alive[index] = False
        everyone = bool(alive.all())
        which = ready.everyone if everyone else np.flatnonzero(alive).tolist()
        counters = ready.counters.read(which)
        self._fail(ready, which, counters.failed, alive)
        gpu_busy = self._read_gpus(ready, which, alive)
        at = np.arange(len(which)) if everyone else np.array(which, dtype=np.int64)
        read = _keeper(np.flatnonzero(alive[at]), at.size)
        at = read(at)
        rows = _keeper(at, len(ready.pods))(ready.rows)
        if counters.throttled_ns is not None:
            self._mark_throttled(rows, read(counters.throttled_ns), now)
        return self._measure(
            picked(ready.pods, at),
            picked(ready.keys, at),
            ready.writer,
            at,
            rows,
            now,
            read(counters.usage_ns),
            read(counters.nr_periods),
            read(counters.nr_throttled),
            read(gpu_busy),
        )

    def _mark_throttled(self, rows: IntArray, throttled_ns: IntArray, now: float) -> None:
        """The time throttled as of this tick: the watch's next look measures how short a
        pod is from here, over a tenth of a period, not from its last look before the
        tick (a burst that began at the tick would read as half its size)."""
        c = self.table.columns
        c.throttled_ns_mark[rows] = throttled_ns
        c.throttle_look_at[rows] = now

    def _start_waiting(self, waiting: list[PodState], now: float) -> None:
        for pod in waiting:
            if pod.status is PodStatus.NOT_READY:
                try:
                    self.lifecycle.start(pod, now)
                except BackendError as err:
                    self.failed(pod, err)

    def failed(self, pod: PodState, err: BackendError) -> None:
        """One pod's read failed: refused when it cannot be managed, completed when its
        cgroup is gone, else counted and tried again next tick."""
        if isinstance(err, Unmanageable):
            self.lifecycle.refuse(pod, str(err))
        elif isinstance(err, CgroupGone):
            if pod.status is PodStatus.NOT_READY and not pod.spec.owned:
                pod.reason = str(err)
            else:
                self.lifecycle.complete(pod, f"its cgroup is gone ({err})")
        else:
            count_error(self.stats, pod.spec, err)

    def _fail(self, ready: Ready, which: list[int], failed: Failures, alive: BoolArray) -> None:
        for i, err in failed.items():
            index = which[i]
            if alive[index]:
                alive[index] = False
                self.failed(ready.pods[index], err)

    def _read_gpus(self, ready: Ready, which: list[int], alive: BoolArray) -> IntArray:
        """Busy nanoseconds of the pods that use a GPU, 0 for the others."""
        busy = np.zeros(len(which), dtype=np.int64)
        if self.gpu is None:
            return busy
        for i, index in enumerate(which):
            vgpu_id = ready.pods[index].spec.vgpu_id
            if vgpu_id is None or not alive[index]:
                continue
            try:
                busy[i] = self.gpu.read(vgpu_id)
            except BackendError as err:
                alive[index] = False
                self.failed(ready.pods[index], err)
        return busy

    def _measure(
        self,
        pods: list[PodState],
        keys: tuple[str, ...],
        writer: DirectWriter | None,
        positions: IntArray,
        rows: IntArray,
        now: float,
        usage_ns: IntArray,
        nr_periods: IntArray,
        nr_throttled: IntArray,
        gpu_busy: IntArray,
    ) -> Sample:
        """Usage since each pod's baseline, which becomes this reading; pods without a
        baseline, or whose counters went backwards, are left out."""
        c = self.table.columns
        gpu = c.uses[rows, GPU]
        any_gpu = bool(gpu.any())
        previous_usage, previous_busy = c.cpu_usage_ns[rows], c.gpu_busy_ns[rows]
        previous_periods, previous_throttled = c.nr_periods[rows], c.nr_throttled[rows]
        last_update, had_baseline = c.last_update[rows], c.has_baseline[rows]
        c.cpu_usage_ns[rows], c.nr_periods[rows], c.nr_throttled[rows] = (
            usage_ns,
            nr_periods,
            nr_throttled,
        )
        c.gpu_busy_ns[rows] = np.where(gpu, gpu_busy, 0) if any_gpu else 0
        c.has_baseline[rows] = True
        c.last_update[rows] = now
        elapsed = now - np.where(np.isnan(last_update), now, last_update)
        timed = had_baseline & (elapsed > 0)
        backwards = timed & (usage_ns < previous_usage)
        if any_gpu:
            backwards |= timed & gpu & (gpu_busy < previous_busy)
        for i in np.flatnonzero(backwards).tolist():
            self.stats.errors["backwards"] += 1
            pod_event(
                pods[i].spec,
                logging.WARNING,
                "counter_backwards",
                "pod %s: a counter went backwards; taking a new baseline",
            )
        keep = np.flatnonzero(timed & ~backwards)
        kept = _keeper(keep, rows.size)
        rows, elapsed, gpu = kept(rows), kept(elapsed), kept(gpu)
        wall_ns = elapsed * 1e9
        usage = np.zeros((keep.size, 2))
        usage[:, CPU] = np.minimum(
            (kept(usage_ns) - kept(previous_usage)) * 100.0 / wall_ns, self.ceilings[CPU]
        )
        previous_throttled = kept(previous_throttled)
        periods = kept(nr_periods) - kept(previous_periods)
        marks = c.raised_mark[rows]
        answered = np.where(marks == NO_MARK, previous_throttled, marks)
        nr_throttled = kept(nr_throttled)
        throttled_periods = nr_throttled - np.maximum(previous_throttled, answered)
        c.raised_mark[rows] = NO_MARK
        c.throttle_mark[rows] = nr_throttled
        starved = np.zeros((keep.size, 2), dtype=np.bool_)
        throttled = np.zeros((keep.size, 2))
        counted = periods > 0
        throttled[:, CPU] = np.where(
            counted,
            np.minimum(np.maximum(throttled_periods / np.where(counted, periods, 1), 0.0), 1.0),
            0.0,
        )
        # Where CFS counted periods its throttle count is the evidence; usage near the
        # limit stands in only where nothing counts (a GPU): a budget that squeezed a
        # limit just above usage is not a pod asking for more.
        limits = take_rows(c.limit, rows)
        pinned_cpu = usage[:, CPU] >= self.pinned_at * limits[:, CPU]
        starved[:, CPU] = (throttled_periods > 0) | (~counted & pinned_cpu)
        if any_gpu:
            busy = np.minimum(
                (kept(gpu_busy) - kept(previous_busy)) * 100.0 / wall_ns, self.ceilings[GPU]
            )
            usage[:, GPU] = np.where(gpu, busy, 0.0)
            starved[:, GPU] = gpu & (usage[:, GPU] >= self.pinned_at * limits[:, GPU])
            throttled[:, GPU] = np.where(starved[:, GPU], 1.0, 0.0)
        return Sample(
            pods=picked(pods, keep),
            keys=picked(keys, keep),
            rows=rows,
            positions=kept(positions),
            writer=writer,
            elapsed=elapsed,
            usage=usage,
            starved=starved,
            throttled=throttled,
        )
