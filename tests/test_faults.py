"""Every step is a fault point: the process that passes it stops itself there (SIGTERM, a
clean stop asked at that moment; or SIGKILL), and whatever comes next — nothing more, a
restarted agent's clean stop, or `kuscale restore` — leaves every workload on real cgroups as
it was before kuscale: no quota, the default weight, still running, the record empty, and a
second look finding nothing to give back.

Every scenario also holds a cgroup an earlier `kuscale launch` left with its first quota and
its entry but no workload registered, so the stop's sweep of the record is always at work."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import BUSY, KUSCALE, LocalNode, stretched, wait_for
from v2guest import FAULTS_ENV, in_guest

from kuscale import faults
from kuscale.backends.vgpu import GPU_LIMIT, MAX_PER_MILLE
from kuscale.cli import main
from kuscale.local.statedir import StateDir
from kuscale.model import Held, Original
from kuscale.originals import OriginalsRecord

ENDINGS = ("term", "kill-restart", "kill-restore")
AGENT = ("--metrics-address", "", "--gpus", "1")
"""The agent holds the workload's vGPU share too (a layer of files, as the original's module)."""
EXIT = 30.0
"""Seconds a process that stops itself at its point has to do so (stretched in the guest)."""


def status_by(node: LocalNode) -> bool:
    """The agent running now has written a status: it has ticked at least once."""
    status = node.status() or {}
    return node.agent is not None and status.get("pid") == node.agent.pid


def adopted(node: LocalNode, name: str) -> bool:
    pod = node.pod(name)
    return status_by(node) and pod is not None and pod["updated_count"] >= 1


def agent_exit(node: LocalNode) -> int:
    assert node.agent is not None
    return node.agent.wait(timeout=stretched(EXIT))


def clean_stop(node: LocalNode) -> None:
    assert node.agent is not None
    node.agent.send_signal(signal.SIGTERM)
    assert agent_exit(node) == 0


def kill(node: LocalNode) -> None:
    assert node.agent is not None
    node.agent.kill()
    node.agent.wait()


def restore(node: LocalNode, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KUSCALE, "restore", "--state-dir", str(node.state)],
        capture_output=True,
        text=True,
        timeout=stretched(EXIT),
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def restart_and_stop(node: LocalNode, workload: str | None) -> None:
    node.start_agent(*AGENT)
    wait_for(lambda: adopted(node, workload) if workload else status_by(node), timeout=30)
    clean_stop(node)


def left_by_an_earlier_launch(node: LocalNode) -> str:
    """A cgroup with the quota launch gives and the entry it records, whose launcher died
    before it registered: only the record knows it."""
    cgroup = f"{node.parent}/left"
    node.cgroups.create(cgroup)
    OriginalsRecord(node.state / "originals").save(
        Original(
            key="local/left",
            uid="u-left",
            cgroup=cgroup,
            held=Held(node.cgroups.read_limit(cgroup)),
            shares=node.cgroups.read_shares(cgroup),
            launched=True,
        )
    )
    node.cgroups.write_limit(cgroup, 30.0)
    node.cgroups.write_shares(cgroup, 307)
    return cgroup


@contextmanager
def busy_workload(node: LocalNode) -> Iterator[subprocess.Popen[bytes]]:
    workload = node.launch("busy", 60, BUSY, gpu=True)
    try:
        cgroup = f"{node.parent}/busy"
        wait_for(lambda: node.cgroups.exists(cgroup) and not node.cgroups.is_empty(cgroup), 15)
        wait_for(lambda: StateDir(node.state).registration("busy").exists(), 15, interval=0.05)
        yield workload
    finally:
        workload.kill()
        workload.wait()


def follow(node: LocalNode, ending: str, workload: str | None) -> None:
    """What comes after the fault, the faulted process gone or stopping by itself."""
    if ending == "kill-restart":
        restart_and_stop(node, workload)
    elif ending == "kill-restore":
        done = restore(node)
        assert done.returncode == 0, done.stderr


def fault_in_launch(node: LocalNode, point: str, ending: str, fault: dict[str, str]) -> None:
    node.start_agent(*AGENT)
    wait_for(lambda: status_by(node), timeout=30)
    launcher = node.launch("busy", 60, BUSY, env=fault, gpu=True)
    try:
        code = launcher.wait(timeout=stretched(EXIT))
    finally:
        launcher.kill()
    assert code in (-signal.SIGTERM, -signal.SIGKILL), f"launch passed {point} and exited {code}"
    if ending == "term":
        clean_stop(node)
    else:
        kill(node)
        follow(node, ending, None)


def fault_in_agent(
    node: LocalNode, point: str, ending: str, fault: dict[str, str], action: str
) -> None:
    node.start_agent(*AGENT, env=fault)
    if point.startswith("stop."):
        wait_for(lambda: adopted(node, "busy"), timeout=30)
        assert node.agent is not None
        node.agent.send_signal(signal.SIGTERM)
    code = agent_exit(node)
    assert code == (0 if action == "term" else -signal.SIGKILL), f"at {point}: exit {code}"
    follow(node, ending, "busy")


def fault_in_restore(node: LocalNode, ending: str, fault: dict[str, str]) -> None:
    node.start_agent(*AGENT)
    wait_for(lambda: adopted(node, "busy"), timeout=30)
    kill(node)
    faulted = restore(node, env=fault)
    assert faulted.returncode in (-signal.SIGTERM, -signal.SIGKILL), faulted.stderr
    follow(node, "kill-restore" if ending == "term" else ending, "busy")


def fresh_shares(node: LocalNode) -> int:
    """What a cgroup nobody changed reads as (1024 on v1; weight 100 on v2)."""
    probe = f"{node.parent}/probe"
    node.cgroups.create(probe)
    try:
        return node.cgroups.read_shares(probe)
    finally:
        node.cgroups.remove(probe)


def nothing_left(
    node: LocalNode, workloads: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = fresh_shares(node)
    for name in ("busy", "left"):
        cgroup = f"{node.parent}/{name}"
        if node.cgroups.exists(cgroup):
            found = (node.cgroups.read_limit(cgroup), node.cgroups.read_shares(cgroup))
            assert found == (None, fresh), f"{cgroup}: quota and shares {found}, not {fresh}"
    gpu_limit = StateDir(node.state).vgpu / "busy" / GPU_LIMIT
    if gpu_limit.exists():
        assert int(gpu_limit.read_text()) == MAX_PER_MILLE, "the vGPU keeps a share kuscale set"
    assert all(w.poll() is None for w in workloads), "a workload died"
    assert list(OriginalsRecord(node.state / "originals").entries()) == []
    capsys.readouterr()
    assert main(["restore", "--state-dir", str(node.state)]) == 0
    assert "given back" not in capsys.readouterr().out


GUEST_CASES = {
    ("launch.quota_written", "term"),
    ("tick.written", "kill-restart"),
    ("stop.record_dropped", "kill-restore"),
}
"""What `make test` asks of the emulated guest, where a case takes about fifty seconds: one
case per ending, at a launch, a tick and a stop. `KUSCALE_FAULT_GUEST=all` runs all 51."""


def guest_skips(point: str, ending: str) -> bool:
    return in_guest() and os.environ.get(FAULTS_ENV) != "all" and (point, ending) not in GUEST_CASES


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("point", list(faults.POINTS))
@pytest.mark.v2_kernel
def test_nothing_is_left_behind_when_a_process_stops_at(
    node: LocalNode, point: str, ending: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if guest_skips(point, ending):
        pytest.skip(
            f"make test runs {len(GUEST_CASES)} cases in the guest; {FAULTS_ENV}=all runs all"
        )
    action = "term" if ending == "term" else "kill"
    fault = {faults.FAULT_ENV: f"{point}:1:{action}"}
    left_by_an_earlier_launch(node)
    if point.startswith("launch."):
        fault_in_launch(node, point, ending, fault)
        nothing_left(node, [], capsys)
        return
    with busy_workload(node) as workload:
        if point.startswith("restore."):
            fault_in_restore(node, ending, fault)
        else:
            fault_in_agent(node, point, ending, fault, action)
        nothing_left(node, [workload], capsys)


def test_every_fault_point_is_passed_somewhere_in_the_code() -> None:
    from pathlib import Path

    source = "".join(p.read_text() for p in Path(faults.__file__).parent.rglob("*.py"))
    for point in faults.POINTS:
        assert f'faults.reached("{point}")' in source, point


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tick.nowhere", "names no fault point"),
        ("tick.sampled:0", "must be a number >= 1"),
        ("tick.sampled:two", "must be a number >= 1"),
        ("tick.sampled:1:explode", "the action is one of"),
    ],
)
def test_a_fault_that_names_no_point_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, value)
    assert main(["status", "--state-dir", "/nonexistent"]) == 2
    assert message in capsys.readouterr().err


def test_a_fault_in_a_production_start_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "tick.sampled")
    monkeypatch.setenv(faults.IN_POD_ENV, "10.96.0.1")
    assert main(["status", "--state-dir", "/nonexistent"]) == 2
    assert "fault points are for tests only" in capsys.readouterr().err
    monkeypatch.delenv(faults.FAULT_ENV)
    faults.arm_from_environment()
