"""HAMi, read-only: each container's SM use from HAMi-core's shared region, so a HAMi node's
GPU use is measured and charged against budgets, though HAMi cannot be resized.

HAMi-core keeps, per container, a file the host mounts in (its `CUDA_DEVICE_MEMORY_SHARED_
CACHE`, under `/usr/local/vgpu/containers/<pod UID>_<container>/` on the host), mmapped by
every process of the container. Its layout (`shared_region_t` in HAMi-core's
`src/multiprocess/multiprocess_memory_limit.h`, version 1.2, x86-64): a header — an
initialised flag (19920718 when complete), major and minor version, the owner pid, a
semaphore, the device count, 16 device UUIDs of 96 bytes, 16 memory limits and 16 SM limits
(percent) — then 1024 process slots of 1960 bytes: pid and host pid, per device the memory
used, the memory monitored and `{dec, enc, sm}` utilisation, and a status. A slot with pid
0 is free. HAMi's own monitor sums `sm_util` over live slots per container; so does this.

The SM limit is fixed when the container starts (cached since HAMi-core commit 24fd045), so
kuscale never writes: the share a pod holds, and is charged for, is HAMi's.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kuscale.backends.base import BackendError
from kuscale.backends.vgpu import PooledGpus, client_directory

READY = 19920718
MAX_DEVICES = 16
MAX_PROCESSES = 1024
UUID_BYTES = 96
SLOT_BYTES = 1960
LIMITS_AT = 64 + MAX_DEVICES * UUID_BYTES
SM_LIMITS_AT = LIMITS_AT + 8 * MAX_DEVICES
SLOTS_AT = SM_LIMITS_AT + 8 * MAX_DEVICES
REGION_BYTES = SLOTS_AT + MAX_PROCESSES * SLOT_BYTES
_HEADER = struct.Struct("<iIIi")
_DEVICE_COUNT_AT = 56
_PIDS = struct.Struct("<ii")
_UTIL_AT = 8 + MAX_DEVICES * 64 + MAX_DEVICES * 8
_UTIL_BYTES = 48
_SM_IN_UTIL = 16
SUPPORTED_MAJOR = 1


@dataclass(frozen=True, slots=True)
class Region:
    """What kuscale reads of one container's shared region."""

    devices: int
    sm_limits: tuple[int, ...]
    """Per device, percent; 0 is no limit."""
    sm_util: tuple[int, ...]
    """Per device, the SM percent its live processes use together now."""


def parse_region(data: bytes, path: str) -> Region:
    """Refuses anything not shaped like a complete version-1 region: the file is written by
    processes in the container, and what is read becomes a pod's charged share."""
    if len(data) < REGION_BYTES:
        raise BackendError(f"{path}: {len(data)} bytes, a HAMi region has {REGION_BYTES}")
    ready, major, minor, _ = _HEADER.unpack_from(data)
    if ready != READY:
        raise BackendError(f"{path}: not an initialised HAMi region")
    if major != SUPPORTED_MAJOR:
        raise BackendError(f"{path}: HAMi region version {major}.{minor} is not supported")
    (devices,) = struct.unpack_from("<Q", data, _DEVICE_COUNT_AT)
    if not 0 < devices <= MAX_DEVICES:
        raise BackendError(f"{path}: {devices} devices, outside 1-{MAX_DEVICES}")
    sm_limits = struct.unpack_from(f"<{devices}Q", data, SM_LIMITS_AT)
    if any(limit > 100 for limit in sm_limits):
        raise BackendError(f"{path}: an SM limit above 100 % ({sm_limits})")
    used = [0] * devices
    for slot in range(MAX_PROCESSES):
        base = SLOTS_AT + slot * SLOT_BYTES
        pid, _ = _PIDS.unpack_from(data, base)
        if pid <= 0:
            continue
        for device in range(devices):
            at = base + _UTIL_AT + device * _UTIL_BYTES + _SM_IN_UTIL
            (util,) = struct.unpack_from("<Q", data, at)
            used[device] += min(int(util), 100)
    return Region(int(devices), tuple(int(v) for v in sm_limits), tuple(min(u, 100) for u in used))


def read_region(directory: str) -> Region:
    """The container's region: the one `.cache` file in its directory."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".cache"))
    except OSError as err:
        raise BackendError(f"cannot list {directory}: {err.strerror}") from err
    if not names:
        raise BackendError(f"{directory} holds no HAMi region (.cache)")
    path = f"{directory}/{names[0]}"
    try:
        with open(path, "rb") as region:
            data = region.read(REGION_BYTES)
    except OSError as err:
        raise BackendError(f"cannot read {path}: {err.strerror}") from err
    return parse_region(data, path)


@dataclass(slots=True)
class _Meter:
    busy_ns: float
    util: int
    at: float


class HamiLayer(PooledGpus):
    """A `GpuBackend` that measures and never writes. Clients are `<pod UID>_<container>`
    directories under `root`; HAMi shares the node's GPUs as one pool here (its regions name
    devices as each container sees them, not the node's order)."""

    mode = "hami"

    def __init__(self, root: Path, gpus: int = 1) -> None:
        self.root = root
        self.gpus = gpus
        self._meters: dict[str, _Meter] = {}

    def _directory(self, client: str) -> str:
        return client_directory(self.root, client)

    def exists(self, vgpu_id: str) -> bool:
        return os.path.isdir(self._directory(vgpu_id))

    def read(self, vgpu_id: str) -> int:
        """Busy ns, integrating the SM use HAMi reports between reads (it keeps a current
        percentage, not a counter)."""
        region = read_region(self._directory(vgpu_id))
        util, now = sum(region.sm_util), time.monotonic()
        meter = self._meters.get(vgpu_id)
        if meter is None:
            meter = self._meters[vgpu_id] = _Meter(0.0, util, now)
        meter.busy_ns += meter.util / 100.0 * (now - meter.at) * 1e9
        meter.util, meter.at = util, now
        return int(meter.busy_ns)

    def read_limit(self, vgpu_id: str) -> float | None:
        limits = read_region(self._directory(vgpu_id)).sm_limits
        return None if not any(limits) else float(sum(limits))

    def quantize(self, vgpu_id: str, limit: float, held: float | None) -> float:
        """The share HAMi fixed at the container's start, whatever kuscale would give: the
        pod is charged for what it holds, so a share beyond its budget shows as overspend."""
        fixed = self.read_limit(vgpu_id)
        return self.capacity() if fixed is None else fixed

    def write_limit(self, vgpu_id: str, limit: float | None) -> None:
        """HAMi cannot change a running container's share: nothing is written."""

    def remove(self, vgpu_id: str) -> None:
        self._meters.pop(vgpu_id, None)

    def commit(self) -> None:
        """Nothing is staged."""
