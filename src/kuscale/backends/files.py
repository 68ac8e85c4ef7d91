"""The only file primitives backends use: confined paths and small, fast reads and writes.

Every path is built from a configured root and a relative name checked component by
component, so a pod name or id from outside can never reach a file outside that root.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from kuscale.backends.base import BackendError, CgroupGone, CounterError

_COMPONENT = re.compile(r"^[A-Za-z0-9_.:@+-]+$")


def confine(root: Path, relative: str) -> Path:
    """Join `relative` under `root`, refusing anything that could leave it."""
    if not relative or relative.startswith("/"):
        raise BackendError(f"path {relative!r} must be relative to {root}")
    parts = relative.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise BackendError(f"path component {part!r} in {relative!r} is not allowed")
    return root.joinpath(*parts)


def read_text(path: Path) -> str:
    """Read a small kernel file in one system call; a missing file means the cgroup is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as err:
        raise CgroupGone(f"{path} does not exist") from err
    except OSError as err:
        raise BackendError(f"cannot open {path}: {err.strerror}") from err
    try:
        return os.read(fd, 65536).decode("ascii", errors="replace")
    except OSError as err:
        if err.errno == errno.ENODEV:
            raise CgroupGone(f"{path} was removed while reading") from err
        raise BackendError(f"cannot read {path}: {err.strerror}") from err
    finally:
        os.close(fd)


def write_text(path: Path, value: str) -> None:
    """Write a value the way the kernel expects: one write, no truncation, no temp file."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError as err:
        raise CgroupGone(f"{path} does not exist") from err
    except OSError as err:
        raise BackendError(f"cannot open {path} for writing: {err.strerror}") from err
    try:
        os.write(fd, value.encode("ascii"))
    except OSError as err:
        raise BackendError(f"kernel refused {value!r} for {path}: {err.strerror}") from err
    finally:
        os.close(fd)


def parse_int(text: str, path: Path) -> int:
    """A counter: one non-negative integer."""
    value = text.strip()
    if not value.isdigit():
        raise CounterError(f"{path} holds {value[:40]!r}, not a counter")
    return int(value)


def parse_keyed(text: str, path: Path) -> dict[str, int]:
    """A flat keyed file such as cpu.stat: `key value` per line; unknown keys are kept."""
    result: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise CounterError(f"{path} has a malformed line {line[:60]!r}")
        result[fields[0]] = int(fields[1])
    return result
