"""The only file primitives backends use: confined paths and small, fast reads and writes.

Every path is built from a configured root and a relative name checked component by
component, so a pod name or id from outside can never reach a file outside that root.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import resource
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kuscale.backends.base import BackendError, CgroupGone, CounterError
from kuscale.model import is_decimal

_COMPONENT = re.compile(r"^[A-Za-z0-9_.:@+-]+$")


@functools.lru_cache(maxsize=8192)
def confine(root: str | Path, relative: str) -> str:
    """Join `relative` under `root`, refusing anything that could leave it.

    Cached, since the loop asks for the same few paths of every pod every tick: about ten
    a pod, so 8192 holds a node of several hundred pods while churn evicts the departed.
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


MAX_COUNTER = 2**63 - 1
"""The kernel keeps counters as u64, but none gets past 2^63 (292 years of nanoseconds): a
larger one is garbage, and the monitor keeps counters in int64 arrays."""


def _counter(digits: str, what: str) -> int:
    value = int(digits)
    if value > MAX_COUNTER:
        raise CounterError(f"{what} is {digits[:40]}, past any counter the kernel keeps")
    return value


def parse_int(text: str, path: str | Path) -> int:
    """A counter: one non-negative integer."""
    value = text.strip()
    if not is_decimal(value):
        raise CounterError(f"{path} holds {value[:40]!r}, not a counter")
    return _counter(value, str(path))


def parse_keyed(text: str, path: str | Path) -> dict[str, int]:
    """A flat keyed file such as cpu.stat: `key value` pairs; unknown keys are kept."""
    fields = text.split()
    values = fields[1::2]
    if len(fields) % 2 or not all(map(is_decimal, values)):
        raise CounterError(f"{path} is not `key value` lines: {text[:60]!r}")
    counters = dict(zip(fields[::2], map(int, values), strict=True))
    if counters and max(counters.values()) > MAX_COUNTER:
        raise CounterError(f"{path} holds a value past any counter the kernel keeps")
    return counters


def parse_key(text: str, key: str, path: str | Path) -> int:
    """One key of a flat keyed file, without splitting the rest: the watch reads one
    counter of every pod ten times a second. A missing key reads as 0, as in `parse_keyed`."""
    if text.startswith(key + " "):
        start = 0
    else:
        start = text.find("\n" + key + " ") + 1
        if start == 0:
            return 0
    start += len(key) + 1
    end = text.find("\n", start)
    value = text[start:] if end < 0 else text[start:end]
    if not is_decimal(value):
        raise CounterError(f"{path}: {key} is {value[:40]!r}, not a counter")
    return _counter(value, f"{path}: {key}")


_SPACE = b" \t\n\r\x0b\x0c"
_DIGITS_AND_SPACE = b"0123456789" + _SPACE
_JOINER = b"|"
SURE_COUNTER = 10**18
"""Values below this are parsed many at once; a larger one (19 digits or more), which may
not fit int64, is left for `parse_int` or `parse_keyed` to judge, one file at a time."""
_NOT_VALUES = bytes(set(range(256)) - set(_DIGITS_AND_SPACE))
"""Every byte of a keyed file that is not part of a value or the space around it: its keys."""


def _counters_of(text: bytes, sep: str, expected: int) -> NDArray[np.int64] | None:
    """`expected` counters separated by `sep` (spaces around it optional), parsed by numpy's
    C reader in one call; None when the text does not hold exactly that many, each sure."""
    try:
        values = np.fromstring(text, dtype=np.int64, sep=sep)
    except ValueError:
        return None
    if values.size != expected or (expected and values.max() >= SURE_COUNTER):
        return None
    return values


def parse_counts(texts: Sequence[bytes]) -> NDArray[np.int64] | None:
    """Many one-counter files at once, as `parse_int` would read each; None when any of
    them is not a counter, or not surely one (see SURE_COUNTER), for the caller to find
    which one by one.

    The files are joined by a byte no counter holds. With only digits and spaces between
    the joiners, and some digit between every two, numpy's reader takes one number per
    file or fails where a file holds two."""
    joined = _JOINER.join(texts)
    if joined.translate(None, _DIGITS_AND_SPACE) != _JOINER * (len(texts) - 1):
        return None
    if texts and _JOINER * 2 in _JOINER + joined.translate(None, _SPACE) + _JOINER:
        return None
    return _counters_of(joined, " | ", len(texts))


_FILE_END = b"\x0c"
"""Ends each keyed file where many are joined: a space to numpy's reader, in no key (keys
hold no space), and in no line of the pattern below, so each match ends a file."""


@functools.lru_cache(maxsize=16)
def _keyed_layout(keys: tuple[bytes, ...]) -> re.Pattern[bytes]:
    """Any number of files, each exactly `keys` in order, one `key value` line each as the
    kernel writes them, then _FILE_END: what a tick's files of one kernel all look like."""
    lines = b"".join(re.escape(key) + rb" [0-9]++\n" for key in keys)
    return re.compile(b"(?:" + lines + re.escape(_FILE_END) + b")*+")


