"""The interfaces between the monitor and whatever holds the counters and the limits.

The kernel's cgroups, the vGPU layer, the GPU emulator and the simulator all sit behind
these, so the monitor and the policies never know which one they drive.
"""

from __future__ import annotations

from typing import Protocol

from kuscale.model import CpuCounters


class BackendError(Exception):
    """A read or write that failed for this pod only; the loop logs it and goes on."""

    kind = "io"


class CgroupGone(BackendError):
    """The pod's cgroup (or vGPU directory) no longer exists: the pod has completed."""

    kind = "gone"


class CounterError(BackendError):
    """A counter file held something that is not a counter."""

    kind = "garbage"


class Unmanageable(BackendError):
    """A pod this actuator cannot scale at all, found before anything was changed; it is
    refused with the reason rather than retried every tick."""

    kind = "refused"


class RangeError(BackendError):
    """A value outside what the kernel accepts; refused before any write."""

    kind = "range"


class CpuBackend(Protocol):
    """CPU usage, throttling and quota of cgroups named relative to the backend's root."""

    mode: str

    def capacity(self) -> float:
        """Percent of one core the node can give pods: cores × 100."""
        ...

    def exists(self, cgroup: str) -> bool: ...

    def is_empty(self, cgroup: str) -> bool:
        """True when no process is left in the cgroup."""
        ...

    def read(self, cgroup: str) -> CpuCounters: ...

    def read_throttled(self, cgroup: str) -> tuple[int, int]:
        """CFS periods throttled so far and the time throttled in ns, summed over the CPUs
        the cgroup ran on (cpu.stat `nr_throttled`, and `throttled_time` on v1 or
        `throttled_usec` on v2): the watch's one read."""
        ...

    def read_limit(self, cgroup: str) -> float | None:
        """The current limit in percent, None for unlimited."""
        ...

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        """Set the limit in percent (None: unlimited), after checking the kernel's range."""
        ...

    def read_shares(self, cgroup: str) -> int:
        """The cgroup's CPU weight as v1 cpu.shares (2..262144)."""
        ...

    def write_shares(self, cgroup: str, shares: int) -> None: ...

    def remove(self, cgroup: str) -> None:
        """Remove a cgroup kuscale created, once it is empty."""
        ...

    def forget(self, cgroup: str) -> None:
        """Close what is kept open for a cgroup kuscale no longer manages."""
        ...


class GpuBackend(Protocol):
    """GPU busy time and time-share limits of vGPU clients named by id."""

    mode: str
    weighted: bool
    """True where the layer shares each device among its clients by the weights `weigh`
    gives, serving any client below its limit (Gemini with REQUEST from tokens): the GPU's
    kernel weights. Limits then carry budgets alone and may add up to more than a device."""

    def capacity(self) -> float:
        """Percent of one GPU the node can give pods: GPUs × 100."""
        ...

    def devices(self) -> tuple[float, ...]:
        """Capacity of each device the layer schedules on its own, percent: a client's share
        lives on one device, and the devices' sum is `capacity()`."""
        ...

    def device_of(self, vgpu_id: str) -> int:
        """The device the client runs on, an index into `devices()`."""
        ...

    def track(self, vgpu_id: str, cgroup: str) -> None:
        """The cgroup whose processes are the client, for layers that measure use by process."""
        ...

    def weigh(self, vgpu_id: str, tokens: float) -> None:
        """The client's weight on its device: its pod's tokens (ignored where not
        `weighted`)."""
        ...

    def quantize(self, vgpu_id: str, limit: float, held: float | None) -> float:
        """The share the client will hold when asked for `limit` while holding `held` (None:
        nothing set yet): never more than `limit` where the layer can change shares, so a
        budget is never overspent; a layer that cannot (HAMi) says what it holds anyway,
        so the pod is charged for it and any overspend shows."""
        ...

    def exists(self, vgpu_id: str) -> bool: ...

    def read(self, vgpu_id: str) -> int:
        """Cumulative busy nanoseconds of the client."""
        ...

    def read_limit(self, vgpu_id: str) -> float | None: ...

    def write_limit(self, vgpu_id: str, limit: float | None) -> None: ...

    def remove(self, vgpu_id: str) -> None: ...

    def commit(self) -> None:
        """Make the scheduler take the limits written this tick (one reload per tick)."""
        ...
