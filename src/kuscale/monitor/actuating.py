"""Carrying limits to the kernel and the GPU layer, and giving them back.

A limit is written only where it changed: a rise smaller than WRITE_RESOLUTION over what is
held is skipped; every fall is written, since the pod is charged for what it holds. A limit
that cannot be written leaves the pod holding (and charged for) the old one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kuscale import faults
from kuscale.actuators.base import CpuActuator
from kuscale.backends.base import BackendError, CgroupGone, CpuBackend, GpuBackend
from kuscale.backends.batch import CgroupSet
from kuscale.config import AgentConfig
from kuscale.model import RESOURCES, Resource
from kuscale.monitor.events import TickStats, count_error, log, pod_event
from kuscale.monitor.pods import PodState
from kuscale.monitor.table import PodTable
from kuscale.policy.base import BoolArray, FloatArray, IntArray

WRITE_RESOLUTION = 0.01
"""A rise smaller than this (percent) over what is already written is not written. Every
fall is: the pod is charged for the limit it holds, so keeping a slightly larger one than
the policy chose would spend beyond its budget."""


@dataclass(frozen=True, slots=True)
class DirectWriter:
    """The actuator's writer for the ready pods' cgroups, taken once per membership, and
    which of them kuscale took over: only their CPU limits are written. A pod is given
    back only on its way out, or when the agent stops, and either counts as a change of
    membership, so the mask is never older than the pods it describes."""

    cgroups: CgroupSet
    held: BoolArray


class Actuation:
    """Writes each pod's limits through the CPU actuator and the GPU layer."""

    def __init__(
        self,
        table: PodTable,
        cpu: CpuBackend,
        gpu: GpuBackend | None,
        actuator: CpuActuator,
        config: AgentConfig,
        stats: TickStats,
        ceilings: FloatArray,
    ) -> None:
        self.table = table
        self.cpu = cpu
        self.gpu = gpu
        self.actuator = actuator
        self.monitor_only = config.monitor_only
        self.stats = stats
        self.ceilings: list[float] = ceilings.tolist()
        """The most one pod can hold per resource: the node's CPU, one device's GPU."""

    def write(self, pod: PodState, resource: Resource, limit: float) -> None:
        """Actuate one limit (a pod's first, or one the watch raised)."""
        rows = np.array([pod.row])
        self.write_decided(
            [pod], rows, np.full((1, len(RESOURCES)), limit), None, rows, (resource,)
        )

    def write_decided(
        self,
        pods: list[PodState],
        rows: IntArray,
        limits: FloatArray,
        writer: DirectWriter | None,
        positions: IntArray,
        resources: tuple[Resource, ...] = RESOURCES,
    ) -> None:
        """Write the limits (one row per pod, one column per resource) the pods use; the
        CPU's through `writer` all at once where the actuator gives one (`positions` are
        the pods' places in it), else pod by pod."""
        c = self.table.columns
        for resource in resources:
            uses = c.uses[rows, resource]
            if not uses.any():
                continue
            wanted = limits[:, resource]
            ok = uses & self._valid(pods, uses, resource, wanted)
            wanted = self._clamped(pods, resource, wanted, ok)
            if self.monitor_only:
                c.limit[rows[ok], resource] = wanted[ok]
                continue
            direct = writer if resource is Resource.CPU else None
            asked, charged = self._quantized(pods, rows, resource, wanted, ok, direct is not None)
            rise = charged - c.limit[rows, resource]
            unchanged = c.changed[rows, resource] & (rise >= 0.0) & (rise < WRITE_RESOLUTION)
            due = np.flatnonzero(ok & ~unchanged)
            if direct is None:
                written = np.array(
                    [i for i in due.tolist() if self._actuate(pods[i], resource, asked[i])],
                    dtype=np.int64,
                )
            else:
                written = self._write_through(direct, pods, positions, due, asked)
            c.limit[rows[written], resource] = charged[written]
            c.peak[rows[written], resource] = np.maximum(
                c.peak[rows[written], resource], charged[written]
            )
            c.changed[rows[written], resource] = True
            faults.reached("tick.written")

    def _write_through(
        self,
        writer: DirectWriter,
        pods: list[PodState],
        positions: IntArray,
        due: IntArray,
        asked: FloatArray,
    ) -> IntArray:
        """The CPU limits of pods the actuator took over, written in one pass; those that
        fail keep (and are charged for) the limit they held."""
        due = due[writer.held[positions[due]]]
        failed = writer.cgroups.write_limits(positions[due].tolist(), asked[due])
        for i, err in failed.items():
            count_error(self.stats, pods[int(due[i])].spec, err)
        return np.delete(due, list(failed)) if failed else due

    def _valid(
        self, pods: list[PodState], uses: np.ndarray, resource: Resource, wanted: FloatArray
    ) -> np.ndarray:
        """False where the policy gave no finite positive limit: nothing is written there."""
        valid = np.isfinite(wanted) & (wanted > 0)
        for i in np.flatnonzero(~valid & uses).tolist():
            self.stats.errors["invalid"] += 1
            pod_event(
                pods[i].spec,
                logging.ERROR,
                "invalid_limit",
                "pod %s: policy gave %s limit %r; not written",
                resource.label,
                float(wanted[i]),
                resource=resource.label,
                limit=repr(float(wanted[i])),
            )
        return valid

    def _clamped(
        self, pods: list[PodState], resource: Resource, wanted: FloatArray, ok: np.ndarray
    ) -> FloatArray:
        ceiling = self.ceilings[resource]
        over = ok & (wanted > ceiling)
        for i in np.flatnonzero(over).tolist():
            pod_event(
                pods[i].spec,
                logging.INFO,
                "clamped",
                "pod %s: %s limit %.1f clamped to the node's %.1f",
                resource.label,
                float(wanted[i]),
                ceiling,
                resource=resource.label,
                limit=float(wanted[i]),
                ceiling=ceiling,
            )
            self.stats.errors["clamped"] += 1
        return np.where(over, ceiling, wanted)

    def _quantized(
        self,
        pods: list[PodState],
        rows: IntArray,
        resource: Resource,
        wanted: FloatArray,
        ok: np.ndarray,
        exact: bool,
    ) -> tuple[FloatArray, FloatArray]:
        """What to ask for, and what the pod will then hold and be charged for: a CPU
        actuator that cannot hold any limit exactly rounds, a GPU layer asks what it holds."""
        asked, charged = wanted, wanted.copy()
        c = self.table.columns
        if resource is Resource.CPU and not exact:
            for i in np.flatnonzero(ok).tolist():
                held = pods[i].held
                if held is not None:
                    charged[i] = self.actuator.quantize(held, float(wanted[i]))
        elif resource is Resource.GPU and self.gpu is not None:
            asked = charged
            for i in np.flatnonzero(ok).tolist():
                vgpu_id = pods[i].spec.vgpu_id
                if vgpu_id is not None:
                    row = int(rows[i])
                    holds = float(c.limit[row, resource]) if c.changed[row, resource] else None
                    charged[i] = self.gpu.quantize(vgpu_id, float(wanted[i]), holds)
        return asked, charged

    def _actuate(self, pod: PodState, resource: Resource, limit: float) -> bool:
        spec = pod.spec
        try:
            if resource is Resource.CPU and pod.held is not None:
                self.actuator.write(spec, pod.held, limit)
            elif resource is Resource.GPU and self.gpu is not None and spec.vgpu_id is not None:
                self.gpu.write_limit(spec.vgpu_id, limit)
        except BackendError as err:
            count_error(self.stats, spec, err)
            return False
        return True

    def commit(self) -> None:
        """One reload of the GPU layer per tick, for the limits written in it."""
        if self.gpu is None or self.monitor_only:
            return
        try:
            self.gpu.commit()
        except BackendError as err:
            self.stats.errors[err.kind] += 1
            log.warning("GPU layer reload failed: %s", err)

    def restore(self, pod: PodState) -> bool:
        """What one pod had before kuscale: on shutdown, and when its source withdraws it
        while it may still run (a Kubernetes pod that lost its tokens). False when some of it
        could not be put back: its record must then stay, for the next agent or `restore`."""
        spec = pod.spec
        c = self.table.columns
        given_back = True
        try:
            if pod.restore_shares is not None:
                self.cpu.write_shares(spec.cgroup, pod.restore_shares)
                pod.restore_shares = None
            if pod.held is not None:
                self.actuator.release(spec, pod.held)
                pod.held = None
                c.changed[pod.row, Resource.CPU] = False
        except CgroupGone:
            pass
        except BackendError as err:
            count_error(self.stats, spec, err)
            given_back = False
        gpu_changed = pod.uses(Resource.GPU) and bool(c.changed[pod.row, Resource.GPU])
        if gpu_changed and self.gpu is not None and spec.vgpu_id:
            try:
                self.gpu.write_limit(spec.vgpu_id, pod.gpu_restore_limit)
                c.changed[pod.row, Resource.GPU] = False
            except BackendError as err:
                count_error(self.stats, spec, err)
                given_back = False
        if self.gpu is not None:
            try:
                self.gpu.commit()
            except BackendError as err:
                log.warning("GPU layer reload failed during restore: %s", err)
        return given_back