def parse_keyed_many(
    texts: Sequence[bytes], keys: Sequence[bytes]
) -> list[NDArray[np.int64]] | None:
    """`keys`' values in many flat keyed files laid out alike (every cpu.stat of one
    kernel is), one array per key, as `parse_keyed` would read each; a missing key reads 0.
    None when any file's layout differs from the first's, any value is not surely a counter
    (see SURE_COUNTER), or a key holds a digit, for the caller to find which one by one.

    One regular expression made from the first file's keys checks every file at once: it
    matches one file per _FILE_END byte, so more than were given where a file holds one,
    and then more values than the files' keys. The keys deleted, numpy's C reader parses
    the values that are left."""
    count = len(texts)
    first = texts[0].split()[0::2] if texts else []
    if any(key.translate(None, _NOT_VALUES) for key in first):
        return None
    joined = _FILE_END.join([*texts, b""])
    if not _keyed_layout(tuple(first)).fullmatch(joined):
        return None
    if not first:  # every file empty, or holding only _FILE_END: no key, so every key reads 0
        return [np.zeros(count, dtype=np.int64) for _ in keys]
    values = _counters_of(joined.translate(None, _NOT_VALUES), " ", count * len(first))
    if values is None:
        return None
    grid = values.reshape(count, len(first))
    last = {key: column for column, key in enumerate(first)}  # a repeated key keeps its last
    return [
        grid[:, last[key]].copy() if key in last else np.zeros(count, dtype=np.int64)
        for key in keys
    ]


MAX_OPEN_FILES = 1 << 20
"""Asked for where the hard limit is unlimited: the kernel's default nr_open."""


def allow_open_files() -> int:
    """Raise this process's soft limit of open files to its hard limit, and return it.

    The tick keeps three or four cgroup files open per pod, so a thousand pods need about
    four thousand descriptors, and a service manager's default soft limit (systemd's is
    1024) would fail pods' reads from about the 250th on. The hard limit is what the
    operator allowed; the soft one is only a default for programs that do not ask."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _close_all(*tables: dict[str, int]) -> None:
    for table in tables:
        for fd in table.values():
            os.close(fd)
        table.clear()


class DescriptorCache:
    """Cgroup files kept open, re-read and rewritten at offset 0 every tick.

    On this kernel a pread or pwrite of a cgroup file costs a sixth of open+read+close, and
    the loop touches two or three files per pod per tick. A removed cgroup's descriptor
    answers ENODEV, so a failed call is retried once on a fresh open, which tells a gone
    cgroup from a recreated one. Kernel files take each write whole; regular files (fixture
    trees) are also truncated after the write. Bounded: past `size` descriptors of a kind,
    the oldest opened is closed first. A cache dropped with its backend (a test's monitor, a
    fuzz input's) closes what it kept: the fuzzer ran out of descriptors after 14,000 trees.
    """

    def __init__(self, size: int = 4096, truncate: bool = False) -> None:
        self.size = size
        self.truncate = truncate
        self._readers: dict[str, int] = {}
        self._writers: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._readers, self._writers)
        self.generation = 0
        """Counts the descriptors closed: a batch that took descriptors from this cache may
        use them only while it is unchanged, as a closed number is soon another file's."""

    def reader(self, path: str) -> int:
        """The kept read descriptor of `path`, opened now if need be."""
        fd = self._readers.get(path)
        return self._open(self._readers, path, os.O_RDONLY) if fd is None else fd

    def writer(self, path: str) -> int:
        """The kept write descriptor of `path`, opened now if need be."""
        fd = self._writers.get(path)
        return self._open(self._writers, path, os.O_WRONLY) if fd is None else fd

    def reserve(self, descriptors: int) -> None:
        """Keep at least this many of a kind: a batch's descriptors must outlive its pass."""
        self.size = max(self.size, descriptors)

    def read(self, path: str) -> str:
        fd = self._readers.get(path)
        if fd is not None:
            try:
                return os.pread(fd, 65536, 0).decode("ascii", errors="replace")
            except OSError:
                self._close(self._readers, path)
        fd = self._open(self._readers, path, os.O_RDONLY)
        try:
            return os.pread(fd, 65536, 0).decode("ascii", errors="replace")
        except OSError as err:
            self._close(self._readers, path)
            raise BackendError(f"cannot read {path}: {err.strerror}") from err

    def write(self, path: str, value: str) -> None:
        data = value.encode("ascii")
        fd = self._writers.get(path)
        if fd is not None:
            try:
                self._put(fd, data)
                return
            except OSError:
                self._close(self._writers, path)
        fd = self._open(self._writers, path, os.O_WRONLY)
        try:
            self._put(fd, data)
        except OSError as err:
            self._close(self._writers, path)
            raise BackendError(f"kernel refused {value!r} for {path}: {err.strerror}") from err

    def _put(self, fd: int, data: bytes) -> None:
        os.pwrite(fd, data, 0)
        if self.truncate:
            os.ftruncate(fd, len(data))

    def _open(self, table: dict[str, int], path: str, mode: int) -> int:
        fd = table[path] = _open(path, mode)
        if len(table) > self.size:
            self._close(table, next(iter(table)))
        return fd

    def forget(self, directory: str) -> None:
        """Close every descriptor under a directory that is being removed."""
        prefix = directory + "/"
        for table in (self._readers, self._writers):
            for path in [p for p in table if p.startswith(prefix)]:
                self._close(table, path)

    def close(self) -> None:
        for table in (self._readers, self._writers):
            for path in list(table):
                self._close(table, path)

    def _close(self, table: dict[str, int], path: str) -> None:
        fd = table.pop(path, None)
        if fd is not None:
            self.generation += 1
            os.close(fd)


def _open(path: str, mode: int) -> int:
    try:
        return os.open(path, mode | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise CgroupGone(f"{path} does not exist") from err
    except OSError as err:
        raise BackendError(f"cannot open {path}: {err.strerror}") from err
