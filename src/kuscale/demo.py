"""`kuscale demo`: the main job on the embedded default, then a summary of how it went.

On real cgroups it starts the GPU emulator, the agent in local mode and three workloads of
known, changing demand; where cgroups cannot be written it runs the same workloads on a
simulated node through the same monitor and policy. Because the demand is known, the summary
can say how much of it the limits left unmet, not only how often pods were throttled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.backends.gemini import GeminiLayer
from kuscale.backends.nvml import NvmlUsage
from kuscale.config import AgentConfig
from kuscale.gpuemu.gemini import POD_MANAGER_PORT_ENV, POD_NAME_ENV
from kuscale.gpuemu.nvml import EmulatedNvml
from kuscale.local.agent import LocalAgent
from kuscale.local.gemini import GeminiRuntime
from kuscale.local.statedir import StateDir
from kuscale.model import PodSpec, Resource
from kuscale.monitor import Monitor, PodAdded
from kuscale.plotting import plot_timeline
from kuscale.sim.node import SimCpu, SimGpu, SimNode, SimPod
from kuscale.sim.run import run_simulation
from kuscale.views import status_table
from kuscale.workload import Schedule

log = logging.getLogger("kuscale.demo")

STARTUP_SECONDS = 3.0
"""Head start that lets every workload process boot before their common schedule begins."""


@dataclass(frozen=True, slots=True)
class DemoWorkload:
    """A workload whose demand steps are given in fractions of the demo's duration."""

    name: str
    tokens: int
    cpu: str
    gpu: str | None = None

    def schedules(self, duration: float) -> tuple[Schedule, Schedule | None]:
        def scaled(text: str) -> Schedule:
            steps = Schedule.parse(text)
            return Schedule(tuple(s * duration for s in steps.starts), steps.percents)

        return scaled(self.cpu), (scaled(self.gpu) if self.gpu else None)


DEMO_WORKLOADS = (
    DemoWorkload("web", tokens=150, cpu="0:20,0.3:90,0.6:30"),
    DemoWorkload("batch", tokens=300, cpu="0:100,0.5:60"),
    DemoWorkload("trainer", tokens=400, cpu="0:30,0.5:60", gpu="0:40,0.25:90,0.75:50"),
)


class Recorder:
    """Turns each tick's snapshot into rows of usage and limit beside the known demand."""

    def __init__(
        self, workloads: tuple[DemoWorkload, ...], duration: float, clock: Callable[[], float]
    ) -> None:
        self.schedules = {w.name: w.schedules(duration) for w in workloads}
        self.starts: dict[str, float] = {}
        self.clock = clock
        self.rows: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}
        self._last_time: dict[str, float] = {}

    def __call__(self, snapshot: dict[str, Any]) -> None:
        now = self.clock()
        self.latest = snapshot
        for pod in snapshot["pods"]:
            name = pod["name"]
            if pod["status"] != "running" or name not in self.starts:
                continue
            previous = self._last_time.get(name)
            self._last_time[name] = now
            if previous is None or pod["updated_count"] == 0:
                continue
            self._record(pod, previous, now)

    def _record(self, pod: dict[str, Any], previous: float, now: float) -> None:
        name = pod["name"]
        cpu, gpu = self.schedules[name]
        middle = (previous + now) / 2 - self.starts[name]
        if middle < 0:
            return
        spend = sum(s["price"] * s["limit"] for s in pod["resources"].values())
        for resource, state in pod["resources"].items():
            schedule = cpu if resource == "cpu" else gpu
            self.rows.append(
                {
                    "t": now,
                    "pod": name,
                    "resource": resource,
                    "tokens": pod["tokens"],
                    "usage": state["usage"],
                    "limit": state["limit"],
                    "demand": schedule.at(middle) if schedule else 0.0,
                    "starved": state["starved"],
                    "spend": spend,
                }
            )


