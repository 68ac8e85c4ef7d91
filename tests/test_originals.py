"""The durable record of originals: written before any change, read by a restarted agent,
given back by `kuscale restore`; a record that cannot be written refuses the pod."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import V1_CPU_FILES, V1_CPUACCT_FILES, write_files

from kuscale import originals
from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.vgpu import VgpuLayer
from kuscale.cli import main
from kuscale.config import AgentConfig
from kuscale.local.launch import born_within_budget
from kuscale.local.statedir import StateDir
from kuscale.model import ContainerLimit, Held, Original, PodSpec, PodStatus, Resource
from kuscale.monitor import RECORD_GRACE, Monitor, PodAdded
from kuscale.originals import OriginalsRecord, RecordBusy, RecordError

CONFIG = AgentConfig(period=0.5)
ORIGINAL = Original(
    key="default/web-0.cache",
    uid="u-1",
    cgroup="kubepods/burstable/podu1",
    held=Held(80.0, (ContainerLimit("kubepods/burstable/podu1/c1", 50.0, 25.0),)),
    shares=2048,
    vgpu_id="kuscale-0",
    gpu_limit=40.0,
)


def test_an_entry_reads_back_as_written_and_goes_when_dropped(tmp_path: Path) -> None:
    record = OriginalsRecord(tmp_path / "originals")
    record.save(ORIGINAL)
    assert record.get(ORIGINAL.key) == ORIGINAL
    assert list(record.entries()) == [ORIGINAL]
    assert not list((tmp_path / "originals").glob(".*.tmp"))
    record.drop(ORIGINAL.key)
    assert record.get(ORIGINAL.key) is None
    assert list(record.entries()) == []


@pytest.mark.parametrize(
    "change",
    [
        {"pod_limit": float("nan")},
        {"pod_limit": -5},
        {"shares": 1},
        {"shares": "many"},
        {"cgroup": "../../etc"},
        {"cgroup": "/abs"},
        {"key": "no-namespace"},
        {"vgpu_id": "../x"},
        {"containers": [{"name": "a/../../b", "limit": 1, "request": 0}]},
        {"containers": [{"name": "a/b", "limit": 1, "request": -1}]},
        {"actuator": "ssh"},
    ],
)
def test_an_entry_with_garbage_is_skipped_never_given_back(
    tmp_path: Path, change: dict[str, object]
) -> None:
    record = OriginalsRecord(tmp_path)
    record.save(ORIGINAL)
    path = record.path(ORIGINAL.key)
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    assert record.get(ORIGINAL.key) is None
    assert list(record.entries()) == []


def test_files_that_are_not_entries_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "local_x.json").write_text("{not json")
    assert list(OriginalsRecord(tmp_path).entries()) == []


def test_one_agent_holds_the_record(tmp_path: Path) -> None:
    first, second = OriginalsRecord(tmp_path), OriginalsRecord(tmp_path)
    first.lock()
    assert second.busy()
    with pytest.raises(RecordBusy):
        second.lock()
    first.unlock()
    assert not second.busy()


def v1_pod(root: Path, quota: str = "-1\n") -> CgroupV1:
    write_files(root / "cpu" / "pods" / "web", {**V1_CPU_FILES, "cpu.cfs_quota_us": quota})
    write_files(root / "cpuacct" / "pods" / "web", V1_CPUACCT_FILES)
    return CgroupV1(root / "cpu", root / "cpuacct")


SPEC = PodSpec(name="web", tokens=30, cgroup="pods/web", uid="u-web")


def test_an_agent_that_crashed_is_followed_by_one_that_gives_back_the_truth(
    tmp_path: Path,
) -> None:
    cgroups = v1_pod(tmp_path / "tree")
    record = OriginalsRecord(tmp_path / "record")
    first = Monitor(cgroups, None, CONFIG, originals=record)
    first.submit(PodAdded(SPEC))
    first.tick(0.0)
    assert record.get(SPEC.key) is not None
    assert cgroups.read_limit("pods/web") == pytest.approx(10.0)
    assert cgroups.read_shares("pods/web") == 307
    # The first agent dies here without restoring anything; a second one starts.
    second = Monitor(cgroups, None, CONFIG, originals=record)
    second.submit(PodAdded(SPEC))
    second.tick(10.0)
    assert second.registry.running[SPEC.key].status is PodStatus.RUNNING
    second.restore()
    assert cgroups.read_limit("pods/web") is None
    assert cgroups.read_shares("pods/web") == 1024
    assert record.get(SPEC.key) is None


class UnwritableRecord(OriginalsRecord):
    def save(self, original: Original) -> None:
        raise RecordError("No space left on device")


def test_a_record_that_cannot_be_written_refuses_the_pod_and_changes_nothing(
    tmp_path: Path,
) -> None:
    cgroups = v1_pod(tmp_path, quota="50000\n")
    monitor = Monitor(cgroups, None, CONFIG, originals=UnwritableRecord(tmp_path / "record"))
    monitor.submit(PodAdded(SPEC))
    monitor.tick(0.0)
    refused = monitor.registry.completed[SPEC.key]
    assert refused.status is PodStatus.REFUSED
    assert "cannot be recorded" in refused.reason
    assert monitor.stats.errors["record"] == 1
    assert cgroups.read_limit("pods/web") == pytest.approx(50.0)
    assert cgroups.read_shares("pods/web") == 1024


def test_entries_no_source_offers_again_are_given_back_after_the_grace(tmp_path: Path) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="20000\n")
    record = OriginalsRecord(tmp_path / "record")
    record.save(Original(key="local/web", uid="u", cgroup="pods/web", held=Held(None), shares=512))
    record.save(Original(key="local/gone", uid="u", cgroup="pods/gone", held=Held(30.0)))
    monitor = Monitor(cgroups, None, CONFIG, originals=record)
    monitor.tick(0.0)
    assert record.get("local/gone") is None
    assert record.get("local/web") is not None
    monitor.tick(RECORD_GRACE)
    assert record.get("local/web") is None
    assert cgroups.read_limit("pods/web") is None
    assert cgroups.read_shares("pods/web") == 512


def test_a_monitor_only_agent_gives_back_what_kuscale_set_before_it(tmp_path: Path) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record")
    record.save(Original(key=SPEC.key, uid=SPEC.uid, cgroup=SPEC.cgroup, held=Held(None)))
    monitor = Monitor(cgroups, None, AgentConfig(monitor_only=True), originals=record)
    monitor.submit(PodAdded(SPEC))
    monitor.tick(0.0)
    assert cgroups.read_limit("pods/web") is None
    assert record.get(SPEC.key) is None
    assert monitor.registry.running[SPEC.key].resources[Resource.CPU].limit > 0


def test_restore_gives_back_a_real_cgroup_and_refuses_while_an_agent_runs(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cgroups, parent = real_cgroups
    cgroup = f"{parent}/left"
    cgroups.create(cgroup)
    cgroups.write_limit(cgroup, 30.0)
    record = OriginalsRecord(tmp_path / "record")
    record.save(Original(key="local/left", uid="u", cgroup=cgroup, held=Held(None)))
    agent = OriginalsRecord(tmp_path / "record")
    agent.lock()
    assert main(["restore", "--record-dir", str(tmp_path / "record")]) == 2
    assert "an agent is running" in capsys.readouterr().err
    assert cgroups.read_limit(cgroup) == pytest.approx(30.0)
    agent.unlock()
    assert main(["restore", "--record-dir", str(tmp_path / "record")]) == 0
    assert cgroups.read_limit(cgroup) is None
    assert record.get("local/left") is None


def test_the_limit_the_api_server_declares_wins_over_the_record(tmp_path: Path) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record")
    declared = PodSpec(name="web", tokens=30, cgroup="pods/web", uid="u-web", declared_cpu=80.0)
    record.save(Original(key=SPEC.key, uid=SPEC.uid, cgroup=SPEC.cgroup, held=Held(None)))
    monitor = Monitor(cgroups, None, CONFIG, originals=record)
    monitor.submit(PodAdded(declared))
    monitor.tick(0.0)
    monitor.restore()
    assert cgroups.read_limit("pods/web") == pytest.approx(80.0)


LAUNCHED = Original(
    key=SPEC.key, uid=SPEC.uid, cgroup=SPEC.cgroup, held=Held(None), shares=1024, launched=True
)
"""What `kuscale launch` records before it writes the quota its tokens buy (30 % here)."""


def test_a_stop_gives_back_a_launched_workload_no_tick_adopted_yet(tmp_path: Path) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record")
    record.save(LAUNCHED)
    monitor = Monitor(cgroups, None, CONFIG, originals=record)
    monitor.submit(PodAdded(SPEC))  # queued, never drained: the stop comes first
    monitor.restore()
    assert cgroups.read_limit("pods/web") is None
    assert cgroups.read_shares("pods/web") == 1024
    assert list(record.entries()) == []


def test_a_pod_refused_before_it_was_taken_over_gets_what_launch_recorded(
    tmp_path: Path,
) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record")
    record.save(LAUNCHED)
    monitor = Monitor(cgroups, None, CONFIG, originals=record)
    monitor.submit(PodAdded(PodSpec(name="web", tokens=30, cgroup="pods/web", vgpu_id="g")))
    monitor.tick(0.0)
    assert monitor.registry.completed[SPEC.key].status is PodStatus.REFUSED
    assert cgroups.read_limit("pods/web") is None
    assert record.get(SPEC.key) is None


class RefusingV1(CgroupV1):
    """A tree whose quota writes fail once `refusing` is set, as on a full disk or a
    permission change."""

    refusing = False

    def write_limit(self, cgroup: str, limit: float | None) -> None:
        if self.refusing:
            raise BackendError(f"cannot write the quota of {cgroup}: Permission denied")
        super().write_limit(cgroup, limit)


def test_a_stop_keeps_the_entry_of_a_pod_it_could_not_give_back(tmp_path: Path) -> None:
    v1_pod(tmp_path / "tree")
    cgroups = RefusingV1(tmp_path / "tree" / "cpu", tmp_path / "tree" / "cpuacct")
    record = OriginalsRecord(tmp_path / "record")
    monitor = Monitor(cgroups, None, CONFIG, originals=record)
    monitor.submit(PodAdded(SPEC))
    monitor.tick(0.0)
    cgroups.refusing = True
    monitor.restore()
    assert record.get(SPEC.key) is not None


def test_a_gpu_share_launch_did_not_record_survives_a_crash(tmp_path: Path) -> None:
    """Launch records a fresh cgroup, not the vGPU: the first agent records the share before
    it changes it, so the agent after a crash gives back that, not the dead agent's."""
    cgroups = v1_pod(tmp_path / "tree")
    vgpus = VgpuLayer(tmp_path / "vgpu", 1)
    vgpus.create("web")
    record = OriginalsRecord(tmp_path / "record")
    record.save(LAUNCHED)
    spec = PodSpec(name="web", tokens=60, cgroup="pods/web", uid=SPEC.uid, vgpu_id="web")
    first = Monitor(cgroups, vgpus, CONFIG, originals=record)
    first.submit(PodAdded(spec))
    first.tick(0.0)
    assert vgpus.read_limit("web") == pytest.approx(10.0)
    second = Monitor(cgroups, VgpuLayer(tmp_path / "vgpu", 1), CONFIG, originals=record)
    second.submit(PodAdded(spec))
    second.tick(10.0)
    second.restore()
    assert vgpus.read_limit("web") is None
    assert record.get(SPEC.key) is None


