"""cgroup v1 and v2 backends against trees shaped like the kernel's files."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import write_files

from kuscale.backends.base import BackendError, CgroupGone, CounterError, RangeError
from kuscale.backends.cgroup import (
    CgroupV1,
    CgroupV2,
    Mount,
    detect,
    limit_to_quota,
    read_mounts,
    shares_to_weight,
    weight_to_shares,
)
from kuscale.backends.files import confine
from kuscale.backends.pressure import Pressure
from kuscale.model import MAX_SHARES, MIN_SHARES, CpuCounters


def test_v1_reads_usage_from_cpuacct_and_throttling_from_cpu(v1_tree: CgroupV1) -> None:
    assert v1_tree.read("pods/a") == CpuCounters(123456789, 10, 2, 5000000)


def test_v1_quota_round_trip(v1_tree: CgroupV1) -> None:
    assert v1_tree.read_limit("pods/a") is None
    v1_tree.write_limit("pods/a", 150.0)
    assert (v1_tree.cpu_root / "pods/a/cpu.cfs_quota_us").read_text() == "150000"
    assert v1_tree.read_limit("pods/a") == pytest.approx(150.0)
    v1_tree.write_limit("pods/a", None)
    assert (v1_tree.cpu_root / "pods/a/cpu.cfs_quota_us").read_text() == "-1"


def test_v1_quota_follows_the_cgroup_period(v1_tree: CgroupV1) -> None:
    (v1_tree.cpu_root / "pods/a/cpu.cfs_period_us").write_text("50000\n")
    v1_tree.write_limit("pods/a", 40.0)
    assert (v1_tree.cpu_root / "pods/a/cpu.cfs_quota_us").read_text() == "20000"


def test_v2_reads_cpu_stat_in_microseconds(v2_tree: CgroupV2) -> None:
    assert v2_tree.read("pods/a") == CpuCounters(2_000_000, 7, 3, 900_000)


def test_v2_cpu_max_round_trip(v2_tree: CgroupV2) -> None:
    assert v2_tree.read_limit("pods/a") is None
    v2_tree.write_limit("pods/a", 25.0)
    assert (v2_tree.cpu_root / "pods/a/cpu.max").read_text() == "25000 100000"
    assert v2_tree.read_limit("pods/a") == pytest.approx(25.0)
    v2_tree.write_limit("pods/a", None)
    assert (v2_tree.cpu_root / "pods/a/cpu.max").read_text() == "max 100000"


def test_v2_create_delegates_the_cpu_controller(v2_tree: CgroupV2) -> None:
    v2_tree.create("pods/b")
    assert (v2_tree.cpu_root / "cgroup.subtree_control").read_text() == "+cpu"
    assert (v2_tree.cpu_root / "pods/cgroup.subtree_control").read_text() == "+cpu"
    assert (v2_tree.cpu_root / "pods/b").is_dir()


@pytest.mark.parametrize("limit", [math.nan, math.inf, -5.0, 0.0, 0.5])
def test_out_of_range_limits_are_refused_before_writing(v1_tree: CgroupV1, limit: float) -> None:
    with pytest.raises(RangeError):
        v1_tree.write_limit("pods/a", limit)
    assert (v1_tree.cpu_root / "pods/a/cpu.cfs_quota_us").read_text() == "-1\n"


def test_a_period_outside_the_kernel_range_is_refused() -> None:
    with pytest.raises(RangeError):
        limit_to_quota(50.0, 2_000_000)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("cpuacct.usage", "garbage\n"),
        ("cpuacct.usage", "-5\n"),
        ("cpuacct.usage", ""),
    ],
)
def test_garbage_counters_raise_counter_errors(v1_tree: CgroupV1, name: str, text: str) -> None:
    (v1_tree.usage_root / "pods/a" / name).write_text(text)
    with pytest.raises(CounterError):
        v1_tree.read("pods/a")


def test_garbage_in_cpu_stat_raises(v2_tree: CgroupV2) -> None:
    (v2_tree.cpu_root / "pods/a/cpu.stat").write_text("usage_usec lots\n")
    with pytest.raises(CounterError):
        v2_tree.read("pods/a")


def test_garbage_in_cpu_max_is_an_error_not_a_limit(v2_tree: CgroupV2) -> None:
    (v2_tree.cpu_root / "pods/a/cpu.max").write_text("fast\n")
    with pytest.raises(BackendError):
        v2_tree.read_limit("pods/a")
    with pytest.raises(BackendError):
        v2_tree.write_limit("pods/a", 50.0)


def test_a_missing_cgroup_is_gone(v1_tree: CgroupV1) -> None:
    with pytest.raises(CgroupGone):
        v1_tree.read("pods/missing")
    assert not v1_tree.exists("pods/missing")


@pytest.mark.parametrize(
    "name", ["../etc", "pods/../../x", "/abs", "", "pods//a", "a/./b", "pods/a b", "pods/a\n"]
)
def test_paths_never_escape_the_root(tmp_path: Path, name: str) -> None:
    with pytest.raises(BackendError):
        confine(tmp_path, name)


def test_confined_kubernetes_names_are_allowed(tmp_path: Path) -> None:
    name = (
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_5678.slice/"
        "cri-containerd-abc123.scope"
    )
    assert confine(tmp_path, name) == str(tmp_path / name)


def test_detect_prefers_v1_cpu_and_cpuacct(tmp_path: Path) -> None:
    mounts = [
        Mount(tmp_path / "cpu", "cgroup", frozenset({"rw", "cpu"})),
        Mount(tmp_path / "cpuacct", "cgroup", frozenset({"rw", "cpuacct"})),
        Mount(tmp_path / "unified", "cgroup2", frozenset({"rw"})),
    ]
    backend = detect(mounts)
    assert isinstance(backend, CgroupV1)
    assert backend.cpu_root == tmp_path / "cpu"
    assert backend.usage_root == tmp_path / "cpuacct"


def test_detect_v2_only_where_the_cpu_controller_is_enabled(tmp_path: Path) -> None:
    write_files(tmp_path / "hugetlb-only", {"cgroup.controllers": "hugetlb\n"})
    write_files(tmp_path / "full", {"cgroup.controllers": "cpuset cpu io memory pids\n"})
    mounts = [
        Mount(tmp_path / "hugetlb-only", "cgroup2", frozenset()),
        Mount(tmp_path / "full", "cgroup2", frozenset()),
    ]
    backend = detect(mounts)
    assert isinstance(backend, CgroupV2)
    assert backend.cpu_root == tmp_path / "full"
    with pytest.raises(BackendError):
        detect(mounts[:1])


def test_read_mounts_parses_mountinfo(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        "31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "22 1 0:5 / /proc rw - proc proc rw\n"
    )
    mounts = read_mounts(mountinfo)
    assert [m.path for m in mounts] == [
        Path("/sys/fs/cgroup/cpu,cpuacct"),
        Path("/sys/fs/cgroup/unified"),
    ]
    assert {"cpu", "cpuacct"} <= mounts[0].options


def test_v1_shares_round_trip_and_range(v1_tree: CgroupV1) -> None:
    assert v1_tree.read_shares("pods/a") == 1024
    v1_tree.write_shares("pods/a", 3072)
    assert (v1_tree.cpu_root / "pods/a/cpu.shares").read_text() == "3072"
    with pytest.raises(RangeError):
        v1_tree.write_shares("pods/a", 1)


def test_v2_weight_follows_the_kubelet_mapping(v2_tree: CgroupV2) -> None:
    v2_tree.write_shares("pods/a", 1024)
    assert (v2_tree.cpu_root / "pods/a/cpu.weight").read_text() == "39"
    v2_tree.write_shares("pods/a", 262144)
    assert (v2_tree.cpu_root / "pods/a/cpu.weight").read_text() == "10000"
    assert v2_tree.read_shares("pods/a") == 262144


def test_cpu_pressure_totals_are_read_and_garbage_is_refused(v2_tree: CgroupV2) -> None:
    pressure = v2_tree.cpu_root / "pods" / "a" / "cpu.pressure"
    pressure.write_text(
        "some avg10=1.50 avg60=0.20 avg300=0.00 total=123456\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=789\n"
    )
    assert v2_tree.read_pressure("pods/a") == Pressure(123456, 789)
    pressure.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    assert v2_tree.read_pressure("pods/a") == Pressure(5, 0)
    pressure.write_text("some total=lots\n")
    with pytest.raises(BackendError, match="no 'some"):
        v2_tree.read_pressure("pods/a")
    with pytest.raises(BackendError):
        v2_tree.read_pressure("pods/gone")


@pytest.mark.parametrize(
    ("stall_us", "window_us"),
    [(100_000, 499_999), (100_000, 10_000_001), (0, 1_000_000), (1_000_001, 1_000_000)],
)
def test_a_psi_trigger_outside_the_kernel_rules_is_refused_before_opening(
    v2_tree: CgroupV2, stall_us: int, window_us: int
) -> None:
    with pytest.raises(RangeError):
        v2_tree.pressure_trigger("pods/a", stall_us, window_us)


def test_a_psi_trigger_on_a_missing_cgroup_or_an_escaping_name_is_an_error(
    v2_tree: CgroupV2,
) -> None:
    with pytest.raises(BackendError, match="cannot open"):
        v2_tree.pressure_trigger("pods/gone", 100_000, 1_000_000)
    with pytest.raises(BackendError, match="not allowed"):
        v2_tree.pressure_trigger("../etc", 100_000, 1_000_000)


def test_every_weight_given_back_through_shares_is_the_weight_read() -> None:
    """A v2 weight is recorded as shares and given back as a weight: the round trip must
    not drift (weight 100 came back 99 once, and 98 after a second agent)."""
    weights = np.arange(1, 10001)
    back = [shares_to_weight(weight_to_shares(int(w))) for w in weights]
    assert back == weights.tolist()
    assert weight_to_shares(1) == MIN_SHARES and weight_to_shares(10000) == MAX_SHARES
