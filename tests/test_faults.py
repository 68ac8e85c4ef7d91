"""Every step is a fault point: the process that passes it stops itself there (SIGTERM, a
clean stop asked at that moment; or SIGKILL), and whatever comes next — nothing more, a
restarted agent's clean stop, or `kuscale restore` — leaves every workload on real cgroups as
it was before kuscale: no quota, the default weight, still running, the record empty, and a
second look finding nothing to give back.

Every scenario also holds a cgroup an earlier `kuscale launch` left with its first quota and
its entry but no workload registered, so the stop's sweep of the record is always at work."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


LAUNCH_POINTS = [p for p in faults.POINTS if p.startswith("launch.")]
IN_LAUNCH_SECTION = ("launch.recorded", "launch.quota_written")
"""The points a launch passes holding the launch lock: a stop or a restore waits for it."""
GUEST_INTERLEAVINGS = {("launch.recorded", "term")}
"""The interleaving `make test` asks of the emulated guest (about fifty seconds a case
there): a stop that must wait for the launch lock. `KUSCALE_FAULT_GUEST=all` runs all 15."""


def paused(process: subprocess.Popen[bytes]) -> bool:
    """The process stopped itself at its fault point: state T in /proc/PID/stat."""
    assert process.poll() is None, f"the launch exited with {process.returncode} before its point"
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


def gone_or_waiting(process: subprocess.Popen[bytes], log: Path) -> bool:
    """The process has exited, or logged that it waits for a launch in flight."""
    return process.poll() is not None or "in flight" in log.read_text(errors="replace")


def restore_in_background(node: LocalNode, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as output:
        return subprocess.Popen(
            [*KUSCALE, "restore", "--state-dir", str(node.state)], stdout=output, stderr=output
        )


def agent_event(node: LocalNode, ending: str, log: Path) -> subprocess.Popen[bytes] | None:
    """What happens to the agent while the launch is held: SIGTERM, or SIGKILL and then
    `kuscale restore` or nothing yet; the process that must get past the launch, if any."""
    assert node.agent is not None
    if ending == "term":
        node.agent.send_signal(signal.SIGTERM)
        return node.agent
    kill(node)
    return restore_in_background(node, log) if ending == "kill-restore" else None


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("point", LAUNCH_POINTS)
@pytest.mark.v2_kernel
def test_a_launch_held_at_a_step_while_the_agent_stops_or_dies_leaves_nothing_behind(
    node: LocalNode, point: str, ending: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two processes: the launch stops itself at `point` (SIGSTOP, holding whatever lock it
    holds there); the agent is stopped or killed; then the launch goes on and execs its
    workload. Either an agent took the workload over, or it runs as it was born."""
    if (
        in_guest()
        and os.environ.get(FAULTS_ENV) != "all"
        and (point, ending) not in (GUEST_INTERLEAVINGS)
    ):
        pytest.skip(f"make test runs {len(GUEST_INTERLEAVINGS)} in the guest; {FAULTS_ENV}=all all")
    left_by_an_earlier_launch(node)
    log = tmp_path / "stopping.log"
    node.start_agent(*AGENT, log=log)
    wait_for(lambda: status_by(node), timeout=30)
    launcher = node.launch("busy", 60, BUSY, env={faults.FAULT_ENV: f"{point}:1:pause"}, gpu=True)
    try:
        wait_for(lambda: paused(launcher), timeout=30, interval=0.05)
        if point == "launch.quota_written":  # beside a live agent: born within its budget
            assert node.cgroups.read_limit(f"{node.parent}/busy") == pytest.approx(60.0)
        stopping = agent_event(node, ending, log)
        if stopping is not None:
            wait_for(lambda: gone_or_waiting(stopping, log), timeout=30, interval=0.05)
            assert (stopping.poll() is None) == (point in IN_LAUNCH_SECTION), log.read_text()
        launcher.send_signal(signal.SIGCONT)
        if stopping is not None:
            assert stopping.wait(timeout=stretched(EXIT)) == 0, log.read_text()
        registration = StateDir(node.state).registration("busy")
        wait_for(registration.exists, timeout=30, interval=0.05)
        if ending == "kill-restart":
            restart_and_stop(node, "busy")
        nothing_left(node, [launcher], capsys)
    finally:
        launcher.kill()
        launcher.wait()


ROUNDS_ENV = "KUSCALE_INTERLEAVE_ROUNDS"
LAUNCH_SPAN = 1.5
"""Seconds after a launch starts within which the agent's event falls: a launch here takes
about half that from its start to its exec, so events land before, during and after it."""


def settled(node: LocalNode, launcher: subprocess.Popen[bytes]) -> bool:
    """The launch is done: it exited (refused), or it execed its workload after registering."""
    if launcher.poll() is not None:
        return True
    command = Path(f"/proc/{launcher.pid}/cmdline").read_bytes().split(b"\0")
    return command[0] == BUSY[0].encode() and StateDir(node.state).registration("busy").exists()


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_workload_launched_around_an_agent_stop_never_keeps_a_quota_with_no_agent(
    node: LocalNode, ending: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's case: a job script launches a workload while the agent restarts. Each
    round the agent is stopped or killed at a random moment of a launch's life; then the
    workload runs unlimited as it was born, or the next agent holds it."""
    draw = random.Random(f"{ending}-{os.getpid()}")
    for round_ in range(int(os.environ.get(ROUNDS_ENV, "4"))):
        local = LocalNode(tmp_path / f"state-{round_}", node.cgroups, node.parent)
        local.start_agent(*AGENT)
        wait_for(lambda: status_by(local), timeout=30)  # noqa: B023
        launcher = local.launch("busy", 60, BUSY, gpu=True)
        try:
            time.sleep(draw.uniform(0.0, LAUNCH_SPAN))
            if ending == "term":
                clean_stop(local)
            else:
                kill(local)
            wait_for(lambda: settled(local, launcher), timeout=30, interval=0.05)  # noqa: B023
            assert launcher.poll() is None, f"round {round_}: the launch exited"
            if ending == "kill-restart":
                restart_and_stop(local, "busy")
            else:
                follow(local, ending, None)
            nothing_left(local, [launcher], capsys)
        finally:
            launcher.kill()
            launcher.wait()
