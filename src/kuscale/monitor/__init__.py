"""The monitor: the one owner of every managed pod's state, and the loop that scales them.

Its parts, each in its own module and each with one reason to change:

- `table`: every pod's numbers as one table of arrays, a row per pod;
- `pods`: the pods as objects (spec, status, what they had) and the registry;
- `lifecycle`: adopting, refusing, taking over, withdrawing and completing pods;
- `sampling`: each tick's counters read into arrays and turned into usage;
- `deciding`: one Observation, one policy call, its answer kept;
- `actuating`: limits written where they changed, and given back;
- `watching`: the fast path between ticks;
- `exporting`: the snapshot every view reads;
- `events`: what other threads may queue, and what is logged per pod;
- `loop`: the Monitor that runs them once per period.
"""

from kuscale.monitor.actuating import WRITE_RESOLUTION
from kuscale.monitor.events import Event, PodAdded, PodRemoved, Stop, TickStats
from kuscale.monitor.exporting import pod_view
from kuscale.monitor.lifecycle import RECORD_GRACE
from kuscale.monitor.loop import Monitor
from kuscale.monitor.pods import PodState, Registry, ResourceView

__all__ = [
    "RECORD_GRACE",
    "WRITE_RESOLUTION",
    "Event",
    "Monitor",
    "PodAdded",
    "PodRemoved",
    "PodState",
    "Registry",
    "ResourceView",
    "Stop",
    "TickStats",
    "pod_view",
]
