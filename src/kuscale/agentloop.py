"""What every agent shares: a monitor whose loop runs on the caller's thread or its own."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from kuscale.monitor import Monitor, Stop


class AgentLoop(ABC):
    """`run` blocks until a Stop; `start`/`stop` run it in a thread (tests, the demo)."""

    monitor: Monitor
    listeners: list[Callable[[dict[str, Any]], None]]
    """Called with every tick's snapshot (the exporter, a recorder)."""
    _thread: threading.Thread | None = None

    def _on_tick(self, snapshot: dict[str, Any]) -> None:
        for listener in self.listeners:
            listener(snapshot)

    @abstractmethod
    def run(self) -> None:
        """Start the agent's sources, run the monitor's loop, stop the sources."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kuscale-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to stop; it restores every limit it changed before returning."""
        self.monitor.submit(Stop())
        if self._thread is not None:
            self._thread.join(timeout)
