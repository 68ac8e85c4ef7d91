"""Emulated GPUs: kernels run one at a time per device, busy time is accounted per client
and per process, and each device keeps NVML-style utilisation samples.

Clients connect to a unix socket and submit kernels (`RUN <µs>`) to the device they named.
With `enforce` (the vGPU layer's emulation), each vGPU id holds a credit that refills at its
share of GPU time per second (its `gpu_limit` per-mille) and is capped at `window` seconds of
that share: a client out of credit waits, as a Gemini client's launches block when its quota
in the window is spent. Busy time is accounted per id into `total_runtime`, and limits are
re-read only when the reload file is poked, so the agent drives this exactly as it drives the
kernel module. Without `enforce` the emulator is only the GPU: something else (Gemini's
scheduler, in front of the client) decides who may launch.

Every `sample_interval` each device records, per process that ran kernels in it, a sample
`(pid, CPU timestamp µs, SM utilisation %)` — the shape NVML's per-process utilisation has —
into a bounded buffer, as the driver does. The process is the client's peer (SO_PEERCRED).

Protocol (one line each way): `HELLO <vgpu id> [device]` → `OK`; `RUN <microseconds>` →
`DONE`; `DEVICES` → the count; `SAMPLES <device> <since µs>` → one `pid timestamp sm` line
per newer sample, then `END`; anything else → `ERR <reason>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kuscale.backends.base import BackendError
from kuscale.backends.files import confine
from kuscale.backends.vgpu import GPU_LIMIT, MAX_PER_MILLE, RELOAD_FILE, TOTAL_RUNTIME, VgpuLayer
from kuscale.model import InvalidSpec, is_decimal, validate_vgpu_id

log = logging.getLogger("kuscale.gpuemu")

MAX_KERNEL_SECONDS = 0.1
SAMPLES_KEPT = 4096
"""Per device: at 10 samples a second for a few processes, minutes of history."""


@dataclass(slots=True)
class Account:
    """One vGPU id's share, credit and busy time."""

    vgpu_id: str
    share: float = 1.0
    credit: float = 0.0
    refilled: float = field(default_factory=time.monotonic)
    busy_ns: int = 0


@dataclass(slots=True)
class Kernel:
    account: Account
    pid: int
    seconds: float
    done: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class Sample:
    pid: int
    timestamp_us: int
    sm_util: int


@dataclass
class Device:
    """One emulated GPU: its queue of kernels, and who kept it busy lately."""

    index: int
    pending: deque[Kernel] = field(default_factory=deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    busy_since_sample: dict[int, float] = field(default_factory=dict)
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))

    def take_sample(self, interval: float) -> None:
        now_us = time.time_ns() // 1000
        for pid, busy in self.busy_since_sample.items():
            util = min(100, round(busy / interval * 100))
            if util > 0:
                self.samples.append(Sample(pid, now_us, util))
        self.busy_since_sample.clear()

    def samples_since(self, since_us: int) -> list[Sample]:
        return [sample for sample in self.samples if sample.timestamp_us > since_us]


@dataclass
class Client:
    """One connection: the process behind it, and the account and device it said HELLO to."""

    pid: int
    account: Account | None = None
    device: Device | None = None


def peer_pid(writer: asyncio.StreamWriter) -> int:
    """The connecting process (Linux SO_PEERCRED: pid, uid, gid); 0 where unknown."""
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0
    return int(struct.unpack("3i", creds)[0])