def test_a_stop_sweeps_the_record_even_where_the_launch_lock_cannot_be_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record")
    record.save(LAUNCHED)
    (tmp_path / "record" / "launch.lock").mkdir()
    Monitor(cgroups, None, CONFIG, originals=record).restore()
    assert cgroups.read_limit("pods/web") is None
    assert "going on without" in caplog.text


def launched_into(tmp_path: Path) -> tuple[StateDir, CgroupV1, PodSpec]:
    """A state dir and a fresh fixture cgroup, as `kuscale launch` has them at its record."""
    state = StateDir(tmp_path / "state").ensure()
    return state, v1_pod(tmp_path / "tree"), replace(SPEC, namespace="local")


def test_a_launch_with_no_agent_writes_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state, cgroups, spec = launched_into(tmp_path)
    born_within_budget(state, cgroups, spec)
    assert cgroups.read_limit(spec.cgroup) is None
    assert cgroups.read_shares(spec.cgroup) == 1024
    assert list(OriginalsRecord(state.originals).entries()) == []
    assert "runs unlimited until an agent adopts it" in caplog.text


def test_a_launch_beside_a_live_agent_is_recorded_then_born_within_budget(
    tmp_path: Path,
) -> None:
    state, cgroups, spec = launched_into(tmp_path)
    agent = OriginalsRecord(state.originals)
    agent.lock()
    born_within_budget(state, cgroups, spec)
    assert cgroups.read_limit(spec.cgroup) == pytest.approx(30.0)
    assert [o.key for o in agent.entries()] == [spec.key]


