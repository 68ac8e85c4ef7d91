"""The loop: sample → estimate → decide → actuate → export, once per period.

The monitor is the one owner of all mutable pod state. Discovery sources, signal handlers and
the device plugin never touch the registry: they put events on the monitor's queue, and the
loop thread handles them between ticks. A failure on one pod is logged, counted and skipped;
it never stops the others or the loop.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import numpy as np

from kuscale.actuators.base import CpuActuator
from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.base import BackendError, CgroupGone, CpuBackend, GpuBackend, Unmanageable
from kuscale.config import AgentConfig
from kuscale.logs import event
from kuscale.model import (
    INITIAL_LIMIT,
    RESOURCES,
    Held,
    Original,
    PodSpec,
    PodState,
    PodStatus,
    Registry,
    Resource,
    ResourceState,
    shares_for_tokens,
)
from kuscale.originals import OriginalsRecord, RecordError, give_back
from kuscale.policy import Observation, Policy, make_policy
from kuscale.policy.base import FloatArray, Starving

log = logging.getLogger("kuscale.monitor")


RECORD_GRACE = 30.0
"""Seconds a starting agent waits for its sources to offer again a pod an earlier agent left
in the record, before giving it back from the record."""

WRITE_RESOLUTION = 0.01
"""A rise smaller than this (percent) over what is already written is not written. Every
fall is: the pod is charged for the limit it holds, so keeping a slightly larger one than
the policy chose would spend beyond its budget."""


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
class _Measured:
    """One pod's usage over its last interval, with what it held, ready for the policy.

    `row` is flat, laid out by `_COLUMN`, so that a tick turns all pods into one array with
    one conversion: at a thousand pods, nested lists per field cost more than the policy.
    """

    pod: PodState
    row: list[float]


_SCALARS = ("elapsed", "tokens", "queue")
_PAIRS = ("usage", "starved", "throttled", "uses", "limit", "average", "demand", "spread", "last")
"""Per resource: this interval's usage, starvation, throttle ratio, whether the pod uses it;
the limit it held, the EWMA average, the demand estimate, the EWMA spread and the usage,
all as of the previous tick."""
_WIDTH = len(_SCALARS) + 2 * len(_PAIRS)
_COLUMN: dict[str, int | slice] = {
    **{name: i for i, name in enumerate(_SCALARS)},
    **{
        name: slice(len(_SCALARS) + 2 * i, len(_SCALARS) + 2 * i + 2)
        for i, name in enumerate(_PAIRS)
    },
}


@dataclass(slots=True)
class TickStats:
    ticks: int = 0
    fast_raises: int = 0
    """Limits the watch raised between ticks."""
    last_tick: float | None = None
    last_duration: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)


class Monitor:
    """Owns the registry and runs the rule over every running pod each period."""

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
    ) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.actuator = actuator or CgroupActuator(cpu)
        self.originals = originals
        """Where what pods had before kuscale is recorded; None keeps it in memory only."""
        self._unclaimed: dict[str, Original] | None = None
        """Entries of the record no running pod has taken over yet (read at the first tick)."""
        self._unclaimed_since = 0.0
        self.config = config
        self.policy = policy or make_policy(config.policy, config.policy_config)
        self.registry = Registry()
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.stats = TickStats()
        self.on_tick = on_tick
        self.on_completed = on_completed
        self.capacity = np.array([cpu.capacity(), gpu.capacity() if gpu else 0.0], dtype=np.float64)
        """The node's totals per resource."""
        self.device_capacity = np.array(gpu.devices() if gpu else (), dtype=np.float64)
        """Each GPU device's capacity: a pod's GPU share lives on one device."""
        self._reach = np.array(
            [self.capacity[0], self.device_capacity.max(initial=0.0)], dtype=np.float64
        )
        """The most one pod can hold per resource: the node's CPU, one device's GPU."""
        self._ceilings: list[float] = self._reach.tolist()
        self._pinned_at = 1.0 - config.policy_config.pin_tolerance
        self._prices = config.policy_config.prices()
        self._weighted = np.array(
            [config.kernel_shares and not config.monitor_only, False], dtype=np.bool_
        )
        self._stopping = False

    # Events: the only way in from other threads.

    def submit(self, event: Event) -> None:
        """Thread-safe: queue an event for the loop thread."""
        self.events.put(event)

    def _handle(self, event: Event, now: float) -> None:
        if isinstance(event, Stop):
            self._stopping = True
        elif isinstance(event, PodAdded):
            running = self.registry.running.get(event.spec.key)
            if running is not None and running.spec != event.spec:
                self._withdraw(running, "replaced: its tokens, cgroup or UID changed")
            self._adopt(event.spec, now)
        elif event.key in self.registry.running:
            self._withdraw(self.registry.running[event.key], "removed by its source")

    def _withdraw(self, pod: PodState, reason: str) -> None:
        """A pod its source no longer offers as it was, which may still run: give back its
        limits, then complete it (its record stays if something could not be given back)."""
        given_back = self._restore_pod(pod)
        self._complete(pod, reason, forget=given_back)

    def _drain(self, now: float) -> None:
        while True:
            try:
                self._handle(self.events.get_nowait(), now)
            except queue.Empty:
                return

    # Pod lifecycle.

    def _adopt(self, spec: PodSpec, now: float) -> None:
        if spec.key in self.registry.running:
            return
        resources = {
            r: ResourceState(price=float(self._prices[r]), history=deque(maxlen=self.config.window))
            for r in spec.resources
        }
        pod = PodState(spec=spec, resources=resources)
        reason = self._refusal(spec)
        self.registry.running[spec.key] = pod
        if reason:
            self._refuse(pod, reason)
            return
        try:
            self._start(pod, now)
        except Unmanageable as err:
            self._refuse(pod, str(err))
        except CgroupGone as err:
            pod.status = PodStatus.NOT_READY
            pod.reason = str(err)
            self._pod_event(
                spec,
                logging.INFO,
                "not_ready",
                "pod %s not ready: %s",
                err,
                reason=str(err),
            )
        except BackendError as err:
            self._count_error(pod, err)
            pod.status = PodStatus.NOT_READY
            pod.reason = str(err)

    def _refuse(self, pod: PodState, reason: str) -> None:
        self._pod_event(
            pod.spec,
            logging.WARNING,
            "refused",
            "pod %s refused: %s",
            reason,
            reason=reason,
        )
        self.registry.complete(pod.key, PodStatus.REFUSED, reason)
        if pod.held is None and pod.restore_shares is None:
            self._forget(pod)

    def _refusal(self, spec: PodSpec) -> str | None:
        if spec.vgpu_id is not None and self.gpu is None:
            return "the pod asks for a GPU and this node has no GPU layer"
        uses = np.array([r in spec.resources for r in RESOURCES])
        capacity, device = self._reach.copy(), 0
        if self.gpu is not None and spec.vgpu_id is not None:
            try:
                device = self.gpu.device_of(spec.vgpu_id)
            except BackendError as err:
                return f"its GPU client is not placed on a device: {err}"
            if not 0 <= device < self.device_capacity.size:
                return f"its GPU client is on device {device}, which this node does not have"
            capacity[Resource.GPU] = self.device_capacity[device]
        return self.policy.admit(float(spec.tokens), uses, capacity, self._committed(device))

    def _committed(self, device: int) -> FloatArray:
        """Minimum limits already promised to running pods, per resource: the node's CPU,
        and the GPU of `device`."""
        minimums = self.config.policy_config.minimums()
        committed = np.zeros(len(RESOURCES))
        for pod in self.registry.running.values():
            for resource in pod.resources:
                if resource is Resource.CPU or pod.gpu_device == device:
                    committed[resource] += minimums[resource]
        return committed

    def _start(self, pod: PodState, now: float) -> None:
        """Take a baseline, take the pod over (remembering what it had, to give it back), and
        set the initial limits. A retry after a failure part way takes nothing over twice."""
        spec = pod.spec
        if self.gpu is not None and spec.vgpu_id is not None:
            pod.gpu_device = self.gpu.device_of(spec.vgpu_id)
            self.gpu.track(spec.vgpu_id, spec.cgroup)
            pod.gpu_baseline = self.gpu.read(spec.vgpu_id)
        pod.cpu_baseline = self.cpu.read(spec.cgroup)
        pod.throttle_mark = pod.cpu_baseline.nr_throttled
        if self.config.monitor_only:
            self._give_back_recorded(spec)
        else:
            self._take_over(pod)
        pod.last_update = now
        pod.status = PodStatus.RUNNING
        pod.reason = ""
        initial = self._initial_limit(spec)
        minimums = self.config.policy_config.minimums()
        for resource, state in pod.resources.items():
            self._write(pod, resource, state, max(initial, float(minimums[resource])))
        self._pod_event(
            spec,
            logging.INFO,
            "adopted",
            "pod %s adopted with %d tokens (cgroup %s%s)",
            spec.tokens,
            spec.cgroup,
            f", vGPU {spec.vgpu_id}" if spec.vgpu_id else "",
            tokens=spec.tokens,
            cgroup=spec.cgroup,
            vgpu_id=spec.vgpu_id,
        )

    def _take_over(self, pod: PodState) -> None:
        spec = pod.spec
        if pod.original is None:
            pod.original = self._record_original(spec)
        original = pod.original
        gpu_state = pod.resources.get(Resource.GPU)
        if gpu_state is not None:
            gpu_state.restore_limit = original.gpu_limit
        if pod.held is None:
            self.actuator.hold(spec, original.held)
            pod.held = original.held
        if self.config.kernel_shares and pod.restore_shares is None:
            pod.restore_shares = original.shares
            self.cpu.write_shares(spec.cgroup, shares_for_tokens(spec.tokens))

    def _record_original(self, spec: PodSpec) -> Original:
        """What the pod has now, recorded before anything is changed; or, for a pod an
        earlier agent took over and never gave back, what that agent recorded. A record that
        cannot be written refuses the pod: no change is made that could not be undone."""
        current = Original(
            key=spec.key,
            uid=spec.uid,
            cgroup=spec.cgroup,
            held=self.actuator.inspect(spec),
            shares=self.cpu.read_shares(spec.cgroup) if self.config.kernel_shares else None,
            vgpu_id=spec.vgpu_id if self.gpu is not None else None,
            gpu_limit=self.gpu.read_limit(spec.vgpu_id)
            if self.gpu is not None and spec.vgpu_id is not None
            else None,
        )
        if self.originals is None:
            return current
        recorded = self.originals.get(spec.key)
        if recorded is not None and (recorded.cgroup, recorded.uid) == (spec.cgroup, spec.uid):
            if recorded.launched:
                self._pod_event(
                    spec,
                    logging.INFO,
                    "adopted_launched",
                    "pod %s adopted with what `kuscale launch` recorded as it made the cgroup",
                )
            else:
                self._pod_event(
                    spec,
                    logging.WARNING,
                    "adopted_recorded",
                    "pod %s was left by an agent that stopped without giving it back: "
                    "adopted with the originals it recorded; its token queue starts afresh",
                )
            return replace(
                recorded,
                launched=False,
                held=self._declared_wins(spec, recorded.held),
                shares=current.shares if recorded.shares is None else recorded.shares,
                vgpu_id=current.vgpu_id if recorded.vgpu_id is None else recorded.vgpu_id,
                gpu_limit=current.gpu_limit if recorded.vgpu_id is None else recorded.gpu_limit,
            )
        try:
            self.originals.save(current)
        except RecordError as err:
            self.stats.errors["record"] += 1
            raise Unmanageable(
                f"its originals cannot be recorded, so nothing is changed: {err}"
            ) from err
        return current

    def _give_back_recorded(self, spec: PodSpec) -> None:
        """A monitor-only agent changes nothing, so what kuscale set before it (a launch's
        first quota, a crashed agent's limits) goes back to the recorded originals."""
        recorded = None if self.originals is None else self.originals.get(spec.key)
        if recorded is not None:
            self._give_back_from_record(recorded)

    def _give_back_from_record(self, original: Original) -> bool:
        """Put back what an entry recorded and drop it; a failure is counted and logged,
        and the entry stays for the next agent or `kuscale restore`."""
        if self.originals is None:
            return False
        try:
            give_back(original, self.actuator, self.cpu, self.gpu)
            self.originals.drop(original.key)
        except (BackendError, RecordError) as err:
            self.stats.errors["record"] += 1
            log.warning("cannot give back %s from the record: %s", original.key, err)
            return False
        return True

    def _settle_record(self, now: float) -> None:
        """Entries an earlier agent left: dropped at once where the cgroup is gone; given
        back from the record where no source offers the pod again within RECORD_GRACE (a
        pod that lost its tokens, or a workload whose registration is gone, while no agent
        ran). Adopted pods take their entries over."""
        if self.originals is None:
            return
        if self._unclaimed is None:
            self._unclaimed = {o.key: o for o in self.originals.entries()}
            self._unclaimed_since = now
        for key in [k for k in self._unclaimed if k in self.registry.running]:
            del self._unclaimed[key]
        overdue = now - self._unclaimed_since >= RECORD_GRACE
        for key, original in list(self._unclaimed.items()):
            if self.cpu.exists(original.cgroup) and not overdue:
                continue
            del self._unclaimed[key]
            if self._give_back_from_record(original):
                log.warning("gave back %s from the record: no source offered it again", key)

    def _declared_wins(self, spec: PodSpec, held: Held) -> Held:
        """Where the API server declares the pod's CPU limit, that is what the kubelet gives
        the pod cgroup: it wins over a record that says otherwise."""
        declared = spec.declared_cpu
        if declared is None or (held.pod is not None and abs(held.pod - declared) < 0.5):
            return held
        self._pod_event(
            spec,
            logging.WARNING,
            "declared_wins",
            "pod %s: the API server declares a CPU limit of %.1f %%, the record %s; the "
            "declared limit is given back",
            declared,
            "none" if held.pod is None else f"{held.pod:.1f} %",
        )
        return replace(held, pod=declared)

    def _forget(self, pod: PodState) -> None:
        """Drop the pod's record: it was given back, or never changed, or is gone."""
        if self.originals is None:
            return
        try:
            self.originals.drop(pod.key)
        except RecordError as err:
            self.stats.errors["record"] += 1
            log.warning("%s", err)

    def _initial_limit(self, spec: PodSpec) -> float:
        """The original's 10 %, or less where the pod's tokens cannot pay for 10 % of every
        resource it uses: its first period is charged like any other. The caller keeps it at
        the configured minimums, which admission has checked the tokens can buy."""
        cost = float(sum(self._prices[r] for r in spec.resources))
        return min(INITIAL_LIMIT, spec.tokens / cost)

    def _complete(self, pod: PodState, reason: str, forget: bool = True) -> None:
        self._pod_event(
            pod.spec,
            logging.INFO,
            "completed",
            "pod %s completed: %s",
            reason,
            reason=reason,
            updates=pod.updated_count,
        )
        self.registry.complete(pod.key, PodStatus.COMPLETED, reason)
        if pod.spec.owned:
            self._remove_owned(pod)
        else:
            self.cpu.forget(pod.spec.cgroup)
        if forget:
            self._forget(pod)
        if self.on_completed:
            self.on_completed(pod)

    def _remove_owned(self, pod: PodState) -> None:
        try:
            self.cpu.remove(pod.spec.cgroup)
            if self.gpu is not None and pod.spec.vgpu_id is not None:
                self.gpu.remove(pod.spec.vgpu_id)
        except BackendError as err:
            self._count_error(pod, err)

    @staticmethod
    def _pod_event(
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

    def _count_error(self, pod: PodState, err: BackendError) -> None:
        self.stats.errors[err.kind] += 1
        self._pod_event(
            pod.spec,
            logging.WARNING,
            "actuation_error",
            "pod %s: %s",
            err,
            kind=err.kind,
            error=str(err),
        )

    # The tick.

    def tick(self, now: float) -> None:
        """One pass over every running pod; the snapshot is built only for a listener."""
        started = time.perf_counter()
        self._drain(now)
        measured = [
            m
            for pod in list(self.registry.running.values())
            if (m := self._measure(pod, now)) is not None
        ]
        if measured:
            self._decide(measured)
        self._settle_record(now)
        if self.gpu is not None and not self.config.monitor_only:
            try:
                self.gpu.commit()
            except BackendError as err:
                self.stats.errors[err.kind] += 1
                log.warning("GPU layer reload failed: %s", err)
        self.stats.ticks += 1
        self.stats.last_tick = now
        self.stats.last_duration = time.perf_counter() - started
        if self.on_tick:
            self.on_tick(self.snapshot())

    def _measure(self, pod: PodState, now: float) -> _Measured | None:
        try:
            if pod.status is PodStatus.NOT_READY:
                self._start(pod, now)
                return None
            if pod.spec.owned and self.cpu.is_empty(pod.spec.cgroup):
                self._complete(pod, "its last process exited")
                return None
            return self._sample(pod, now)
        except Unmanageable as err:
            self._refuse(pod, str(err))
        except CgroupGone as err:
            if pod.status is PodStatus.NOT_READY and not pod.spec.owned:
                pod.reason = str(err)
                return None
            self._complete(pod, f"its cgroup is gone ({err})")
        except BackendError as err:
            self._count_error(pod, err)
        return None

    def _sample(self, pod: PodState, now: float) -> _Measured | None:
        """Usage over the interval since the pod's baseline; None when it cannot be trusted."""
        spec = pod.spec
        counters = self.cpu.read(spec.cgroup)
        busy_gpu = None
        if self.gpu is not None and spec.vgpu_id is not None:
            busy_gpu = self.gpu.read(spec.vgpu_id)
        elapsed = now - (pod.last_update if pod.last_update is not None else now)
        previous_cpu, previous_gpu = pod.cpu_baseline, pod.gpu_baseline
        pod.cpu_baseline, pod.gpu_baseline, pod.last_update = counters, busy_gpu, now
        if previous_cpu is None or elapsed <= 0:
            return None
        if counters.usage_ns < previous_cpu.usage_ns or (
            busy_gpu is not None and previous_gpu is not None and busy_gpu < previous_gpu
        ):
            self.stats.errors["backwards"] += 1
            self._pod_event(
                spec,
                logging.WARNING,
                "counter_backwards",
                "pod %s: a counter went backwards; taking a new baseline",
            )
            return None
        wall_ns = elapsed * 1e9
        ceilings = self._ceilings
        usage = [
            min((counters.usage_ns - previous_cpu.usage_ns) * 100.0 / wall_ns, ceilings[0]),
            0.0,
        ]
        if busy_gpu is not None and previous_gpu is not None:
            usage[1] = min((busy_gpu - previous_gpu) * 100.0 / wall_ns, ceilings[1])
        periods = counters.nr_periods - previous_cpu.nr_periods
        answered = previous_cpu.nr_throttled if pod.raised_mark is None else pod.raised_mark
        throttled_periods = counters.nr_throttled - max(previous_cpu.nr_throttled, answered)
        pod.raised_mark = None
        pod.throttle_mark = counters.nr_throttled
        starved = [throttled_periods > 0, False]
        # Where CFS counted periods its throttle count is the evidence; usage near the
        # limit stands in only where nothing counts (a GPU): a budget that squeezed a
        # limit just above usage is not a pod asking for more.
        pinned_counts = [periods <= 0, True]
        throttled = [min(max(throttled_periods / periods, 0.0), 1.0) if periods > 0 else 0.0, 0.0]
        threshold = self._pinned_at
        uses = [0.0, 0.0]
        previous = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        for index, state in pod.resources.items():
            uses[index] = 1.0
            previous[index] = state.limit
            previous[2 + index] = state.avg_usage
            previous[4 + index] = state.demand
            previous[6 + index] = state.spread
            previous[8 + index] = state.usage
            pinned = pinned_counts[index] and usage[index] >= threshold * state.limit
            starved[index] = starved[index] or pinned
        if starved[1]:
            throttled[1] = 1.0
        row = [elapsed, float(spec.tokens), pod.token_queue, *usage]
        row += [float(starved[0]), float(starved[1]), *throttled, *uses, *previous]
        return _Measured(pod, row)

    def _decide(self, measured: list[_Measured]) -> None:
        rows = chain.from_iterable(m.row for m in measured)
        table = np.fromiter(rows, np.float64, len(measured) * _WIDTH).reshape(len(measured), -1)

        def column(name: str) -> FloatArray:
            return table[:, _COLUMN[name]]

        uses = column("uses") > 0.0
        usage, previous_avg, previous_spread = column("usage"), column("average"), column("spread")
        weight = self.config.policy_config.ewma_weight
        avg = np.where(uses, previous_avg + weight * (usage - previous_avg), 0.0)
        deviation = np.abs(usage - column("last"))
        spread = np.where(uses, previous_spread + weight * (deviation - previous_spread), 0.0)
        obs = Observation(
            period=self.config.period,
            elapsed=column("elapsed"),
            tokens=column("tokens"),
            queue=column("queue"),
            usage=usage,
            avg_usage=avg,
            limits=column("limit"),
            starved=(column("starved") > 0.0) & uses,
            demand=column("demand"),
            uses=uses,
            capacity=self._reach,
            keys=tuple(m.pod.key for m in measured),
            throttled=column("throttled"),
            spread=spread,
            weighted=self._weighted,
            device=np.array([m.pod.gpu_device for m in measured], dtype=np.int64),
            device_capacity=self.device_capacity,
        )
        decision = self.policy.decide(obs)
        pairs = (
            decision.limits,
            decision.demand,
            usage,
            avg,
            spread,
            obs.starved,
            decision.weights,
        )
        updates = np.concatenate([decision.queue[:, None], *pairs], axis=1)
        for m, update in zip(measured, updates.tolist(), strict=True):
            pod = m.pod
            pod.token_queue = update[0]
            pod.updated_count += 1
            for resource, state in pod.resources.items():
                limit, state.demand, state.usage, state.avg_usage, state.spread, starved, weight = (
                    update[1 + resource :: 2]
                )
                state.starved, state.weight = starved > 0.0, weight
                state.history.append(state.usage)
                self._write(pod, resource, state, limit)

    def _write(self, pod: PodState, resource: Resource, state: ResourceState, limit: float) -> None:
        """Actuate one limit; on failure the pod keeps (and is charged for) the old one."""
        if not math.isfinite(limit) or limit <= 0:
            self.stats.errors["invalid"] += 1
            self._pod_event(
                pod.spec,
                logging.ERROR,
                "invalid_limit",
                "pod %s: policy gave %s limit %r; not written",
                resource.label,
                limit,
                resource=resource.label,
                limit=repr(limit),
            )
            return
        ceiling = self._ceilings[resource]
        if limit > ceiling:
            self._pod_event(
                pod.spec,
                logging.INFO,
                "clamped",
                "pod %s: %s limit %.1f clamped to the node's %.1f",
                resource.label,
                limit,
                ceiling,
                resource=resource.label,
                limit=limit,
                ceiling=ceiling,
            )
            self.stats.errors["clamped"] += 1
            limit = ceiling
        if self.config.monitor_only:
            state.limit = limit
            return
        charged = limit
        if resource is Resource.CPU and pod.held is not None:
            charged = self.actuator.quantize(pod.held, limit)
        elif self.gpu is not None and pod.spec.vgpu_id is not None:
            held = state.limit if state.changed else None
            charged = limit = self.gpu.quantize(pod.spec.vgpu_id, limit, held)
        if state.changed and 0.0 <= charged - state.limit < WRITE_RESOLUTION:
            return
        try:
            self._actuate(pod, resource, limit)
        except BackendError as err:
            self._count_error(pod, err)
            return
        state.limit = charged
        state.changed = True

    def _actuate(self, pod: PodState, resource: Resource, limit: float) -> None:
        if resource is Resource.CPU and pod.held is not None:
            self.actuator.write(pod.spec, pod.held, limit)
        elif resource is Resource.GPU and self.gpu is not None and pod.spec.vgpu_id is not None:
            self.gpu.write_limit(pod.spec.vgpu_id, limit)

    # The watch between ticks.

    def watch(self, now: float) -> None:
        """Read every managed pod's throttle counter; hand those throttled since the last
        look to the policy's fast path and write what it raises. A pod whose cgroup cannot
        be read, or whose counter went backwards, is skipped until the next tick."""
        if self.config.monitor_only:
            return
        starving = [pod for pod in self.registry.running.values() if self._throttled(pod)]
        if not starving:
            return
        limits = self.policy.raise_starved(self._starving(starving))
        if limits is None:
            return
        cpu = Resource.CPU
        for pod, raised in zip(starving, limits[:, cpu].tolist(), strict=True):
            state = pod.resources[cpu]
            if raised <= state.limit + WRITE_RESOLUTION:
                continue
            before = state.limit
            self._write(pod, cpu, state, raised)
            if state.limit > before:
                self.stats.fast_raises += 1
                pod.raised_mark = pod.throttle_mark
                log.debug("pod %s throttled at %.1f %%: raised to %.1f %%", pod.key, before, raised)

    def _throttled(self, pod: PodState) -> bool:
        if pod.status is not PodStatus.RUNNING or pod.held is None:
            return False
        try:
            count = self.cpu.read_throttled(pod.spec.cgroup)
        except BackendError as err:
            log.debug("watch skips pod %s: %s", pod.key, err)
            return False
        mark, pod.throttle_mark = pod.throttle_mark, count
        return count > mark

    def _starving(self, pods: list[PodState]) -> Starving:
        limits = np.zeros((len(pods), len(RESOURCES)))
        uses = np.zeros((len(pods), len(RESOURCES)), dtype=np.bool_)
        for row, pod in enumerate(pods):
            for resource, state in pod.resources.items():
                limits[row, resource] = state.limit
                uses[row, resource] = True
        held = np.zeros(len(RESOURCES))
        for pod in self.registry.running.values():
            for resource, state in pod.resources.items():
                held[resource] += state.limit
        return Starving(
            period=self.config.period,
            tokens=np.array([float(p.spec.tokens) for p in pods]),
            queue=np.array([p.token_queue for p in pods]),
            limits=limits,
            uses=uses,
            capacity=self._reach,
            held=held,
            weighted=self._weighted,
        )

    # Running and stopping.

    def run(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Tick every period until a Stop event; then restore what was changed."""
        next_tick = clock()
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
            self.restore()

    def _wait(self, delay: float, clock: Callable[[], float]) -> None:
        """Sleep until the next tick, handling events as they come (a Stop ends the wait)
        and running the watch every `watch_interval`."""
        deadline = clock() + delay
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
        for pod in self.registry.running.values():
            if self._restore_pod(pod):
                self._forget(pod)
        log.info("restored the limits of %d pods", len(self.registry.running))

    def _restore_pod(self, pod: PodState) -> bool:
        """What one pod had before kuscale: on shutdown, and when its source withdraws it
        while it may still run (a Kubernetes pod that lost its tokens). False when some of it
        could not be put back: its record must then stay, for the next agent or `restore`."""
        spec = pod.spec
        given_back = True
        try:
            if pod.restore_shares is not None:
                self.cpu.write_shares(spec.cgroup, pod.restore_shares)
                pod.restore_shares = None
            if pod.held is not None:
                self.actuator.release(spec, pod.held)
                pod.held = None
                pod.resources[Resource.CPU].changed = False
        except CgroupGone:
            pass
        except BackendError as err:
            self._count_error(pod, err)
            given_back = False
        gpu_state = pod.resources.get(Resource.GPU)
        if gpu_state is not None and gpu_state.changed and self.gpu and spec.vgpu_id:
            try:
                self.gpu.write_limit(spec.vgpu_id, gpu_state.restore_limit)
                gpu_state.changed = False
            except BackendError as err:
                self._count_error(pod, err)
                given_back = False
        if self.gpu is not None:
            try:
                self.gpu.commit()
            except BackendError as err:
                log.warning("GPU layer reload failed during restore: %s", err)
        return given_back

    # Export.

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view of every pod, for `kuscale status`, the demo and exporters."""
        pods = [*self.registry.running.values(), *self.registry.completed.values()]
        return {
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
            "tick_seconds": self.stats.last_duration,
            "errors": dict(self.stats.errors),
            "gpu_devices": self._device_view(),
            "pods": [pod_view(pod) for pod in pods],
        }

    def _device_view(self) -> list[dict[str, float]]:
        """Each GPU device's capacity and what its running pods hold and use of it."""
        held = np.zeros(self.device_capacity.size)
        used = np.zeros(self.device_capacity.size)
        for pod in self.registry.running.values():
            state = pod.resources.get(Resource.GPU)
            if state is not None and 0 <= pod.gpu_device < held.size:
                held[pod.gpu_device] += state.limit
                used[pod.gpu_device] += state.usage
        return [
            {"device": d, "capacity": float(c), "limit": float(held[d]), "usage": float(used[d])}
            for d, c in enumerate(self.device_capacity.tolist())
        ]


def pod_view(pod: PodState) -> dict[str, Any]:
    return {
        "name": pod.spec.name,
        "namespace": pod.spec.namespace,
        "tokens": pod.spec.tokens,
        "status": pod.status.value,
        "reason": pod.reason,
        "token_queue": pod.token_queue,
        "updated_count": pod.updated_count,
        "gpu_device": pod.gpu_device if Resource.GPU in pod.resources else None,
        "resources": {
            resource.label: {
                "usage": state.usage,
                "avg_usage": state.avg_usage,
                "limit": state.limit,
                "weight": state.weight,
                "price": state.price,
                "demand": state.demand,
                "starved": state.starved,
            }
            for resource, state in pod.resources.items()
        },
    }
