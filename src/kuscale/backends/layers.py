"""The GPU backend a configuration names: the original's vGPU module; Gemini measured
through NVML (a GPU node's driver, or the GPU emulator's NVML view in local mode); or HAMi,
measured from its shared regions and never written."""

from __future__ import annotations

from pathlib import Path

from kuscale.backends.base import BackendError, GpuBackend
from kuscale.backends.gemini import GeminiLayer
from kuscale.backends.hami import HamiLayer
from kuscale.backends.nvml import NvmlUsage, load_pynvml
from kuscale.backends.vgpu import VgpuLayer
from kuscale.config import AgentConfig
from kuscale.gpuemu.nvml import EmulatedNvml
from kuscale.model import Resource

GPU_CLIENT_NAMES = {"vgpu": "tokens", "gemini": "tokens", "hami": "container"}
"""How Kubernetes discovery names a pod to each GPU layer (see KubernetesDiscovery)."""


def gpu_backend(
    config: AgentConfig, cgroup_mode: str, emulator_socket: Path | None = None
) -> GpuBackend | None:
    layer = config.gpu_layer
    if layer.kind == "vgpu":
        return VgpuLayer(Path(layer.root), layer.gpus)
    if layer.kind == "hami":
        return HamiLayer(Path(layer.hami_root), layer.gpus)
    if layer.kind != "gemini":
        return None
    if layer.usage == "emulator":
        if emulator_socket is None:
            raise BackendError("gpu_layer.usage = 'emulator' needs the GPU emulator's socket")
        nvml = EmulatedNvml(emulator_socket)
    else:
        nvml = load_pynvml()
    return GeminiLayer(
        Path(layer.gemini_dir),
        layer.files(),
        NvmlUsage(nvml, cgroup_mode),
        layer.gemini_request,
        float(config.policy_config.minimums()[Resource.GPU]),
    )
