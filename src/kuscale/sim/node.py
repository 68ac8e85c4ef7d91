"""A simulated node: simulated time, counters and a CFS-like share of a full node.

Every pod is a row of arrays, so one step of a thousand pods is a handful of numpy
operations. Over a step each pod receives min(demand, limit); when those add up to more than
the node has, the node shares by weight (cpu.shares for the CPU, equal for the GPU) capped at
what each pod asks, as the kernel's fair scheduler would; each GPU device is shared on its own,
since a client runs on one device. With Gemini as the GPU layer (`gemini=True`) a device
serves each client first up to its REQUEST, then the least used, up to each LIMIT: over
gem-schd's window, max-min fair above the REQUESTs. A pod whose demand exceeds its
quota is throttled in every CFS period of the step.

A coupled pod (a pipeline: a trainer whose data loading feeds its GPU, an inference server
whose preprocessing feeds its model) progresses at the served fraction of its scarcest
resource and uses no more of the others than that progress needs: its CPU waits for its GPU
and the other way round. The step is then shared twice: once as if every pod were
independent, which tells each coupled pod's fraction, then with coupled pods asking only that
fraction of their demand, so what they cannot use goes to the other pods in the same step.
A coupled pod is throttled only where its CPU limit is what holds it back: the CPU it
presents is its demand times what its other resources let it use.

Demand comes either from per-pod step schedules (the demo and the tests) or, for scenarios,
from one function of time that returns every row's demand at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kuscale.backends.base import CgroupGone
from kuscale.backends.batch import (
    CgroupSet,
    CounterArrays,
    Counts,
    Failures,
    Limits,
    Positions,
)
from kuscale.backends.gemini import ClientWeights, token_requests
from kuscale.model import CpuCounters, Resource
from kuscale.policy.base import BoolArray, FloatArray, IntArray
from kuscale.policy.waterfill import water_fill
from kuscale.workload import Schedule

CFS_PERIOD = 0.1
DEVICE_CAPACITY = 100.0
NS = 1e9

DemandSource = Callable[[float], FloatArray]
"""Simulated time → demand in percent, shape (rows, 2): CPU then GPU."""


@dataclass(frozen=True, slots=True)
class SimPod:
    """A pod whose demand follows step schedules, present from `start` until `end`."""

    cpu: Schedule
    gpu: Schedule | None = None
    end: float = float("inf")
    start: float = 0.0
    device: int = 0
    coupled: bool = False


class SimNode:
    """The node's pods as rows; limits are NaN where unlimited."""

    def __init__(
        self,
        cores: int = 2,
        gpus: int = 1,
        demand: DemandSource | None = None,
        gemini: bool = False,
    ) -> None:
        self.cores = cores
        self.gpus = gpus
        self.gemini = gemini
        self.now = 0.0
        self.capacity = np.array([cores * 100.0, gpus * 100.0])
        self.index: dict[str, int] = {}
        self._schedules: list[SimPod] = []
        self._source = demand
        self.start = np.zeros(0)
        self.end = np.zeros(0)
        self.removed = np.zeros(0, dtype=bool)
        self.limit = np.zeros((0, 2))
        self.shares = np.zeros(0)
        self.device = np.zeros(0, dtype=np.int64)
        self.request = np.zeros(0)
        """Each client's REQUEST on its device, percent (Gemini only)."""
        self.coupled = np.zeros(0, dtype=bool)
        self.demand = np.zeros((0, 2))
        self.granted = np.zeros((0, 2))
        self.busy_ns = np.zeros((0, 2))
        self.nr_periods = np.zeros(0, dtype=np.int64)
        self.nr_throttled = np.zeros(0, dtype=np.int64)
        self.throttled_ns = np.zeros(0)

    def add(self, name: str, pod: SimPod) -> None:
        self.add_rows(
            [name], np.array([pod.start]), np.array([pod.end]), [pod.device], [pod.coupled]
        )
        self._schedules.append(pod)

    def add_rows(
        self,
        names: list[str],
        start: FloatArray,
        end: FloatArray,
        devices: list[int] | None = None,
        coupled: list[bool] | None = None,
    ) -> None:
        """Append pods whose demand the node's demand source gives, in this row order, with
        the GPU each runs on (default: the first) and whether each is a coupled pipeline
        (default: none is)."""
        first = len(self.index)
        self.index.update((name, first + i) for i, name in enumerate(names))
        rows = len(names)
        self.start = np.concatenate([self.start, start])
        self.end = np.concatenate([self.end, end])
        self.removed = np.concatenate([self.removed, np.zeros(rows, dtype=bool)])
        self.limit = np.concatenate([self.limit, np.full((rows, 2), np.nan)])
        self.shares = np.concatenate([self.shares, np.full(rows, 1024.0)])
        placed = np.array(devices if devices is not None else [0] * rows, dtype=np.int64)
        self.device = np.concatenate([self.device, placed])
        self.request = np.concatenate([self.request, np.zeros(rows)])
        linked = np.array(coupled if coupled is not None else [False] * rows, dtype=bool)
        self.coupled = np.concatenate([self.coupled, linked])
        for name in ("demand", "granted", "busy_ns"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros((rows, 2))]))
        self.nr_periods = np.concatenate([self.nr_periods, np.zeros(rows, dtype=np.int64)])
        self.nr_throttled = np.concatenate([self.nr_throttled, np.zeros(rows, dtype=np.int64)])
        self.throttled_ns = np.concatenate([self.throttled_ns, np.zeros(rows)])

    def live(self) -> np.ndarray:
        return (self.start <= self.now) & (self.now < self.end) & ~self.removed

    def _demand_now(self) -> FloatArray:
        if self._source is not None:
            return self._source(self.now)
        return np.array(
            [[p.cpu.at(self.now), p.gpu.at(self.now) if p.gpu else 0.0] for p in self._schedules]
        ).reshape(-1, 2)

    def advance(self, seconds: float) -> None:
        """Run every live pod for `seconds` of simulated time at its current demand."""
        self.advance_to(self.now + seconds)

    def advance_to(self, until: float) -> None:
        """Run every live pod until simulated time `until`, landing on it exactly: steps of a
        tenth of a second must not drift a pod's arrival past the tick that adopts it."""
        seconds = until - self.now
        live = self.live()
        self.demand = np.where(live[:, None], self._demand_now(), 0.0)
        wanted = np.fmin(self.demand, self.limit)
        granted = self._share(live, wanted)
        presented = self.demand
        coupled = live & self.coupled
        if coupled.any():
            fractions = served_fractions(self.demand[coupled], granted[coupled])
            presented = self.demand.copy()
            presented[coupled] = self.demand[coupled] * _others_least(fractions)
            wanted[coupled] = self.demand[coupled] * fractions.min(axis=1, keepdims=True)
            granted = self._share(live, wanted)
            granted[coupled] = np.minimum(granted[coupled], wanted[coupled])
        self.granted = granted
        self.busy_ns += granted / 100.0 * seconds * NS
        periods = max(1, round(seconds / CFS_PERIOD))
        self.nr_periods[live] += periods
        cpu = Resource.CPU
        over = (
            live
            & (presented[:, cpu] > self.limit[:, cpu])
            & (granted[:, cpu] >= self.limit[:, cpu])
        )
        self.nr_throttled[over] += periods
        excess = presented[over, cpu] - self.limit[over, cpu]
        self.throttled_ns[over] += excess / 100.0 * seconds * NS
        self.now = until

    def _share(self, live: BoolArray, wanted: FloatArray) -> FloatArray:
        """What each live pod is served of what it wants: the CPU by weight, each crowded
        GPU device on its own."""
        granted = np.zeros_like(wanted)
        column = wanted[live, Resource.CPU]
        if column.sum() > self.capacity[Resource.CPU]:
            column = water_fill(float(self.capacity[Resource.CPU]), self.shares[live], column)
        granted[live, Resource.CPU] = column
        granted[live, Resource.GPU] = wanted[live, Resource.GPU]
        for device in self._crowded_devices(live, wanted[:, Resource.GPU]):
            on = live & (self.device == device)
            granted[on, Resource.GPU] = self._share_device(wanted[on, Resource.GPU], on)
        return granted

    def _share_device(self, wanted: FloatArray, on: BoolArray) -> FloatArray:
        """One crowded device's time among its clients: equal shares capped at what each
        asks; under Gemini, each client's REQUEST first (never more in all than the
        device), then equal shares of the rest above it."""
        if wanted.sum() <= DEVICE_CAPACITY:
            return wanted
        equal = np.ones(wanted.shape)
        floors = None
        if self.gemini:
            floors = water_fill(DEVICE_CAPACITY, equal, np.minimum(wanted, self.request[on]))
        return water_fill(DEVICE_CAPACITY, equal, wanted, floors=floors)

    def present_rows(self, rows: IntArray) -> BoolArray:
        """Which rows' cgroups exist now (a row of -1 never does)."""
        known = rows >= 0
        safe = np.where(known, rows, 0)
        return known & (self.start[safe] <= self.now) & ~self.removed[safe]

    def _crowded_devices(self, live: BoolArray, wanted: FloatArray) -> list[int]:
        """Devices whose live pods may want more than the device has: one sum per device
        finds them, and each is then checked and shared as on its own (the margin covers
        the sums' different rounding)."""
        totals = np.bincount(self.device[live], wanted[live], minlength=self.gpus)
        return np.flatnonzero(totals > DEVICE_CAPACITY * (1 - 1e-9)).tolist()

    def row(self, name: str) -> int:
        row = self.index.get(name, -1)
        if not self._present(row):
            raise CgroupGone(f"simulated pod {name!r} is gone")
        return row

    def _present(self, row: int) -> bool:
        """`present_rows` for one row, without building arrays: one pod's reads ask it."""
        return row >= 0 and bool(self.start[row] <= self.now) and not self.removed[row]

    def present(self, name: str) -> bool:
        return self._present(self.index.get(name, -1))

    def ended(self, name: str) -> bool:
        return self.now >= float(self.end[self.row(name)])

    def counters(self, name: str) -> CpuCounters:
        row = self.row(name)
        return CpuCounters(
            int(self.busy_ns[row, 0]),
            int(self.nr_periods[row]),
            int(self.nr_throttled[row]),
            int(self.throttled_ns[row]),
        )

    def gpu_busy(self, name: str) -> int:
        return int(self.busy_ns[self.row(name), 1])

    def remove(self, name: str) -> None:
        row = self.index.get(name)
        if row is not None:
            self.removed[row] = True


