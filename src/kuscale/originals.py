"""The durable record of originals: what every pod had before kuscale first changed it.

One JSON file per pod under the record directory, written before the first change and
removed once the pod is given back, so that whatever stops the agent — a clean stop, a
SIGKILL, the OOM killer, an upgrade — the next agent, or `kuscale restore`, can give every
workload back what it had. A file is written whole (temporary file, fsync, rename, fsync of
the directory), so a crash during a write leaves the old entry or the new one, never half.

The running agent holds an exclusive lock on `DIR/lock` until its stop has given the record
back; `kuscale restore` refuses while it is held, so two writers never give back and take
over the same pod, and `kuscale launch` writes a quota only while it is held (see
`launch_section`), so no launch leaves a quota that no agent will give back.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kuscale.actuators.base import CpuActuator
from kuscale.backends.base import BackendError, CgroupGone, CpuBackend, GpuBackend
from kuscale.model import (
    MAX_SHARES,
    MIN_SHARES,
    ContainerLimit,
    Held,
    InvalidSpec,
    Original,
    PodSpec,
    validate_vgpu_id,
)

log = logging.getLogger("kuscale.originals")

_ENTRY = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?_[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.json$")
_CGROUP_PART = re.compile(r"^[A-Za-z0-9_.:@+-]+$")
ACTUATORS = ("cgroup", "resize")
LAUNCH_LOCK = "launch.lock"
LAUNCH_WAIT = 10.0
"""Seconds a stop or `kuscale restore` waits for launches in flight (a launch holds the lock
for two file writes): well inside the 30 s a kubelet or systemd grants a stop by default."""
WAITING_FOR_LAUNCH = "waiting up to %.0f s for a `kuscale launch` in flight on %s"
PROBE_WAIT = 0.5
LOCK_RETRY = 0.01


class RecordError(OSError):
    """The record cannot be written or read; the message says where and why."""


class RecordBusy(RecordError):
    """An agent holds the record's lock."""


