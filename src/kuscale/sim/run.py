"""Drive the real monitor and a real policy over a simulated node on simulated time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kuscale.model import PodSpec, PodStatus, Resource
from kuscale.monitor import Monitor, PodAdded
from kuscale.policy import Decision, Observation, Policy, make_policy
from kuscale.policy.base import BoolArray, FloatArray, GpuLook, Starving
from kuscale.sim.node import SimCpu, SimGpu, SimNode
from kuscale.sim.scenario import Scenario

STEP_SECONDS = 0.1


def run_simulation(node: SimNode, monitor: Monitor, duration: float) -> None:
    """Tick the monitor every period and advance the node between ticks, then restore."""
    period = monitor.config.period
    while node.now <= duration:
        monitor.tick(node.now)
        run_period(node, monitor, period)
    monitor.tick(node.now)
    monitor.restore()


def run_period(node: SimNode, monitor: Monitor, period: float) -> tuple[FloatArray, FloatArray]:
    """Advance the node one period in steps of the monitor's watch interval (of
    STEP_SECONDS when the watch is off), watching between steps as the agent does.

    Returns the limits to charge for the period — the highest each pod held, since a pod
    is charged for a raise as if it held it from the period's start — and the mean service."""
    interval = monitor.config.watch_interval or STEP_SECONDS
    steps = max(1, round(period / interval))
    held = node.limit.copy()
    served = np.zeros_like(node.granted)
    start = node.now
    for step in range(steps):
        if step and monitor.config.watch_interval > 0:
            monitor.watch(node.now)
            held = np.fmax(held, node.limit)
        node.advance_to(start + period * (step + 1) / steps)
        served += node.granted
    return held, served / steps


class TimedPolicy:
    """A policy with a stopwatch around `decide`: the compute cost the report shows."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.seconds = 0.0
        self.calls = 0

    def decide(self, obs: Observation) -> Decision:
        started = time.perf_counter()
        decision = self.policy.decide(obs)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return decision

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        return self.policy.admit(tokens, uses, capacity, committed)

    def raise_starved(self, obs: Starving) -> FloatArray | None:
        return self.policy.raise_starved(obs)

    def raise_pinned_gpu(self, obs: GpuLook) -> FloatArray | None:
        return self.policy.raise_pinned_gpu(obs)


@dataclass(slots=True)
class Trace:
    """What happened to every pod at every period, as the node saw it (percent).

    `limit` is NaN where a pod was unlimited: before it arrived, or when it was refused.
    """

    scenario: Scenario
    policy: str
    names: list[str]
    tokens: FloatArray
    uses: BoolArray
    alive: BoolArray
    refused: BoolArray
    demand: np.ndarray
    usage: np.ndarray
    limit: np.ndarray
    decide_seconds_per_tick: float
    exact: bool = True
    """False for a bound solved in windows, whose limits need not be one policy's."""


Progress = Callable[[int], None]


def simulate(
    scenario: Scenario,
    policy_name: str,
    demand: FloatArray | None = None,
    progress: Progress | None = None,
) -> Trace:
    """Run one policy through a scenario; pass the same `demand` to compare policies."""
    demand = scenario.demand() if demand is None else demand
    ticks, period = scenario.ticks, scenario.period
    layer = scenario.config.gpu_layer
    node = SimNode(
        scenario.cores,
        scenario.gpus,
        demand=lambda now: demand[min(int(now / period + 1e-9), ticks - 1)],
        gemini=scenario.gemini,
    )
    pods = scenario.pods
    node.add_rows(
        [p.name for p in pods],
        np.array([p.start for p in pods]),
        np.array([p.end for p in pods]),
        [p.device for p in pods],
        [p.coupled for p in pods],
    )
    config = replace(scenario.config, policy=policy_name)
    policy = TimedPolicy(make_policy(policy_name, config.policy_config))
    minimum = float(config.policy_config.minimums()[Resource.GPU])
    gpu = SimGpu(node, layer.gemini_request, minimum) if scenario.gpus else None
    monitor = Monitor(SimCpu(node), gpu, config, policy)
    times = scenario.times()
    trace = Trace(
        scenario=scenario,
        policy=policy_name,
        names=[p.name for p in pods],
        tokens=np.array([p.tokens for p in pods], dtype=np.float64),
        uses=np.array([[True, p.gpu is not None] for p in pods]),
        alive=(times[:, None] >= node.start) & (times[:, None] < node.end),
        refused=np.zeros(len(pods), dtype=bool),
        demand=demand.astype(np.float32),
        usage=np.zeros(demand.shape, dtype=np.float32),
        limit=np.zeros(demand.shape),
        decide_seconds_per_tick=0.0,
    )
    arrivals = sorted(range(len(pods)), key=lambda i: (pods[i].start, i))
    arrived = 0
    for tick in range(ticks):
        now = float(times[tick])
        first = arrived
        while arrived < len(arrivals) and pods[arrivals[arrived]].start <= now:
            index = arrivals[arrived]
            monitor.submit(PodAdded(_spec(scenario, index)))
            arrived += 1
        monitor.tick(now)
        for index in arrivals[first:arrived]:
            key = f"local/{pods[index].name}"
            completed = monitor.registry.completed.get(key)
            trace.refused[index] = completed is not None and completed.status is PodStatus.REFUSED
        trace.limit[tick], trace.usage[tick] = run_period(node, monitor, period)
        if progress is not None:
            progress(tick + 1)
    monitor.tick(node.now)
    monitor.restore()
    trace.decide_seconds_per_tick = policy.seconds / max(policy.calls, 1)
    return trace


def _spec(scenario: Scenario, index: int) -> PodSpec:
    pod = scenario.pods[index]
    return PodSpec(
        name=pod.name,
        tokens=pod.tokens,
        cgroup=pod.name,
        vgpu_id=pod.name if pod.gpu is not None and scenario.gpus else None,
        owned=True,
    )