def _fraction(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pod and resource: means, unmet demand, slack; per pod: budget overspend."""
    by_pod: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_pod[row["pod"]][row["resource"]].append(row)
    summary: dict[str, Any] = {}
    for pod, resources in by_pod.items():
        entry: dict[str, Any] = {}
        for resource, samples in resources.items():
            n = len(samples)
            demand = sum(r["demand"] for r in samples)
            limit = sum(r["limit"] for r in samples)
            entry[resource] = {
                "samples": n,
                "mean_demand": demand / n,
                "mean_usage": sum(r["usage"] for r in samples) / n,
                "mean_limit": limit / n,
                "unmet_demand_fraction": _fraction(
                    sum(max(0.0, r["demand"] - r["usage"]) for r in samples), demand
                ),
                "throttled_tick_fraction": sum(r["starved"] for r in samples) / n,
                "slack_fraction": _fraction(
                    sum(max(0.0, r["limit"] - r["usage"]) for r in samples), limit
                ),
            }
        ticks = resources["cpu"]
        entry["tokens"] = ticks[0]["tokens"]
        entry["budget_overspend_fraction"] = _fraction(
            sum(max(0.0, r["spend"] - r["tokens"]) for r in ticks), sum(r["tokens"] for r in ticks)
        )
        summary[pod] = entry
    return summary


STARVED_POINTS = 1.0
"""A pod served this many points below its demand while its limits cost less than its
tokens was starved by the policy, not by its budget (the simulator's rule, per tick)."""


def idle_while_starved(rows: list[dict[str, Any]], capacity: dict[str, float]) -> dict[str, float]:
    """Per resource: the node's capacity left unused in each tick that pods which could pay
    for more, served below their demand, could have used; over capacity × ticks."""
    ticks: dict[tuple[float, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        ticks[(row["t"], row["resource"])].append(row)
    idle: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for (_, resource), samples in ticks.items():
        count[resource] += 1
        wanted = sum(
            r["demand"] - r["usage"]
            for r in samples
            if r["demand"] - r["usage"] > STARVED_POINTS and r["spend"] < r["tokens"]
        )
        unused = capacity.get(resource, 0.0) - sum(r["usage"] for r in samples)
        idle[resource] += min(max(unused, 0.0), wanted)
    return {
        resource: _fraction(idle[resource], capacity[resource] * n)
        for resource, n in count.items()
        if capacity.get(resource, 0.0) > 0
    }


def summary_table(summary: dict[str, Any], mode: str) -> Table:
    table = Table(title=f"kuscale demo summary ({mode})")
    for column in (
        "pod",
        "tokens",
        "resource",
        "demand",
        "usage",
        "limit",
        "unmet",
        "throttled ticks",
        "slack",
        "overspend",
    ):
        table.add_column(column, justify="left" if column in ("pod", "resource") else "right")
    for pod, entry in summary.items():
        for resource in ("cpu", "gpu"):
            if resource not in entry:
                continue
            r = entry[resource]
            table.add_row(
                pod,
                str(entry["tokens"]),
                resource,
                f"{r['mean_demand']:.1f}",
                f"{r['mean_usage']:.1f}",
                f"{r['mean_limit']:.1f}",
                f"{r['unmet_demand_fraction']:.1%}",
                f"{r['throttled_tick_fraction']:.1%}",
                f"{r['slack_fraction']:.1%}",
                f"{entry['budget_overspend_fraction']:.1%}",
            )
    return table


def cgroups_writable() -> CgroupV1 | CgroupV2 | None:
    """The cgroup backend if this process can create, write and remove a cgroup, else None."""
    probe = f"kuscale-probe-{os.getpid()}"
    try:
        cgroups = detect()
        cgroups.create(probe)
        try:
            cgroups.write_limit(probe, 50.0)
        finally:
            cgroups.remove(probe)
    except (BackendError, OSError) as err:
        log.info("cgroups are not writable here (%s)", err)
        return None
    return cgroups


@contextlib.contextmanager
def gpu_emulator(state: StateDir, enforce: bool) -> Iterator[None]:
    """The emulated GPU: enforcing each vGPU's share itself, or (behind Gemini) only the GPU."""
    command = [sys.executable, "-m", "kuscale", "gpu-emulator", "--state-dir", str(state.path)]
    process = subprocess.Popen(command if enforce else [*command, "--no-enforce"])
    try:
        deadline = time.monotonic() + 15
        while not state.gpu_socket.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the GPU emulator did not start")
            time.sleep(0.05)
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


def _launch(
    state: StateDir,
    parent: str,
    workload: DemoWorkload,
    duration: float,
    start_at: float,
    env: dict[str, str],
) -> subprocess.Popen[bytes]:
    cpu, gpu = workload.schedules(duration)
    command = [
        sys.executable,
        "-m",
        "kuscale",
        "launch",
        "--state-dir",
        str(state.path),
        "--tokens",
        str(workload.tokens),
        "--name",
        workload.name,
        "--cgroup-parent",
        parent,
    ]
    if gpu is not None:
        command.append("--gpu")
    command += [
        "--",
        sys.executable,
        "-m",
        "kuscale",
        "workload",
        "--cpu",
        cpu.format(),
        "--duration",
        str(duration),
        "--start-at",
        repr(start_at),
    ]
    if gpu is not None:
        command += ["--gpu", gpu.format()]
    return subprocess.Popen(command, env={**os.environ, **env})


def run_on_cgroups(
    cgroups: CgroupV1 | CgroupV2,
    config: AgentConfig,
    duration: float,
    console: Console,
    gemini_bin: Path | None = None,
) -> Recorder:
    """The agent and the workloads on real cgroups; the GPU pod behind the emulator's own
    shares, or behind the real Gemini from `gemini_bin` with use read through NVML."""
    start_at = time.monotonic() + STARTUP_SECONDS
    recorder = Recorder(DEMO_WORKLOADS, duration, clock=lambda: time.monotonic() - start_at)
    state_path = Path(tempfile.mkdtemp(prefix="kuscale-demo-"))
    state = StateDir(state_path).ensure()
    parent = f"kuscale-demo-{os.getpid()}"
    gemini = None
    if gemini_bin is not None:
        window_ms = config.period * 1000.0
        gemini = GeminiRuntime(gemini_bin, state_path / "gemini" / "config", 1, window_ms)
    agent: LocalAgent | None = None
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with gpu_emulator(state, enforce=gemini is None):
            envs = _start_gemini(gemini) if gemini is not None else {}
            gpu = _gemini_layer(gemini, state, cgroups, config) if gemini is not None else None
            agent = LocalAgent(state, config, cgroups=cgroups, listeners=[recorder], gpu=gpu)
            agent.start()
            for workload in DEMO_WORKLOADS:
                recorder.starts[workload.name] = 0.0
                env = envs.get(workload.name, {})
                processes.append(_launch(state, parent, workload, duration, start_at, env))
            with Live(console=console, refresh_per_second=4, transient=False) as live:
                while any(p.poll() is None for p in processes):
                    live.update(status_table(recorder.latest) if recorder.latest else "starting")
                    time.sleep(0.25)
                    if recorder.clock() > duration + STARTUP_SECONDS:
                        break
            time.sleep(2 * config.period)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        if agent is not None:
            agent.stop()
        if gemini is not None:
            gemini.stop()
        _remove_cgroups(cgroups, parent, [w.name for w in DEMO_WORKLOADS])
        shutil.rmtree(state_path, ignore_errors=True)
    return recorder


def _remove_cgroups(cgroups: CgroupV1 | CgroupV2, parent: str, pods: list[str]) -> None:
    """The demo's cgroups, whatever stopped it: the agent removes a pod's cgroup when its
    workload ends, but an interrupted demo ends first, and a killed workload's own worker
    processes may outlive it; they are the demo's, so they go too."""
    for cgroup in [f"{parent}/{pod}" for pod in pods] + [parent]:
        with contextlib.suppress(BackendError, OSError):
            if not cgroups.exists(cgroup):
                continue
            procs = Path(cgroups.cpu_root, cgroup, "cgroup.procs").read_text().split()
            for pid in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while not cgroups.is_empty(cgroup) and time.monotonic() < deadline:
                time.sleep(0.05)
            cgroups.remove(cgroup)


def _start_gemini(gemini: GeminiRuntime) -> dict[str, dict[str, str]]:
    """Gemini's scheduler, and a pod manager per GPU workload with the whole GPU until the
    agent adopts it; the variables Gemini's hook would read, per workload."""
    gemini.start()
    envs = {}
    for workload in DEMO_WORKLOADS:
        if workload.gpu is not None:
            port = gemini.add_client(workload.name, device=0, limit=100.0)
            envs[workload.name] = {POD_NAME_ENV: workload.name, POD_MANAGER_PORT_ENV: str(port)}
    return envs


def _gemini_layer(
    gemini: GeminiRuntime, state: StateDir, cgroups: CgroupV1 | CgroupV2, config: AgentConfig
) -> GeminiLayer:
    usage = NvmlUsage(EmulatedNvml(state.gpu_socket), cgroups.mode)
    minimum = float(config.policy_config.minimums()[Resource.GPU])
    return GeminiLayer(
        gemini.config_dir, gemini.files(), usage, config.gpu_layer.gemini_request, minimum
    )


def run_simulated(config: AgentConfig, duration: float) -> Recorder:
    node = SimNode(cores=2, gpus=1)
    recorder = Recorder(DEMO_WORKLOADS, duration, clock=lambda: node.now)
    monitor = Monitor(SimCpu(node), SimGpu(node), config, on_tick=recorder)
    for workload in DEMO_WORKLOADS:
        cpu, gpu = workload.schedules(duration)
        node.add(workload.name, SimPod(cpu=cpu, gpu=gpu, end=duration))
        recorder.starts[workload.name] = 0.0
        monitor.submit(
            PodAdded(
                PodSpec(
                    name=workload.name,
                    tokens=workload.tokens,
                    cgroup=workload.name,
                    owned=True,
                    vgpu_id=workload.name if gpu else None,
                )
            )
        )
    run_simulation(node, monitor, duration)
    return recorder


def run_demo(
    config: AgentConfig,
    duration: float,
    json_path: Path | None,
    plot_path: Path | None,
    simulate: bool,
    console: Console,
    gemini_bin: Path | None = None,
) -> dict[str, Any]:
    cgroups = None if simulate else cgroups_writable()
    if gemini_bin is not None and cgroups is None:
        raise RuntimeError("--gpu-layer gemini runs Gemini's programs: it needs real cgroups")
    if cgroups is None:
        if not simulate:
            console.print(
                "[yellow]cgroups are not writable here (run as root on a machine "
                "with the cpu controller); running a simulated node instead[/]"
            )
        mode = "simulated"
        recorder = run_simulated(config, duration)
        console.print(status_table(recorder.latest, title="simulated node, last tick"))
    else:
        mode = cgroups.mode
        recorder = run_on_cgroups(cgroups, config, duration, console, gemini_bin)
    summary = summarise(recorder.rows)
    console.print(summary_table(summary, mode))
    idle = idle_while_starved(recorder.rows, recorder.latest.get("capacity", {}))
    console.print(
        "node idle while a pod starved: "
        + ", ".join(f"{resource} {value:.1%}" for resource, value in idle.items())
    )
    result = {
        "mode": mode,
        "gpu_mode": recorder.latest.get("gpu_mode"),
        "policy": config.policy,
        "period": config.period,
        "duration": duration,
        "node": {resource: {"idle_while_starved_fraction": v} for resource, v in idle.items()},
        "pods": summary,
    }
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
        console.print(f"summary written to {json_path}")
    if plot_path is not None and recorder.rows:
        plot_timeline(recorder.rows, plot_path, f"kuscale demo · {mode} · {config.policy}")
        console.print(f"plot written to {plot_path}")
    return result
