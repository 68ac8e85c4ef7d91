"""Drive the real monitor over a simulated node on simulated time."""

from __future__ import annotations

from kuscale.monitor import Monitor
from kuscale.sim.node import SimNode

STEP_SECONDS = 0.1


def run_simulation(node: SimNode, monitor: Monitor, duration: float) -> None:
    """Tick the monitor every period and advance the node between ticks, then restore."""
    period = monitor.config.period
    steps = max(1, round(period / STEP_SECONDS))
    while node.now <= duration:
        monitor.tick(node.now)
        for _ in range(steps):
            node.advance(period / steps)
    monitor.tick(node.now)
    monitor.restore()
