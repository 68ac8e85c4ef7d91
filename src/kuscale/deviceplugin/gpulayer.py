"""What `Allocate` gives a container for the vGPU layer: a vGPU of its own, mounted into it,
and the environment the Gemini hook reads.

The kubelet's `Allocate` names only token IDs, never the pod; the pod-resources `List` later
names the pod with the same IDs. The vGPU is named after the lowest of its container's
tokens, which no other running container holds, so the plugin and discovery name it alike
without sharing any state, and an agent that restarts finds the vGPUs of running pods again.
A vGPU left by a container that held that token before is stale and is made afresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from kuscale.backends.base import GpuBackend
from kuscale.backends.gemini import GeminiLayer
from kuscale.backends.vgpu import VgpuLayer
from kuscale.config import GpuLayerConfig
from kuscale.deviceplugin import api_pb2 as api
from kuscale.model import GPU_DEVICE_ENV, VGPU_ENV, is_decimal

TOKEN_PREFIX = "token-"
HOOK_CLIENT_ENV = "POD_NAME"
"""The Gemini hook's name for its client: the section of the scheduler's configuration."""
PRELOAD_ENV = "LD_PRELOAD"
POD_MANAGER_IP_ENV = "POD_MANAGER_IP"
POD_MANAGER_PORT_ENV = "POD_MANAGER_PORT"


def token_id(index: int) -> str:
    return f"{TOKEN_PREFIX}{index}"


def _token_index(token: str) -> int:
    suffix = token.removeprefix(TOKEN_PREFIX)
    return int(suffix) if is_decimal(suffix) else -1


def vgpu_id_for(tokens: Iterable[str]) -> str:
    """The vGPU of the container that holds these tokens."""
    lowest = min(tokens, key=lambda t: (_token_index(t), t))
    return f"kuscale-{lowest.removeprefix(TOKEN_PREFIX)}"


class Allocator(Protocol):
    def allocate(self, tokens: list[str]) -> api.ContainerAllocateResponse: ...


class VgpuAllocator:
    def __init__(self, config: GpuLayerConfig, layer: VgpuLayer) -> None:
        self.config = config
        self.layer = layer

    def allocate(self, tokens: list[str]) -> api.ContainerAllocateResponse:
        """Make the container's vGPU afresh and say how the container reaches it; a vGPU
        that cannot be made raises BackendError, so the container does not start without."""
        vgpu_id = vgpu_id_for(tokens)
        self.layer.remove(vgpu_id)
        self.layer.create(vgpu_id)
        config = self.config
        envs = {VGPU_ENV: vgpu_id}
        mounts = [
            api.Mount(
                container_path=config.container_dir,
                host_path=str(Path(config.root) / vgpu_id),
                read_only=False,
            )
        ]
        return hook_answer(config, vgpu_id, envs, mounts)


class GeminiAllocator:
    """Places the container's Gemini client on the GPU with the fewest clients (its line in
    that GPU's file, the whole GPU until the agent adopts the pod) and tells the hook its
    name and pod manager. Gemini's pod manager per client is run as KubeShare runs it."""

    def __init__(self, config: GpuLayerConfig, layer: GeminiLayer) -> None:
        self.config = config
        self.layer = layer

    def allocate(self, tokens: list[str]) -> api.ContainerAllocateResponse:
        client = vgpu_id_for(tokens)
        device = self.layer.place(client, self.config.gemini_memory)
        return hook_answer(self.config, client, {GPU_DEVICE_ENV: str(device)}, [])


def hook_answer(
    config: GpuLayerConfig, client: str, envs: dict[str, str], mounts: list[api.Mount]
) -> api.ContainerAllocateResponse:
    """What Gemini's hook reads: the client's name (POD_NAME), the library preloaded from
    the host, and its pod manager; then the configured environment."""
    if config.hook_library:
        envs[PRELOAD_ENV] = config.hook_library
        envs[HOOK_CLIENT_ENV] = client
        mounts.append(
            api.Mount(
                container_path=config.hook_library,
                host_path=config.hook_library,
                read_only=True,
            )
        )
    if config.kind == "gemini":
        envs[HOOK_CLIENT_ENV] = client
    address = config.pod_manager_address()
    if address is not None:
        envs[POD_MANAGER_IP_ENV], envs[POD_MANAGER_PORT_ENV] = address[0], str(address[1])
    return api.ContainerAllocateResponse(envs={**config.env, **envs}, mounts=mounts)


def allocator_for(config: GpuLayerConfig, gpu: GpuBackend | None) -> Allocator | None:
    if isinstance(gpu, VgpuLayer):
        return VgpuAllocator(config, gpu)
    if isinstance(gpu, GeminiLayer):
        return GeminiAllocator(config, gpu)
    return None
