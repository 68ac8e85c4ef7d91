"""Reading and writing many cgroups at once: the same answers as one at a time, and a
failure stays with its own cgroup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import V1_CPU_FILES, V1_CPUACCT_FILES, write_files

from kuscale.backends.base import BackendError, CgroupGone
from kuscale.backends.batch import each_cgroup
from kuscale.backends.cgroup import CgroupV1
from kuscale.sim.node import SimCpu, SimNode, SimPod
from kuscale.workload import Schedule


def test_a_kernel_set_answers_as_each_cgroup_would_and_keeps_failures_apart(
    v1_tree: CgroupV1, tmp_path: Path
) -> None:
    write_files(tmp_path / "cpu" / "pods" / "b", V1_CPU_FILES)
    write_files(tmp_path / "cpuacct" / "pods" / "b", V1_CPUACCT_FILES)
    (tmp_path / "cpuacct" / "pods" / "b" / "cpuacct.usage").write_text("42\n")
    cgroups = ["pods/a", "../escape", "pods/gone", "pods/b"]
    kernel = v1_tree.cgroup_set(cgroups)
    counters = kernel.read([0, 1, 2, 3])
    assert counters.usage_ns.tolist() == [123456789, 0, 0, 42]
    assert counters.nr_throttled.tolist() == [2, 0, 0, 2]
    assert sorted(counters.failed) == [1, 2]
    assert isinstance(counters.failed[2], CgroupGone)
    one_by_one = each_cgroup(v1_tree, cgroups).read([3, 0])
    assert one_by_one.usage_ns.tolist() == kernel.read([3, 0]).usage_ns.tolist()
    failed = kernel.write_limits([0, 1, 3], [25.0, 30.0, 40.0])
    assert list(failed) == [1] and isinstance(failed[1], BackendError)
    assert v1_tree.read_limit("pods/a") == 25.0
    assert v1_tree.read_limit("pods/b") == 40.0


def test_the_simulator_set_agrees_with_its_one_pod_reads() -> None:
    node = SimNode(cores=4)
    for name, (start, demand) in {
        "a": (0.0, "0:50"),
        "b": (0.0, "0:300"),
        "c": (5.0, "0:20"),
    }.items():
        node.add(name, SimPod(cpu=Schedule.parse(demand), start=start))
    cpu = SimCpu(node)
    cpu.write_limit("b", 100.0)
    node.advance(2.0)
    cgroups = ["a", "b", "c", "missing"]
    vectorised, one_by_one = cpu.cgroup_set(cgroups), each_cgroup(cpu, cgroups)
    for which in ([0, 1, 2, 3], [1]):
        fast, slow = vectorised.read(which), one_by_one.read(which)
        assert np.array_equal(fast.usage_ns, slow.usage_ns)
        assert np.array_equal(fast.nr_throttled, slow.nr_throttled)
        assert sorted(fast.failed) == sorted(slow.failed)
    assert vectorised.read_throttled([1])[0].tolist() == [cpu.read_throttled("b")]
    failed = vectorised.write_limits([0, 2, 1], [30.0, 10.0, 60.0])
    assert list(failed) == [1]
    assert (cpu.read_limit("a"), cpu.read_limit("b")) == (30.0, 60.0)
