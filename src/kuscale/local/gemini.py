"""Gemini's own programs run for local mode: one `gem-schd` per GPU and one `gem-pmgr` per
client, as Gemini's launcher and KubeShare run them, from the folder where the user installed
them (`--gemini-bin`; they need no CUDA, only Gemini's hook in the workload does).

The scheduler's window suits the agent's period: a limit kuscale writes is a share of each
period, and Gemini enforces it over its sliding window, so the window is one period (at
least 100 ms), the base quota a tenth of it and the minimum a fiftieth — the proportions of
Gemini's defaults (`-q 300 -m 20 -w 10000` in KubeShare, facts from Gemini's launcher).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kuscale.backends.gemini import GeminiLayer, render_config

SCHEDULER = "gem-schd"
POD_MANAGER = "gem-pmgr"
STARTUP_SECONDS = 15.0


class GeminiRuntimeError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise GeminiRuntimeError(f"{what} exited with status {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise GeminiRuntimeError(f"{what} did not listen on port {port} within {STARTUP_SECONDS} s")


@dataclass
class GeminiRuntime:
    """Gemini for `devices` GPUs, configured in `config_dir` (one file per device: `0`, `1`,
    ...); everything it starts is stopped by `stop`."""

    bin_dir: Path
    config_dir: Path
    devices: int = 1
    window_ms: float = 1000.0
    schedulers: list[int] = field(default_factory=list)
    """Each device's scheduler port."""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Everything started here, stopped or not."""

    def files(self) -> list[str]:
        return [str(device) for device in range(self.devices)]

    def start(self) -> None:
        for program in (SCHEDULER, POD_MANAGER):
            if not os.access(self.bin_dir / program, os.X_OK):
                raise GeminiRuntimeError(f"no executable {program} in {self.bin_dir}")
        self.config_dir.mkdir(parents=True, exist_ok=True)
        window = max(self.window_ms, 100.0)
        for name in self.files():
            path = self.config_dir / name
            if not path.exists():
                path.write_text(render_config([]))
            port = free_port()
            command = [str(self.bin_dir / SCHEDULER), "-p", str(self.config_dir), "-f", name]
            command += ["-P", str(port), "-q", f"{window / 10:g}", "-m", f"{window / 50:g}"]
            command += ["-w", f"{window:g}"]
            process = self._spawn(command, f"{SCHEDULER}-{name}", {})
            _wait_listening(port, process, f"{SCHEDULER} for GPU {name}")
            # It reads the file, then starts watching: a write in between would go unseen.
            self._wait_logged(f"{SCHEDULER}-{name}", "Watching '")
            self.schedulers.append(port)

    def add_client(
        self,
        name: str,
        device: int,
        limit: float,
        memory: int = 1 << 30,
        pod_manager: bool = False,
    ) -> int:
        """List the client on its device (LIMIT `limit` %, REQUEST 0; a line it had goes);
        the port its hook talks to.

        With `pod_manager`, a `gem-pmgr` of its own stands between them, as in KubeShare.
        Without (the default), the client asks the scheduler itself, in the same messages
        under its own name: here every client behind a pod manager stalled within 0.5–2 s
        (four runs of four; none of two asking the scheduler directly), because the pod
        manager waits for the scheduler's answer without first looking whether it came
        (`hook_kernel_launch` in Gemini's `src/pod-manager.cpp`), and once it sleeps
        through one answer it holds its client, and every later one, for good."""
        if not 0 <= device < len(self.schedulers):
            raise GeminiRuntimeError(f"no GPU {device} (this runtime has {self.devices})")
        GeminiLayer(self.config_dir, self.files(), None).place(name, memory, device, limit)
        # A pod manager that asks before the reload is told "Unknown client" and retries
        # only ten seconds later.
        self._wait_logged(f"{SCHEDULER}-{self.files()[device]}", f" {name} request: ")
        if not pod_manager:
            return self.schedulers[device]
        port = free_port()
        self._start_pod_manager(name, device, port)
        return port

    def _start_pod_manager(self, name: str, device: int, port: int) -> None:
        env = {
            "POD_NAME": name,
            "POD_MANAGER_PORT": str(port),
            "SCHEDULER_IP": "127.0.0.1",
            "SCHEDULER_PORT": str(self.schedulers[device]),
        }
        process = self._spawn([str(self.bin_dir / POD_MANAGER)], f"{POD_MANAGER}-{name}", env)
        _wait_listening(port, process, f"{POD_MANAGER} for {name}")

    def _wait_logged(self, program: str, text: str) -> None:
        """Until the program's log says `text`: Gemini tells no other way what it has done."""
        log = self._log(program)
        deadline = time.monotonic() + STARTUP_SECONDS
        while text not in log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise GeminiRuntimeError(f"{program} did not log {text!r} in {log}")
            time.sleep(0.02)

    def _log(self, name: str) -> Path:
        return self.config_dir.parent / f"{name}.log"

    def _spawn(self, command: list[str], log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self._log(log).open("wb") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
            )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        """Terminate every program started here, pod managers first, and wait for them."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
