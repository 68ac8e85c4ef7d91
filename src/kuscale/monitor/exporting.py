"""What the monitor shows: a JSON-ready snapshot for `kuscale status`, the demo, `top` and the
Prometheus exporter."""

from __future__ import annotations

from typing import Any

import numpy as np

from kuscale.model import Resource
from kuscale.monitor.pods import PodState, Registry
from kuscale.monitor.table import PodTable
from kuscale.policy.base import FloatArray


def snapshot(
    head: dict[str, Any], registry: Registry, table: PodTable, device_capacity: FloatArray
) -> dict[str, Any]:
    """`head` (the agent's own fields), each GPU device, then every pod, running first."""
    pods = [*registry.running.values(), *registry.completed.values()]
    return {
        **head,
        "gpu_devices": device_view(registry, table, device_capacity),
        "pods": [pod_view(pod) for pod in pods],
    }


def device_view(
    registry: Registry, table: PodTable, device_capacity: FloatArray
) -> list[dict[str, float]]:
    """Each GPU device's capacity and what its running pods hold and use of it."""
    c = table.columns
    rows = np.array([p.row for p in registry.running.values()], dtype=np.int64)
    gpu = rows[c.uses[rows, Resource.GPU]]
    on = c.device[gpu]
    placed = (on >= 0) & (on < device_capacity.size)
    size = device_capacity.size
    held = np.bincount(on[placed], c.limit[gpu[placed], Resource.GPU], minlength=size)
    used = np.bincount(on[placed], c.usage[gpu[placed], Resource.GPU], minlength=size)
    return [
        {"device": d, "capacity": float(capacity), "limit": float(held[d]), "usage": float(used[d])}
        for d, capacity in enumerate(device_capacity.tolist())
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
        "gpu_device": pod.gpu_device if pod.uses(Resource.GPU) else None,
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
