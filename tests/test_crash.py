"""Fault injection on real cgroups: an agent killed with SIGKILL at random points of its loop
never leaves a workload with a value kuscale set — not after a restarted agent's clean stop,
not after `kuscale restore`. KUSCALE_FAULT_ROUNDS sets how many kills (default 5)."""

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
from conftest import BUSY, KUSCALE, LocalNode, wait_for

from kuscale.local.statedir import StateDir

ROUNDS = int(os.environ.get("KUSCALE_FAULT_ROUNDS", "5"))
DEFAULT_SHARES = 1024
"""What a fresh cgroup has: the original kuscale must give back (no quota, this weight)."""


def adopted(node: LocalNode, name: str) -> bool:
    """By the agent running now: a killed one's last status says the same of the pod."""
    status = node.status() or {}
    pod = node.pod(name)
    return (
        node.agent is not None
        and status.get("pid") == node.agent.pid
        and pod is not None
        and pod["status"] == "running"
        and pod["updated_count"] >= 1
    )


def kill_agent(node: LocalNode) -> None:
    assert node.agent is not None
    node.agent.send_signal(signal.SIGKILL)
    node.agent.wait()


def stop_agent(node: LocalNode) -> None:
    assert node.agent is not None
    node.agent.send_signal(signal.SIGTERM)
    assert node.agent.wait(timeout=30) == 0


def untouched(node: LocalNode, cgroup: str) -> bool:
    return (
        node.cgroups.read_limit(cgroup) is None
        and node.cgroups.read_shares(cgroup) == DEFAULT_SHARES
    )


def test_a_killed_agent_is_followed_by_one_that_gives_back_the_truth(node: LocalNode) -> None:
    rng = random.Random(int(os.environ.get("KUSCALE_FAULT_SEED", "7")))
    cgroup = f"{node.parent}/busy"
    workload = node.launch("busy", 30, BUSY)
    try:
        wait_for(lambda: node.cgroups.exists(cgroup), timeout=15, interval=0.05)
        for _ in range(ROUNDS):
            node.start_agent("--metrics-address", "")
            time.sleep(rng.uniform(0.0, 1.5))
            kill_agent(node)
            node.start_agent("--metrics-address", "")
            wait_for(lambda: adopted(node, "busy"), timeout=20)
            time.sleep(rng.uniform(0.0, 1.0))
            stop_agent(node)
            assert untouched(node, cgroup)
            assert workload.poll() is None
    finally:
        workload.kill()
        workload.wait()


def test_restore_after_a_kill_gives_back_the_truth_without_an_agent(node: LocalNode) -> None:
    rng = random.Random(11)
    cgroup = f"{node.parent}/busy"
    workload = node.launch("busy", 30, BUSY)
    try:
        wait_for(lambda: node.cgroups.exists(cgroup), timeout=15, interval=0.05)
        for _ in range(max(2, ROUNDS // 2)):
            node.start_agent("--metrics-address", "")
            wait_for(lambda: adopted(node, "busy"), timeout=20)
            time.sleep(rng.uniform(0.0, 1.0))
            kill_agent(node)
            assert node.cgroups.read_limit(cgroup) is not None
            restore = [*KUSCALE, "restore", "--state-dir", str(node.state)]
            subprocess.run(restore, check=True, capture_output=True)
            assert untouched(node, cgroup)
    finally:
        workload.kill()
        workload.wait()


def test_a_second_agent_on_the_same_state_dir_is_refused(node: LocalNode) -> None:
    node.start_agent("--metrics-address", "")
    try:
        wait_for(lambda: node.state.joinpath("status.json").exists(), timeout=20)
        second = subprocess.run(
            [*KUSCALE, "agent", "--local", "--state-dir", str(node.state), "--gpus", "0"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        assert "an agent is running" in second.stderr
        restore = [*KUSCALE, "restore", "--state-dir", str(node.state)]
        refused = subprocess.run(restore, check=False, capture_output=True, text=True, timeout=30)
        assert refused.returncode == 2
        assert "stop it first" in refused.stderr
    finally:
        stop_agent(node)


def test_launch_refuses_a_busy_cgroup_and_remakes_an_empty_one(node: LocalNode) -> None:
    cgroup = f"{node.parent}/taken"
    node.cgroups.create(cgroup)
    node.cgroups.write_limit(cgroup, 25.0)
    squatter = subprocess.Popen(BUSY)
    try:
        node.cgroups.attach(cgroup, squatter.pid)
        launch = [*KUSCALE, "launch", "--state-dir", str(node.state), "--tokens", "50"]
        refused = subprocess.run(
            [*launch, "--name", "taken", "--cgroup-parent", node.parent, "--", "true"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert refused.returncode == 2
        assert "holds processes" in refused.stderr
    finally:
        squatter.kill()
        squatter.wait()
    wait_for(lambda: node.cgroups.is_empty(cgroup), timeout=10, interval=0.05)
    sleeper = node.launch("taken", 50, ["sleep", "30"])
    try:
        wait_for(lambda: not node.cgroups.is_empty(cgroup), timeout=15, interval=0.05)
        # Born afresh, not with the 25 % left behind: with no agent to give a quota back,
        # unlimited with the default weight (beside an agent, the quota its tokens buy).
        assert node.cgroups.read_limit(cgroup) is None
        assert node.cgroups.read_shares(cgroup) == DEFAULT_SHARES
    finally:
        sleeper.kill()
        sleeper.wait()


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` as a read-only filesystem (a bind mount over itself)."""
    mounted = subprocess.run(
        ["mount", "--bind", str(directory), str(directory)],
        check=False,
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(directory)], check=True, capture_output=True
        )
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True, capture_output=True)


@pytest.mark.parametrize(
    ("read_only_part", "message"),
    [("state", "is not writable"), ("originals", "nothing was launched")],
)
def test_a_launch_on_a_read_only_state_dir_refuses_before_any_quota(
    node: LocalNode, read_only_part: str, message: str
) -> None:
    state = StateDir(node.state).ensure()
    state.originals.mkdir()
    with read_only(node.state if read_only_part == "state" else state.originals):
        refused = subprocess.run(
            [*KUSCALE, "launch", "--state-dir", str(node.state), "--tokens", "50", "--name",
             "ro", "--cgroup-parent", node.parent, "--", "true"],
            check=False, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert message in refused.stderr
    assert not node.cgroups.exists(f"{node.parent}/ro")
    assert not state.registration("ro").exists()
