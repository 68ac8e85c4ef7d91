"""Kubernetes discovery: the pods the kubelet gave tokens, as monitor events.

Each pass asks the kubelet which pods hold tokens (a local gRPC call), joins them with the
API server's view (kept current by its own watch, never polled), resolves each pod's cgroup,
and announces what is new, changed or gone. Like local discovery it only puts events on the
monitor's queue; a pod it cannot place yet is skipped with a log line and tried again on the
next pass. A pod is taken up only once all its containers have started: under cgroup v1 the
kernel refuses a container's own quota above its pod's, so a container created while its pod
is held below that container's `limits.cpu` would fail to start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from kuscale.backends.base import CpuBackend
from kuscale.deviceplugin.gpulayer import vgpu_id_for
from kuscale.kubernetes.apiserver import NodePods, join
from kuscale.kubernetes.cgroups import Driver, ResolutionError, detect_driver, resolve
from kuscale.kubernetes.podresources import (
    PodResourcesError,
    TokenHolder,
    list_token_holders,
)
from kuscale.model import InvalidSpec, PodSpec
from kuscale.monitor import Event, PodAdded, PodRemoved

log = logging.getLogger(__name__)


class KubernetesDiscovery:
    def __init__(
        self,
        pods: NodePods,
        tree: CpuBackend,
        submit: Callable[[Event], None],
        interval: float,
        pod_resources_socket: Path,
        gpu_clients: str = "none",
    ) -> None:
        self.pods = pods
        self.tree = tree
        self.submit = submit
        self.interval = interval
        self.socket = pod_resources_socket
        self.gpu_clients = gpu_clients
        """How a pod holding tokens is named to the node's GPU layer: `tokens` (the vGPU
        layer and Gemini: named after the container's lowest token, as Allocate named it),
        `container` (HAMi: `<pod UID>_<container>`, its region's directory), `none`."""
        self._driver: Driver | None = None
        self._known: dict[str, PodSpec] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads = [
            threading.Thread(
                target=self.pods.run, args=(self._stop,), name="k8s-pods", daemon=True
            ),
            threading.Thread(target=self._run, name="k8s-discovery", daemon=True),
        ]

    def specs(self) -> dict[str, PodSpec]:
        """The pods holding tokens that can be managed now, by key."""
        holders = list_token_holders(self.socket)
        if self._driver is None:
            self._driver = detect_driver(self.tree)
        found = {}
        for holder, view in join(holders, self.pods):
            if not view.started:
                log.info(
                    "pod %s/%s holds tokens but not all its containers have started; later",
                    holder.namespace,
                    holder.name,
                )
                continue
            try:
                cgroups = resolve(
                    self.tree, view.uid, view.qos, list(view.container_ids), self._driver
                )
                spec = PodSpec(
                    name=holder.name,
                    namespace=holder.namespace,
                    tokens=holder.tokens,
                    cgroup=cgroups.pod,
                    uid=view.uid,
                    containers=cgroups.containers,
                    declared_cpu=view.declared_cpu,
                    vgpu_id=self._gpu_client(holder, view.uid),
                )
            except (ResolutionError, InvalidSpec) as err:
                log.info(
                    "pod %s/%s holds tokens but is skipped: %s", holder.namespace, holder.name, err
                )
                continue
            found[spec.key] = spec
        return found

    def _gpu_client(self, holder: TokenHolder, uid: str) -> str | None:
        if self.gpu_clients == "tokens":
            return vgpu_id_for(holder.container_tokens[0])
        if self.gpu_clients == "container":
            return f"{uid}_{holder.containers[0]}"
        return None

    def scan(self) -> None:
        """Announce new and changed pods, and withdraw those whose tokens are gone."""
        current = self.specs()
        for key, spec in current.items():
            if self._known.get(key) != spec:
                self.submit(PodAdded(spec))
        for key in self._known.keys() - current.keys():
            self.submit(PodRemoved(key))
        self._known = current

    def _run(self) -> None:
        self.pods.synced.wait(timeout=30)
        while not self._stop.is_set():
            try:
                self.scan()
            except (PodResourcesError, ResolutionError) as err:
                log.warning("discovery pass failed: %s; trying again", err)
            self._wake.wait(self.interval)
            self._wake.clear()

    def wake(self) -> None:
        """Look again now: the device plugin has just given a container tokens, so its pod
        will soon be listed (thread-safe; the device plugin's threads call it)."""
        self._wake.set()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=5)
