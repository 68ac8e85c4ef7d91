"""The API server's view of this node's pods: UID, QoS class and container IDs.

The kubelet's pod-resources API names the pods that hold tokens but not their UIDs; the API
server has those, with the QoS class and container IDs that locate a pod's cgroups. One
list of the pods with `spec.nodeName=<node>`, then a watch from its resource version, keeps
the view current without polling; a watch that ends is resumed, one whose version expired
(410 Gone) or that fails starts over with a list, after a backoff that doubles up to 30 s.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kuscale.actuators.resize import cpu_percent
from kuscale.backends.base import BackendError
from kuscale.kubernetes.podresources import TokenHolder

log = logging.getLogger(__name__)

WATCH_SECONDS = 30
"""A watch is reopened this often, so a stop is noticed and a dead connection replaced."""
MAX_BACKOFF = 30.0


@dataclass(frozen=True, slots=True)
class PodView:
    namespace: str
    name: str
    uid: str
    qos: str
    container_ids: tuple[str, ...]
    """`runtime://id` of each container that has started."""
    declared: int
    """How many containers the pod's spec declares."""
    declared_cpu: float | None = None
    """The pod's CPU limit as its spec declares it, percent: the sum of its containers'
    `limits.cpu` where each declares one (the kubelet then sets the pod cgroup's quota to
    it); None where one does not (the pod cgroup is unlimited) or one cannot be read."""

    @property
    def started(self) -> bool:
        """Every container has been created: its cgroup is where the runtime put it."""
        return len(self.container_ids) >= self.declared


def core_api(kubeconfig: Path | None = None) -> client.CoreV1Api:
    """In-cluster credentials by default (the DaemonSet's service account); a kubeconfig for
    development."""
    if kubeconfig is None:
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=str(kubeconfig))
    return client.CoreV1Api()


def pod_view(pod: Any) -> PodView:
    status = pod.status
    statuses = (status.container_statuses or []) if status is not None else []
    return PodView(
        namespace=pod.metadata.namespace,
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        qos=(status.qos_class if status is not None else None) or "",
        container_ids=tuple(s.container_id for s in statuses if s.container_id),
        declared=len(pod.spec.containers or []) if pod.spec is not None else 0,
        declared_cpu=declared_cpu(pod.spec.containers or []) if pod.spec is not None else None,
    )


def declared_cpu(containers: list[Any]) -> float | None:
    total = 0.0
    for container in containers:
        limits = (container.resources.limits if container.resources is not None else None) or {}
        if "cpu" not in limits:
            return None
        try:
            total += cpu_percent(limits["cpu"])
        except BackendError:
            return None
    return total


class NodePods:
    """The pods the API server places on `node`, kept current by a list and a watch."""

    def __init__(self, core: client.CoreV1Api, node: str) -> None:
        self.core = core
        self.selector = f"spec.nodeName={node}"
        self._pods: dict[tuple[str, str], PodView] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()

    def get(self, namespace: str, name: str) -> PodView | None:
        with self._lock:
            return self._pods.get((namespace, name))

    def sync(self) -> str:
        """Replace the view with a fresh list; its resource version starts the watch."""
        listed = self.core.list_pod_for_all_namespaces(field_selector=self.selector)
        views = {(v.namespace, v.name): v for v in map(pod_view, listed.items)}
        with self._lock:
            self._pods = views
        self.synced.set()
        if listed.metadata is None or not listed.metadata.resource_version:
            raise ValueError("the pod list came without a resource version to watch from")
        return str(listed.metadata.resource_version)

    def follow(self, version: str, stop: threading.Event) -> str:
        """Apply watch events until the watch ends; the version to resume from. An expired
        version (410 Gone) arrives as an ApiException, and `run` lists again."""
        stream = watch.Watch().stream(
            self.core.list_pod_for_all_namespaces,
            field_selector=self.selector,
            resource_version=version,
            timeout_seconds=WATCH_SECONDS,
            allow_watch_bookmarks=True,
        )
        for event in stream:
            if not isinstance(event, dict):
                raise ValueError(
                    f"the pod watch sent something that is not an event: {event!r:.80}"
                )
            if event["type"] == "BOOKMARK":
                version = str(event["raw_object"]["metadata"]["resourceVersion"])
                continue
            view = pod_view(event["object"])
            version = str(event["object"].metadata.resource_version)
            with self._lock:
                if event["type"] == "DELETED":
                    self._pods.pop((view.namespace, view.name), None)
                else:
                    self._pods[(view.namespace, view.name)] = view
            if stop.is_set():
                break
        return version

    def run(self, stop: threading.Event) -> None:
        """List, then watch, until `stop`; every failure is logged and retried."""
        backoff = 1.0
        version: str | None = None
        while not stop.is_set():
            try:
                version = self.sync() if version is None else self.follow(version, stop)
                backoff = 1.0
            except (
                ApiException,
                HTTPError,
                OSError,
                ValueError,
                KeyError,
                AttributeError,
                TypeError,
            ) as err:
                log.warning("the API server's pod list failed (%s); again in %.0f s", err, backoff)
                version = None
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)


def join(holders: list[TokenHolder], pods: NodePods) -> list[tuple[TokenHolder, PodView]]:
    """Token holders with the API server's view of them; one the API server does not know
    (yet) is skipped with a log line and found on a later pass."""
    joined = []
    for holder in holders:
        view = pods.get(holder.namespace, holder.name)
        if view is None:
            log.info(
                "pod %s/%s holds tokens but the API server has not shown it; skipped",
                holder.namespace,
                holder.name,
            )
            continue
        joined.append((holder, view))
    return joined
