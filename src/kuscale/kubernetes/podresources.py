"""Which pods on this node hold tokens, and how many: the kubelet's pod-resources `List`.

The kubelet knows which token IDs it gave each container; it does not say the pod's UID
(the API server's view, joined by namespace and name, supplies that). A pod's tokens are the
distinct token IDs of all its containers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from kuscale.deviceplugin.plugin import RESOURCE_NAME
from kuscale.kubernetes import POD_RESOURCES_SOCKET
from kuscale.kubernetes import podresources_pb2 as api
from kuscale.kubernetes import podresources_pb2_grpc as rpc


class PodResourcesError(Exception):
    """The kubelet's pod-resources API could not be asked; the caller retries later."""


@dataclass(frozen=True, slots=True)
class TokenHolder:
    namespace: str
    name: str
    tokens: int
    containers: tuple[str, ...]
    """The containers that were given tokens."""
    container_tokens: tuple[tuple[str, ...], ...]
    """The token IDs each of those containers was given, in the same order."""


def token_holders(response: api.ListPodResourcesResponse) -> list[TokenHolder]:
    holders = []
    for pod in response.pod_resources:
        ids: set[str] = set()
        containers = []
        given_ids = []
        for container in pod.containers:
            given = {
                i
                for d in container.devices
                if d.resource_name == RESOURCE_NAME
                for i in d.device_ids
            }
            if given:
                containers.append(container.name)
                given_ids.append(tuple(sorted(given)))
                ids |= given
        if ids:
            holders.append(
                TokenHolder(pod.namespace, pod.name, len(ids), tuple(containers), tuple(given_ids))
            )
    return holders


def list_token_holders(
    socket: Path = POD_RESOURCES_SOCKET, timeout: float = 5.0
) -> list[TokenHolder]:
    """Ask the kubelet once; an unreachable kubelet or a garbled answer is an error."""
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            response = rpc.PodResourcesListerStub(channel).List(
                api.ListPodResourcesRequest(), timeout=timeout
            )
    except grpc.RpcError as err:
        raise PodResourcesError(f"pod-resources List on {socket} failed: {err}") from None
    return token_holders(response)
