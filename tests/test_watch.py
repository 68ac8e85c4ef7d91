"""The watch between ticks and the policy's fast path: a burst is met within a watch
interval, never beyond a pod's budget or the node, on a simulated node and on real cgroups."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import BUSY, stretched, wait_for

from kuscale.backends.base import CgroupGone
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.config import AgentConfig, ConfigError, PolicyConfig, config_from_mapping
from kuscale.model import PodSpec, Resource
from kuscale.monitor import Monitor, PodAdded, Stop
from kuscale.monitor.watching import PressureWake
from kuscale.sim.node import SimCpu, SimGpu, SimNode, SimPod
from kuscale.sim.run import run_period
from kuscale.workload import Schedule

CREDIT = PolicyConfig(burst_factor=0.5, burst_seconds=10.0)
CONFIG = AgentConfig(period=1.0, watch_interval=0.1, policy_config=CREDIT)


def burst_node(config: AgentConfig = CONFIG, cpu: SimCpu | None = None) -> tuple[SimNode, Monitor]:
    """A web pod idle at 10 % for five seconds, then wanting 120 %, beside a steady pod."""
    node = SimNode(cores=2, gpus=0)
    node.add("web", SimPod(cpu=Schedule.parse("0:10,5:120")))
    node.add("batch", SimPod(cpu=Schedule.parse("0:60")))
    monitor = Monitor(cpu or SimCpu(node), None, config)
    for name, tokens in (("web", 150), ("batch", 100)):
        monitor.submit(PodAdded(PodSpec(name=name, tokens=tokens, cgroup=name, owned=True)))
    return node, monitor


def budget_holds(monitor: Monitor) -> bool:
    """Σ price × limit ≤ R + k·Q/T for every pod, as the tick and the fast path promise."""
    policy = monitor.config.policy_config
    for pod in monitor.registry.running.values():
        spend = sum(state.price * state.limit for state in pod.resources.values())
        budget = pod.spec.tokens + policy.burst_factor * pod.token_queue / monitor.config.period
        if spend > budget * (1 + 1e-9) + 1e-9:
            return False
    return True


def ticked(node: SimNode, monitor: Monitor, periods: int) -> None:
    """`periods` periods of ticks and watch steps, then the tick that starts the next."""
    for _ in range(periods):
        monitor.tick(node.now)
        run_period(node, monitor, 1.0)
    monitor.tick(node.now)


def test_a_burst_is_met_within_a_few_watch_intervals() -> None:
    """Each look raises by what the pod was short (its time throttled over the look's wall
    time, counted from the tick), within the budget: from under 30 % a burst to 120 % that
    began at the tick is met at the first look, 0.1 s."""
    node, monitor = burst_node()
    ticked(node, monitor, 5)
    web = monitor.registry.running["local/web"].resources[Resource.CPU]
    assert web.limit < 30.0
    raises = monitor.stats.fast_raises
    held = [web.limit]
    while held[-1] < 120.0 - 1e-3 and len(held) < 10:
        node.advance(0.1)
        monitor.watch(node.now)
        held.append(web.limit)
        assert budget_holds(monitor)
    looks = len(held) - 1
    assert looks == 1, held
    assert held[1] > 2 * held[0], "a step sized by the evidence, not by fast_growth"
    assert monitor.stats.fast_raises == raises + looks
    assert monitor.snapshot()["fast_raises"] == raises + looks


def test_the_tick_after_a_raise_does_not_count_what_it_answered() -> None:
    node, monitor = burst_node()
    ticked(node, monitor, 6)
    web = monitor.registry.running["local/web"].resources[Resource.CPU]
    assert not web.starved
    assert web.limit >= 0.95 * 120.0, "the period's usage, raises included, is its demand"


@pytest.mark.parametrize("kernel_shares", [True, False])
def test_every_tick_and_every_raise_keep_budgets_and_the_node(kernel_shares: bool) -> None:
    node, monitor = burst_node(replace(CONFIG, kernel_shares=kernel_shares))
    for _ in range(15):
        monitor.tick(node.now)
        assert budget_holds(monitor)
        for step in range(10):
            if step:
                monitor.watch(node.now)
                assert budget_holds(monitor)
                limits = node.limit[:, Resource.CPU]
                assert np.all(np.isfinite(limits)) and np.all(limits > 0)
                assert np.all(limits <= 200.0)
                if not kernel_shares:
                    assert limits.sum() <= 200.0 + 1e-6
            node.advance(0.1)
    assert monitor.stats.fast_raises >= 1


def test_no_watch_at_zero_and_no_fast_path_for_the_baselines() -> None:
    for config in (replace(CONFIG, watch_interval=0.0), replace(CONFIG, policy="static")):
        node, monitor = burst_node(config)
        for _ in range(8):
            monitor.tick(node.now)
            run_period(node, monitor, 1.0)
        assert monitor.stats.fast_raises == 0


class VanishingCpu(SimCpu):
    """Between ticks one pod's cgroup vanishes and the other's counter runs backwards."""

    def __init__(self, node: SimNode) -> None:
        super().__init__(node)
        self.broken = False

    def read_throttled(self, cgroup: str) -> tuple[int, int]:
        if self.broken and cgroup == "web":
            raise CgroupGone("cpu.stat of web is gone")
        if self.broken and cgroup == "batch":
            return 0, 0
        return super().read_throttled(cgroup)


def test_a_vanished_cgroup_or_a_counter_gone_backwards_is_skipped() -> None:
    node = SimNode(cores=2, gpus=0)
    cpu = VanishingCpu(node)
    node, monitor = burst_node(cpu=cpu)
    cpu.node = node
    for _ in range(6):
        monitor.tick(node.now)
        run_period(node, monitor, 1.0)
    raises = monitor.stats.fast_raises
    cpu.broken = True
    node.advance(0.1)
    monitor.watch(node.now)
    assert monitor.stats.fast_raises == raises
    assert set(monitor.registry.running) == {"local/web", "local/batch"}


@pytest.mark.parametrize(
    ("value", "message"),
    [(-0.1, "must not be negative"), ("fast", "finite number"), (2.0, "not be longer")],
)
def test_a_bad_watch_interval_names_the_key(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        config_from_mapping({"agent": {"watch_interval": value}}, "test")
    assert "agent.watch_interval" in str(caught.value)


BURST_AFTER_IDLE = [sys.executable, "-c", "import time; time.sleep(2.5)\nwhile True: pass"]


@pytest.mark.v2_kernel
def test_fast_raises_keep_the_budget_on_real_cgroups(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    """A real process idles, then spins: the watch raises its quota between ticks, and at
    every tick and every raise what the pod holds is within its budget."""
    cgroups, parent = real_cgroups
    name = f"{parent}/burst"
    cgroups.create(name)
    monitor = Monitor(cgroups, None, CONFIG)
    process = subprocess.Popen(BURST_AFTER_IDLE)
    try:
        cgroups.attach(name, process.pid)
        monitor.submit(PodAdded(PodSpec(name="burst", tokens=150, cgroup=name)))
        ticks_at_raise: list[int] = []
        deadline = time.monotonic() + stretched(30.0)
        next_tick = time.monotonic()
        while not ticks_at_raise and time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_tick:
                monitor.tick(now)
                next_tick = now + 1.0
            else:
                raised = monitor.stats.fast_raises
                monitor.watch(now)
                if monitor.stats.fast_raises > raised:
                    ticks_at_raise.append(monitor.stats.ticks)
            assert budget_holds(monitor)
            pod = monitor.registry.running["local/burst"]
            assert cgroups.read_limit(name) == pytest.approx(
                pod.resources[Resource.CPU].limit, abs=0.01
            )
            time.sleep(0.1)
        assert ticks_at_raise, "the watch never raised the spinning process's quota"
    finally:
        process.kill()
        process.wait()
        monitor.restore()
    assert cgroups.read_limit(name) is None


IDLE_PODS = 10
IDLE_SECONDS = 3.0


def run_in_thread(monitor: Monitor) -> threading.Thread:
    loop = threading.Thread(target=monitor.run, name="kuscale-monitor", daemon=True)
    loop.start()
    return loop


def asleep(pid: int) -> bool:
    """The process sleeps: it has finished starting and spends no CPU."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "S"


