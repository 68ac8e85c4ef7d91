"""`kuscale top` under a real pseudo-terminal: the screen is read back, keys are typed."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kuscale.top import snapshot_from_metrics, sort_pods

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def snapshot(ticks: int) -> dict[str, Any]:
    def pod(name: str, tokens: int, cpu: float, gpu: float | None) -> dict[str, Any]:
        resources = {
            "cpu": {
                "usage": cpu,
                "limit": cpu + 10,
                "avg_usage": cpu,
                "weight": 10.0,
                "price": 1.0,
                "demand": cpu,
                "starved": cpu > 50,
            }
        }
        if gpu is not None:
            resources["gpu"] = {
                "usage": gpu,
                "limit": gpu + 5,
                "avg_usage": gpu,
                "weight": 30.0,
                "price": 3.0,
                "demand": gpu,
                "starved": False,
            }
        return {
            "name": name,
            "namespace": "local",
            "tokens": tokens,
            "status": "running",
            "reason": "",
            "token_queue": tokens / 2,
            "updated_count": ticks,
            "resources": resources,
        }

    return {
        "time": time.time(),
        "mode": "cgroup-v1",
        "gpu_mode": "vgpu",
        "policy": "kuscale",
        "period": 0.2,
        "monitor_only": False,
        "ticks": ticks,
        "tick_seconds": 0.001,
        "errors": {},
        "pods": [
            pod("hungry", 100, 90.0, None),
            pod("trainer", 400, 20.0, 70.0),
            pod("idle", 900, 1.0, None),
        ],
    }


class Terminal:
    """A child process on a pseudo-terminal, its output collected as plain text."""

    def __init__(self, command: list[str]) -> None:
        master, slave = pty.openpty()
        os.set_blocking(master, False)
        env = {**os.environ, "COLUMNS": "120", "LINES": "30", "TERM": "xterm-256color"}
        self.process = subprocess.Popen(
            command, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
        )
        os.close(slave)
        self.master = master
        self.screen = ""

    def read_until(self, pattern: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.screen):
                return self.screen
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    break
                self.screen += ANSI.sub("", chunk.decode(errors="replace"))
        pytest.fail(f"{pattern!r} never appeared; the screen shows:\n{self.screen[-2000:]}")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        try:
            return self.process.wait(timeout=10)
        finally:
            os.close(self.master)


def test_top_shows_every_pod_and_changes_sort_on_a_key(tmp_path: Path) -> None:
    status = tmp_path / "status.json"
    status.write_text(json.dumps(snapshot(1)))
    terminal = Terminal([sys.executable, "-m", "kuscale", "top", "--state-dir", str(tmp_path)])
    screen = terminal.read_until(r"sorted by cpu")
    terminal.read_until(r"idle")
    for name in ("hungry", "trainer", "idle"):
        assert name in screen or name in terminal.screen
    status.write_text(json.dumps(snapshot(7)))
    terminal.read_until(r"tick 7")
    terminal.type("g")
    terminal.read_until(r"sorted by gpu")
    terminal.type("q")
    assert terminal.close() == 0


def test_top_once_prints_a_sorted_frame(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text(json.dumps(snapshot(3)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kuscale",
            "top",
            "--state-dir",
            str(tmp_path),
            "--once",
            "--sort",
            "tokens",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "120"},
    ).stdout
    assert out.index("idle") < out.index("trainer") < out.index("hungry")
    assert "70/75" in out


def test_sorting_keys() -> None:
    pods = snapshot(1)["pods"]
    assert [p["name"] for p in sort_pods(pods, "cpu")] == ["hungry", "trainer", "idle"]
    assert sort_pods(pods, "gpu")[0]["name"] == "trainer"
    assert [p["name"] for p in sort_pods(pods, "name")] == ["hungry", "idle", "trainer"]


def test_metrics_text_rebuilds_the_pods() -> None:
    text = "\n".join(
        [
            'kuscale_policy_info{policy="kuscale",mode="cgroup-v2",node="n",gpu_mode="None",'
            'monitor_only="false"} 1',
            'kuscale_pod_limit_percent{pod="a",namespace="ns",node="n",resource="cpu"} 55',
            'kuscale_pod_usage_percent{pod="a",namespace="ns",node="n",resource="cpu"} 50',
            'kuscale_pod_starved{pod="a",namespace="ns",node="n",resource="cpu"} 1',
            'kuscale_pod_tokens{pod="a",namespace="ns",node="n"} 300',
            'kuscale_pod_status{pod="a",namespace="ns",node="n",status="running"} 1',
            "",
        ]
    )
    result = snapshot_from_metrics(text)
    assert result["mode"] == "cgroup-v2"
    (pod,) = result["pods"]
    assert pod["tokens"] == 300
    assert pod["resources"]["cpu"]["limit"] == 55
    assert pod["resources"]["cpu"]["starved"] is True
