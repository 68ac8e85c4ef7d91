"""What only a real cgroup v2 kernel can answer, asked inside the throwaway VM (`v2guest`):
the mount kuscale detects, the files it writes as the kernel reads them back, a kubelet's
systemd tree, and a PSI trigger that fires for a starving cgroup."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest
from conftest import BUSY, wait_for

from kuscale.actuators.cgroup import CgroupActuator
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect, read_mounts, shares_to_weight
from kuscale.backends.pressure import PressureTrigger, wait_for_pressure
from kuscale.kubernetes.cgroups import Driver, PodCgroups, detect_driver, resolve
from kuscale.model import PodSpec, shares_for_tokens

V2_ONLY = pytest.mark.v2_kernel(only=True)
DIGEST = "0123456789abcdef" * 4


def read(cgroups: CgroupV1 | CgroupV2, cgroup: str, name: str) -> str:
    return (cgroups.cpu_root / cgroup / name).read_text().strip()


@V2_ONLY
def test_the_guest_has_cgroup_v2_alone_and_kuscale_picks_it(cgroup_kernel: str) -> None:
    mounts = read_mounts()
    assert {mount.fstype for mount in mounts} == {"cgroup2"}
    cgroups = detect(mounts)
    assert isinstance(cgroups, CgroupV2)
    assert "cpu" in (cgroups.cpu_root / "cgroup.controllers").read_text().split()


@V2_ONLY
def test_cpu_max_and_cpu_weight_hold_what_kuscale_writes(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    name = f"{parent}/pod"
    cgroups.create(name)
    assert read(cgroups, name, "cpu.max") == "max 100000"
    cgroups.write_limit(name, 25.0)
    assert read(cgroups, name, "cpu.max") == "25000 100000"
    (cgroups.cpu_root / name / "cpu.max").write_text("max 50000")
    cgroups.forget(name)
    cgroups.write_limit(name, 30.0)
    assert read(cgroups, name, "cpu.max") == "15000 50000", "kuscale keeps the period it found"
    assert cgroups.read_limit(name) == pytest.approx(30.0)
    cgroups.write_limit(name, None)
    assert read(cgroups, name, "cpu.max") == "max 50000"
    shares = shares_for_tokens(600)
    cgroups.write_shares(name, shares)
    assert int(read(cgroups, name, "cpu.weight")) == shares_to_weight(shares)
    assert cgroups.read_shares(name) == pytest.approx(shares, rel=0.01)


@pytest.mark.v2_kernel
def test_a_kubelet_systemd_tree_resolves_and_its_pod_quota_binds_its_containers(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    uid = str(uuid.uuid4())
    slice_ = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    pod = f"kubepods.slice/kubepods-burstable.slice/{slice_}"
    container = f"{pod}/cri-containerd-{DIGEST}.scope"
    cgroups.create(f"{parent}/{container}")
    tree = type(cgroups)(cgroups.cpu_root / parent, cgroups.usage_root / parent)
    assert detect_driver(tree) is Driver.SYSTEMD
    resolved = resolve(tree, uid, "Burstable", [f"containerd://{DIGEST}"], Driver.SYSTEMD)
    assert resolved == PodCgroups(pod, (container,))
    leaf = f"{parent}/{container}"
    cgroups.write_limit(leaf, 50.0)
    spec = PodSpec(name="pod", tokens=30, cgroup=f"{parent}/{pod}", containers=(leaf,))
    actuator = CgroupActuator(cgroups)
    held = actuator.inspect(spec)
    busy = subprocess.Popen(BUSY)
    try:
        cgroups.attach(leaf, busy.pid)
        actuator.hold(spec, held)
        actuator.write(spec, held, 20.0)
        assert cgroups.read_limit(leaf) is None
        before, started = cgroups.read(spec.cgroup), time.monotonic()
        wait_for(lambda: time.monotonic() - started > 2.0, timeout=10)
        after, elapsed = cgroups.read(spec.cgroup), time.monotonic() - started
        usage = (after.usage_ns - before.usage_ns) * 100.0 / (elapsed * 1e9)
        assert 10.0 < usage < 30.0, f"the pod used {usage:.0f} % under a 20 % quota"
        assert after.nr_throttled > before.nr_throttled
        actuator.release(spec, held)
    finally:
        busy.kill()
        busy.wait()
    assert cgroups.read_limit(spec.cgroup) is None
    assert cgroups.read_limit(leaf) == pytest.approx(50.0)


@V2_ONLY
def test_a_psi_trigger_fires_for_a_starving_cgroup_and_not_for_an_idle_one(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    assert isinstance(cgroups, CgroupV2)
    starving, idle = f"{parent}/starving", f"{parent}/idle"
    for name in (starving, idle):
        cgroups.create(name)
    cgroups.write_limit(starving, 10.0)
    quiet = cgroups.pressure_trigger(idle, 100_000, 1_000_000)
    loud = cgroups.pressure_trigger(starving, 100_000, 1_000_000)
    busy = [subprocess.Popen(BUSY) for _ in range(2)]
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        before = cgroups.read_pressure(starving)
        cgroups.attach(idle, sleeper.pid)
        for process in busy:
            cgroups.attach(starving, process.pid)
        fired: set[PressureTrigger] = set()

        def starving_fired() -> bool:
            fired.update(wait_for_pressure([quiet, loud], 1.0)[0])
            return loud in fired

        wait_for(starving_fired, timeout=20)
        assert quiet not in fired
        assert cgroups.read_pressure(starving).some_total_us > before.some_total_us
    finally:
        for process in (*busy, sleeper):
            process.kill()
            process.wait()
        quiet.close()
        loud.close()


@V2_ONLY
def test_from_a_private_cgroup_namespace_another_pods_process_maps_to_the_nodes_path(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    """As the agent's container is on a v2 node under containerd: its own cgroup namespace,
    the node's tree mounted. The kernel shows the other pod's process climbing out of the
    namespace, and kuscale maps it back to the node's cgroup."""
    cgroups, parent = real_cgroups
    agent = f"{parent}/kubepods/besteffort/pod{uuid.uuid4()}/{DIGEST}"
    other = f"{parent}/kubepods/burstable/pod{uuid.uuid4()}/{'f' * 64}"
    for cgroup in (agent, other):
        cgroups.create(cgroup)
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        cgroups.attach(other, sleeper.pid)
        code = (
            "from kuscale.backends.procfs import cgroup_of_process\n"
            "from kuscale.kubernetes.cgroups import resolve_from_process\n"
            "from kuscale.backends.cgroup import detect\n"
            f"print(open('/proc/{sleeper.pid}/cgroup').read().strip())\n"
            f"print(cgroup_of_process({sleeper.pid}, 'cgroup-v2'))\n"
            f"print(resolve_from_process(detect(), {sleeper.pid}).pod)\n"
        )
        procs = cgroups.cpu_root / agent / "cgroup.procs"
        inside = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec unshare --cgroup "$0" -c "$1"',
             sys.executable, code],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
    finally:
        sleeper.kill()
        sleeper.wait()
    seen, mapped, pod = inside.stdout.splitlines()
    assert seen.startswith("0::/../../../"), "the kernel shows it from inside the namespace"
    assert mapped == other
    assert pod == other.rpartition("/")[0]
