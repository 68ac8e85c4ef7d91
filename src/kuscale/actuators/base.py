"""The interface between the monitor and whatever carries a pod's CPU limit to the kernel."""

from __future__ import annotations

from typing import Protocol

from kuscale.model import Held, PodSpec


class CpuActuator(Protocol):
    mode: str

    def hold(self, spec: PodSpec) -> Held:
        """Take the pod over: read what it has, and make its own limit the one that binds.
        Raises before changing anything when the pod cannot be managed this way."""
        ...

    def write(self, spec: PodSpec, limit: float) -> float:
        """Set the pod's limit in percent; the limit it now holds, which rounding or the
        API's rules may make differ from the one asked for."""
        ...

    def release(self, spec: PodSpec, held: Held) -> None:
        """Give back what `hold` found, in the order the kernel accepts."""
        ...
