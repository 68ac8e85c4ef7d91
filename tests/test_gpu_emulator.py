"""The GPU emulator: real processes over a real unix socket, shares enforced per client."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kuscale.backends.vgpu import VgpuLayer
from kuscale.gpuemu.client import GpuClient, GpuClientError
from kuscale.local.statedir import StateDir
from kuscale.model import GPU_SOCKET_ENV, VGPU_ENV


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[StateDir]:
    state = StateDir(tmp_path).ensure()
    process = subprocess.Popen(
        [sys.executable, "-m", "kuscale", "gpu-emulator", "--state-dir", str(tmp_path)]
    )
    deadline = time.monotonic() + 20
    while not state.gpu_socket.exists():
        assert process.poll() is None and time.monotonic() < deadline, "emulator did not start"
        time.sleep(0.05)
    yield state
    process.terminate()
    assert process.wait(timeout=10) == 0


def _saturate(state: StateDir, vgpu_id: str, seconds: float) -> None:
    client = GpuClient(state.gpu_socket, vgpu_id)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        client.run(0.005)
    client.close()


def test_busy_time_follows_each_clients_share(emulator: StateDir) -> None:
    layer = VgpuLayer(emulator.vgpu)
    for vgpu_id in ("small", "large"):
        layer.create(vgpu_id)
    layer.write_limit("small", 20.0)
    layer.write_limit("large", 60.0)
    layer.commit()
    time.sleep(0.2)
    before = {i: layer.read(i) for i in ("small", "large")}
    threads = [
        threading.Thread(target=_saturate, args=(emulator, i, 2.0)) for i in ("small", "large")
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    time.sleep(0.2)
    share = {i: (layer.read(i) - before[i]) / 1e9 / elapsed for i in ("small", "large")}
    assert share["small"] == pytest.approx(0.20, abs=0.06)
    assert share["large"] == pytest.approx(0.60, abs=0.1)


def test_an_unlimited_client_gets_most_of_the_gpu(emulator: StateDir) -> None:
    _saturate(emulator, "solo", 0.3)
    time.sleep(0.2)
    layer = VgpuLayer(emulator.vgpu)
    before = layer.read("solo")
    _saturate(emulator, "solo", 1.0)
    time.sleep(0.2)
    assert (layer.read("solo") - before) / 1e9 > 0.7


def test_a_bad_id_is_refused(emulator: StateDir) -> None:
    with pytest.raises(GpuClientError):
        GpuClient(emulator.gpu_socket, "../etc")
    assert not (emulator.vgpu.parent / "etc").exists()


def test_a_pipeline_runs_at_the_rate_its_scarcer_stage_allows(
    emulator: StateDir, tmp_path: Path
) -> None:
    """20 ms of CPU and 10 ms of GPU an item, two CPU threads: held to 20 % of the GPU it
    completes about 20 items a second (its CPU could do far more), and it says so."""
    layer = VgpuLayer(emulator.vgpu)
    layer.create("pipe")
    layer.write_limit("pipe", 20.0)
    layer.commit()
    report = tmp_path / "rate"
    env = {
        **os.environ,
        GPU_SOCKET_ENV: str(emulator.gpu_socket),
        VGPU_ENV: "pipe",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kuscale",
            "workload",
            "--pipeline",
            "--duration",
            "4",
            "--report",
            str(report),
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rate = float(report.read_text())
    assert "items/s" in done.stdout
    assert 12.0 <= rate <= 22.0, rate


def test_a_pipeline_without_a_gpu_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (GPU_SOCKET_ENV, VGPU_ENV)}
    done = subprocess.run(
        [sys.executable, "-m", "kuscale", "workload", "--pipeline", "--duration", "1"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "kuscale launch --gpu" in done.stderr