def served_fractions(demand: FloatArray, served: FloatArray) -> FloatArray:
    """Per pod and resource, the share of its demand served; 1 where it demands nothing, so
    a coupled pod with no demand on one resource progresses at the other's."""
    asked = demand > 0
    return np.where(asked, np.minimum(served / np.where(asked, demand, 1.0), 1.0), 1.0)


def _others_least(fractions: FloatArray) -> FloatArray:
    """Per pod and resource, the least fraction among its other resources: how much of its
    demand on this one the pod can use."""
    least = np.ones_like(fractions)
    for r in range(fractions.shape[1]):
        others = np.delete(fractions, r, axis=1)
        least[:, r] = others.min(axis=1) if others.shape[1] else 1.0
    return least


def _limit(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


class SimCpu:
    """The CPU backend over a simulated node; cgroup names are pod names."""

    mode = "simulated"

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def capacity(self) -> float:
        return float(self.node.capacity[Resource.CPU])

    def exists(self, cgroup: str) -> bool:
        return self.node.present(cgroup)

    def is_empty(self, cgroup: str) -> bool:
        return self.node.ended(cgroup)

    def read(self, cgroup: str) -> CpuCounters:
        return self.node.counters(cgroup)

    def read_throttled(self, cgroup: str) -> tuple[int, int]:
        counters = self.node.counters(cgroup)
        return counters.nr_throttled, counters.throttled_ns

    def cgroup_set(self, cgroups: Sequence[str]) -> CgroupSet:
        return SimCgroups(self.node, cgroups)

    def read_limit(self, cgroup: str) -> float | None:
        return _limit(self.node.limit[self.node.row(cgroup), 0])

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        self.node.limit[self.node.row(cgroup), 0] = np.nan if limit is None else limit

    def read_shares(self, cgroup: str) -> int:
        return round(float(self.node.shares[self.node.row(cgroup)]))

    def write_shares(self, cgroup: str, shares: int) -> None:
        self.node.shares[self.node.row(cgroup)] = float(shares)

    def remove(self, cgroup: str) -> None:
        self.node.remove(cgroup)

    def forget(self, cgroup: str) -> None:
        """A simulated cgroup keeps nothing open."""


class SimCgroups:
    """Many simulated cgroups read and written at once, straight from the node's arrays."""

    def __init__(self, node: SimNode, cgroups: Sequence[str]) -> None:
        self.node = node
        self.names = list(cgroups)
        self.rows = np.array([node.index.get(name, -1) for name in cgroups], dtype=np.int64)

    def present(self, which: Positions) -> tuple[IntArray, BoolArray, Failures]:
        """The rows asked for, which of them exist, and why the others fail."""
        rows = self.rows[np.asarray(which, dtype=np.int64)]
        present = self.node.present_rows(rows)
        failed: Failures = {
            int(i): CgroupGone(f"simulated pod {self.names[which[i]]!r} is gone")
            for i in np.flatnonzero(~present).tolist()
        }
        return np.where(present, rows, 0), present, failed

    def read(self, which: Positions) -> CounterArrays:
        rows, present, failed = self.present(which)
        node = self.node
        return CounterArrays(
            np.where(present, node.busy_ns[rows, 0].astype(np.int64), 0),
            np.where(present, node.nr_periods[rows], 0),
            np.where(present, node.nr_throttled[rows], 0),
            failed,
            np.where(present, node.throttled_ns[rows].astype(np.int64), 0),
        )

    def read_throttled(self, which: Positions) -> tuple[IntArray, IntArray, Failures]:
        rows, present, failed = self.present(which)
        throttled_ns = self.node.throttled_ns[rows].astype(np.int64)
        return (
            np.where(present, self.node.nr_throttled[rows], 0),
            np.where(present, throttled_ns, 0),
            failed,
        )

    def empty(self, which: Positions) -> tuple[BoolArray, Failures]:
        rows, present, failed = self.present(which)
        return present & (self.node.now >= self.node.end[rows]), failed

    def write_limits(self, which: Positions, limits: Limits) -> Failures:
        rows, present, failed = self.present(which)
        self.node.limit[rows[present], 0] = np.asarray(limits, dtype=np.float64)[present]
        return failed


class SimGpu:
    """The GPU backend over a simulated node; vGPU ids are pod names. Over a Gemini node
    it writes REQUEST as GeminiLayer does: by tokens (`weighted`), the GPU minimum or 0."""

    mode = "simulated"

    def __init__(self, node: SimNode, request: str = "tokens", minimum: float = 0.0) -> None:
        self.node = node
        self.weighted = node.gemini and request == "tokens"
        self.minimum = minimum if node.gemini and request == "minimum" else 0.0
        self._weights = ClientWeights()

    def capacity(self) -> float:
        return float(self.node.capacity[Resource.GPU])

    def devices(self) -> tuple[float, ...]:
        return (DEVICE_CAPACITY,) * self.node.gpus

    def device_of(self, vgpu_id: str) -> int:
        return int(self.node.device[self.node.row(vgpu_id)])

    def track(self, vgpu_id: str, cgroup: str) -> None:
        """A simulated pod's GPU use is its own row's."""

    def weigh(self, vgpu_id: str, tokens: float) -> None:
        if self.weighted:
            self._weights.set(vgpu_id, tokens)

    def quantize(self, vgpu_id: str, limit: float, held: float | None) -> float:
        """A simulated GPU holds any share exactly."""
        return limit

    def exists(self, vgpu_id: str) -> bool:
        return self.node.present(vgpu_id)

    def read(self, vgpu_id: str) -> int:
        return self.node.gpu_busy(vgpu_id)

    def busy_set(self, vgpu_ids: Sequence[str]) -> SimBusy:
        return SimBusy(SimCgroups(self.node, vgpu_ids))

    def read_limit(self, vgpu_id: str) -> float | None:
        return _limit(self.node.limit[self.node.row(vgpu_id), 1])

    def write_limit(self, vgpu_id: str, limit: float | None) -> None:
        row = self.node.row(vgpu_id)
        self.node.limit[row, 1] = np.nan if limit is None else limit
        if self.minimum:
            self.node.request[row] = min(self.minimum, 100.0 if limit is None else limit)

    def remove(self, vgpu_id: str) -> None:
        """The pod itself goes with its CPU cgroup; its weight goes now."""
        self._weights.drop(vgpu_id)

    def commit(self) -> None:
        """Simulated limits take effect at once; REQUESTs by tokens are remade, device by
        device, when the weights changed."""
        if not self._weights.taken():
            return
        node = self.node
        tokens = self._weights.tokens
        rows = {name: node.index[name] for name in tokens if node.present(name)}
        for device in range(node.gpus):
            weights = {n: tokens[n] for n, r in rows.items() if node.device[r] == device}
            for name, fraction in token_requests(weights, 0.0).items():
                node.request[rows[name]] = fraction * 100.0


class SimBusy:
    """Many simulated GPU clients' busy time at once, from the node's arrays."""

    def __init__(self, rows: SimCgroups) -> None:
        self.rows = rows

    def read(self, which: Positions) -> tuple[Counts, Failures]:
        rows, present, failed = self.rows.present(which)
        return np.where(present, self.rows.node.busy_ns[rows, 1].astype(np.int64), 0), failed