def reaction_and_idle_cost(
    cgroups: CgroupV1 | CgroupV2, parent: str, pressure: bool
) -> tuple[str, float, float]:
    """The watch's mode; the loop's CPU seconds per second while every pod sleeps; seconds
    from a burst's start to its fast raise. The sleepers join their pods asleep, so none is
    raised for its start, and the one tick falls before the pods arrive: the burst's raise
    is the watch's alone."""
    config = replace(CONFIG, period=60.0, watch_pressure=pressure)
    monitor = Monitor(cgroups, None, config)
    processes: list[subprocess.Popen[bytes]] = []
    names = [f"{parent}/{'psi' if pressure else 'poll'}-{i}" for i in range(IDLE_PODS + 1)]
    loop = run_in_thread(monitor)
    try:
        for name in names:
            cgroups.create(name)
            processes.append(subprocess.Popen(["sleep", "600"]))
            wait_for(lambda: asleep(processes[-1].pid), timeout=10, interval=0.01)
            cgroups.attach(name, processes[-1].pid)
            monitor.submit(PodAdded(PodSpec(name=name.rsplit("/")[-1], tokens=100, cgroup=name)))
        wait_for(lambda: len(monitor.watcher.managed_cgroups()) == len(names), timeout=20)
        time.sleep(0.5)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(IDLE_SECONDS)
        idle_cost = (time.process_time() - cpu) / (time.monotonic() - wall)
        raised = monitor.stats.fast_raises
        spinner = subprocess.Popen(BUSY)
        processes.append(spinner)
        cgroups.attach(names[0], spinner.pid)
        reaction = wait_for(lambda: monitor.stats.fast_raises > raised, timeout=5, interval=0.01)
        mode = monitor.snapshot()["watch"]
        assert monitor.stats.ticks == 1, "a tick, not the watch, may have answered the burst"
    finally:
        monitor.submit(Stop())
        loop.join(stretched(30))
        for process in processes:
            process.kill()
            process.wait()
    assert not loop.is_alive()
    return mode, idle_cost, reaction


