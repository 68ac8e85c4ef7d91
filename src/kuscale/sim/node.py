"""A simulated node: simulated time, counters and a CFS-like share of a full node.

Each pod has a demand schedule per resource. Over a step it receives min(demand, limit); when
those add up to more than the node has, the node shares by weight (cpu.shares for the CPU,
equal for the GPU) capped at what each pod asks, as the kernel's fair scheduler would. A pod
whose demand exceeds its limit is throttled in every CFS period of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kuscale.backends.base import CgroupGone
from kuscale.model import CpuCounters
from kuscale.policy.waterfill import water_fill
from kuscale.workload import Schedule

CFS_PERIOD = 0.1


@dataclass(slots=True)
class SimPod:
    cpu: Schedule
    gpu: Schedule | None = None
    end: float = float("inf")
    cpu_limit: float | None = None
    gpu_limit: float | None = None
    shares: float = 1024.0
    usage_ns: float = 0.0
    gpu_busy_ns: float = 0.0
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_ns: float = 0.0
    last_cpu: float = 0.0
    last_gpu: float = 0.0


@dataclass(slots=True)
class SimNode:
    cores: int = 2
    gpus: int = 1
    now: float = 0.0
    pods: dict[str, SimPod] = field(default_factory=dict)

    def add(self, name: str, pod: SimPod) -> None:
        self.pods[name] = pod

    def _grant(
        self, capacity: float, demand: list[float], limits: list[float | None], weights: list[float]
    ) -> np.ndarray:
        wanted = np.array(
            [
                min(d, capacity if lim is None else lim)
                for d, lim in zip(demand, limits, strict=True)
            ],
            dtype=np.float64,
        )
        return water_fill(capacity, np.array(weights, dtype=np.float64), wanted)

    def advance(self, seconds: float) -> None:
        """Run every live pod for `seconds` of simulated time at its current demand."""
        live = [(name, pod) for name, pod in self.pods.items() if self.now < pod.end]
        if live:
            pods = [pod for _, pod in live]
            cpu_demand = [pod.cpu.at(self.now) for pod in pods]
            gpu_demand = [pod.gpu.at(self.now) if pod.gpu else 0.0 for pod in pods]
            cpu = self._grant(
                self.cores * 100.0,
                cpu_demand,
                [p.cpu_limit for p in pods],
                [p.shares for p in pods],
            )
            gpu = self._grant(
                self.gpus * 100.0, gpu_demand, [p.gpu_limit for p in pods], [1.0] * len(pods)
            )
            periods = max(1, round(seconds / CFS_PERIOD))
            for i, pod in enumerate(pods):
                pod.last_cpu, pod.last_gpu = float(cpu[i]), float(gpu[i])
                pod.usage_ns += cpu[i] / 100.0 * seconds * 1e9
                pod.gpu_busy_ns += gpu[i] / 100.0 * seconds * 1e9
                pod.nr_periods += periods
                if pod.cpu_limit is not None and cpu_demand[i] > pod.cpu_limit:
                    pod.nr_throttled += periods
                    pod.throttled_ns += (cpu_demand[i] - pod.cpu_limit) / 100.0 * seconds * 1e9
        self.now += seconds

    def pod(self, name: str) -> SimPod:
        try:
            return self.pods[name]
        except KeyError:
            raise CgroupGone(f"simulated pod {name!r} is gone") from None


class SimCpu:
    """The CPU backend over a simulated node; cgroup names are pod names."""

    mode = "simulated"

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def capacity(self) -> float:
        return self.node.cores * 100.0

    def exists(self, cgroup: str) -> bool:
        return cgroup in self.node.pods

    def is_empty(self, cgroup: str) -> bool:
        return self.node.now >= self.node.pod(cgroup).end

    def read(self, cgroup: str) -> CpuCounters:
        pod = self.node.pod(cgroup)
        return CpuCounters(
            int(pod.usage_ns), pod.nr_periods, pod.nr_throttled, int(pod.throttled_ns)
        )

    def read_limit(self, cgroup: str) -> float | None:
        return self.node.pod(cgroup).cpu_limit

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        self.node.pod(cgroup).cpu_limit = limit

    def read_shares(self, cgroup: str) -> int:
        return round(self.node.pod(cgroup).shares)

    def write_shares(self, cgroup: str, shares: int) -> None:
        self.node.pod(cgroup).shares = float(shares)

    def remove(self, cgroup: str) -> None:
        self.node.pods.pop(cgroup, None)


class SimGpu:
    """The GPU backend over a simulated node; vGPU ids are pod names."""

    mode = "simulated"

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def capacity(self) -> float:
        return self.node.gpus * 100.0

    def exists(self, vgpu_id: str) -> bool:
        return vgpu_id in self.node.pods

    def read(self, vgpu_id: str) -> int:
        return int(self.node.pod(vgpu_id).gpu_busy_ns)

    def read_limit(self, vgpu_id: str) -> float | None:
        return self.node.pod(vgpu_id).gpu_limit

    def write_limit(self, vgpu_id: str, limit: float | None) -> None:
        self.node.pod(vgpu_id).gpu_limit = limit

    def remove(self, vgpu_id: str) -> None:
        """The pod itself goes with its CPU cgroup."""

    def commit(self) -> None:
        """Simulated limits take effect at once."""
