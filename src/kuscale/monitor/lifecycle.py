"""A pod's life under the monitor: adopted (or refused), taken over, withdrawn, completed.

Taking a pod over records what it had first, so that whatever happens to the agent it can be
given back: by this agent when the pod is withdrawn or the agent stops, by the next agent from
the durable record after a crash, or by `kuscale restore`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from kuscale import faults
from kuscale.actuators.base import CpuActuator
from kuscale.backends.base import (
    BackendError,
    CgroupGone,
    CounterError,
    CpuBackend,
    GpuBackend,
    Unmanageable,
)
from kuscale.config import AgentConfig
from kuscale.model import (
    INITIAL_LIMIT,
    RESOURCES,
    Held,
    Original,
    PodSpec,
    PodStatus,
    Resource,
    shares_for_tokens,
)
from kuscale.monitor.actuating import Actuation
from kuscale.monitor.events import TickStats, count_error, log, pod_event
from kuscale.monitor.pods import PodState, Registry
from kuscale.monitor.table import PodTable
from kuscale.originals import OriginalsRecord, RecordError, give_back
from kuscale.policy import Policy
from kuscale.policy.base import FloatArray

RECORD_GRACE = 30.0
"""Seconds a starting agent waits for its sources to offer again a pod an earlier agent left
in the record, before giving it back from the record."""


class Lifecycle:
    """Adopts, refuses, withdraws and completes pods, and settles an earlier agent's record.

    `membership` counts every change to which pods are running and ready, or which of them
    kuscale holds, so the tick knows when the rows it samples and the pods it may write
    must be gathered again."""

    def __init__(
        self,
        table: PodTable,
        registry: Registry,
        cpu: CpuBackend,
        gpu: GpuBackend | None,
        actuator: CpuActuator,
        actuation: Actuation,
        config: AgentConfig,
        policy: Policy,
        stats: TickStats,
        originals: OriginalsRecord | None,
        on_completed: Callable[[PodState], None] | None,
        reach: FloatArray,
        device_capacity: FloatArray,
    ) -> None:
        self.table = table
        self.registry = registry
        self.cpu = cpu
        self.gpu = gpu
        self.actuator = actuator
        self.actuation = actuation
        self.config = config
        self.policy = policy
        self.stats = stats
        self.originals = originals
        """Where what pods had before kuscale is recorded; None keeps it in memory only."""
        self.on_completed = on_completed
        self.reach = reach
        self.device_capacity = device_capacity
        self.prices = config.policy_config.prices()
        self.minimums = config.policy_config.minimums()
        self.membership = 0
        self._unclaimed: dict[str, Original] | None = None
        """Entries of the record no running pod has taken over yet (read at the first tick)."""
        self._unclaimed_since = 0.0

    # Arriving.

    def offer(self, spec: PodSpec, now: float) -> None:
        """A source offers a pod: one running as it was is kept; one whose tokens, cgroup or
        UID changed is withdrawn and adopted afresh. A changed declared CPU limit alone is no
        new pod: the resize actuator changes it with every limit it writes."""
        running = self.registry.running.get(spec.key)
        if running is not None and running.spec != spec:
            if replace(running.spec, declared_cpu=spec.declared_cpu) == spec:
                running.spec = spec
                return
            self.withdraw(running, "replaced: its tokens, cgroup or UID changed")
        self.adopt(spec, now)

    def adopt(self, spec: PodSpec, now: float) -> None:
        if spec.key in self.registry.running:
            return
        row = self.table.add(float(spec.tokens), self.prices, spec.resources, INITIAL_LIMIT)
        pod = PodState(spec=spec, table=self.table, row=row)
        reason = self._refusal(spec)
        self.registry.running[spec.key] = pod
        self.membership += 1
        if reason:
            self.refuse(pod, reason)
            return
        try:
            self.start(pod, now)
        except Unmanageable as err:
            self.refuse(pod, str(err))
        except CgroupGone as err:
            pod.status = PodStatus.NOT_READY
            pod.reason = str(err)
            pod_event(spec, logging.INFO, "not_ready", "pod %s not ready: %s", err, reason=str(err))
        except BackendError as err:
            count_error(self.stats, spec, err)
            pod.status = PodStatus.NOT_READY
            pod.reason = str(err)

    def refuse(self, pod: PodState, reason: str) -> None:
        pod_event(pod.spec, logging.WARNING, "refused", "pod %s refused: %s", reason, reason=reason)
        self._leave(pod, PodStatus.REFUSED, reason)
        if pod.held is None and pod.restore_shares is None:
            self.settle(pod)

    def _refusal(self, spec: PodSpec) -> str | None:
        if spec.vgpu_id is not None and self.gpu is None:
            return "the pod asks for a GPU and this node has no GPU layer"
        uses = np.array([r in spec.resources for r in RESOURCES])
        capacity, device = self.reach.copy(), 0
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
        and the GPU of `device`, summed in the order the pods arrived."""
        c = self.table.columns
        rows = np.array([p.row for p in self.registry.running.values()], dtype=np.int64)
        promised = c.uses[rows].copy()
        promised[:, Resource.GPU] &= c.device[rows] == device
        committed = np.zeros(len(RESOURCES))
        for resource in RESOURCES:
            count = int(promised[:, resource].sum())
            if count:
                committed[resource] = np.cumsum(np.full(count, self.minimums[resource]))[-1]
        return committed

    def start(self, pod: PodState, now: float) -> None:
        """Take a baseline, take the pod over (remembering what it had, to give it back), and
        set the initial limits. A retry after a failure part way takes nothing over twice."""
        spec = pod.spec
        c = self.table.columns
        row = pod.row
        if self.gpu is not None and spec.vgpu_id is not None:
            c.device[row] = self.gpu.device_of(spec.vgpu_id)
            self.gpu.track(spec.vgpu_id, spec.cgroup)
            if not self.config.monitor_only:
                self.gpu.weigh(spec.vgpu_id, float(spec.tokens))
            c.gpu_busy_ns[row] = self.gpu.read(spec.vgpu_id)
        counters = self.cpu.read(spec.cgroup)
        c.cpu_usage_ns[row] = counters.usage_ns
        c.nr_periods[row] = counters.nr_periods
        c.nr_throttled[row] = c.throttle_mark[row] = counters.nr_throttled
        c.throttle_look_at[row] = np.nan
        c.has_baseline[row] = True
        if self.config.monitor_only:
            self._give_back_recorded(spec)
        else:
            self._take_over(pod)
        c.last_update[row] = now
        pod.status = PodStatus.RUNNING
        pod.reason = ""
        self.membership += 1
        initial = self._initial_limit(spec)
        for resource in pod.resources:
            self.actuation.write(pod, resource, max(initial, float(self.minimums[resource])))
        pod_event(
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

    def _initial_limit(self, spec: PodSpec) -> float:
        """The original's 10 %, or less where the pod's tokens cannot pay for 10 % of every
        resource it uses: its first period is charged like any other. The caller keeps it at
        the configured minimums, which admission has checked the tokens can buy."""
        cost = float(sum(self.prices[r] for r in spec.resources))
        return min(INITIAL_LIMIT, spec.tokens / cost)

    def _take_over(self, pod: PodState) -> None:
        spec = pod.spec
        if pod.original is None:
            pod.original = self._record_original(spec)
            faults.reached("adopt.recorded")
        original = pod.original
        if pod.uses(Resource.GPU):
            pod.gpu_restore_limit = original.gpu_limit
        if pod.held is None:
            self.actuator.hold(spec, original.held)
            pod.held = original.held
            pod.taken_over = True
            faults.reached("adopt.held")
        if self.config.kernel_shares and pod.restore_shares is None:
            pod.restore_shares = original.shares
            self.cpu.write_shares(spec.cgroup, shares_for_tokens(spec.tokens))

    def _current_gpu_limit(self, spec: PodSpec) -> float | None:
        """The pod's vGPU limit now. A vGPU file is written in place (truncated, then
        written), so an agent killed between the two leaves it empty; where the record
        holds what that agent found before it changed anything, that is the original and
        the pod is adopted; without a record, the garbage refuses it as before."""
        if self.gpu is None or spec.vgpu_id is None:
            return None
        try:
            return self.gpu.read_limit(spec.vgpu_id)
        except CounterError:
            recorded = None if self.originals is None else self.originals.get(spec.key)
            if recorded is None or recorded.vgpu_id != spec.vgpu_id:
                raise
            pod_event(
                spec,
                logging.WARNING,
                "gpu_limit_unreadable",
                "pod %s: its vGPU limit holds no number (a write cut short); the recorded "
                "original stands",
            )
            return recorded.gpu_limit

    def _record_original(self, spec: PodSpec) -> Original:
        """What the pod has now, recorded before anything is changed; or, for a pod an
        earlier agent took over and never gave back, what that agent recorded. A record that
        cannot be written refuses the pod: no change is made that could not be undone."""
        current = Original(
            actuator=self.actuator.mode,
            key=spec.key,
            uid=spec.uid,
            cgroup=spec.cgroup,
            held=self.actuator.inspect(spec),
            shares=self.cpu.read_shares(spec.cgroup) if self.config.kernel_shares else None,
            vgpu_id=spec.vgpu_id if self.gpu is not None else None,
            gpu_limit=self._current_gpu_limit(spec),
        )
        faults.reached("adopt.inspected")
        if self.originals is None:
            return current
        original = current
        recorded = self.originals.get(spec.key)
        if recorded is not None and (recorded.cgroup, recorded.uid) == (spec.cgroup, spec.uid):
            original = self._adopt_recorded(spec, recorded, current)
            if original == recorded:
                return original
        try:
            self.originals.save(original)
        except RecordError as err:
            self.stats.errors["record"] += 1
            raise Unmanageable(
                f"its originals cannot be recorded, so nothing is changed: {err}"
            ) from err
        return original

    def _adopt_recorded(self, spec: PodSpec, recorded: Original, current: Original) -> Original:
        """The originals an earlier agent (or `kuscale launch`) recorded win over what the pod
        has now, which that agent may have changed. What the entry lacks (launch records no
        GPU share) is taken from now and recorded before any change: the next agent after a
        crash would otherwise take this agent's share for the original."""
        if recorded.launched:
            pod_event(
                spec,
                logging.INFO,
                "adopted_launched",
                "pod %s adopted with what `kuscale launch` recorded as it made the cgroup",
            )
        else:
            pod_event(
                spec,
                logging.WARNING,
                "adopted_recorded",
                "pod %s was left by an agent that stopped without giving it back: "
                "adopted with the originals it recorded; its token queue starts afresh",
            )
        return replace(
            recorded,
            launched=False,
            held=self._declared_wins(spec, recorded),
            shares=current.shares if recorded.shares is None else recorded.shares,
            vgpu_id=current.vgpu_id if recorded.vgpu_id is None else recorded.vgpu_id,
            gpu_limit=current.gpu_limit if recorded.vgpu_id is None else recorded.gpu_limit,
        )

    def _declared_wins(self, spec: PodSpec, recorded: Original) -> Held:
        """Where the API server declares the pod's CPU limit, that is what the kubelet gives
        the pod cgroup: it wins over a record that says otherwise. Not where the record's
        agent resized the pod: the declared limit is then that agent's, and the record's
        is the pod's own."""
        held, declared = recorded.held, spec.declared_cpu
        if recorded.actuator == "resize" or declared is None:
            return held
        if held.pod is not None and abs(held.pod - declared) < 0.5:
            return held
        pod_event(
            spec,
            logging.WARNING,
            "declared_wins",
            "pod %s: the API server declares a CPU limit of %.1f %%, the record %s; the "
            "declared limit is given back",
            declared,
            "none" if held.pod is None else f"{held.pod:.1f} %",
        )
        return replace(held, pod=declared)

    # The record an earlier agent left.

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

    def settle_record(self, now: float) -> None:
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

    def settle(self, pod: PodState) -> None:
        """The pod's entry once this agent has given back what it changed: dropped where this
        agent took the pod over, since what it gave back is the recorded truth; given back from
        the entry first where it never did, since what `kuscale launch` or an earlier agent
        set may still bind."""
        if self.originals is None:
            return
        if not pod.taken_over:
            self._give_back_recorded(pod.spec)
            return
        try:
            self.originals.drop(pod.key)
        except RecordError as err:
            self.stats.errors["record"] += 1
            log.warning("%s", err)

    # Leaving.

    def withdraw(self, pod: PodState, reason: str) -> None:
        """A pod its source no longer offers as it was, which may still run: give back its
        limits, then complete it (its record stays if something could not be given back)."""
        given_back = self.actuation.restore(pod)
        self.complete(pod, reason, forget=given_back)

    def complete(self, pod: PodState, reason: str, forget: bool = True) -> None:
        pod_event(
            pod.spec,
            logging.INFO,
            "completed",
            "pod %s completed: %s",
            reason,
            reason=reason,
            updates=pod.updated_count,
        )
        self._leave(pod, PodStatus.COMPLETED, reason)
        if pod.spec.owned:
            self._remove_owned(pod)
        else:
            self.cpu.forget(pod.spec.cgroup)
            self._unweigh(pod)
        if forget:
            self.settle(pod)
        if self.on_completed:
            self.on_completed(pod)

    def _leave(self, pod: PodState, status: PodStatus, reason: str) -> None:
        """Out of the running pods; the rows of completed pods pushed out go back to the
        table."""
        for dropped in self.registry.complete(pod.key, status, reason):
            self.table.release(dropped.row)
        self.membership += 1

    def _unweigh(self, pod: PodState) -> None:
        """A pod kuscale leaves running no longer counts in its device's weights."""
        if self.gpu is not None and pod.spec.vgpu_id is not None:
            try:
                self.gpu.weigh(pod.spec.vgpu_id, 0.0)
            except BackendError as err:
                count_error(self.stats, pod.spec, err)

    def _remove_owned(self, pod: PodState) -> None:
        try:
            self.cpu.remove(pod.spec.cgroup)
            if self.gpu is not None and pod.spec.vgpu_id is not None:
                self.gpu.remove(pod.spec.vgpu_id)
        except BackendError as err:
            count_error(self.stats, pod.spec, err)

    def restore_all(self) -> None:
        """Put back every limit kuscale changed, so no workload stays throttled behind it:
        the pods this agent holds, then every entry left in the record, adopted or not (a
        workload launched just before the stop, a pod an earlier agent left)."""
        kept = set()
        for pod in self.registry.running.values():
            if self.actuation.restore(pod):
                faults.reached("stop.given_back")
                self.settle(pod)
                faults.reached("stop.record_dropped")
            else:
                kept.add(pod.key)
        self.membership += 1
        log.info(
            "restored the limits of %d pods, %d more from the record",
            len(self.registry.running) - len(kept),
            self._give_back_record(kept),
        )

    def _give_back_record(self, kept: set[str]) -> int:
        """Every entry but those of pods whose own give-back failed (their entries stay for
        the next agent or `kuscale restore`), while no `kuscale launch` is between recording
        a cgroup and writing its first quota. The record is let go inside that, so a launch
        that comes after the sweep finds no agent and writes no quota."""
        if self.originals is None:
            return 0
        with self.originals.launches_held():
            swept = 0
            for original in self.originals.entries():
                if original.key not in kept and self._give_back_from_record(original):
                    faults.reached("stop.swept")
                    swept += 1
            self.originals.unlock()
            return swept
