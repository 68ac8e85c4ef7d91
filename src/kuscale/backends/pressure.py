"""CPU pressure (PSI) of a cgroup v2: its stall totals, and triggers the kernel wakes us for.

A watch that polls throttling counters sees a starving pod only at its next look; a PSI
trigger makes the kernel itself wake a poller once a cgroup's tasks have stalled for CPU
`stall_us` within a `window_us`. The kernel's rules (Documentation/accounting/psi.rst): the
trigger is the text `some <stall> <window>` written to an open `cpu.pressure`, lives as long
as that descriptor, fires as POLLPRI, and the window lies between 500 ms and 10 s.
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kuscale.backends.base import BackendError, RangeError
from kuscale.backends.files import read_text
from kuscale.model import is_decimal

MIN_WINDOW_US = 500_000
MAX_WINDOW_US = 10_000_000


@dataclass(frozen=True, slots=True)
class Pressure:
    """Microseconds some (`some`) or all (`full`) of a cgroup's runnable tasks waited for CPU."""

    some_total_us: int
    full_total_us: int


def parse_pressure(text: str, path: str) -> Pressure:
    """`some avg10=.. avg60=.. avg300=.. total=N` and the same for `full` (absent before 5.13
    for CPU: then `full` is 0)."""
    totals = {"some": -1, "full": 0}
    for line in text.splitlines():
        kind, _, fields = line.partition(" ")
        values = dict(field.partition("=")[::2] for field in fields.split())
        total = values.get("total", "")
        if kind in totals and is_decimal(total):
            totals[kind] = int(total)
    if totals["some"] < 0:
        raise BackendError(f"{path} has no 'some ... total=N' line")
    return Pressure(totals["some"], totals["full"])


def read_pressure(path: str) -> Pressure:
    return parse_pressure(read_text(path), path)


class PressureTrigger:
    """One registered trigger on one cgroup's `cpu.pressure`; close it to unregister."""

    def __init__(self, path: str, stall_us: int, window_us: int) -> None:
        if not MIN_WINDOW_US <= window_us <= MAX_WINDOW_US:
            raise RangeError(
                f"PSI window {window_us} µs is outside [{MIN_WINDOW_US}, {MAX_WINDOW_US}]"
            )
        if not 0 < stall_us <= window_us:
            raise RangeError(f"PSI stall {stall_us} µs is outside (0, window {window_us}]")
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            raise BackendError(f"cannot open {path}: {err.strerror}") from err
        try:
            os.write(self._fd, f"some {stall_us} {window_us}".encode("ascii"))
        except OSError as err:
            os.close(self._fd)
            raise BackendError(f"kernel refused a PSI trigger on {path}: {err.strerror}") from err

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def wait_for_pressure(
    triggers: Sequence[PressureTrigger], timeout: float, wake: int | None = None
) -> tuple[list[PressureTrigger], bool]:
    """The triggers that fired within `timeout` seconds (none when it passed quietly), and
    whether `wake` (a descriptor another thread writes to end the wait) became readable.

    POLLERR means the cgroup was removed under the trigger: it is returned too, so the
    caller looks at the cgroup and finds it gone."""
    poller = select.poll()
    by_fd = {trigger.fileno(): trigger for trigger in triggers}
    for fd in by_fd:
        poller.register(fd, select.POLLPRI)
    if wake is not None:
        poller.register(wake, select.POLLIN)
    ready = [fd for fd, _ in poller.poll(max(timeout, 0.0) * 1000.0)]
    return [by_fd[fd] for fd in ready if fd in by_fd], wake in ready


@runtime_checkable
class PressureSource(Protocol):
    """A CPU backend whose cgroups have `cpu.pressure` (cgroup v2)."""

    def pressure_trigger(self, cgroup: str, stall_us: int, window_us: int) -> PressureTrigger:
        """A trigger registered on `cgroup`: BackendError where the kernel refuses it,
        CgroupGone where the cgroup is gone."""
        ...
