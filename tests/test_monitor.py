"""The monitor loop over a simulated node: lifecycle, isolation of failures, restore."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from kuscale.backends.base import CounterError
from kuscale.backends.batch import OneAtATime, each_cgroup
from kuscale.config import AgentConfig
from kuscale.model import CpuCounters, PodSpec, PodStatus, Resource
from kuscale.monitor import Monitor, PodAdded, PodRemoved, Stop
from kuscale.sim.node import SimCpu, SimGpu, SimNode, SimPod
from kuscale.sim.run import run_simulation
from kuscale.views import status_lines
from kuscale.workload import Schedule

CONFIG = AgentConfig(period=0.5)
ORIGINAL = replace(CONFIG, policy="kuscale-2022")


def pod(
    node: SimNode,
    name: str,
    cpu: str = "0:100",
    gpu: str | None = None,
    tokens: int = 300,
    end: float = float("inf"),
) -> PodSpec:
    node.add(
        name, SimPod(cpu=Schedule.parse(cpu), gpu=Schedule.parse(gpu) if gpu else None, end=end)
    )
    return PodSpec(name=name, tokens=tokens, cgroup=name, vgpu_id=name if gpu else None, owned=True)


def make(node: SimNode, config: AgentConfig = CONFIG, gpu: bool = True) -> Monitor:
    return Monitor(SimCpu(node), SimGpu(node) if gpu else None, config)


def step(node: SimNode, monitor: Monitor, ticks: int) -> None:
    for _ in range(ticks):
        node.advance(monitor.config.period)
        monitor.tick(node.now)


def test_a_new_pod_starts_at_ten_and_follows_demand() -> None:
    node = SimNode()
    monitor = make(node)
    monitor.submit(PodAdded(pod(node, "busy")))
    monitor.tick(node.now)
    state = monitor.registry.running["local/busy"]
    assert state.status is PodStatus.RUNNING
    assert SimCpu(node).read_limit("busy") == 10.0
    step(node, monitor, 20)
    assert (SimCpu(node).read_limit("busy") or 0.0) >= 90.0
    assert state.updated_count == 20
    assert len(state.resources[Resource.CPU].history) == CONFIG.window


def test_small_budget_never_spent_above_its_tokens() -> None:
    node = SimNode()
    monitor = make(node)
    monitor.submit(PodAdded(pod(node, "thrifty", tokens=30)))
    monitor.tick(node.now)
    for _ in range(40):
        step(node, monitor, 1)
        limit = SimCpu(node).read_limit("thrifty")
        assert limit is not None
        assert limit <= 30.0 + 1e-9


def test_a_pod_whose_cgroup_disappears_completes_and_the_rest_go_on() -> None:
    node = SimNode()
    monitor = make(node)
    monitor.submit(PodAdded(pod(node, "a")))
    monitor.submit(PodAdded(pod(node, "b")))
    step(node, monitor, 2)
    SimCpu(node).remove("a")
    step(node, monitor, 2)
    assert "local/a" in monitor.registry.completed
    assert monitor.registry.completed["local/a"].status is PodStatus.COMPLETED
    assert monitor.registry.running["local/b"].updated_count == 3


def test_an_owned_pod_whose_processes_exit_completes_and_is_removed() -> None:
    node = SimNode()
    monitor = make(node)
    monitor.submit(PodAdded(pod(node, "short", end=1.0)))
    step(node, monitor, 4)
    assert "local/short" in monitor.registry.completed
    assert not node.present("short")


class FlakyCpu(SimCpu):
    """Garbage for one pod, counters that go backwards for another."""

    def __init__(self, node: SimNode) -> None:
        super().__init__(node)
        self.rewind = False

    def read(self, cgroup: str) -> CpuCounters:
        if cgroup == "garbage":
            raise CounterError("cpuacct.usage holds 'xyz'")
        counters = super().read(cgroup)
        if cgroup == "rewound" and self.rewind:
            return replace(counters, usage_ns=0)
        return counters

    def cgroup_set(self, cgroups: Sequence[str]) -> OneAtATime[str]:
        """Read one cgroup at a time, through the flaky `read`."""
        return each_cgroup(self, cgroups)


def test_failures_on_one_pod_are_counted_and_never_stop_the_others() -> None:
    node = SimNode()
    cpu = FlakyCpu(node)
    monitor = Monitor(cpu, SimGpu(node), CONFIG)
    for name in ("garbage", "rewound", "healthy"):
        monitor.submit(PodAdded(pod(node, name)))
    step(node, monitor, 3)
    cpu.rewind = True
    step(node, monitor, 1)
    assert monitor.stats.errors["backwards"] == 1
    assert monitor.stats.errors["garbage"] >= 1
    assert monitor.registry.running["local/garbage"].status is PodStatus.NOT_READY
    assert monitor.registry.running["local/healthy"].updated_count == 3
    assert monitor.registry.running["local/rewound"].updated_count == 2


def test_monitor_only_measures_and_writes_nothing() -> None:
    node = SimNode()
    monitor = make(node, replace(CONFIG, monitor_only=True))
    monitor.submit(PodAdded(pod(node, "watched", gpu="0:50")))
    step(node, monitor, 5)
    assert SimCpu(node).read_limit("watched") is None
    assert SimGpu(node).read_limit("watched") is None
    state = monitor.registry.running["local/watched"]
    assert state.resources[Resource.CPU].usage == pytest.approx(100.0)
    assert state.resources[Resource.GPU].usage == pytest.approx(50.0)


def test_a_gpu_pod_on_a_node_without_gpu_is_refused_with_a_reason() -> None:
    node = SimNode()
    monitor = make(node, gpu=False)
    monitor.submit(PodAdded(pod(node, "wants-gpu", gpu="0:50")))
    monitor.tick(node.now)
    snapshot = monitor.snapshot()
    view = next(p for p in snapshot["pods"] if p["name"] == "wants-gpu")
    assert view["status"] == "refused"
    assert "GPU" in view["reason"]
    assert SimCpu(node).read_limit("wants-gpu") is None


def test_removed_pods_are_released() -> None:
    node = SimNode()
    monitor = make(node)
    spec = pod(node, "leaving")
    monitor.submit(PodAdded(spec))
    step(node, monitor, 1)
    monitor.submit(PodRemoved(spec.key))
    step(node, monitor, 1)
    assert spec.key in monitor.registry.completed


def test_a_pod_withdrawn_while_it_runs_gets_its_limit_back() -> None:
    node = SimNode()
    spec = replace(pod(node, "lost-tokens"), owned=False)
    SimCpu(node).write_limit("lost-tokens", 150.0)
    monitor = make(node)
    monitor.submit(PodAdded(spec))
    step(node, monitor, 3)
    assert SimCpu(node).read_limit("lost-tokens") != 150.0
    monitor.submit(PodRemoved(spec.key))
    step(node, monitor, 1)
    assert spec.key in monitor.registry.completed
    assert SimCpu(node).read_limit("lost-tokens") == 150.0


def test_a_pod_offered_again_with_other_tokens_is_taken_up_anew() -> None:
    node = SimNode()
    spec = replace(pod(node, "grows"), owned=False)
    monitor = make(node)
    monitor.submit(PodAdded(spec))
    step(node, monitor, 2)
    monitor.submit(PodAdded(replace(spec, tokens=600)))
    step(node, monitor, 1)
    state = monitor.registry.running[spec.key]
    assert state.spec.tokens == 600
    assert monitor.registry.completed[spec.key].status is PodStatus.COMPLETED
    monitor.submit(PodAdded(replace(spec, tokens=600)))
    step(node, monitor, 1)
    assert monitor.registry.running[spec.key] is state


def test_restore_puts_back_what_was_there_before() -> None:
    node = SimNode()
    spec = pod(node, "had-limit", gpu="0:100")
    SimCpu(node).write_limit("had-limit", 150.0)
    monitor = make(node)
    monitor.submit(PodAdded(spec))
    step(node, monitor, 3)
    assert SimCpu(node).read_limit("had-limit") != 150.0
    monitor.restore()
    assert SimCpu(node).read_limit("had-limit") == 150.0
    assert SimGpu(node).read_limit("had-limit") is None


def test_ticks_after_a_restore_leave_the_limits_given_back() -> None:
    node = SimNode()
    spec = pod(node, "given-back")
    SimCpu(node).write_limit("given-back", 150.0)
    monitor = make(node)
    monitor.submit(PodAdded(spec))
    step(node, monitor, 3)
    monitor.restore()
    step(node, monitor, 3)
    monitor.watch(node.now)
    assert SimCpu(node).read_limit("given-back") == 150.0


def test_run_stops_on_a_stop_event_and_restores() -> None:
    node = SimNode()
    monitor = make(node, replace(CONFIG, period=0.05))
    monitor.submit(PodAdded(pod(node, "busy")))
    thread = threading.Thread(target=monitor.run)
    thread.start()
    while monitor.stats.ticks < 3:
        threading.Event().wait(0.01)
    monitor.submit(Stop())
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert SimCpu(node).read_limit("busy") is None


def test_the_original_rule_never_writes_more_than_the_node_has() -> None:
    node = SimNode(cores=2, gpus=1)
    monitor = make(node, ORIGINAL)
    monitor.submit(PodAdded(pod(node, "greedy", cpu="0:300", gpu="0:100", tokens=5000)))
    run_simulation(node, monitor, 20.0)
    assert monitor.stats.errors["clamped"] > 0
    assert monitor.stats.errors.get("range", 0) == 0
    assert monitor.registry.running["local/greedy"].resources[Resource.GPU].limit <= 100.0


def ticks_to_reach(policy: str, target: float) -> int:
    node = SimNode(cores=2)
    monitor = make(node, replace(CONFIG, policy=policy))
    monitor.submit(PodAdded(pod(node, "burst", cpu="0:100", tokens=300)))
    monitor.tick(node.now)
    for tick in range(1, 60):
        step(node, monitor, 1)
        if node.granted[node.index["burst"], 0] >= target:
            return tick
    return 60


def test_the_default_rule_catches_a_burst_in_a_few_ticks_where_the_original_needs_many() -> None:
    assert ticks_to_reach("kuscale", 95.0) <= 5
    assert ticks_to_reach("kuscale-2022", 95.0) >= 10


def test_a_full_node_is_shared_by_tokens_through_kernel_weights() -> None:
    """The default: cpu.shares follow tokens, the limits may add up past the node, and the
    kernel's split of a full node goes by tokens, with nothing left idle."""
    node = SimNode(cores=2)
    monitor = make(node)
    for name in ("a", "b", "c"):
        monitor.submit(PodAdded(pod(node, name, cpu="0:100", tokens=300)))
    step(node, monitor, 20)
    granted = {n: float(node.granted[node.row(n), 0]) for n in "abc"}
    assert list(granted.values()) == pytest.approx([200 / 3] * 3, rel=0.02)
    monitor.submit(PodAdded(pod(node, "d", cpu="0:100", tokens=600)))
    step(node, monitor, 20)
    granted = {n: float(node.granted[node.row(n), 0]) for n in "abcd"}
    assert sum(granted.values()) == pytest.approx(200.0)
    assert granted["d"] == pytest.approx(2 * granted["a"], rel=0.05)


