"""Local discovery: turn registrations in the state dir into monitor events.

It runs in its own thread and only ever puts events on the monitor's queue; the monitor's
thread is the one that adopts pods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kuscale.local.statedir import StateDir
from kuscale.model import PodSpec
from kuscale.monitor import Event, PodAdded, PodRemoved

log = logging.getLogger("kuscale.local")


class LocalDiscovery:
    def __init__(self, state: StateDir, submit: Callable[[Event], None], interval: float) -> None:
        self.state = state
        self.submit = submit
        self.interval = interval
        self._known: dict[str, PodSpec] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-discovery", daemon=True)

    def scan(self) -> None:
        """Announce new registrations and withdrawn ones."""
        current = self.state.registrations()
        for name, spec in current.items():
            if self._known.get(name) != spec:
                self.submit(PodAdded(spec))
        for name, spec in self._known.items():
            if name not in current:
                self.submit(PodRemoved(spec.key))
        self._known = current

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.scan()
            except OSError as err:
                log.warning("cannot scan %s: %s", self.state.pods, err)

    def start(self) -> None:
        self.scan()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
