"""The state directory shared by `kuscale launch`, `kuscale agent --local` and `kuscale status`.

    DIR/pods/<name>.json   one registration per launched workload, written by `launch`
    DIR/status.json        the agent's latest snapshot, replaced atomically every tick
    DIR/originals/         what every workload had before kuscale changed it (`originals`)
    DIR/vgpu/              the GPU emulator's vGPU layer
    DIR/gpu.sock           the GPU emulator's socket

Files are replaced by rename so a reader never sees half of one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from kuscale.model import InvalidSpec, PodSpec, validate_pod_name

log = logging.getLogger("kuscale.local")


class StateDirError(Exception):
    """The state directory cannot be used; the message says why."""


def write_json_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StateDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.pods = path / "pods"
        self.status = path / "status.json"
        self.vgpu = path / "vgpu"
        self.gpu_socket = path / "gpu.sock"
        self.originals = path / "originals"

    def ensure(self) -> StateDir:
        """Create the layout, and refuse a directory this process cannot write."""
        try:
            self.pods.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StateDirError(f"cannot create state dir {self.path}: {err.strerror}") from err
        if not os.access(self.pods, os.W_OK | os.X_OK):
            raise StateDirError(f"state dir {self.path} is not writable")
        return self

    def registration(self, name: str) -> Path:
        return self.pods / f"{validate_pod_name(name)}.json"

    def register(self, spec: PodSpec, pid: int) -> None:
        path = self.registration(spec.name)
        if path.exists():
            raise StateDirError(
                f"a workload named {spec.name!r} is already registered in {self.path}"
            )
        write_json_atomic(
            path,
            {
                "name": spec.name,
                "tokens": spec.tokens,
                "cgroup": spec.cgroup,
                "vgpu_id": spec.vgpu_id,
                "uid": spec.uid,
                "pid": pid,
            },
        )

    def unregister(self, name: str) -> None:
        self.registration(name).unlink(missing_ok=True)

    def registrations(self) -> dict[str, PodSpec]:
        """Every readable registration by name; a broken file is logged and skipped."""
        specs: dict[str, PodSpec] = {}
        for path in sorted(self.pods.glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                spec = PodSpec(
                    name=data["name"],
                    tokens=data["tokens"],
                    cgroup=data["cgroup"],
                    vgpu_id=data.get("vgpu_id"),
                    uid=data.get("uid", ""),
                    owned=True,
                )
                if path.stem != spec.name:
                    raise InvalidSpec(f"file name does not match pod name {spec.name!r}")
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("skipping registration %s: %s", path, err)
                continue
            specs[spec.name] = spec
        return specs

    def write_status(self, snapshot: dict[str, Any]) -> None:
        write_json_atomic(self.status, snapshot)

    def read_status(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.status.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise StateDirError(f"cannot read {self.status}: {err}") from err
        if not isinstance(data, dict):
            raise StateDirError(f"{self.status} does not hold a status object")
        return data
