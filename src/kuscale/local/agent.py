"""The agent in local mode: cgroups on this machine, workloads found in a state dir."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kuscale.agentloop import AgentLoop
from kuscale.backends.base import GpuBackend
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.backends.vgpu import VgpuLayer
from kuscale.config import AgentConfig
from kuscale.local.discovery import LocalDiscovery
from kuscale.local.statedir import StateDir
from kuscale.monitor import Monitor, PodState
from kuscale.originals import OriginalsRecord

log = logging.getLogger("kuscale.local")


class LocalAgent(AgentLoop):
    """Wires the monitor to the state dir."""

    def __init__(
        self,
        state: StateDir,
        config: AgentConfig,
        gpus: int = 1,
        gpu_root: Path | None = None,
        cgroups: CgroupV1 | CgroupV2 | None = None,
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
        originals: OriginalsRecord | None = None,
        gpu: GpuBackend | None = None,
    ) -> None:
        """`gpu` overrides the vGPU layer of `gpus` GPUs under `gpu_root` (the state dir's
        by default), for another GPU layer such as Gemini. Without `originals`, the state
        dir's record is taken and held (RecordBusy where another agent holds it): a launch
        writes a quota only while an agent holds the record."""
        self.state = state.ensure()
        if originals is None:
            originals = OriginalsRecord(state.originals)
            originals.lock()
        self.cgroups = cgroups or detect()
        if gpu is None and gpus > 0:
            gpu = VgpuLayer(gpu_root or state.vgpu, gpus)
        self.listeners = list(listeners)
        self.monitor = Monitor(
            self.cgroups,
            gpu,
            config,
            on_tick=self._on_tick,
            on_completed=self._on_completed,
            originals=originals,
        )
        self.discovery = LocalDiscovery(
            state, self.monitor.submit, interval=min(config.period / 2, 0.5)
        )

    def _on_tick(self, snapshot: dict[str, Any]) -> None:
        try:
            self.state.write_status(snapshot)
        except OSError as err:
            log.warning("cannot write %s: %s", self.state.status, err)
        super()._on_tick(snapshot)

    def _on_completed(self, pod: PodState) -> None:
        try:
            self.state.unregister(pod.spec.name)
        except OSError as err:
            log.warning("cannot remove the registration of %s: %s", pod.key, err)

    def run(self) -> None:
        self.discovery.start()
        try:
            self.monitor.run()
        finally:
            self.discovery.stop()
