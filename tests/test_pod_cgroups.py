"""Pod cgroup resolution: every driver × cgroup version × runtime × QoS class on fixture
trees, the /proc fallback, bad input, and the real cgroup v1 tree here."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.procfs import ProcessCgroupError, cgroup_of_process
from kuscale.cli import main
from kuscale.kubernetes.cgroups import (
    Driver,
    PodCgroups,
    ResolutionError,
    detect_driver,
    resolve,
    resolve_from_process,
)

UID = "0b8e4c1a-7d2f-4e3a-9c5b-1f2e3d4c5b6a"
DIGEST = "ab" * 32
POD = {
    (Driver.CGROUPFS, "Guaranteed"): f"kubepods/pod{UID}",
    (Driver.CGROUPFS, "Burstable"): f"kubepods/burstable/pod{UID}",
    (Driver.CGROUPFS, "BestEffort"): f"kubepods/besteffort/pod{UID}",
    (
        Driver.SYSTEMD,
        "Guaranteed",
    ): "kubepods.slice/kubepods-pod0b8e4c1a_7d2f_4e3a_9c5b_1f2e3d4c5b6a.slice",
    (Driver.SYSTEMD, "Burstable"): "kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-pod0b8e4c1a_7d2f_4e3a_9c5b_1f2e3d4c5b6a.slice",
    (Driver.SYSTEMD, "BestEffort"): "kubepods.slice/kubepods-besteffort.slice/"
    "kubepods-besteffort-pod0b8e4c1a_7d2f_4e3a_9c5b_1f2e3d4c5b6a.slice",
}
CONTAINER = {
    (Driver.CGROUPFS, "containerd"): DIGEST,
    (Driver.CGROUPFS, "cri-o"): f"crio-{DIGEST}",
    (Driver.CGROUPFS, "docker"): DIGEST,
    (Driver.SYSTEMD, "containerd"): f"cri-containerd-{DIGEST}.scope",
    (Driver.SYSTEMD, "cri-o"): f"crio-{DIGEST}.scope",
    (Driver.SYSTEMD, "docker"): f"docker-{DIGEST}.scope",
}


def make_tree(tmp_path: Path, version: int, cgroups: list[str]) -> CgroupV1 | CgroupV2:
    """Directories as the kubelet and runtime leave them, under v1's two roots or v2's one."""
    root = tmp_path / "cpu,cpuacct" if version == 1 else tmp_path
    for cgroup in cgroups:
        (root / cgroup).mkdir(parents=True, exist_ok=True)
    if version == 1:
        return CgroupV1(root, root)
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    return CgroupV2(root, root)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("driver", list(Driver))
@pytest.mark.parametrize("runtime", ["containerd", "cri-o", "docker"])
@pytest.mark.parametrize("qos", ["Guaranteed", "Burstable", "BestEffort"])
def test_every_layout_resolves_to_the_pod_and_its_container(
    tmp_path: Path, version: int, driver: Driver, runtime: str, qos: str
) -> None:
    pod = POD[(driver, qos)]
    container = f"{pod}/{CONTAINER[(driver, runtime)]}"
    tree = make_tree(tmp_path, version, [container])
    assert detect_driver(tree) is driver
    resolved = resolve(tree, UID, qos, [f"{runtime}://{DIGEST}"], driver)
    assert resolved == PodCgroups(pod, (container,))


def test_writes_raise_the_pod_first_and_lower_it_last() -> None:
    cgroups = PodCgroups("kubepods/podX", ("kubepods/podX/a", "kubepods/podX/b"))
    assert cgroups.write_order(raising=True) == ("kubepods/podX", *cgroups.containers)
    assert cgroups.write_order(raising=False) == (*cgroups.containers, "kubepods/podX")


def test_a_container_not_started_yet_is_left_out(tmp_path: Path) -> None:
    pod = POD[(Driver.SYSTEMD, "Burstable")]
    tree = make_tree(tmp_path, 2, [pod])
    resolved = resolve(tree, UID, "Burstable", [f"containerd://{DIGEST}"], Driver.SYSTEMD)
    assert resolved == PodCgroups(pod, ())


@pytest.mark.parametrize(
    ("uid", "qos", "container", "message"),
    [
        ("../../etc", "Burstable", f"containerd://{DIGEST}", "not a UUID"),
        (UID.upper(), "Burstable", f"containerd://{DIGEST}", "not a UUID"),
        (UID, "Platinum", f"containerd://{DIGEST}", "unknown QoS class"),
        (UID, "Burstable", f"rkt://{DIGEST}", "unknown runtime"),
        (UID, "Burstable", DIGEST, "no runtime scheme"),
        (UID, "Burstable", "containerd://../../x", "not 64 hex digits"),
    ],
)
def test_bad_input_is_refused_with_a_reason(
    tmp_path: Path, uid: str, qos: str, container: str, message: str
) -> None:
    tree = make_tree(tmp_path, 1, [POD[(Driver.CGROUPFS, "Burstable")]])
    with pytest.raises(ResolutionError, match=message):
        resolve(tree, uid, qos, [container], Driver.CGROUPFS)


def test_a_pod_without_a_cgroup_and_a_node_without_kubepods_are_errors(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, 2, ["system.slice"])
    with pytest.raises(ResolutionError, match=r"neither kubepods\.slice nor kubepods"):
        detect_driver(tree)
    with pytest.raises(ResolutionError, match="no cgroup"):
        resolve(tree, UID, "Burstable", [], Driver.SYSTEMD)


def proc_with(tmp_path: Path, pid: int, text: str) -> Path:
    (tmp_path / "proc" / str(pid)).mkdir(parents=True)
    (tmp_path / "proc" / str(pid) / "cgroup").write_text(text)
    return tmp_path / "proc"


@pytest.mark.parametrize("version", [1, 2])
def test_the_proc_fallback_finds_the_pod_from_a_container_process(
    tmp_path: Path, version: int
) -> None:
    container = f"{POD[(Driver.SYSTEMD, 'Burstable')]}/crio-{DIGEST}.scope"
    tree = make_tree(tmp_path / "fs", version, [container])
    lines = (
        f"12:memory:/{container}\n4:cpu,cpuacct:/{container}\n1:name=systemd:/x\n"
        if version == 1
        else f"0::/{container}\n"
    )
    proc = proc_with(tmp_path, 41, lines)
    resolved = resolve_from_process(tree, 41, proc)
    assert resolved == PodCgroups(POD[(Driver.SYSTEMD, "Burstable")], (container,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0::/kubepods.slice/kubepods-burstable.slice/x.scope\n", "not in a pod's container"),
        ("0::/../../kubepods/podX/c\n", "no usable"),
        ("4:memory:/kubepods\n", "no usable"),
    ],
)
def test_the_proc_fallback_never_returns_a_qos_slice_or_escapes(
    tmp_path: Path, text: str, message: str
) -> None:
    tree = make_tree(tmp_path / "fs", 2, ["kubepods.slice"])
    with pytest.raises(ResolutionError, match=message):
        resolve_from_process(tree, 7, proc_with(tmp_path, 7, text))
    with pytest.raises(ResolutionError, match="cannot read"):
        resolve_from_process(tree, 8, tmp_path / "proc")


def private_namespace(tmp_path: Path, own: str, pid: int) -> tuple[Path, Path]:
    """A proc and a v2 tree as an agent in its own cgroup namespace sees them: its cgroup is
    `own` on the node, and the node's tree is mounted over the runtime's own mount, with the
    root that climbs from `own` to the node's."""
    mount = tmp_path / "node-cgroup"
    (mount / own).mkdir(parents=True)
    (mount / own / "cgroup.procs").write_text(f"{pid}\n")
    climb = "/".join([".."] * len(own.split("/")))
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / "self").symlink_to(str(pid))
    (proc / str(pid) / "mountinfo").write_text(
        f"30 25 0:26 / {mount} rw,nosuid - cgroup2 cgroup rw\n"
        f"31 30 0:26 /{climb} {mount} rw,nosuid - cgroup2 cgroup rw\n"
    )
    return proc, mount


