"""The original KuScale vGPU layer: one directory per vGPU id under a root.

Each directory has `total_runtime` (cumulative busy ns, read), `gpu_limit` and `gpu_request`
(per-mille of the GPU's time, written); writing `0` to `gemini/resource_conf` makes the Gemini
scheduler reload. The kernel module and the GPU emulator both serve this layout, so the same
code drives either. The original poked the module through `sh -c echo`; this writes the files.
"""

from __future__ import annotations

import errno
import math
import time
from pathlib import Path

from kuscale.backends.base import BackendError, RangeError
from kuscale.backends.files import confine, parse_int, read_text, write_text
from kuscale.model import validate_vgpu_id

RELOAD_FILE = "gemini/resource_conf"
MAX_PER_MILLE = 1000
TOTAL_RUNTIME = "total_runtime"
KEPT_PATHS = 8192
"""Clients whose `total_runtime` path is kept (a node's pods, with room for churn)."""
GPU_LIMIT = "gpu_limit"
GPU_REQUEST = "gpu_request"
REMOVE_TRIES = 4
REMOVE_PAUSE_S = 0.005
"""Between tries: long enough for a layer's write-and-rename of `total_runtime` to land."""


def limit_to_per_mille(limit: float | None, gpus: int) -> int:
    """L percent of one GPU ↔ L × 10 per-mille; unlimited means all of the node's GPUs."""
    if limit is None:
        return MAX_PER_MILLE * gpus
    if not math.isfinite(limit) or not 0.0 < limit <= 100.0 * gpus:
        raise RangeError(f"GPU limit {limit} is outside (0, {100 * gpus}]")
    return max(1, round(limit * 10.0))


def client_directory(root: Path, vgpu_id: str) -> str:
    """A client's directory under a layer's root, its id checked first."""
    try:
        validate_vgpu_id(vgpu_id)
    except ValueError as err:
        raise BackendError(str(err)) from err
    return confine(root, vgpu_id)


class PooledGpus:
    """A layer that schedules the node's GPUs as one pool and accounts each client's use
    itself: one device of them all, no process to follow."""

    gpus: int
    weighted = False

    def capacity(self) -> float:
        return 100.0 * self.gpus

    def devices(self) -> tuple[float, ...]:
        return (self.capacity(),)

    def device_of(self, vgpu_id: str) -> int:
        return 0

    def track(self, vgpu_id: str, cgroup: str) -> None:
        """Nothing to follow: the layer counts use per client."""

    def weigh(self, vgpu_id: str, tokens: float) -> None:
        """The layer shares by limits alone."""


class VgpuLayer(PooledGpus):
    """GPU backend over the vGPU directory layout, rooted at a configurable directory. The
    kernel module's scheduler pools the node's GPUs."""

    mode = "vgpu"

    def __init__(self, root: Path, gpus: int = 1) -> None:
        self.root = root
        self.gpus = gpus
        self._dirty = False
        self._runtimes: dict[str, str] = {}

    def quantize(self, vgpu_id: str, limit: float, held: float | None) -> float:
        """The module takes per-mille: within a twentieth of a point of `limit`."""
        return limit

    def _dir(self, vgpu_id: str) -> Path:
        return Path(client_directory(self.root, vgpu_id))

    def exists(self, vgpu_id: str) -> bool:
        return self._dir(vgpu_id).is_dir()

    def create(self, vgpu_id: str) -> None:
        """Make a client's directory with the whole GPU allowed, as an allocation would."""
        directory = self._dir(vgpu_id)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name, value in (
                (TOTAL_RUNTIME, "0"),
                (GPU_LIMIT, str(MAX_PER_MILLE)),
                (GPU_REQUEST, str(MAX_PER_MILLE)),
            ):
                path = directory / name
                if not path.exists():
                    path.write_text(value)
        except OSError as err:
            raise BackendError(f"cannot create vGPU {vgpu_id} under {self.root}: {err}") from err

    def remove(self, vgpu_id: str) -> None:
        """Delete the files kuscale made, then the directory; tried again where the layer
        published busy time into it in between (the emulator's flush lands there every
        50 ms, seen in the demo). A file of anyone else's is left, and said."""
        directory = self._dir(vgpu_id)
        self._runtimes.pop(vgpu_id, None)
        for attempt in range(1, REMOVE_TRIES + 1):
            try:
                for name in (TOTAL_RUNTIME, GPU_LIMIT, GPU_REQUEST):
                    (directory / name).unlink(missing_ok=True)
                directory.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.ENOTEMPTY or attempt == REMOVE_TRIES:
                    raise BackendError(f"cannot remove vGPU {vgpu_id}: {err}") from err
            time.sleep(REMOVE_PAUSE_S)

    def read(self, vgpu_id: str) -> int:
        """Busy ns; the file's path is kept per client, as the watch reads it every look."""
        path = self._runtimes.get(vgpu_id)
        if path is None:
            if len(self._runtimes) >= KEPT_PATHS:
                self._runtimes.clear()
            path = self._runtimes[vgpu_id] = (
                f"{client_directory(self.root, vgpu_id)}/{TOTAL_RUNTIME}"
            )
        return parse_int(read_text(path), path)

    def read_limit(self, vgpu_id: str) -> float | None:
        path = self._dir(vgpu_id) / GPU_LIMIT
        per_mille = parse_int(read_text(path), path)
        return None if per_mille >= MAX_PER_MILLE * self.gpus else per_mille / 10.0

    def write_limit(self, vgpu_id: str, limit: float | None) -> None:
        directory = self._dir(vgpu_id)
        value = str(limit_to_per_mille(limit, self.gpus))
        write_text(directory / GPU_LIMIT, value)
        write_text(directory / GPU_REQUEST, value)
        self._dirty = True

    def commit(self) -> None:
        """One Gemini reload per tick, after all of the tick's writes, not one per pod."""
        if not self._dirty:
            return
        path = self.root / RELOAD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.write_text("0")
        except OSError as err:
            raise BackendError(f"cannot poke {path}: {err}") from err
        self._dirty = False
