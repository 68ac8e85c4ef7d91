"""The cgroup actuator on real cgroups: the pod's quota binds, its containers' quotas are
lifted first and given back last, in the order cgroup v1 requires."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import BUSY, V1_CPU_FILES, V1_CPUACCT_FILES, write_files

from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.config import AgentConfig
from kuscale.model import PodSpec, PodStatus, Resource
from kuscale.monitor import Monitor, PodAdded


def kubelet_like_pod(cgroups: CgroupV1 | CgroupV2, parent: str) -> PodSpec:
    """A pod limited to 80 % whose app container has its own 50 % and sidecar none."""
    pod = f"{parent}/pod"
    leaves = (f"{pod}/app", f"{pod}/sidecar")
    for cgroup in (pod, *leaves):
        cgroups.create(cgroup)
    cgroups.write_limit(pod, 80.0)
    cgroups.write_limit(leaves[0], 50.0)
    return PodSpec(name="pod", tokens=30, cgroup=pod, containers=leaves)


@pytest.mark.v2_kernel
def test_a_pod_is_held_below_its_containers_own_limits_and_given_everything_back(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    spec = kubelet_like_pod(cgroups, parent)
    app, sidecar = spec.containers
    if isinstance(cgroups, CgroupV1):
        with pytest.raises(BackendError, match="Invalid argument"):
            cgroups.write_limit(spec.cgroup, 20.0)
    else:
        cgroups.write_limit(spec.cgroup, 20.0)  # v2 takes a pod below its containers
        cgroups.write_limit(spec.cgroup, 80.0)
    busy = subprocess.Popen(BUSY)
    try:
        cgroups.attach(app, busy.pid)
        monitor = Monitor(cgroups, None, AgentConfig(period=0.2))
        monitor.submit(PodAdded(spec))
        for _ in range(10):
            monitor.tick(time.monotonic())
            time.sleep(0.2)
        pod = monitor.registry.running["local/pod"]
        assert pod.status is PodStatus.RUNNING
        assert cgroups.read_limit(app) is None
        assert cgroups.read_limit(sidecar) is None
        held = cgroups.read_limit(spec.cgroup)
        assert held is not None and held <= 30.0 + 1e-6
        assert pod.resources[Resource.CPU].usage > 5.0
        monitor.restore()
    finally:
        busy.kill()
        busy.wait()
    assert cgroups.read_limit(spec.cgroup) == pytest.approx(80.0)
    assert cgroups.read_limit(app) == pytest.approx(50.0)
    assert cgroups.read_limit(sidecar) is None


class FailingLeaf(CgroupV1):
    """A real v1 fixture tree whose one container refuses every write."""

    def __init__(self, root: Path, refusing: str) -> None:
        super().__init__(root / "cpu", root / "cpuacct")
        self.refusing = refusing

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        if cgroup == self.refusing:
            raise BackendError(f"{cgroup}: refused")
        super().write_limit(cgroup, limit)


def test_a_take_over_that_fails_part_way_gives_back_what_it_lifted(tmp_path: Path) -> None:
    pod = "kubepods/burstable/podx"
    leaves = (f"{pod}/a", f"{pod}/b")
    for cgroup in (pod, *leaves):
        write_files(tmp_path / "cpu" / cgroup, {**V1_CPU_FILES, "cpu.cfs_quota_us": "40000\n"})
        write_files(tmp_path / "cpuacct" / cgroup, V1_CPUACCT_FILES)
    cgroups = FailingLeaf(tmp_path, refusing=leaves[1])
    actuator = CgroupActuator(cgroups)
    spec = PodSpec(name="x", tokens=30, cgroup=pod, containers=leaves)
    with pytest.raises(BackendError, match="refused"):
        actuator.hold(spec, actuator.inspect(spec))
    assert cgroups.read_limit(leaves[0]) == pytest.approx(40.0)


def test_a_container_that_exited_is_passed_over_when_giving_back(tmp_path: Path) -> None:
    pod = "kubepods/burstable/podx"
    leaf = f"{pod}/a"
    for cgroup in (pod, leaf):
        write_files(tmp_path / "cpu" / cgroup, {**V1_CPU_FILES, "cpu.cfs_quota_us": "40000\n"})
        write_files(tmp_path / "cpuacct" / cgroup, V1_CPUACCT_FILES)
    cgroups = CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")
    actuator = CgroupActuator(cgroups)
    spec = PodSpec(name="x", tokens=30, cgroup=pod, containers=(leaf,))
    held = actuator.inspect(spec)
    actuator.hold(spec, held)
    assert cgroups.read_limit(leaf) is None
    (tmp_path / "cpu" / leaf / "cpu.cfs_quota_us").unlink()
    actuator.release(spec, held)
    assert cgroups.read_limit(pod) == pytest.approx(40.0)


def test_a_container_cgroup_outside_its_pod_is_refused() -> None:
    with pytest.raises(ValueError, match="not under"):
        PodSpec(name="x", tokens=30, cgroup="kubepods/podx", containers=("kubepods/other/c",))