class OriginalsRecord:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_fd: int | None = None

    def ensure(self) -> OriginalsRecord:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RecordError(f"cannot create record dir {self.directory}: {err.strerror}") from err
        return self

    # The lock.

    def lock(self) -> None:
        """Hold the record for this process (released when it exits, however it exits, or by
        `unlock`). A launch's probe (`busy`) holds it shared for microseconds, so a lock
        that is taken is tried again for PROBE_WAIT before it is called busy."""
        self.ensure()
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        if not _flock_within(fd, PROBE_WAIT):
            os.close(fd)
            raise RecordBusy(f"an agent is running on {self.directory}")
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def launch_section(self) -> Iterator[bool]:
        """Held by `kuscale launch` from recording a new cgroup's originals to writing its
        first quota, shared, so launches never wait for one another; it yields whether an
        agent holds the record at that moment. A stop gives the record back under
        `launches_held` and lets go of the record before it lets go of that, so a launch that
        sees a live agent here is given back by that agent's stop (or adopted by the next
        agent, after a crash), and a launch that sees none must write nothing. A lock file
        that cannot be made raises RecordError: the launch refuses before any write. One
        that a stop holds past LAUNCH_WAIT (a stopping agent that hangs) is taken as no agent:
        writing nothing is always safe."""
        fd = self._open_launch_lock()
        try:
            if _flock_within(fd, LAUNCH_WAIT, fcntl.LOCK_SH):
                yield self.busy()
            else:
                log.warning("%s held past %.0f s", self.directory / LAUNCH_LOCK, LAUNCH_WAIT)
                yield False
        finally:
            os.close(fd)

    @contextmanager
    def launches_held(self) -> Iterator[None]:
        """Held by a stopping agent and by `kuscale restore` while they give the record back,
        so no launch falls between recording a cgroup and writing its first quota. Launches
        in flight are waited for up to LAUNCH_WAIT seconds: a launch stopped in between (Ctrl-Z
        in a terminal) must not hold a stop past its supervisor's grace, so past that the
        record is given back without the lock, and the log says what may stay behind. A lock
        that cannot be made is logged and gone without: a stop still gives back."""
        try:
            fd = self._open_launch_lock()
        except RecordError as err:
            log.warning("going on without the launch lock: %s", err)
            yield
            return
        try:
            if not _flock_within(fd, 0.0):
                log.warning(WAITING_FOR_LAUNCH, LAUNCH_WAIT, self.directory / LAUNCH_LOCK)
            if not _flock_within(fd, LAUNCH_WAIT):
                log.warning(
                    "a `kuscale launch` has held %s for %.0f s: giving the record back without "
                    "it; what that launch records after this stays for the next agent or "
                    "`kuscale restore`",
                    self.directory / LAUNCH_LOCK,
                    LAUNCH_WAIT,
                )
            yield
        finally:
            os.close(fd)

    def _open_launch_lock(self) -> int:
        path = self.directory / LAUNCH_LOCK
        try:
            self.ensure()
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RecordError(f"cannot open {path}: {err.strerror or err}") from err

    def busy(self) -> bool:
        """True while another process (an agent, `kuscale restore`) holds the lock. The
        probe is shared, so two launches probing at once never mistake each other for an
        agent; an agent starting at that instant waits it out in `lock`."""
        try:
            fd = os.open(self.directory / "lock", os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    # Entries.

    def path(self, key: str) -> Path:
        namespace, _, name = key.partition("/")
        return self.directory / f"{namespace}_{name}.json"

    def save(self, original: Original) -> None:
        """Write one entry whole, or raise RecordError and leave the old one."""
        self.ensure()
        path = self.path(original.key)
        temporary = path.with_name(f".{path.name}.tmp")
        data = json.dumps(_encode(original)).encode("utf-8")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temporary, path)
            self._sync_directory()
        except OSError as err:
            temporary.unlink(missing_ok=True)
            raise RecordError(f"cannot record the originals of {original.key}: {err}") from err

    def drop(self, key: str) -> None:
        try:
            self.path(key).unlink()
            self._sync_directory()
        except FileNotFoundError:
            return
        except OSError as err:
            raise RecordError(f"cannot remove the record of {key}: {err}") from err

    def get(self, key: str) -> Original | None:
        """The entry of one pod; a missing or unreadable one is None (the latter logged)."""
        path = self.path(key)
        try:
            return _decode(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("skipping record %s: %s", path, err)
            return None

    def entries(self) -> Iterator[Original]:
        """Every readable entry; a broken file is logged and left for the operator."""
        try:
            paths = sorted(self.directory.iterdir())
        except FileNotFoundError:
            return
        except OSError as err:
            log.warning("cannot read the record %s: %s", self.directory, err)
            return
        for path in paths:
            if not _ENTRY.fullmatch(path.name):
                continue
            try:
                original = _decode(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("skipping record %s: %s", path, err)
                continue
            if self.path(original.key) == path:
                yield original
            else:
                log.warning("skipping record %s: it names pod %s", path, original.key)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _flock_within(fd: int, wait: float, mode: int = fcntl.LOCK_EX) -> bool:
    """Take `fd`'s lock (exclusive, or `mode`), trying until `wait` seconds have passed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_RETRY)


def _encode(original: Original) -> dict[str, Any]:
    return {
        "key": original.key,
        "uid": original.uid,
        "cgroup": original.cgroup,
        "pod_limit": original.held.pod,
        "containers": [
            {"name": c.name, "limit": c.limit, "request": c.request}
            for c in original.held.containers
        ],
        "shares": original.shares,
        "vgpu_id": original.vgpu_id,
        "gpu_limit": original.gpu_limit,
        "launched": original.launched,
        "actuator": original.actuator,
    }


def _decode(data: Any) -> Original:
    """An entry read back, every field checked: the record lives on a host path, and what
    is read from it becomes writes to the kernel."""
    if not isinstance(data, dict):
        raise ValueError("an entry must be an object")
    key, uid, cgroup = data["key"], data["uid"], data["cgroup"]
    if not all(isinstance(v, str) for v in (key, uid, cgroup)) or key.count("/") != 1:
        raise ValueError("key, uid and cgroup must be strings, key NAMESPACE/NAME")
    _check_cgroup(cgroup)
    containers = []
    for item in data["containers"]:
        name, request = item["name"], item["request"]
        if not isinstance(name, str):
            raise ValueError(f"container {name!r} is not a name")
        _check_cgroup(name)
        if (
            isinstance(request, bool)
            or not isinstance(request, int | float)
            or not (math.isfinite(request) and request >= 0)
        ):
            raise ValueError(f"request {request!r} is not a non-negative number")
        containers.append(ContainerLimit(name, _limit(item["limit"]), float(request)))
    shares = data["shares"]
    if shares is not None and (
        isinstance(shares, bool)
        or not isinstance(shares, int)
        or not MIN_SHARES <= shares <= MAX_SHARES
    ):
        raise ValueError(f"shares {shares!r} outside [{MIN_SHARES}, {MAX_SHARES}]")
    launched = data.get("launched", False)
    if not isinstance(launched, bool):
        raise ValueError(f"launched {launched!r} is not true or false")
    actuator = data.get("actuator", "cgroup")
    if actuator not in ACTUATORS:
        raise ValueError(f"actuator {actuator!r} is not one of {', '.join(ACTUATORS)}")
    vgpu_id = data["vgpu_id"]
    if vgpu_id is not None:
        try:
            validate_vgpu_id(vgpu_id)
        except (InvalidSpec, TypeError) as err:
            raise ValueError(str(err)) from None
    return Original(
        key=key,
        uid=uid,
        cgroup=cgroup,
        held=Held(_limit(data["pod_limit"]), tuple(containers)),
        shares=shares,
        vgpu_id=vgpu_id,
        gpu_limit=_limit(data["gpu_limit"]),
        launched=launched,
        actuator=actuator,
    )


def _limit(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"limit {value!r} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"limit {value!r} is not a positive finite number")
    return float(value)


def _check_cgroup(cgroup: str) -> None:
    parts = cgroup.split("/")
    if not cgroup or any(p in ("", ".", "..") or not _CGROUP_PART.fullmatch(p) for p in parts):
        raise ValueError(f"cgroup {cgroup!r} is not a relative cgroup path")


def give_back(
    original: Original, actuator: CpuActuator, cpu: CpuBackend, gpu: GpuBackend | None
) -> bool:
    """Put back everything an entry recorded: the pod's CPU limit and its containers' (in
    the order the kernel accepts, or through the API server), its cpu.shares, its GPU share.
    A cgroup or pod that is gone needs nothing back. Raises BackendError, having tried every
    part, when one could not be put back; the entry must then stay. False when the pod was
    gone."""
    namespace, _, name = original.key.partition("/")
    spec = PodSpec(
        name=name,
        namespace=namespace,
        tokens=1,
        cgroup=original.cgroup,
        uid=original.uid,
        containers=tuple(c.name for c in original.held.containers if "/" in c.name),
    )
    failures: list[str] = []
    gone: list[str] = []

    def attempt(put_back: Callable[[], None]) -> None:
        try:
            put_back()
        except CgroupGone as err:
            gone.append(str(err))
        except BackendError as err:
            failures.append(str(err))

    attempt(lambda: actuator.release(spec, original.held))
    present = not gone
    if original.shares is not None:
        shares = original.shares
        attempt(lambda: cpu.write_shares(spec.cgroup, shares))
    attempt(lambda: _give_back_gpu(original, gpu))
    if failures:
        raise BackendError("; ".join(failures))
    return present


def _give_back_gpu(original: Original, gpu: GpuBackend | None) -> None:
    if gpu is None or original.vgpu_id is None:
        return
    gpu.write_limit(original.vgpu_id, original.gpu_limit)
    gpu.commit()
