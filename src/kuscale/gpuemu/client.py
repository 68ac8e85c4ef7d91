"""A blocking client of the GPU emulator: what a workload calls to run a kernel."""

from __future__ import annotations

import os
import socket
from pathlib import Path

VGPU_ENV = "KUSCALE_VGPU_ID"
GPU_SOCKET_ENV = "KUSCALE_GPU_SOCKET"


class GpuClientError(Exception):
    pass


class GpuClient:
    def __init__(self, socket_path: Path, vgpu_id: str, timeout: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(socket_path))
        except OSError as err:
            self._sock.close()
            raise GpuClientError(f"cannot reach the GPU emulator at {socket_path}: {err}") from err
        self._file = self._sock.makefile("rwb")
        self._request(f"HELLO {vgpu_id}")

    def _request(self, line: str) -> None:
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        reply = self._file.readline().decode().strip()
        if reply not in ("OK", "DONE"):
            raise GpuClientError(f"GPU emulator answered {reply!r} to {line!r}")

    def run(self, seconds: float) -> None:
        """Run one kernel of this length; blocks while the client is out of its share."""
        self._request(f"RUN {max(1, round(seconds * 1e6))}")

    def close(self) -> None:
        self._file.close()
        self._sock.close()


def from_environment() -> tuple[Path | None, str | None]:
    """The emulator socket and vGPU id that `kuscale launch --gpu` put in the environment."""
    socket_path = os.environ.get(GPU_SOCKET_ENV)
    return (Path(socket_path) if socket_path else None), os.environ.get(VGPU_ENV)
