"""The loop: sample → decide → actuate → export, once per period, and the watch between.

The monitor is the one owner of all mutable pod state: the table of numbers and the registry
of pods. Other threads only queue events, which the loop handles between ticks. A failure on
one pod is logged, counted and skipped; it never stops the others or the loop.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kuscale import faults
from kuscale.actuators.base import CpuActuator
from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.base import CpuBackend, GpuBackend
from kuscale.config import AgentConfig
from kuscale.model import RESOURCES
from kuscale.monitor.actuating import Actuation
from kuscale.monitor.deciding import Decider
from kuscale.monitor.events import Event, PodAdded, Stop, TickStats
from kuscale.monitor.exporting import snapshot
from kuscale.monitor.lifecycle import Lifecycle
from kuscale.monitor.pods import PodState, Registry
from kuscale.monitor.sampling import Sampler
from kuscale.monitor.table import PodTable
from kuscale.monitor.watching import PRESSURE_WINDOW_US, PressureWake, Watch
from kuscale.originals import OriginalsRecord
from kuscale.policy import Policy, make_policy


class Monitor:
    """Owns the registry and the table, and runs the rule over every running pod each
    period; each step is one of the parts it is built from."""

    def __init__(
        self,
        cpu: CpuBackend,
        gpu: GpuBackend | None,
        config: AgentConfig,
        policy: Policy | None = None,
        on_tick: Callable[[dict[str, Any]], None] | None = None,
        on_completed: Callable[[PodState], None] | None = None,
        actuator: CpuActuator | None = None,
        originals: OriginalsRecord | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        """`on_stop` runs once the loop ends, before every limit is given back and the
        record let go: what must be gone before the next agent starts."""
        self.cpu = cpu
        self.gpu = gpu
        self.actuator = actuator or CgroupActuator(cpu)
        self.config = config
        self.policy = policy or make_policy(config.policy, config.policy_config)
        self.registry = Registry()
        self.table = PodTable(config.window)
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.stats = TickStats()
        self.on_tick = on_tick
        self.on_stop = on_stop
        self.capacity = np.array([cpu.capacity(), gpu.capacity() if gpu else 0.0], dtype=np.float64)
        """The node's totals per resource."""
        self.device_capacity = np.array(gpu.devices() if gpu else (), dtype=np.float64)
        """Each GPU device's capacity: a pod's GPU share lives on one device."""
        reach = np.array([self.capacity[0], self.device_capacity.max(initial=0.0)])
        """The most one pod can hold per resource: the node's CPU, one device's GPU."""
        weighted = np.array([config.kernel_shares, gpu is not None and gpu.weighted]) & (
            not config.monitor_only
        )
        """Per resource: shared by weights inside every period (cpu.shares; the GPU's layer
        where it shares by tokens), so limits need not fit the node."""
        self.actuation = Actuation(
            self.table, cpu, gpu, self.actuator, config, self.stats, ceilings=reach
        )
        self.lifecycle = Lifecycle(
            self.table,
            self.registry,
            cpu,
            gpu,
            self.actuator,
            self.actuation,
            config,
            self.policy,
            self.stats,
            originals,
            on_completed,
            reach,
            self.device_capacity,
        )
        pinned_at = 1.0 - config.policy_config.pin_tolerance
        self.sampler = Sampler(
            self.table,
            self.registry,
            cpu,
            gpu,
            self.actuator,
            self.lifecycle,
            self.stats,
            reach,
            pinned_at,
        )
        self.decider = Decider(
            self.table, self.policy, config, reach, weighted, self.device_capacity
        )
        self.watcher = Watch(
            self.table,
            self.sampler,
            self.actuation,
            self.policy,
            self.stats,
            config.period,
            reach,
            weighted,
            gpu,
            self.device_capacity,
            pinned_at,
        )
        self._watching = config.watch_interval > 0 and not config.monitor_only
        self.pressure = PressureWake(cpu, self._watching and config.watch_pressure)
        self._wake: int | None = None
        """An eventfd that `submit` writes while the loop sleeps on pressure triggers."""
        self._wake_lock = threading.RLock()
        """Taken by `submit` and by the loop closing the eventfd: reentrant, since a signal
        handler submits on the loop's own thread."""
        self._stopping = False

    # Events: the only way in from other threads.

    def submit(self, event: Event) -> None:
        """Thread-safe: queue an event for the loop thread, and wake it where it sleeps."""
        self.events.put(event)
        with self._wake_lock:
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)

    def _handle(self, event: Event, now: float) -> None:
        if isinstance(event, Stop):
            self._stopping = True
        elif isinstance(event, PodAdded):
            self.lifecycle.offer(event.spec, now)
        elif event.key in self.registry.running:
            self.lifecycle.withdraw(self.registry.running[event.key], "removed by its source")

    def _drain(self, now: float) -> None:
        while True:
            try:
                self._handle(self.events.get_nowait(), now)
            except queue.Empty:
                return

    # The tick and the watch.

    def tick(self, now: float) -> None:
        """One pass over every running pod; the snapshot is built only for a listener."""
        started = time.perf_counter()
        self._drain(now)
        sample = self.sampler.sample(now)
        faults.reached("tick.sampled")
        if sample.pods:
            decision = self.decider.decide(sample)
            faults.reached("tick.decided")
            self.actuation.write_decided(
                sample.pods, sample.rows, decision.limits, sample.writer, sample.positions
            )
        np.copyto(self.table.columns.peak, self.table.columns.limit)
        self.lifecycle.settle_record(now)
        self.actuation.commit()
        self.stats.ticks += 1
        self.stats.last_tick = now
        self.stats.last_duration = time.perf_counter() - started
        if self.on_tick:
            self.on_tick(self.snapshot())

    def watch(self, now: float) -> None:
        """The fast path between ticks (see `Watch`); a monitor-only agent changes nothing."""
        if not self.config.monitor_only:
            self.watcher.look(now)

    # Running and stopping.

    def run(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Tick every period until a Stop event; then restore what was changed."""
        next_tick = clock()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            while not self._stopping:
                self.tick(clock())
                next_tick += self.config.period
                delay = next_tick - clock()
                if delay < 0:
                    next_tick = clock()
                    delay = 0.0
                self._wait(delay, clock)
        finally:
            self.pressure.close()
            with self._wake_lock:
                os.close(self._wake)
                self._wake = None
            if self.on_stop is not None:
                self.on_stop()
            self.restore()

    def _wait(self, delay: float, clock: Callable[[], float]) -> None:
        """Sleep until the next tick, handling events as they come (a Stop ends the wait):
        on the pods' pressure triggers where the kernel has them, else polling."""
        deadline = clock() + delay
        if (
            self._wake is not None
            and not self.watcher.watches_gpu()
            and self.pressure.follow(self.watcher.managed_cgroups())
        ):
            self._sleep_on_pressure(deadline, clock, self._wake)
        else:
            self._poll(deadline, clock)

    def _sleep_on_pressure(self, deadline: float, clock: Callable[[], float], wake: int) -> None:
        """The watch looks when a pod stalled for CPU, then every `watch_interval` for one
        PSI window, since the throttle count may rise only after the kernel told of the
        stall and the trigger fires at most once a window. Events wake the loop through
        `wake`; a change of pods that leaves one without a trigger falls back to polling."""
        interval = self.config.watch_interval
        looking_until, next_look = -math.inf, math.inf
        while not self._stopping:
            now = clock()
            if now >= deadline:
                return
            if now >= next_look:
                self.watch(now)
                next_look = now + interval if now + interval < looking_until else math.inf
            stalled, woken = self.pressure.wait(wake, min(deadline, next_look) - now)
            if woken:
                os.eventfd_read(wake)
                self._drain(clock())
                if not self.pressure.follow(self.watcher.managed_cgroups()):
                    self._poll(deadline, clock)
                    return
            if stalled:
                now = clock()
                self.watch(now)
                looking_until, next_look = now + PRESSURE_WINDOW_US / 1e6, now + interval

    def _poll(self, deadline: float, clock: Callable[[], float]) -> None:
        """Handle events as they come, running the watch every `watch_interval`."""
        interval = self.config.watch_interval
        next_watch = clock() + interval if interval > 0 else math.inf
        while not self._stopping:
            now = clock()
            if now >= deadline:
                return
            if now >= next_watch:
                self.watch(now)
                next_watch = now + interval
            try:
                event = self.events.get(timeout=max(min(deadline, next_watch) - clock(), 0.0))
            except queue.Empty:
                continue
            self._handle(event, clock())

    def restore(self) -> None:
        """Put back every limit kuscale changed, so no workload stays throttled behind it."""
        self.lifecycle.restore_all()

    # Export.

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view of every pod, for `kuscale status`, the demo and exporters."""
        head = {
            "time": time.time(),
            "pid": os.getpid(),
            "mode": self.cpu.mode,
            "actuator": self.actuator.mode,
            "gpu_mode": self.gpu.mode if self.gpu else None,
            "policy": self.policy.name,
            "period": self.config.period,
            "monitor_only": self.config.monitor_only,
            "capacity": {r.label: float(self.capacity[r]) for r in RESOURCES},
            "ticks": self.stats.ticks,
            "fast_raises": self.stats.fast_raises,
            "gpu_fast_raises": self.stats.gpu_fast_raises,
            "watch": self.pressure.mode if self._watching else "off",
            "tick_seconds": self.stats.last_duration,
            "errors": dict(self.stats.errors),
        }
        return snapshot(head, self.registry, self.table, self.device_capacity)
