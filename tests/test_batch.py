"""Reading and writing many cgroups at once: the same answers as one at a time, and a
failure stays with its own cgroup."""

from __future__ import annotations

import math
import resource
from pathlib import Path

import numpy as np
from conftest import V1_CPU_FILES, V1_CPUACCT_FILES, V2_FILES, write_files
from hypothesis import given
from hypothesis import strategies as st

from kuscale.backends.base import BackendError, CgroupGone, CounterError, RangeError
from kuscale.backends.batch import each_cgroup
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.files import (
    SURE_COUNTER,
    allow_open_files,
    parse_counts,
    parse_int,
    parse_keyed,
    parse_keyed_many,
)
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
    counts, throttled_ns, _ = vectorised.read_throttled([1])
    assert (counts.tolist()[0], throttled_ns.tolist()[0]) == cpu.read_throttled("b")
    failed = vectorised.write_limits([0, 2, 1], [30.0, 10.0, 60.0])
    assert list(failed) == [1]
    assert (cpu.read_limit("a"), cpu.read_limit("b")) == (30.0, 60.0)


def kernel_files(root: Path, cgroup: str, usage: str, stat: str) -> None:
    write_files(root / "cpu" / cgroup, {**V1_CPU_FILES, "cpu.stat": stat})
    write_files(root / "cpuacct" / cgroup, {**V1_CPUACCT_FILES, "cpuacct.usage": usage})


STAT = "nr_periods {}\nnr_throttled {}\nthrottled_time 0\n"


def test_garbage_in_one_cgroup_fails_it_alone_and_the_rest_read_at_full_speed(
    v1_tree: CgroupV1, tmp_path: Path
) -> None:
    kernel_files(tmp_path, "pods/b", "7\n", STAT.format(5, 1))
    kernel_files(tmp_path, "pods/c", "-3\n", STAT.format(6, 2))
    kernel_files(tmp_path, "pods/d", "9\n", "nr_periods x\nnr_throttled 1\n")
    kernel_files(tmp_path, "pods/e", "11\n", STAT.format(2**63, 0))
    kernel_files(tmp_path, "pods/f", "13\n", STAT.format(8, 3))
    cgroups = ["pods/a", "pods/b", "pods/c", "pods/d", "pods/e", "pods/f"]
    fast = v1_tree.cgroup_set(cgroups)
    counters = fast.read([5, 0, 1, 2, 3, 4])
    assert counters.usage_ns.tolist()[:3] == [13, 123456789, 7]
    assert counters.nr_periods.tolist()[:3] == [8, 10, 5]
    assert counters.nr_throttled.tolist()[:3] == [3, 2, 1]
    assert sorted(counters.failed) == [3, 4, 5]
    assert all(isinstance(err, CounterError) for err in counters.failed.values())
    slow = each_cgroup(v1_tree, cgroups).read([5, 0, 1, 2, 3, 4])
    assert [str(err) for err in slow.failed.values()] == [
        str(err) for err in counters.failed.values()
    ]
    throttled, throttled_ns, failed = fast.read_throttled([1, 3, 5])
    assert throttled.tolist() == [1, 1, 3] and not failed
    assert throttled_ns.tolist() == [0, 0, 0]


def test_a_set_reads_the_right_files_after_the_cache_closed_and_reused_descriptors(
    v1_tree: CgroupV1, tmp_path: Path
) -> None:
    names = [f"pods/p{i}" for i in range(6)]
    for i, name in enumerate(names):
        kernel_files(tmp_path, name, f"{i}\n", STAT.format(i, i))
    fast = v1_tree.cgroup_set(names)
    assert fast.read(range(6)).usage_ns.tolist() == list(range(6))
    for name in reversed(names):
        v1_tree.read(name)
    v1_tree.descriptors.size = 1
    assert fast.read(range(6)).usage_ns.tolist() == list(range(6))
    assert fast.read_throttled([4, 2])[0].tolist() == [4, 2]
    small = CgroupV1(v1_tree.cpu_root, v1_tree.usage_root)
    fresh = small.cgroup_set(names)
    small.descriptors.size = 1
    assert fresh.read(range(6)).nr_periods.tolist() == list(range(6))
    assert fresh.write_limits(range(6), [10.0 + i for i in range(6)]) == {}
    assert [small.read_limit(name) for name in names] == [10.0 + i for i in range(6)]


