"""An emulated shared GPU with Gemini-like enforcement of each client's time share.

Clients connect to a unix socket and submit kernels (`RUN <µs>`); the one GPU runs one kernel
at a time. Each vGPU id holds a credit that refills at its share of GPU time per second (its
`gpu_limit` per-mille) and is capped at `window` seconds of that share: a client out of credit
waits, as a Gemini client's launches block when its quota in the window is spent. Busy time
is accounted per id into `total_runtime`, and limits are re-read only when the reload file is
poked, so the agent drives this exactly as it drives the kernel module.

Protocol (one line each way): `HELLO <vgpu id>` → `OK`; `RUN <microseconds>` → `DONE`;
anything else → `ERR <reason>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kuscale.backends.base import BackendError
from kuscale.backends.files import confine
from kuscale.backends.vgpu import GPU_LIMIT, MAX_PER_MILLE, RELOAD_FILE, TOTAL_RUNTIME, VgpuLayer
from kuscale.model import InvalidSpec, validate_vgpu_id

log = logging.getLogger("kuscale.gpuemu")

MAX_KERNEL_SECONDS = 0.1


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
    seconds: float
    done: asyncio.Future[None]


class GpuEmulator:
    def __init__(
        self, root: Path, socket_path: Path, window: float = 0.1, flush_interval: float = 0.05
    ) -> None:
        self.layer = VgpuLayer(root)
        self.root = root
        self.socket_path = socket_path
        self.window = window
        self.flush_interval = flush_interval
        self.accounts: dict[str, Account] = {}
        self.pending: deque[Kernel] = deque()
        self._arrived = asyncio.Event()
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
            self.layer.create(vgpu_id)
            share = self._read_share(vgpu_id)
            self.accounts[vgpu_id] = Account(vgpu_id, share=share, credit=share * self.window)
        return self.accounts[vgpu_id]

    def _refill(self, account: Account, now: float) -> None:
        account.credit = min(
            account.credit + (now - account.refilled) * account.share, account.share * self.window
        )
        account.refilled = now

    def _next_kernel(self) -> tuple[Kernel | None, float]:
        """The first pending kernel whose client has credit, or how long until one will."""
        now = time.monotonic()
        wait = float("inf")
        for kernel in self.pending:
            self._refill(kernel.account, now)
            if kernel.account.credit >= 0:
                self.pending.remove(kernel)
                return kernel, 0.0
            wait = min(wait, -kernel.account.credit / kernel.account.share)
        return None, wait

    async def _execute(self) -> None:
        """The GPU: one kernel at a time, for as long as it asks."""
        while True:
            kernel, wait = self._next_kernel()
            if kernel is None:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._arrived.wait(), None if wait == float("inf") else wait
                    )
                continue
            started = time.monotonic()
            await asyncio.sleep(kernel.seconds)
            busy = time.monotonic() - started
            kernel.account.busy_ns += int(busy * 1e9)
            kernel.account.credit -= busy
            if not kernel.done.done():
                kernel.done.set_result(None)

    def flush(self) -> None:
        """Publish busy time, and take new limits if the agent poked the reload file."""
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
        account: Account | None = None
        try:
            while line := await reader.readline():
                reply, account = await self._handle(line.decode(errors="replace").split(), account)
                writer.write(reply.encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _handle(
        self, words: list[str], account: Account | None
    ) -> tuple[str, Account | None]:
        if len(words) == 2 and words[0] == "HELLO":
            try:
                return "OK", self.account(validate_vgpu_id(words[1]))
            except (InvalidSpec, BackendError) as err:
                return f"ERR {err}", account
        if len(words) == 2 and words[0] == "RUN" and words[1].isdigit():
            if account is None:
                return "ERR say HELLO first", account
            seconds = min(int(words[1]) / 1e6, MAX_KERNEL_SECONDS)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.pending.append(Kernel(account, seconds, done))
            self._arrived.set()
            await done
            return "DONE", account
        return "ERR unknown request", account

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._serve_client, path=str(self.socket_path))
        tasks = [asyncio.create_task(self._execute()), asyncio.create_task(self._flusher())]
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
