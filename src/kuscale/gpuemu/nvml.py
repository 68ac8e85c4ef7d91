"""The emulator seen through NVML: the functions, errors and sample records of `pynvml` that
kuscale's NVML backend calls, answered from the emulated GPUs' own per-process samples.

Only the names kuscale uses are here, with pynvml's signatures and return shapes (a list of
records with `pid`, `timeStamp`, `smUtil`, ...; NVMLError carrying `value`; NOT_FOUND when
no sample is newer than the timestamp asked). A test checks each name against the real
module, so the backend meets the same library on a GPU node.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass(frozen=True, slots=True)
class ProcessUtilizationSample:
    """pynvml's c_nvmlProcessUtilizationSample_t (and the v1 info record's first fields)."""

    pid: int
    timeStamp: int  # noqa: N815 - pynvml's field name
    smUtil: int  # noqa: N815
    memUtil: int = 0  # noqa: N815
    encUtil: int = 0  # noqa: N815
    decUtil: int = 0  # noqa: N815


class EmulatedNvml:
    """A `pynvml` stand-in over the emulator's socket; device handles are indices."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND

    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def _ask(self, line: str) -> list[str]:
        """One request; the reply's lines up to `END` (or its one line)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(str(self.socket_path))
                reader = sock.makefile("rb")
                sock.sendall(line.encode() + b"\n")
                first = reader.readline().decode().strip()
                if first.startswith("ERR"):
                    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
                lines = [first]
                while line.startswith("SAMPLES") and lines[-1] != "END":
                    lines.append(reader.readline().decode().strip())
                    if not lines[-1]:
                        raise NVMLError(NVML_ERROR_UNKNOWN)
        except OSError as err:
            raise NVMLError(NVML_ERROR_UNKNOWN) from err
        return lines[:-1] if line.startswith("SAMPLES") else lines

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self._ask("DEVICES")

    def nvmlShutdown(self) -> None:  # noqa: N802
        return None

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return int(self._ask("DEVICES")[0])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if not 0 <= index < self.nvmlDeviceGetCount():
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetProcessUtilization(  # noqa: N802
        self,
        handle: int,
        timeStamp: int,  # noqa: N803
    ) -> list[ProcessUtilizationSample]:
        samples = []
        for line in self._ask(f"SAMPLES {handle} {timeStamp}"):
            pid, stamp, sm = (int(field) for field in line.split())
            samples.append(ProcessUtilizationSample(pid, stamp, sm))
        if not samples:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return samples

    def nvmlDeviceGetProcessesUtilizationInfo(  # noqa: N802
        self,
        handle: int,
        timeStamp: int,  # noqa: N803
    ) -> list[ProcessUtilizationSample]:
        return self.nvmlDeviceGetProcessUtilization(handle, timeStamp)
