"""`kuscale agent --record FILE`: every tick's samples and decisions, bounded in size.

One JSON line per tick. When the file passes its size limit it is renamed to FILE.1 (the
previous FILE.1 is dropped) and a new FILE begins, so a recording never holds more than
twice the limit. `kuscale plot` reads FILE.1 then FILE.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("kuscale.record")


class RecordingError(Exception):
    """A recording that cannot be read; the message names the file and line."""


class TickRecorder:
    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("the recording size limit must be positive")
        self.path = path
        self.max_bytes = max_bytes
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def __call__(self, snapshot: dict[str, Any]) -> None:
        pods = [
            {
                "name": p["name"],
                "namespace": p["namespace"],
                "tokens": p["tokens"],
                "token_queue": p["token_queue"],
                "resources": {
                    r: {k: s[k] for k in ("usage", "limit", "demand", "starved")}
                    for r, s in p["resources"].items()
                },
            }
            for p in snapshot["pods"]
            if p["status"] == "running"
        ]
        line = json.dumps({"time": snapshot["time"], "tick": snapshot["ticks"], "pods": pods})
        try:
            self._file.write(line + "\n")
            self._file.flush()
            if self._file.tell() >= self.max_bytes:
                self._rotate()
        except OSError as err:
            log.warning("cannot write the recording %s: %s", self.path, err)

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, rotated(self.path))
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def read_recording(path: Path) -> list[dict[str, Any]]:
    """Rows of t, pod, resource, usage, limit, estimate for `plot_timeline`.

    A last line cut short (the agent was killed mid-write) is skipped with a warning; any
    other line that is not a tick is an error naming the file and line.
    """
    files = [p for p in (rotated(path), path) if p.exists()]
    if not files:
        raise RecordingError(f"no recording at {path}")
    ticks: list[dict[str, Any]] = []
    for file in files:
        ticks.extend(_read_ticks(file))
    if not ticks:
        raise RecordingError(f"{path} holds no complete tick")
    start = ticks[0]["time"]
    return [
        {
            "t": tick["time"] - start,
            "pod": pod["name"],
            "resource": resource,
            "usage": state["usage"],
            "limit": state["limit"],
            "estimate": state["demand"],
        }
        for tick in ticks
        for pod in tick["pods"]
        for resource, state in pod["resources"].items()
    ]


def _read_ticks(file: Path) -> list[dict[str, Any]]:
    try:
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise RecordingError(f"cannot read {file}: {err.strerror}") from err
    ticks = []
    for number, line in enumerate(lines, start=1):
        try:
            tick = json.loads(line)
            _check_tick(tick)
        except (ValueError, KeyError, TypeError) as err:
            if number == len(lines):
                log.warning("%s:%d: skipping a tick cut short (%s)", file, number, err)
                break
            raise RecordingError(f"{file}:{number}: not a recorded tick ({err})") from None
        ticks.append(tick)
    return ticks


def _check_tick(tick: Any) -> None:
    float(tick["time"])
    for pod in tick["pods"]:
        str(pod["name"])
        for state in pod["resources"].values():
            float(state["usage"]), float(state["limit"]), float(state["demand"])
