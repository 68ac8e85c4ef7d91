"""A synthetic workload with a known demand over time, for demos and tests.

Demand is a step schedule, `T:P,T:P,...` (seconds from start : percent). CPU demand above
100 % runs in several processes, each a duty-cycled busy loop; GPU demand submits kernels to
the GPU emulator for that share of each slot — behind Gemini's pod manager, when the hook's
variables name one, only within the quota Gemini grants. Work the limits do not allow is
dropped, not queued, so measured usage below demand is exactly unmet demand.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from kuscale.gpuemu.client import GpuClient
from kuscale.gpuemu.gemini import GeminiGate

SLOT_SECONDS = 0.05
KERNEL_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class Schedule:
    """Piecewise-constant demand in percent, from (start second, percent) steps."""

    starts: tuple[float, ...]
    percents: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> Schedule:
        steps = []
        for item in text.split(","):
            start, sep, percent = item.partition(":")
            try:
                step = (float(start), float(percent))
            except ValueError:
                step = (math.nan, math.nan)
            if not sep or not all(math.isfinite(v) and v >= 0 for v in step):
                raise ValueError(f"schedule step {item!r} is not 'SECONDS:PERCENT' (both >= 0)")
            steps.append(step)
        steps.sort()
        if steps[0][0] != 0:
            steps.insert(0, (0.0, 0.0))
        return cls(tuple(s for s, _ in steps), tuple(p for _, p in steps))

    def at(self, seconds: float) -> float:
        return self.percents[max(bisect_right(self.starts, seconds) - 1, 0)]

    def peak(self) -> float:
        return max(self.percents)

    def format(self) -> str:
        return ",".join(f"{s:g}:{p:g}" for s, p in zip(self.starts, self.percents, strict=True))


def _cpu_worker(schedule: Schedule, share: float, start: float, duration: float) -> None:
    """Busy for `share` of the schedule's demand in every slot; sleep for the rest."""
    while (now := time.monotonic()) - start < duration:
        slot_end = now + SLOT_SECONDS
        busy_until = now + SLOT_SECONDS * min(schedule.at(now - start) * share / 100.0, 1.0)
        while time.monotonic() < busy_until:
            pass
        time.sleep(max(0.0, slot_end - time.monotonic()))


def _gpu_worker(client: GpuClient, schedule: Schedule, start: float, duration: float) -> None:
    """Submit kernels for the demanded share of each slot; kernels the share blocks are lost."""
    slot = 2 * SLOT_SECONDS
    while (now := time.monotonic()) - start < duration:
        slot_end = now + slot
        wanted = slot * min(schedule.at(now - start) / 100.0, 1.0)
        while wanted > 1e-4 and time.monotonic() < slot_end:
            wanted -= client.run(min(KERNEL_SECONDS, wanted))
        time.sleep(max(0.0, slot_end - time.monotonic()))


def run(
    cpu: Schedule,
    gpu: Schedule | None,
    duration: float,
    gpu_socket: Path | None = None,
    vgpu_id: str | None = None,
    start: float | None = None,
    device: int = 0,
    gate: GeminiGate | None = None,
) -> None:
    """Follow the schedules from `start` (CLOCK_MONOTONIC, shared by all processes) on."""
    start = time.monotonic() if start is None else start
    time.sleep(max(0.0, start - time.monotonic()))
    processes = max(1, math.ceil(cpu.peak() / 100.0))
    workers = [
        multiprocessing.Process(
            target=_cpu_worker, args=(cpu, 1.0 / processes, start, duration), daemon=True
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    gpu_thread = None
    if gpu is not None and gpu.peak() > 0:
        if gpu_socket is None or vgpu_id is None:
            raise ValueError("GPU demand needs the emulator's socket and a vGPU id")
        client = GpuClient(gpu_socket, vgpu_id, device=device, gate=gate)
        gpu_thread = threading.Thread(
            target=_gpu_worker, args=(client, gpu, start, duration), daemon=True
        )
        gpu_thread.start()
    try:
        for worker in workers:
            worker.join()
        if gpu_thread is not None:
            gpu_thread.join()
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