def test_another_pods_process_read_from_a_private_namespace_maps_to_the_nodes_path(
    tmp_path: Path,
) -> None:
    agent = f"kubepods/besteffort/pod{UID}/{DIGEST}"
    proc, _ = private_namespace(tmp_path, agent, 4242)
    other = f"pod{UID.replace('1', '2')}/{'f' * 64}"
    (proc / "7").mkdir()
    (proc / "7" / "cgroup").write_text(f"0::/../../../burstable/{other}\n")
    assert cgroup_of_process(7, "cgroup-v2", proc) == f"kubepods/burstable/{other}"
    (proc / "8").mkdir()
    (proc / "8" / "cgroup").write_text("0::/../../../../../escaped\n")
    with pytest.raises(ProcessCgroupError, match="no usable"):
        cgroup_of_process(8, "cgroup-v2", proc)


def test_the_real_cgroup_v1_tree(real_cgroups: tuple[CgroupV1 | CgroupV2, str]) -> None:
    cgroups, parent = real_cgroups
    uid = str(uuid.uuid4())
    pod = f"kubepods/burstable/pod{uid}"
    container = f"{pod}/{DIGEST}"
    cgroups.create(f"{parent}/{container}")
    tree = type(cgroups)(cgroups.cpu_root / parent, cgroups.usage_root / parent)
    assert detect_driver(tree) is Driver.CGROUPFS
    resolved = resolve(tree, uid, "Burstable", [f"containerd://{DIGEST}"], Driver.CGROUPFS)
    assert resolved == PodCgroups(pod, (container,))
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        cgroups.attach(f"{parent}/{container}", sleeper.pid)
        found = resolve_from_process(cgroups, sleeper.pid)
        assert found == PodCgroups(f"{parent}/{pod}", (f"{parent}/{container}",))
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_cli_prints_the_pod_and_its_containers_or_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pod = POD[(Driver.SYSTEMD, "Guaranteed")]
    container = f"{pod}/cri-containerd-{DIGEST}.scope"
    make_tree(tmp_path, 2, [container])
    args = ["pod-cgroups", "--cgroup-root", str(tmp_path), "--uid", UID]
    assert main([*args, "--qos", "Guaranteed", "--container-id", f"containerd://{DIGEST}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"pod        {tmp_path}/{pod}",
        f"container  {tmp_path}/{container}",
    ]
    assert main(args) == 2
    assert "--uid needs --qos" in capsys.readouterr().err
    assert main([*args, "--qos", "Guaranteed", "--container-id", "rkt://x"]) == 2
    assert "unknown runtime" in capsys.readouterr().err