def test_a_set_writes_quotas_for_the_period_each_cgroup_holds_now(
    v1_tree: CgroupV1, tmp_path: Path
) -> None:
    kernel_files(tmp_path, "pods/b", "1\n", STAT.format(1, 0))
    fast = v1_tree.cgroup_set(["pods/a", "pods/b", "pods/gone"])
    assert fast.write_limits([0, 1], [40.0, 40.0]) == {}
    (tmp_path / "cpu" / "pods" / "b" / "cpu.cfs_period_us").write_text("50000\n")
    failed = fast.write_limits([0, 1, 2], [30.0, 30.0, 30.0])
    assert list(failed) == [2] and isinstance(failed[2], CgroupGone)
    assert (tmp_path / "cpu" / "pods" / "a" / "cpu.cfs_quota_us").read_text() == "30000"
    assert (tmp_path / "cpu" / "pods" / "b" / "cpu.cfs_quota_us").read_text() == "15000"
    refused = fast.write_limits([0, 1], [0.5, math.nan])
    assert sorted(refused) == [0, 1] and all(isinstance(e, RangeError) for e in refused.values())
    assert (tmp_path / "cpu" / "pods" / "a" / "cpu.cfs_quota_us").read_text() == "30000"
    kernel_files(tmp_path, "pods/c", "1\n", STAT.format(1, 0))
    unwritable = tmp_path / "cpu" / "pods" / "c" / "cpu.cfs_quota_us"
    unwritable.unlink()
    unwritable.mkdir()
    mixed = v1_tree.cgroup_set(["pods/a", "pods/b", "pods/c"]).write_limits(
        [0, 2, 1], [math.inf, 20.0, 20.0]
    )
    assert isinstance(mixed[0], RangeError) and not isinstance(mixed[1], RangeError)
    assert len(mixed) == 2
    assert (tmp_path / "cpu" / "pods" / "b" / "cpu.cfs_quota_us").read_text() == "10000"


def test_a_v2_set_reads_usage_in_microseconds_and_writes_cpu_max(
    v2_tree: CgroupV2, tmp_path: Path
) -> None:
    write_files(tmp_path / "pods" / "b", {**V2_FILES, "cpu.stat": "nr_periods 1\n"})
    fast = v2_tree.cgroup_set(["pods/a", "pods/b"])
    counters = fast.read([0, 1])
    assert (counters.usage_ns[0], counters.nr_throttled[0]) == (2_000_000, 3)
    assert list(counters.failed) == [1]
    assert fast.write_limits([0], [25.0]) == {}
    assert (tmp_path / "pods" / "a" / "cpu.max").read_text() == "25000 100000"


counter_text = st.one_of(
    st.integers(0, 2**64).map(str),
    st.sampled_from(["", " ", "+5", "-1", "1_0", "1 2", "x", "٣", "9" * 19]),
)


@given(st.lists(st.tuples(counter_text, st.sampled_from(["\n", "", " \n"])), max_size=6))
def test_counters_parsed_at_once_agree_with_one_at_a_time(files: list[tuple[str, str]]) -> None:
    texts = [(value + end).encode() for value, end in files]
    alone: list[int | None] = []
    for text in texts:
        try:
            alone.append(parse_int(text.decode("ascii", "replace"), "f"))
        except CounterError:
            alone.append(None)
    together = parse_counts(texts)
    if together is not None:
        assert together.tolist() == alone
    else:
        unsure = any(value is not None and value >= SURE_COUNTER for value in alone)
        assert None in alone or unsure


@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(["a", "b", "|", "c", "c2"]), counter_text), max_size=3),
        max_size=5,
    )
)
def test_keyed_files_parsed_at_once_agree_with_one_at_a_time(
    files: list[list[tuple[str, str]]],
) -> None:
    texts = ["".join(f"{key} {value}\n" for key, value in lines).encode() for lines in files]
    alone: list[dict[str, int] | None] = []
    for text in texts:
        try:
            alone.append(parse_keyed(text.decode("ascii", "replace"), "f"))
        except CounterError:
            alone.append(None)
    together = parse_keyed_many(texts, (b"a", b"b"))
    if together is not None:
        assert all(parsed is not None for parsed in alone)
        assert [values.tolist() for values in together] == [
            [p.get(key, 0) for p in alone if p is not None] for key in "ab"
        ]
    elif all(parsed is not None for parsed in alone):
        layouts = {tuple(text.split()[::2]) for text in texts}
        long_values = any(len(field) >= 19 for text in texts for field in text.split())
        digit_keys = any(b"c2" in text for text in texts)
        assert len(layouts) > 1 or long_values or digit_keys


def test_files_that_only_numpys_reader_would_misread_are_left_to_the_checked_path() -> None:
    assert parse_counts([b"\n", b"5\n"]) is None  # numpy reads a blank first field as 0
    assert parse_counts([b"5\n", b" "]) is None
    assert parse_counts([b"1 2", b""]) is None
    assert parse_counts([b"1|2", b"3"]) is None
    assert parse_counts([b"1" * 19]) is None  # may not fit in 64 bits: judged alone
    assert parse_keyed_many([b"a 1\n\x0ca 2\n", b"a 3\n"], (b"a",)) is None
    assert parse_keyed_many([b"a 1\n", b"", b"a 2\na 3\n"], (b"a",)) is None
    assert parse_keyed_many([b"a 1\n", b"a 22222222222222222222\n"], (b"a",)) is None
    assert parse_keyed_many([b"a1 1\n", b"a1 2\n"], (b"a1",)) is None


def test_the_agent_may_keep_as_many_files_open_as_the_hard_limit_allows() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, soft)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        allowed = allow_open_files()
        assert allowed == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert allowed > lowered or hard == lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
