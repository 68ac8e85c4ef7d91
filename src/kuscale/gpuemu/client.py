"""A blocking client of the GPU emulator: what a workload calls to run a kernel, on the
device it names, behind Gemini's pod manager where one is given."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from kuscale.gpuemu.gemini import GeminiError, GeminiGate
from kuscale.model import GPU_DEVICE_ENV, GPU_SOCKET_ENV, VGPU_ENV, is_decimal


class GpuClientError(Exception):
    pass


class GpuClient:
    def __init__(
        self,
        socket_path: Path,
        vgpu_id: str,
        timeout: float = 30.0,
        device: int = 0,
        gate: GeminiGate | None = None,
    ) -> None:
        self.gate = gate
        self._quota_until = 0.0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(socket_path))
        except OSError as err:
            self._sock.close()
            raise GpuClientError(f"cannot reach the GPU emulator at {socket_path}: {err}") from err
        self._file = self._sock.makefile("rwb")
        self._request(f"HELLO {vgpu_id} {device}")

    def _request(self, line: str) -> None:
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        reply = self._file.readline().decode().strip()
        if reply not in ("OK", "DONE"):
            raise GpuClientError(f"GPU emulator answered {reply!r} to {line!r}")

    def run(self, seconds: float) -> float:
        """Run one kernel of at most this length; blocks while the client is out of its
        share. Behind Gemini the kernel is cut to the quota left; the seconds it ran."""
        if self.gate is not None:
            seconds = self._within_quota(seconds)
        self._request(f"RUN {max(1, round(seconds * 1e6))}")
        return seconds

    def _within_quota(self, seconds: float) -> float:
        """As Gemini's hook does: ask the pod manager only when the quota it last granted
        would not cover this kernel, reporting the kernel as the next burst."""
        assert self.gate is not None
        if time.monotonic() + seconds > self._quota_until:
            try:
                left = self.gate.quota_ms(seconds * 1000.0) / 1000.0
            except GeminiError as err:
                raise GpuClientError(str(err)) from err
            self._quota_until = time.monotonic() + max(left, 0.0)
        return min(seconds, max(self._quota_until - time.monotonic(), 1e-4))

    def close(self) -> None:
        self._file.close()
        self._sock.close()
        if self.gate is not None:
            self.gate.close()


def from_environment() -> tuple[Path | None, str | None, int]:
    """The emulator socket, vGPU id and device that `kuscale launch --gpu` (or the demo)
    put in the environment."""
    socket_path = os.environ.get(GPU_SOCKET_ENV)
    device = os.environ.get(GPU_DEVICE_ENV, "0")
    if not is_decimal(device):
        raise GpuClientError(f"{GPU_DEVICE_ENV}={device!r} is not a device index")
    return (Path(socket_path) if socket_path else None), os.environ.get(VGPU_ENV), int(device)
