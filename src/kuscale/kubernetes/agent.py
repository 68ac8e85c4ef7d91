"""The agent on a Kubernetes node: the token device plugin, discovery and the monitor.

The device plugin advertises the node's tokens so the scheduler places pods by them, and
on a node with the vGPU layer gives each container a vGPU as the kubelet allocates it;
discovery finds the pods that were given tokens and their cgroups; the monitor scales what
they were given, writing each pod's own cgroups (never a QoS slice) or, with `resize`,
asking the API server for an in-place resize, and gives back what it changed when the pod
loses its tokens or the agent stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from kuscale.actuators.resize import ResizeActuator
from kuscale.agentloop import AgentLoop
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.backends.layers import GPU_CLIENT_NAMES, gpu_backend
from kuscale.config import AgentConfig
from kuscale.deviceplugin.gpulayer import allocator_for
from kuscale.deviceplugin.plugin import DevicePluginServer, TokenPlugin
from kuscale.kubernetes import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET
from kuscale.kubernetes.apiserver import NodePods
from kuscale.kubernetes.discovery import KubernetesDiscovery
from kuscale.monitor import Monitor
from kuscale.originals import OriginalsRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KubeletPaths:
    device_plugins: Path = DEVICE_PLUGIN_DIR
    pod_resources: Path = POD_RESOURCES_SOCKET


class KubernetesAgent(AgentLoop):
    """Wires the monitor to the kubelet and the API server."""

    def __init__(
        self,
        config: AgentConfig,
        core: client.CoreV1Api,
        node: str,
        tokens: int | None,
        kubelet: KubeletPaths = KubeletPaths(),
        cgroups: CgroupV1 | CgroupV2 | None = None,
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
        resize: bool = False,
        originals: OriginalsRecord | None = None,
    ) -> None:
        self.cgroups = cgroups or detect()
        self.listeners = list(listeners)
        gpu = gpu_backend(config, self.cgroups.mode)
        self.monitor = Monitor(
            self.cgroups,
            gpu,
            config,
            on_tick=self._on_tick,
            actuator=ResizeActuator(core) if resize else None,
            originals=originals,
            on_stop=self._stop_plugin,
        )
        self.discovery = KubernetesDiscovery(
            NodePods(core, node),
            self.cgroups,
            self.monitor.submit,
            interval=config.period,
            pod_resources_socket=kubelet.pod_resources,
            gpu_clients=GPU_CLIENT_NAMES.get(config.gpu_layer.kind, "none"),
        )
        self.plugin = None
        if tokens:
            plugin = TokenPlugin(
                tokens,
                on_allocate=lambda _ids: self.discovery.wake(),
                gpu=allocator_for(config.gpu_layer, gpu),
            )
            self.plugin = DevicePluginServer(plugin, kubelet.device_plugins)

    def _stop_plugin(self) -> None:
        """The plugin goes before the record is let go: in a rolling update the next agent
        serves its socket under the same name as soon as it holds the record, and gRPC
        removes a unix socket's path when its server stops, so a stop after that would take
        the new agent's socket, and for a moment the node's tokens."""
        if self.plugin is not None:
            self.plugin.stop()

    def run(self) -> None:
        if self.plugin is not None:
            self.plugin.start()
        self.discovery.start()
        try:
            self.monitor.run()
        finally:
            self.discovery.stop()
            self._stop_plugin()
