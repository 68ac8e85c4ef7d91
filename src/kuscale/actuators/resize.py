"""The Kubernetes actuator: a pod's limit asked of the API server as an in-place resize.

Each write is one strategic-merge PATCH of the pod's `resize` subresource setting its
containers' `limits.cpu`; the kubelet then writes the cgroups itself, in its own order.
Slower than writing them (a request per changed pod per period, then the kubelet's sync),
but the limit is visible in the pod's spec, and what the scheduler sees stays true.

The pod's limit is split across its containers in proportion to the limits they declared,
rounded down to millicores and never below a container's request (the API refuses a limit
under the request). A container without `limits.cpu` would leave the pod unbounded whatever
the others hold, and a Guaranteed pod's limits cannot move without changing its QoS class,
which a resize may not: such pods are refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity
from urllib3.exceptions import HTTPError

from kuscale.backends.base import BackendError, CgroupGone, Unmanageable
from kuscale.model import ContainerLimit, Held, PodSpec

MILLI_PER_PERCENT = 10
"""limits.cpu "1" is one core, 100 %, 1000 millicores."""
MIN_MILLI = 10
"""The kubelet turns a limit into a quota of at least 1 ms per 100 ms period: 10m."""
FIELD_MANAGER = "kuscale"
PATCH_TYPE = "application/strategic-merge-patch+json"

Result = TypeVar("Result")


def cpu_percent(quantity: object) -> float:
    """A `cpu` quantity ("250m", "1.5", 2) in percent of one core."""
    try:
        value = parse_quantity(quantity)
    except (ValueError, TypeError, InvalidOperation):
        raise BackendError(f"{quantity!r} is not a CPU quantity") from None
    if not isinstance(value, Decimal) or not value.is_finite() or value < 0:
        raise BackendError(f"{quantity!r} is not a CPU quantity")
    return float(value * 100)


class ResizeActuator:
    def __init__(self, core: client.CoreV1Api, timeout: float = 5.0) -> None:
        self.core = core
        self.timeout = timeout
        self.mode = "resize"

    def inspect(self, spec: PodSpec) -> Held:
        pod = self._call(
            spec,
            lambda: self.core.read_namespaced_pod(
                spec.name, spec.namespace, _request_timeout=self.timeout
            ),
        )
        if pod.metadata is None or pod.spec is None or pod.metadata.uid != spec.uid:
            raise CgroupGone(f"pod {spec.key} is not the one with UID {spec.uid}")
        if pod.status is not None and pod.status.qos_class == "Guaranteed":
            raise Unmanageable(
                "a Guaranteed pod's CPU limit cannot be resized without changing its QoS class"
            )
        containers = tuple(_container_limit(c) for c in pod.spec.containers)
        return Held(sum(c.limit or 0.0 for c in containers), containers)

    def hold(self, spec: PodSpec, held: Held) -> None:
        """A resize binds as it is: nothing to lift."""

    def quantize(self, held: Held, limit: float) -> float:
        return sum(self._split(held, limit)) / MILLI_PER_PERCENT

    def cgroup_set(self, cgroups: Sequence[str]) -> None:
        """Each pod's containers are patched through the API, one pod at a time."""
        return None

    def write(self, spec: PodSpec, held: Held, limit: float) -> None:
        milli = self._split(held, limit)
        self._patch(spec, {c.name: m for c, m in zip(held.containers, milli, strict=True)})

    def release(self, spec: PodSpec, held: Held) -> None:
        """The declared limits back, to the very pod that held them: a pod of the same name
        made since (another UID) is not touched, and counts as gone (CgroupGone)."""
        pod = self._call(
            spec,
            lambda: self.core.read_namespaced_pod(
                spec.name, spec.namespace, _request_timeout=self.timeout
            ),
        )
        if pod.metadata is None or pod.metadata.uid != spec.uid:
            raise CgroupGone(f"pod {spec.key} is not the one with UID {spec.uid}")
        declared = {c.name: round((c.limit or 0.0) * MILLI_PER_PERCENT) for c in held.containers}
        self._patch(spec, declared)

    def _split(self, held: Held, limit: float) -> list[int]:
        """Millicores per container: the pod's limit in proportion to their declared limits,
        rounded down so the pod never holds more than it is charged for, floored at each
        container's request."""
        declared = [c.limit or 0.0 for c in held.containers]
        total = sum(declared) or 1.0
        return [
            max(
                math.floor(limit * MILLI_PER_PERCENT * share / total),
                math.ceil(c.request * MILLI_PER_PERCENT),
                MIN_MILLI,
            )
            for c, share in zip(held.containers, declared, strict=True)
        ]

    def _patch(self, spec: PodSpec, millicores: dict[str, int]) -> None:
        body = {
            "spec": {
                "containers": [
                    {"name": name, "resources": {"limits": {"cpu": f"{milli}m"}}}
                    for name, milli in millicores.items()
                ]
            }
        }
        self._call(
            spec,
            lambda: self.core.patch_namespaced_pod_resize(
                spec.name,
                spec.namespace,
                body,
                field_manager=FIELD_MANAGER,
                _content_type=PATCH_TYPE,
                _request_timeout=self.timeout,
            ),
        )

    def _call(self, spec: PodSpec, request: Callable[[], Result]) -> Result:
        """One API request; a pod that is gone, a refusal and a failed connection become the
        errors the monitor knows."""
        try:
            return request()
        except ApiException as err:
            if err.status == 404:
                raise CgroupGone(f"pod {spec.key} is gone") from None
            raise BackendError(
                f"the API server refused to resize {spec.key}: {err.status} {_reason(err)}"
            ) from None
        except (HTTPError, OSError) as err:
            raise BackendError(f"cannot reach the API server to resize {spec.key}: {err}") from None


def _container_limit(container: Any) -> ContainerLimit:
    resources = container.resources
    limits = (resources.limits if resources is not None else None) or {}
    requests = (resources.requests if resources is not None else None) or {}
    if "cpu" not in limits:
        raise Unmanageable(
            f"container {container.name} declares no limits.cpu: the resize actuator scales "
            "pods whose every container has one"
        )
    return ContainerLimit(
        container.name, cpu_percent(limits["cpu"]), cpu_percent(requests.get("cpu", 0))
    )


def _reason(err: ApiException) -> str:
    """The Status message the API server sends with a refusal, else the HTTP reason."""
    try:
        message = json.loads(err.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or err.reason)
