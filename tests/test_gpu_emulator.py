"""The GPU emulator: real processes over a real unix socket, shares enforced per client."""

from __future__ import annotations

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