def test_without_kernel_weights_a_full_node_is_never_oversubscribed() -> None:
    node = SimNode(cores=2)
    monitor = make(node, replace(CONFIG, kernel_shares=False))
    for name in ("a", "b", "c"):
        monitor.submit(PodAdded(pod(node, name, cpu="0:100", tokens=300)))
    for _ in range(20):
        step(node, monitor, 1)
        assert float(np.nansum(node.limit[:, 0])) <= 200.0 + 1e-6
    assert [SimCpu(node).read_limit(n) for n in "abc"] == pytest.approx([200 / 3] * 3, rel=0.02)
    monitor.submit(PodAdded(pod(node, "d", cpu="0:100", tokens=600)))
    step(node, monitor, 20)
    limits = {n: SimCpu(node).read_limit(n) or 0.0 for n in "abcd"}
    assert sum(limits.values()) <= 200.0 + 1e-6
    assert limits["d"] == pytest.approx(2 * limits["a"], rel=0.05)


def test_a_pod_that_cannot_afford_its_minimums_is_refused_and_shown() -> None:
    node = SimNode()
    monitor = make(node)
    monitor.submit(PodAdded(pod(node, "poor", gpu="0:50", tokens=30)))
    monitor.tick(node.now)
    view = next(p for p in monitor.snapshot()["pods"] if p["name"] == "poor")
    assert view["status"] == "refused"
    assert "cannot buy the minimum" in view["reason"]
    assert SimCpu(node).read_limit("poor") is None