@pytest.mark.v2_kernel
def test_the_watch_sleeps_on_pressure_triggers_where_the_kernel_has_them(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
    record_property: Callable[[str, object], None],
) -> None:
    """On cgroup v2 the loop sleeps on PSI triggers and still raises a burst between ticks;
    on v1, or with watch_pressure off, it polls. Its figures are printed, never judged."""
    cgroups, parent = real_cgroups
    expected = "pressure" if cgroups.mode == "cgroup-v2" else "poll"
    for pressure, wanted in ((True, expected), (False, "poll")):
        mode, idle_cost, reaction = reaction_and_idle_cost(cgroups, parent, pressure)
        assert mode == wanted
        label = f"watch_pressure={str(pressure).lower()}, {mode}"
        record_property(f"{label}: loop CPU while {IDLE_PODS + 1} pods idle", f"{idle_cost:.2%}")
        record_property(f"{label}: burst to fast raise", f"{reaction * 1000:.0f} ms")


def test_pressure_triggers_follow_the_pods_and_fall_back_to_polling(v2_tree: CgroupV2) -> None:
    pod = Path(v2_tree.cpu_root) / "pods" / "a"
    wake = PressureWake(v2_tree, enabled=True)
    (pod / "cpu.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert wake.follow(["pods/a"]) and wake.mode == "pressure"
    assert wake.follow([]) and not wake.triggers
    assert not wake.follow(["pods/gone"]) and wake.mode == "pressure"
    (pod / "cpu.pressure").unlink()
    assert not wake.follow(["pods/a"])
    assert wake.mode == "poll" and "cpu.pressure" in str(wake.refused)
    assert not PressureWake(v2_tree, enabled=False).follow(["pods/a"])


def test_a_v1_node_polls(v1_tree: CgroupV1) -> None:
    wake = PressureWake(v1_tree, enabled=True)
    assert wake.mode == "poll" and not wake.follow(["pods/a"])


GPU_CONFIG = replace(CONFIG, policy_config=replace(CREDIT, burst_factor=0.0))


def gpu_node(gemini: bool = False, config: AgentConfig = GPU_CONFIG) -> tuple[SimNode, Monitor]:
    """On the original's vGPU layer (no weights), or on Gemini with REQUEST from tokens: a
    trainer at 20 % of the GPU that wants 90 % from second 5, beside a notebook that holds
    headroom it does not use."""
    node = SimNode(cores=2, gpus=1, gemini=gemini)
    node.add("trainer", SimPod(cpu=Schedule.parse("0:10"), gpu=Schedule.parse("0:20,5:90")))
    node.add("notebook", SimPod(cpu=Schedule.parse("0:10"), gpu=Schedule.parse("0:10")))
    monitor = Monitor(SimCpu(node), SimGpu(node), config)
    for name, tokens in (("trainer", 300), ("notebook", 300)):
        spec = PodSpec(name=name, tokens=tokens, cgroup=name, vgpu_id=name, owned=True)
        monitor.submit(PodAdded(spec))
    return node, monitor


def test_a_gpu_pinned_at_its_limit_is_raised_within_one_watch_interval() -> None:
    """The GPU twin of the CPU fast path, where the layer has no weights: the trainer gets
    what its budget allows beside the CPU limit it holds this period, part of it taken from
    the notebook's unused headroom (never below what the notebook uses plus a margin)."""
    node, monitor = gpu_node()
    ticked(node, monitor, 5)
    running = monitor.registry.running
    trainer = running["local/trainer"].resources[Resource.GPU]
    notebook = running["local/notebook"].resources[Resource.GPU]
    held, spare = trainer.limit, notebook.limit
    cpu_held = running["local/trainer"].resources[Resource.CPU].limit
    assert held < 90.0 and held + spare > 95.0, "the device is all held before the burst"
    raises = monitor.stats.gpu_fast_raises
    node.advance(0.1)
    monitor.watch(node.now)
    assert monitor.stats.gpu_fast_raises == raises + 1
    assert trainer.limit == pytest.approx((300 - cpu_held) / 3, rel=1e-3), "all it can pay"
    assert 11.0 < notebook.limit < spare
    assert trainer.limit + notebook.limit <= 100.0 + 1e-6
    assert budget_holds(monitor)
    assert monitor.snapshot()["gpu_fast_raises"] == raises + 1
    node.advance(0.1)
    monitor.watch(node.now)
    assert monitor.stats.gpu_fast_raises == raises + 1, "served now: nothing more to raise"


def test_under_gpu_weights_a_raise_is_the_budgets_alone() -> None:
    """Where the layer shares the device by tokens the watch raises a pinned pod within its
    budget (with burst credit, so that the tick left it below what it may spend) and takes
    nothing from the others: limits need not fit the device."""
    node, monitor = gpu_node(gemini=True, config=CONFIG)
    assert monitor.decider.weighted[Resource.GPU]
    ticked(node, monitor, 5)
    running = monitor.registry.running
    trainer = running["local/trainer"].resources[Resource.GPU]
    notebook = running["local/notebook"].resources[Resource.GPU]
    assert monitor.watcher.watches_gpu()
    held, spare = trainer.limit, notebook.limit
    raises = monitor.stats.gpu_fast_raises
    node.advance(0.1)
    monitor.watch(node.now)
    assert monitor.stats.gpu_fast_raises == raises + 1
    assert trainer.limit > held
    assert notebook.limit == spare, "nothing is taken back under weights"
    assert budget_holds(monitor)


def test_a_gpu_client_gone_between_passes_is_skipped() -> None:
    node, monitor = gpu_node()
    ticked(node, monitor, 1)
    node.remove("notebook")
    node.advance(0.1)
    monitor.watch(node.now)
    assert "local/notebook" in monitor.registry.running, "the watch leaves that to the tick"
    monitor.tick(node.now)
    assert "local/notebook" not in monitor.registry.running


def test_a_gpu_counter_gone_backwards_is_skipped_until_the_next_look() -> None:
    node, monitor = gpu_node()
    ticked(node, monitor, 6)
    raises = monitor.stats.gpu_fast_raises
    node.advance(0.1)
    node.busy_ns[node.row("trainer"), Resource.GPU] = 0.0
    monitor.watch(node.now)
    assert monitor.stats.gpu_fast_raises == raises, "no use can be read from a reset counter"
    node.advance(0.1)
    monitor.watch(node.now)
    assert monitor.stats.gpu_fast_raises == raises + 1, "the next look measures from it"
