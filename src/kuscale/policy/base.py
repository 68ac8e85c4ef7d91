"""The interface every allocation rule implements: arrays in, arrays out, no I/O, no clock.

Arrays have one row per pod and one column per resource, in `model.RESOURCES` order. A pod
that does not use a resource has `uses` False in that column; rules must leave its limit 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Observation:
    """What the monitor measured this tick, for the pods that have a valid sample."""

    period: float
    """T: seconds until the next decision."""
    elapsed: FloatArray
    """Δt per pod: seconds since that pod's last update."""
    tokens: FloatArray
    """R per pod: reserved tokens per second."""
    queue: FloatArray
    """Q per pod: the token queue before this tick."""
    usage: FloatArray
    avg_usage: FloatArray
    limits: FloatArray
    """The limits each pod held during Δt."""
    starved: BoolArray
    """True where the pod was throttled or pinned at its limit during Δt."""
    demand: FloatArray
    """The previous tick's demand estimate (the rule's own memory)."""
    uses: BoolArray
    capacity: FloatArray
    """Node capacity per resource, percent (0 where the node has none)."""
    keys: tuple[str, ...] = ()
    """Each row's pod, for rules that remember pods across ticks (VPA's histograms)."""
    spread: FloatArray | None = field(default=None)
    """EWMA of |usage − last usage| per pod and resource; None where not measured."""
    throttled: FloatArray | None = field(default=None)
    """Share of the pod's CFS periods in Δt that were throttled, per resource (the GPU's is
    1 where it was pinned at its limit); None where not measured."""
    weighted: BoolArray | None = field(default=None)
    """Per resource: True where the kernel shares it among pods by their tokens inside every
    period (cpu.shares/cpu.weight from tokens), so limits may add up to more than the node
    has without handing contended capacity to whoever holds the larger limit."""
    device: IntArray | None = field(default=None)
    """The GPU device each pod's client runs on; None: one device of `capacity`."""
    device_capacity: FloatArray | None = field(default=None)
    """Each GPU device's capacity; `capacity`'s GPU entry is the largest of them."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def pod_keys(self) -> tuple[str, ...]:
        return self.keys or tuple(str(i) for i in range(self.size))

    def throttle_ratio(self) -> FloatArray:
        if self.throttled is not None:
            return self.throttled
        return self.starved.astype(np.float64)


@dataclass(frozen=True, slots=True)
class Starving:
    """Pods the watch saw throttled between ticks, with what they hold now."""

    period: float
    tokens: FloatArray
    queue: FloatArray
    """Q per pod as of the last tick: the credit its budget may draw on until the next."""
    limits: FloatArray
    """(n, m): the CPU limit each pod holds now, and the most it held of the others since the
    tick (what the period is charged for, which a raise must leave room for)."""
    uses: BoolArray
    capacity: FloatArray
    held: FloatArray
    """Per resource: the sum of every running pod's limit, these pods' included."""
    weighted: BoolArray
    """Per resource: True where the kernel shares it by tokens (see Observation)."""
    shortfall: FloatArray | None = None
    """Per pod, percent of a core it was short since the last look: the time it spent
    throttled, summed over CPUs, over the look's wall time (NaN where not known yet)."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class GpuLook:
    """Every pod holding a share of a GPU layer, as one watch pass found them: which were
    pinned at their limit since the last look, and what each used."""

    period: float
    tokens: FloatArray
    queue: FloatArray
    """Q per pod as of the last tick."""
    limits: FloatArray
    """(n, m): the GPU limit each pod holds now, and the most it held of the others since the
    tick."""
    uses: BoolArray
    usage: FloatArray
    """GPU use since the last look, percent, (n,)."""
    spread: FloatArray
    """The EWMA of the GPU use's tick-to-tick change, (n,)."""
    pinned: BoolArray
    """True where the pod used at least `1 − pin_tolerance` of its GPU limit."""
    device: IntArray
    device_capacity: FloatArray
    capacity: FloatArray
    weighted: bool = False
    """True where the layer shares each device by tokens (Gemini's REQUEST): limits need
    not fit the device, and nothing is taken from other pods."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class Decision:
    limits: FloatArray
    weights: FloatArray
    queue: FloatArray
    demand: FloatArray


class Policy(Protocol):
    """A rule that maps one tick's observation of all pods to their next limits."""

    name: str

    def decide(self, obs: Observation) -> Decision: ...

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        """Why a pod with these tokens and resources cannot be managed, or None.

        `committed` is the sum of the minimum limits of the pods already running.
        """
        ...

    def raise_starved(self, obs: Starving) -> FloatArray | None:
        """New limits (n, m) for pods seen starved between ticks, never below what they hold;
        None for a rule that waits for its tick."""
        ...

    def raise_pinned_gpu(self, obs: GpuLook) -> FloatArray | None:
        """New GPU limits (n,): pinned pods raised, others never above what they hold; None
        for a rule that waits for its tick."""
        ...


class WaitsForItsTick:
    """A rule with no fast path: it acts at its own pace, once a tick, whatever the watch
    sees between ticks (the original and the baselines)."""

    def raise_starved(self, obs: Starving) -> FloatArray | None:
        return None

    def raise_pinned_gpu(self, obs: GpuLook) -> FloatArray | None:
        return None
