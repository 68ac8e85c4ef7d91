"""The node's harness where it fails: a component that dies shows its own last lines, and what
no run of the harness made is refused, never cleaned. These need no node."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import e2enode, guestnode
from e2e.e2enode import (
    Component,
    ComponentFailed,
    Node,
    NodeUnavailable,
    clean_leftovers,
    wait_for,
)
from e2e.guestnode import GuestNode


def test_a_component_that_dies_fails_with_its_last_log_lines(tmp_path: Path) -> None:
    dying = Component(
        "kube-apiserver",
        ["sh", "-c", "echo 'E1207 the etcd it was given does not answer'; exit 3"],
        tmp_path / "kube-apiserver.log",
    )
    dying.start()
    with pytest.raises(ComponentFailed) as failed:
        wait_for(lambda: False, "the API server is ready", dying, deadline=60)
    assert "kube-apiserver exited with 3" in str(failed.value)
    assert "the etcd it was given does not answer" in str(failed.value)


def test_a_missed_deadline_names_what_was_awaited(tmp_path: Path) -> None:
    idle = Component("etcd", ["sleep", "60"], tmp_path / "etcd.log")
    idle.start()
    try:
        with pytest.raises(ComponentFailed, match="etcd is healthy: not within 1 s"):
            wait_for(lambda: False, "etcd is healthy", idle, deadline=1)
    finally:
        idle.stop()


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The harness pointed at a scratch tree instead of this machine's paths."""
    monkeypatch.setattr(e2enode, "WORK", tmp_path / "work")
    monkeypatch.setattr(e2enode, "MARKER", tmp_path / "work" / "made-by-kuscale-e2e")
    monkeypatch.setattr(e2enode, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(e2enode, "DEVICE_PLUGINS", tmp_path / "kubelet" / "device-plugins")
    (tmp_path / "cgroup" / "cpu").mkdir(parents=True)
    return tmp_path


def test_kubepods_no_run_made_are_refused(elsewhere: Path) -> None:
    (elsewhere / "cgroup" / "cpu" / "kubepods").mkdir()
    with pytest.raises(NodeUnavailable, match="a kubelet may be running"):
        clean_leftovers()
    assert (elsewhere / "cgroup" / "cpu" / "kubepods").is_dir()


def test_a_kubelet_socket_no_run_made_is_refused(elsewhere: Path) -> None:
    (elsewhere / "kubelet" / "device-plugins").mkdir(parents=True)
    (elsewhere / "kubelet" / "device-plugins" / "kubelet.sock").touch()
    with pytest.raises(NodeUnavailable, match="a kubelet may be running"):
        clean_leftovers()


def test_a_work_directory_no_run_made_is_refused(elsewhere: Path) -> None:
    (elsewhere / "work").mkdir()
    with pytest.raises(NodeUnavailable, match="no e2e run made it"):
        clean_leftovers()
    assert (elsewhere / "work").is_dir()


@pytest.fixture
def guest_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The v2 node's shared directory in a scratch tree, with no VM behind it."""
    monkeypatch.setattr(guestnode, "SHARED", tmp_path)
    (tmp_path / "logs").mkdir()
    return tmp_path


def test_a_guest_kubelet_that_never_registers_fails_with_its_lines_and_the_console(
    guest_elsewhere: Path,
) -> None:
    (guest_elsewhere / "logs" / "kubelet.log").write_text(
        'E1207 run.go:72] "command failed" err="unable to load client CA file"\n'
    )
    (guest_elsewhere / "steps.log").write_text("100.0 booted\n104.5 containerd answers\n")
    guest = GuestNode(host=Node(Path("/nonexistent")))
    console = "echo virtme-ng-init: starting script; exec sleep 60"
    guest.vm = Component("guest", ["sh", "-c", console], guest_elsewhere / "console.log")
    guest.vm.start()
    try:
        with pytest.raises(ComponentFailed) as failed:
            guest._wait(lambda: False, "the v2 node is Ready", 2)
    finally:
        guest.vm.stop()
    message = str(failed.value)
    assert "the v2 node is Ready: not within 2 s" in message
    assert "unable to load client CA file" in message
    assert "starting script" in message
    assert "'containerd answers': 4.5" in message


def test_a_guest_that_does_not_stop_is_killed_with_its_process_group(
    guest_elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guestnode, "STOP_GRACE_S", 1.0)
    guest = GuestNode(host=Node(Path("/nonexistent")))
    guest.vm = Component("guest", ["sh", "-c", "sleep 600 & wait"], guest_elsewhere / "c.log")
    guest.vm.start()
    process = guest.vm.process
    assert process is not None
    guest._power_off()
    assert process.returncode == -9
    assert (guest_elsewhere / "stop").exists(), "it was asked first"