def test_kernel_shares_follow_tokens_and_are_restored() -> None:
    node = SimNode()
    monitor = make(node, replace(CONFIG, kernel_shares=True))
    for name, tokens in (("small", 100), ("large", 400)):
        monitor.submit(PodAdded(pod(node, name, tokens=tokens)))
    step(node, monitor, 1)
    assert SimCpu(node).read_shares("small") == 1024
    assert SimCpu(node).read_shares("large") == 4096
    monitor.restore()
    assert SimCpu(node).read_shares("large") == 1024


def test_each_gpu_device_is_shared_and_shown_on_its_own() -> None:
    """Three pods on GPU 0 and one on GPU 1 of a 2-GPU node: admission, limits and the
    status's per-device figures count each device alone; status text and top show them."""
    node = SimNode(cores=4, gpus=2)
    monitor = make(node)
    for name, device in (("a", 0), ("b", 0), ("c", 0), ("d", 1)):
        node.add(
            name, SimPod(cpu=Schedule.parse("0:20"), gpu=Schedule.parse("0:60"), device=device)
        )
        monitor.submit(PodAdded(PodSpec(name=name, tokens=300, cgroup=name, vgpu_id=name)))
    step(node, monitor, 30)
    snapshot = monitor.snapshot()
    devices = snapshot["gpu_devices"]
    assert [d["device"] for d in devices] == [0, 1]
    assert all(d["capacity"] == 100.0 for d in devices)
    assert devices[0]["usage"] <= 100.0 + 1e-6
    assert devices[0]["limit"] <= 100.0 * CONFIG.policy_config.gpu.overcommit + 1e-6
    assert devices[1]["usage"] == pytest.approx(60.0, abs=6.0)
    assert {p["name"]: p["gpu_device"] for p in snapshot["pods"]} == {
        "a": 0,
        "b": 0,
        "c": 0,
        "d": 1,
    }
    assert any(line.startswith("gpu1: usage=") for line in status_lines(snapshot))
    assert "d tokens=300" in "\n".join(status_lines(snapshot))
