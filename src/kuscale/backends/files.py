"""The only file primitives backends use: confined paths and small, fast reads and writes.

Every path is built from a configured root and a relative name checked component by
component, so a pod name or id from outside can never reach a file outside that root.
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kuscale.backends.base import BackendError, CgroupGone, CounterError

_COMPONENT = re.compile(r"^[A-Za-z0-9_.:@+-]+$")


@functools.lru_cache(maxsize=65536)
def confine(root: Path, relative: str) -> str:
    """Join `relative` under `root`, refusing anything that could leave it.

    Cached, since the loop asks for the same few paths of every pod every tick.
    """
    if not relative or relative.startswith("/"):
        raise BackendError(f"path {relative!r} must be relative to {root}")
    for part in relative.split("/"):
        if part in ("", ".", "..") or not _COMPONENT.fullmatch(part):
            raise BackendError(f"path component {part!r} in {relative!r} is not allowed")
    return f"{root}/{relative}"


def read_text(path: str | Path) -> str:
    """Read a small kernel file in one system call; a missing file means the cgroup is gone."""
    fd = _open(str(path), os.O_RDONLY)
    try:
        return os.read(fd, 65536).decode("ascii", errors="replace")
    except OSError as err:
        if err.errno == errno.ENODEV:
            raise CgroupGone(f"{path} was removed while reading") from err
        raise BackendError(f"cannot read {path}: {err.strerror}") from err
    finally:
        os.close(fd)


def write_text(path: str | Path, value: str) -> None:
    """One write, no temp file: what kernel files expect (kernfs ignores the O_TRUNC)."""
    fd = _open(str(path), os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, value.encode("ascii"))
    except OSError as err:
        raise BackendError(f"kernel refused {value!r} for {path}: {err.strerror}") from err
    finally:
        os.close(fd)


def parse_int(text: str, path: str | Path) -> int:
    """A counter: one non-negative integer."""
    value = text.strip()
    if not value.isdigit():
        raise CounterError(f"{path} holds {value[:40]!r}, not a counter")
    return int(value)


def parse_keyed(text: str, path: str | Path) -> dict[str, int]:
    """A flat keyed file such as cpu.stat: `key value` pairs; unknown keys are kept."""
    fields = text.split()
    values = fields[1::2]
    if len(fields) % 2 or not all(map(str.isdigit, values)):
        raise CounterError(f"{path} is not `key value` lines: {text[:60]!r}")
    return dict(zip(fields[::2], map(int, values), strict=True))


class DescriptorCache:
    """Cgroup files kept open, re-read and rewritten at offset 0 every tick.

    On this kernel a pread or pwrite of a cgroup file costs a sixth of open+read+close, and
    the loop touches two or three files per pod per tick. A removed cgroup's descriptor
    answers ENODEV, so a failed call is retried once on a fresh open, which tells a gone
    cgroup from a recreated one. Kernel files take each write whole; regular files (fixture
    trees) are also truncated after the write. Bounded: the least recently used descriptor
    is closed first.
    """

    def __init__(self, size: int = 4096, truncate: bool = False) -> None:
        self.size = size
        self.truncate = truncate
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()

    def read(self, path: str) -> str:
        data = self._use(path, os.O_RDONLY, lambda fd: os.pread(fd, 65536, 0))
        return data.decode("ascii", errors="replace")

    def write(self, path: str, value: str) -> None:
        data = value.encode("ascii")

        def put(fd: int) -> bytes:
            os.pwrite(fd, data, 0)
            if self.truncate:
                os.ftruncate(fd, len(data))
            return data

        self._use(path, os.O_WRONLY, put)

    def _use(self, path: str, mode: int, call: Callable[[int], bytes]) -> bytes:
        key = (path, mode)
        fd = self._fds.get(key)
        if fd is not None:
            try:
                result = call(fd)
            except OSError:
                self._close(key)
            else:
                self._fds.move_to_end(key)
                return result
        fd = _open(path, mode)
        try:
            result = call(fd)
        except OSError as err:
            os.close(fd)
            verb = "read" if mode == os.O_RDONLY else "write"
            raise BackendError(f"cannot {verb} {path}: {err.strerror}") from err
        self._fds[key] = fd
        if len(self._fds) > self.size:
            self._close(next(iter(self._fds)))
        return result

    def _close(self, key: tuple[str, int]) -> None:
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def forget(self, directory: str) -> None:
        """Close every descriptor under a directory that is being removed."""
        prefix = directory + "/"
        for key in [k for k in self._fds if k[0].startswith(prefix)]:
            self._close(key)

    def close(self) -> None:
        for key in list(self._fds):
            self._close(key)


def _open(path: str, mode: int) -> int:
    try:
        return os.open(path, mode | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise CgroupGone(f"{path} does not exist") from err
    except OSError as err:
        raise BackendError(f"cannot open {path}: {err.strerror}") from err
