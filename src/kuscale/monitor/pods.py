"""The pods the monitor manages: what each is (spec, status, what it had before kuscale) as
objects, and its numbers as a row of the monitor's table, read through these views."""

from __future__ import annotations

from dataclasses import dataclass, field

from kuscale.model import Held, Original, PodSpec, PodStatus, Resource
from kuscale.monitor.table import PodTable


class ResourceView:
    """One resource of one pod, read from its row: the original's ResourceInfo."""

    __slots__ = ("_resource", "_row", "_table")

    def __init__(self, table: PodTable, row: int, resource: Resource) -> None:
        self._table = table
        self._row = row
        self._resource = resource

    def _value(self, name: str) -> float:
        return float(getattr(self._table.columns, name)[self._row, self._resource])

    @property
    def price(self) -> float:
        return self._value("price")

    @property
    def limit(self) -> float:
        return self._value("limit")

    @property
    def usage(self) -> float:
        return self._value("usage")

    @property
    def avg_usage(self) -> float:
        return self._value("avg_usage")

    @property
    def demand(self) -> float:
        return self._value("demand")

    @property
    def spread(self) -> float:
        return self._value("spread")

    @property
    def weight(self) -> float:
        return self._value("weight")

    @property
    def starved(self) -> bool:
        return bool(self._table.columns.starved[self._row, self._resource])

    @property
    def changed(self) -> bool:
        return bool(self._table.columns.changed[self._row, self._resource])

    @property
    def history(self) -> list[float]:
        return self._table.history(self._row, self._resource)


@dataclass(slots=True, eq=False)
class PodState:
    """A pod the monitor manages: the original's PodInfo. Its numbers live in `row` of the
    monitor's table; what is not a number lives here."""

    spec: PodSpec
    table: PodTable
    row: int
    status: PodStatus = PodStatus.INITIALIZING
    reason: str = ""
    held: Held | None = None
    """What the CPU actuator found when it took the pod over, to give back."""
    original: Original | None = None
    """Everything the pod had before kuscale, as recorded before the first change."""
    taken_over: bool = False
    """This agent lifted the pod's own limits and made its limit the one that binds: what it
    gives back is then the recorded truth, and the record entry can go."""
    restore_shares: int | None = None
    """cpu.shares before kuscale set them from tokens (None: not changed)."""
    gpu_restore_limit: float | None = None
    """The GPU share before kuscale first changed it (None: unlimited)."""
    key: str = field(init=False)
    """`namespace/name`, kept rather than formatted: every tick reads it for every pod."""
    resources: dict[Resource, ResourceView] = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.spec.key
        self.resources = {r: ResourceView(self.table, self.row, r) for r in self.spec.resources}

    def uses(self, resource: Resource) -> bool:
        return resource in self.resources

    @property
    def token_queue(self) -> float:
        return float(self.table.columns.queue[self.row])

    @property
    def updated_count(self) -> int:
        return int(self.table.columns.updates[self.row])

    @property
    def gpu_device(self) -> int:
        return int(self.table.columns.device[self.row])


@dataclass(slots=True)
class Registry:
    """Running and completed pods, keyed by namespace/name. Owned by the monitor's thread."""

    running: dict[str, PodState] = field(default_factory=dict)
    completed: dict[str, PodState] = field(default_factory=dict)
    completed_limit: int = 1000

    def complete(
        self, key: str, status: PodStatus = PodStatus.COMPLETED, reason: str = ""
    ) -> list[PodState]:
        """Move the pod to the completed ones; the completed pods this pushes out (the oldest
        past the limit, and an earlier one of the same key), whose rows can be reused."""
        pod = self.running.pop(key, None)
        if pod is None:
            return []
        pod.status = status
        pod.reason = reason
        dropped = [self.completed.pop(key)] if key in self.completed else []
        self.completed[key] = pod
        while len(self.completed) > self.completed_limit:
            dropped.append(self.completed.pop(next(iter(self.completed))))
        return dropped