class GpuEmulator:
    def __init__(
        self,
        root: Path,
        socket_path: Path,
        window: float = 0.1,
        flush_interval: float = 0.05,
        devices: int = 1,
        enforce: bool = True,
        sample_interval: float = 0.1,
    ) -> None:
        self.layer = VgpuLayer(root)
        self.root = root
        self.socket_path = socket_path
        self.window = window
        self.flush_interval = flush_interval
        self.enforce = enforce
        self.sample_interval = sample_interval
        self.accounts: dict[str, Account] = {}
        self.devices = [Device(index) for index in range(devices)]
        self._reload_mtime = 0.0

    def _read_share(self, vgpu_id: str) -> float:
        path = Path(confine(self.root, vgpu_id)) / GPU_LIMIT
        try:
            per_mille = int(path.read_text().strip())
        except (OSError, ValueError):
            return 1.0
        return min(max(per_mille, 1), MAX_PER_MILLE) / MAX_PER_MILLE

    def account(self, vgpu_id: str) -> Account:
        if vgpu_id not in self.accounts:
            share = 1.0
            if self.enforce:
                self.layer.create(vgpu_id)
                share = self._read_share(vgpu_id)
            self.accounts[vgpu_id] = Account(vgpu_id, share=share, credit=share * self.window)
        return self.accounts[vgpu_id]

    def _refill(self, account: Account, now: float) -> None:
        if not self.enforce:
            account.credit = 0.0
            return
        account.credit = min(
            account.credit + (now - account.refilled) * account.share, account.share * self.window
        )
        account.refilled = now

    def _next_kernel(self, device: Device) -> tuple[Kernel | None, float]:
        """The first pending kernel whose client has credit, or how long until one will."""
        now = time.monotonic()
        wait = float("inf")
        for kernel in device.pending:
            self._refill(kernel.account, now)
            if kernel.account.credit >= 0:
                device.pending.remove(kernel)
                return kernel, 0.0
            wait = min(wait, -kernel.account.credit / kernel.account.share)
        return None, wait

    async def _execute(self, device: Device) -> None:
        """One GPU: one kernel at a time, for as long as it asks."""
        while True:
            kernel, wait = self._next_kernel(device)
            if kernel is None:
                device.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        device.arrived.wait(), None if wait == float("inf") else wait
                    )
                continue
            started = time.monotonic()
            await asyncio.sleep(kernel.seconds)
            busy = time.monotonic() - started
            kernel.account.busy_ns += int(busy * 1e9)
            kernel.account.credit -= busy
            device.busy_since_sample[kernel.pid] = (
                device.busy_since_sample.get(kernel.pid, 0.0) + busy
            )
            if not kernel.done.done():
                kernel.done.set_result(None)

    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(self.sample_interval)
            for device in self.devices:
                device.take_sample(self.sample_interval)

    def flush(self) -> None:
        """Publish busy time, and take new limits if the agent poked the reload file."""
        if not self.enforce:
            return
        for account in self.accounts.values():
            directory = Path(confine(self.root, account.vgpu_id))
            tmp = directory / f".{TOTAL_RUNTIME}.tmp"
            with contextlib.suppress(OSError):
                tmp.write_text(str(account.busy_ns))
                os.replace(tmp, directory / TOTAL_RUNTIME)
        try:
            mtime = (self.root / RELOAD_FILE).stat().st_mtime
        except OSError:
            return
        if mtime != self._reload_mtime:
            self._reload_mtime = mtime
            for account in self.accounts.values():
                account.share = self._read_share(account.vgpu_id)

    async def _flusher(self) -> None:
        while True:
            self.flush()
            await asyncio.sleep(self.flush_interval)

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = Client(pid=peer_pid(writer))
        try:
            while line := await reader.readline():
                reply = await self._handle(line.decode(errors="replace").split(), client)
                writer.write(reply.encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # The emulator is stopping with this client connected: end quietly, since
            # asyncio logs a connection task that ends cancelled as an error.
            return
        finally:
            writer.close()

    async def _handle(self, words: list[str], client: Client) -> str:
        match words:
            case ["HELLO", vgpu_id, *device] if len(device) <= 1:
                return self._hello(client, vgpu_id, device[0] if device else "0")
            case ["RUN", micros] if is_decimal(micros):
                if client.account is None or client.device is None:
                    return "ERR say HELLO first"
                seconds = min(int(micros) / 1e6, MAX_KERNEL_SECONDS)
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                client.device.pending.append(Kernel(client.account, client.pid, seconds, done))
                client.device.arrived.set()
                await done
                return "DONE"
            case ["DEVICES"]:
                return str(len(self.devices))
            case ["SAMPLES", index, since] if is_decimal(index) and is_decimal(since):
                if int(index) >= len(self.devices):
                    return f"ERR no device {index}"
                lines = [
                    f"{s.pid} {s.timestamp_us} {s.sm_util}"
                    for s in self.devices[int(index)].samples_since(int(since))
                ]
                return "\n".join([*lines, "END"])
        return "ERR unknown request"

    def _hello(self, client: Client, vgpu_id: str, device: str) -> str:
        if not is_decimal(device) or int(device) >= len(self.devices):
            return f"ERR no device {device[:20]!r}"
        try:
            client.account = self.account(validate_vgpu_id(vgpu_id))
        except (InvalidSpec, BackendError) as err:
            return f"ERR {err}"
        client.device = self.devices[int(device)]
        return "OK"

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._serve_client, path=str(self.socket_path))
        tasks = [
            *(asyncio.create_task(self._execute(device)) for device in self.devices),
            asyncio.create_task(self._flusher()),
            asyncio.create_task(self._sampler()),
        ]
        log.info("GPU emulator serving %s on %s", self.root, self.socket_path)
        if ready:
            ready.set()
        try:
            async with server:
                await server.serve_forever()
        finally:
            for task in tasks:
                task.cancel()
            self.flush()
            self.socket_path.unlink(missing_ok=True)
