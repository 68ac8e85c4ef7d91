"""Recordings: bounded by rotation, readable after a crash, plotted by `kuscale plot`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kuscale.record import RecordingError, TickRecorder, read_recording, rotated


def snapshot(tick: int) -> dict[str, Any]:
    return {
        "time": 1000.0 + tick,
        "ticks": tick,
        "pods": [
            {
                "name": "p",
                "namespace": "local",
                "status": "running",
                "tokens": 100,
                "token_queue": 1.0,
                "resources": {
                    "cpu": {"usage": 10.0 + tick, "limit": 20.0, "demand": 15.0, "starved": False}
                },
            },
            {
                "name": "gone",
                "namespace": "local",
                "status": "completed",
                "tokens": 1,
                "token_queue": 0.0,
                "resources": {},
            },
        ],
    }


def test_recording_rotates_and_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    recorder = TickRecorder(path, max_bytes=2000)
    for tick in range(200):
        recorder(snapshot(tick))
    recorder.close()
    assert path.stat().st_size < 2000 + 400
    assert rotated(path).stat().st_size < 2000 + 400
    rows = read_recording(path)
    assert rows[-1]["usage"] == 10.0 + 199
    assert {r["pod"] for r in rows} == {"p"}
    assert rows[0]["t"] == 0.0


def test_a_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    lines = [
        json.dumps({"time": 1.0 + i, "tick": i, "pods": snapshot(i)["pods"][:1]}) for i in range(3)
    ]
    path.write_text("\n".join(lines) + "\n" + lines[0][: len(lines[0]) // 2])
    assert len(read_recording(path)) == 3
    out = tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, "-m", "kuscale", "plot", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 5000


def test_garbage_in_the_middle_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    good = json.dumps({"time": 1.0, "tick": 1, "pods": []})
    path.write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(RecordingError, match=r"rec.jsonl:2"):
        read_recording(path)
    result = subprocess.run(
        [sys.executable, "-m", "kuscale", "plot", str(path), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "rec.jsonl:2" in result.stderr


def test_a_missing_recording_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="no recording"):
        read_recording(tmp_path / "absent.jsonl")
