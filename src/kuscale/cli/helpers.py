"""The processes local mode starts for itself: `gpu-emulator` (the shared GPUs) and
`workload` (a synthetic workload of known demand, in a launched pod)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

from kuscale.cli.shared import CliError, SubParsers, milliseconds, positive_int, seconds


def add_parsers(sub: SubParsers) -> None:
    emulator = sub.add_parser("gpu-emulator", help="emulate shared GPUs for local mode")
    emulator.set_defaults(handler=cmd_gpu_emulator)
    emulator.add_argument("--state-dir", type=Path, required=True)
    emulator.add_argument("--devices", type=positive_int, default=1, help="GPUs to emulate")
    emulator.add_argument(
        "--no-enforce",
        action="store_true",
        help="be the GPU only: another layer (Gemini's scheduler) decides who launches",
    )

    workload = sub.add_parser("workload", help="a synthetic workload of known demand")
    workload.set_defaults(handler=cmd_workload)
    workload.add_argument("--cpu", default="0:100", help="schedule SECONDS:PERCENT,...")
    workload.add_argument("--gpu", help="GPU schedule (needs `launch --gpu`)")
    workload.add_argument("--duration", type=seconds, default=60.0)
    workload.add_argument(
        "--start-at",
        type=float,
        help="CLOCK_MONOTONIC second the schedule starts at (default: now)",
    )
    workload.add_argument(
        "--pipeline",
        action="store_true",
        help="instead of schedules: a CPU stage feeding a GPU stage through a bounded queue "
        "(needs `launch --gpu`); prints items per second",
    )
    workload.add_argument("--cpu-ms", type=milliseconds, default=20.0, help="CPU per item")
    workload.add_argument("--gpu-ms", type=milliseconds, default=10.0, help="GPU per item")
    workload.add_argument("--threads", type=positive_int, default=2, help="CPU stage threads")
    workload.add_argument("--queue", type=positive_int, default=8, help="items between stages")
    workload.add_argument("--report", type=Path, help="pipeline: write items per second here")


def cmd_gpu_emulator(args: argparse.Namespace) -> int:
    from kuscale.gpuemu.emulator import GpuEmulator
    from kuscale.local.statedir import StateDir

    state = StateDir(args.state_dir).ensure()
    emulator = GpuEmulator(
        state.vgpu, state.gpu_socket, devices=args.devices, enforce=not args.no_enforce
    )

    async def serve_until_terminated() -> None:
        """SIGTERM cancels the server inside the loop, so every task ends in order."""
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await emulator.serve()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_until_terminated())
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from kuscale.gpuemu.client import GpuClientError, from_environment
    from kuscale.gpuemu.gemini import GeminiError, gate_from_environment
    from kuscale.workload import Schedule, run

    if args.pipeline:
        return _pipeline(args)
    try:
        cpu = Schedule.parse(args.cpu)
        gpu = Schedule.parse(args.gpu) if args.gpu else None
    except ValueError as err:
        raise CliError(str(err)) from None
    try:
        socket_path, vgpu_id, device = from_environment()
        gate = gate_from_environment() if gpu is not None else None
        run(cpu, gpu, args.duration, socket_path, vgpu_id, args.start_at, device, gate)
    except (GpuClientError, GeminiError, ValueError) as err:
        raise CliError(str(err)) from None
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    """`workload --pipeline`: both stages for --duration, then items per second."""
    from kuscale.gpuemu.client import GpuClient, GpuClientError, from_environment
    from kuscale.gpuemu.gemini import GeminiError, gate_from_environment
    from kuscale.workload import Pipeline, run_pipeline

    pipeline = Pipeline(args.cpu_ms, args.gpu_ms, args.threads, args.queue)
    try:
        socket_path, vgpu_id, device = from_environment()
        if socket_path is None or vgpu_id is None:
            raise CliError("--pipeline needs a GPU: run it under `kuscale launch --gpu`")
        client = GpuClient(socket_path, vgpu_id, device=device, gate=gate_from_environment())
        rate = run_pipeline(pipeline, client, args.duration, args.start_at)
    except (GpuClientError, GeminiError) as err:
        raise CliError(str(err)) from None
    print(f"pipeline: {rate:.2f} items/s over {args.duration:g} s")
    if args.report:
        written = args.report.with_name(args.report.name + ".part")
        written.write_text(f"{rate:.4f}\n", encoding="utf-8")
        written.replace(args.report)
    return 0
