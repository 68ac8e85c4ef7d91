"""What every agent shares: a monitor whose loop runs on the caller's thread or its own."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

from kuscale.monitor import Monitor, Stop


class AgentLoop(ABC):
    """`run` blocks until a Stop; `start`/`stop` run it in a thread (tests, the demo)."""

    monitor: Monitor
    _thread: threading.Thread | None = None

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
