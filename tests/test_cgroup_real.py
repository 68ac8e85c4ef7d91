"""The CPU backend on this machine's real cgroups: a busy process, a quota, real throttling."""

from __future__ import annotations

import subprocess
import time

import pytest
from conftest import BUSY

from kuscale.backends.base import CgroupGone
from kuscale.backends.cgroup import CgroupV1, CgroupV2


@pytest.mark.v2_kernel
def test_quota_throttles_a_real_busy_process(real_cgroups: tuple[CgroupV1 | CgroupV2, str]) -> None:
    cgroups, parent = real_cgroups
    name = f"{parent}/busy"
    cgroups.create(name)
    assert cgroups.is_empty(name)
    cgroups.write_limit(name, 20.0)
    assert cgroups.read_limit(name) == pytest.approx(20.0)
    process = subprocess.Popen(BUSY)
    try:
        cgroups.attach(name, process.pid)
        assert not cgroups.is_empty(name)
        before, started = cgroups.read(name), time.monotonic()
        time.sleep(1.5)
        after, elapsed = cgroups.read(name), time.monotonic() - started
    finally:
        process.kill()
        process.wait()
    usage = (after.usage_ns - before.usage_ns) * 100.0 / (elapsed * 1e9)
    assert 10.0 < usage < 30.0
    assert after.nr_throttled > before.nr_throttled
    assert after.throttled_ns > before.throttled_ns
    cgroups.write_limit(name, None)
    assert cgroups.read_limit(name) is None


def test_remove_takes_the_cgroup_out_of_every_hierarchy(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    name = f"{parent}/gone"
    cgroups.create(name)
    assert cgroups.exists(name)
    cgroups.remove(name)
    assert not cgroups.exists(name)
    assert not (cgroups.usage_root / name).exists()
    cgroups.remove(name)


def test_kept_descriptors_see_fresh_counters_and_a_removed_cgroup_is_gone(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    name = f"{parent}/kept"
    cgroups.create(name)
    first = cgroups.read(name)
    process = subprocess.Popen(BUSY)
    try:
        cgroups.attach(name, process.pid)
        time.sleep(0.3)
        assert cgroups.read(name).usage_ns > first.usage_ns
    finally:
        process.kill()
        process.wait()
    for root in {cgroups.cpu_root, cgroups.usage_root}:
        (root / name).rmdir()
    with pytest.raises(CgroupGone):
        cgroups.read(name)
    cgroups.create(name)
    assert cgroups.read(name).usage_ns == 0
