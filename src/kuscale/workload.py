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


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A CPU stage feeding a GPU stage through a bounded queue, as a trainer's input
    pipeline feeds its GPU: each item takes `cpu_ms` of real computation (zlib, which lets
    go of the GIL, so threads use several cores) and then `gpu_ms` of GPU time. The stage
    that is short holds the other back: a full queue stops the CPU threads, an empty one
    idles the GPU."""

    cpu_ms: float = 20.0
    gpu_ms: float = 10.0
    threads: int = 2
    queue: int = 8


def calibrate(cpu_ms: float) -> tuple[bytes, int]:
    """A buffer and a number of zlib rounds that take about `cpu_ms` of this thread's CPU
    time here. CPU time, not wall time: a busy machine or a quota slows the rounds down but
    does not change the work, so every run does the same work per item."""
    import zlib

    block = bytes(range(256)) * 256 + b"kuscale pipeline " * 4096
    started = time.thread_time()
    rounds = 0
    while time.thread_time() - started < 0.1:
        zlib.compress(block, 6)
        rounds += 1
    per_round_ms = (time.thread_time() - started) * 1000.0 / rounds
    return block, max(1, round(cpu_ms / per_round_ms))


def run_pipeline(
    pipeline: Pipeline, client: GpuClient, duration: float, start: float | None = None
) -> float:
    """Run the pipeline for `duration` seconds from `start`; items per second through both
    stages."""
    import queue
    import zlib

    block, rounds = calibrate(pipeline.cpu_ms)
    start = time.monotonic() if start is None else start
    time.sleep(max(0.0, start - time.monotonic()))
    end = start + duration
    items: queue.Queue[int] = queue.Queue(maxsize=pipeline.queue)
    done = [0]

    def produce() -> None:
        while time.monotonic() < end:
            for _ in range(rounds):
                zlib.compress(block, 6)
            while time.monotonic() < end:
                try:
                    items.put(1, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def consume() -> None:
        kernel = pipeline.gpu_ms / 1000.0
        while time.monotonic() < end:
            try:
                items.get(timeout=0.05)
            except queue.Empty:
                continue
            left = kernel
            while left > 1e-4 and time.monotonic() < end:
                left -= client.run(min(KERNEL_SECONDS, left))
            if left <= 1e-4:
                done[0] += 1

    stages = [threading.Thread(target=produce, daemon=True) for _ in range(pipeline.threads)]
    stages.append(threading.Thread(target=consume, daemon=True))
    for stage in stages:
        stage.start()
    for stage in stages:
        stage.join()
    return done[0] / duration