def test_after_a_stop_gives_the_record_back_a_launch_finds_no_agent(tmp_path: Path) -> None:
    """The stop lets go of the record inside the launch lock: a launch right after the
    sweep must not take the stopping agent for a live one and write a quota no one gives
    back."""
    state, cgroups, spec = launched_into(tmp_path)
    record = OriginalsRecord(state.originals)
    record.lock()
    Monitor(cgroups, None, CONFIG, originals=record).restore()
    assert not OriginalsRecord(state.originals).busy()
    born_within_budget(state, cgroups, spec)
    assert cgroups.read_limit(spec.cgroup) is None


def test_launches_in_flight_never_wait_for_one_another(tmp_path: Path) -> None:
    agent, launches = OriginalsRecord(tmp_path), OriginalsRecord(tmp_path)
    agent.lock()
    with launches.launch_section() as first, launches.launch_section() as second:
        assert first and second


def hold_launch_lock(directory: Path) -> subprocess.Popen[str]:
    """A process holding the launch lock shared, as a launch between its record and quota."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
            str(directory / "launch.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_lock_left_by_a_killed_launch_holds_up_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record").ensure()
    record.save(LAUNCHED)
    holder = hold_launch_lock(record.directory)
    holder.kill()
    holder.wait()
    Monitor(cgroups, None, CONFIG, originals=record).restore()
    assert cgroups.read_limit("pods/web") is None
    assert "in flight" not in caplog.text


def test_a_launch_stopped_in_its_section_holds_a_stop_only_so_long(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch stopped between its record and its quota (Ctrl-Z) delays a stop by at most
    LAUNCH_WAIT; then the record is given back anyway, and the log says what may stay."""
    monkeypatch.setattr(originals, "LAUNCH_WAIT", 0.3)
    cgroups = v1_pod(tmp_path / "tree", quota="30000\n")
    record = OriginalsRecord(tmp_path / "record").ensure()
    record.save(LAUNCHED)
    holder = hold_launch_lock(record.directory)
    try:
        holder.send_signal(signal.SIGSTOP)
        Monitor(cgroups, None, CONFIG, originals=record).restore()
    finally:
        holder.kill()
        holder.wait()
    assert cgroups.read_limit("pods/web") is None
    assert "in flight" in caplog.text
    assert "giving the record back without it" in caplog.text


def test_a_launch_behind_a_stop_that_hangs_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(originals, "LAUNCH_WAIT", 0.3)
    state, cgroups, spec = launched_into(tmp_path)
    OriginalsRecord(state.originals).lock()
    with OriginalsRecord(state.originals).launches_held():
        born_within_budget(state, cgroups, spec)
    assert cgroups.read_limit(spec.cgroup) is None
