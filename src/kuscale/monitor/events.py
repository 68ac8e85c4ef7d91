"""What other threads may hand the monitor, and what it says about each pod.

Discovery sources, signal handlers and the device plugin never touch the registry: they put
these events on the monitor's queue, and the loop thread handles them between ticks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kuscale.backends.base import BackendError
from kuscale.logs import event
from kuscale.model import PodSpec

log = logging.getLogger("kuscale.monitor")


@dataclass(frozen=True, slots=True)
class PodAdded:
    spec: PodSpec


@dataclass(frozen=True, slots=True)
class PodRemoved:
    key: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Event = PodAdded | PodRemoved | Stop


@dataclass(slots=True)
class TickStats:
    ticks: int = 0
    fast_raises: int = 0
    """CPU limits the watch raised between ticks."""
    gpu_fast_raises: int = 0
    """GPU limits the watch raised between ticks."""
    last_tick: float | None = None
    last_duration: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)


def pod_event(
    spec: PodSpec, level: int, name: str, message: str, *args: Any, **fields: Any
) -> None:
    """An event about one pod: `message` starts with `pod %s`, filled with its key."""
    event(
        log,
        level,
        name,
        message,
        spec.key,
        *args,
        pod=spec.name,
        namespace=spec.namespace,
        **fields,
    )


def count_error(stats: TickStats, spec: PodSpec, err: BackendError) -> None:
    """A failure on one pod: counted by kind and logged; the loop goes on."""
    stats.errors[err.kind] += 1
    pod_event(
        spec,
        logging.WARNING,
        "actuation_error",
        "pod %s: %s",
        err,
        kind=err.kind,
        error=str(err),
    )
