"""GPU busy time per cgroup and device, from NVML's per-process utilisation samples.

NVML reports, per process that used a GPU since a timestamp, samples of its SM utilisation
(`nvmlDeviceGetProcessesUtilizationInfo` on drivers 550 and newer, else the legacy
`nvmlDeviceGetProcessUtilization`). Each sample's utilisation holds over one sampling period
of the driver, so busy time is the utilisation times that period, integrated into a counter
per (cgroup, device): the same cumulative counter the monitor reads from every other layer.
The period is learned as the smallest gap between a device's sampling instants. Host PIDs
map to cgroups through `/proc/<pid>/cgroup`; a process gone before the lookup is skipped.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from kuscale.backends.base import BackendError
from kuscale.backends.procfs import ProcessCgroupError, cgroup_of_process

log = logging.getLogger("kuscale.nvml")

DEFAULT_SAMPLE_PERIOD_US = 166_667
"""What a driver's period is taken to be until two sampling instants show it."""
MIN_SAMPLE_PERIOD_US = 10_000


def load_pynvml() -> Any:
    """The real NVML binding (optional extra `kuscale[nvml]`)."""
    try:
        import pynvml  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError as err:
        raise BackendError("NVML needs nvidia-ml-py: pip install 'kuscale[nvml]'") from err
    return pynvml


class NvmlUsage:
    """Cumulative GPU busy nanoseconds per (cgroup, device), polled from a `pynvml`-shaped
    library (typed Any: pynvml ships no type information)."""

    def __init__(self, nvml: Any, cgroup_mode: str, proc: Path = Path("/proc")) -> None:
        self.nvml = nvml
        self.cgroup_mode = cgroup_mode
        self.proc = proc
        try:
            nvml.nvmlInit()
            self._handles = [
                nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
            ]
        except nvml.NVMLError as err:
            raise BackendError(f"NVML: {err}") from err
        now_us = time.time_ns() // 1000
        self.last_seen = [now_us] * len(self._handles)
        """Per device: the newest sample taken (µs), where the next poll starts."""
        self._period_us = [DEFAULT_SAMPLE_PERIOD_US] * len(self._handles)
        self._last_instant: list[int | None] = [None] * len(self._handles)
        self._newer_api = True
        self._busy_ns: defaultdict[tuple[str, int], float] = defaultdict(float)

    @property
    def devices(self) -> int:
        return len(self._handles)

    def poll(self) -> None:
        """Take every sample newer than the last seen, on every device."""
        cgroups: dict[int, str | None] = {}
        for device in range(len(self._handles)):
            samples = sorted(self._samples(device), key=lambda s: int(s.timeStamp))
            self._learn_period(device, samples)
            for sample in samples:
                pid = int(sample.pid)
                if pid not in cgroups:
                    cgroups[pid] = self._cgroup(pid)
                cgroup = cgroups[pid]
                if cgroup is not None:
                    share = min(max(int(sample.smUtil), 0), 100) / 100.0
                    self._busy_ns[cgroup, device] += share * self._period_us[device] * 1000.0
            if samples:
                self.last_seen[device] = max(self.last_seen[device], int(samples[-1].timeStamp))

    def busy_ns(self, cgroup: str, device: int) -> int:
        """Busy time of the cgroup and everything under it on this device."""
        below = cgroup + "/"
        return int(
            sum(
                busy
                for (owner, on), busy in self._busy_ns.items()
                if on == device and (owner == cgroup or owner.startswith(below))
            )
        )

    def _samples(self, device: int) -> list[Any]:
        """Samples newer than the last seen; NOT_FOUND is none, other errors are logged."""
        handle, since = self._handles[device], self.last_seen[device]
        nvml = self.nvml
        try:
            if self._newer_api:
                try:
                    return list(nvml.nvmlDeviceGetProcessesUtilizationInfo(handle, since))
                except (AttributeError, nvml.NVMLError) as err:
                    if not _missing_function(nvml, err):
                        raise
                    self._newer_api = False
            return list(nvml.nvmlDeviceGetProcessUtilization(handle, since))
        except nvml.NVMLError as err:
            if getattr(err, "value", None) != nvml.NVML_ERROR_NOT_FOUND:
                log.warning("NVML device %d: per-process utilisation failed: %s", device, err)
            return []

    def _learn_period(self, device: int, samples: list[Any]) -> None:
        """The smallest gap between sampling instants seen on the device (an idle instant
        has no sample, so gaps are whole multiples of the period)."""
        instants = {int(s.timeStamp) for s in samples}
        if not instants:
            return
        previous = self._last_instant[device]
        ordered = sorted(instants if previous is None else instants | {previous})
        self._last_instant[device] = ordered[-1]
        gaps = [b - a for a, b in itertools.pairwise(ordered)]
        useful = [gap for gap in gaps if gap >= MIN_SAMPLE_PERIOD_US]
        if useful:
            self._period_us[device] = min(self._period_us[device], *useful)

    def _cgroup(self, pid: int) -> str | None:
        try:
            return cgroup_of_process(pid, self.cgroup_mode, self.proc)
        except ProcessCgroupError as err:
            log.debug("NVML sample of pid %d skipped: %s", pid, err)
            return None


def _missing_function(nvml: Any, err: Exception) -> bool:
    """The driver or binding lacks the newer call: fall back to the legacy one."""
    if isinstance(err, AttributeError):
        return True
    return getattr(err, "value", None) in (
        nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        nvml.NVML_ERROR_NOT_SUPPORTED,
    )
