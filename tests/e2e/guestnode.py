"""The cgroup v2 worker of the end-to-end cluster: a throwaway VM that joins the host node's
control plane as a second node.

This machine's cpu controller is bound to cgroup v1, so cgroup v2 under a kubelet exists here
only in a guest, the same one the v2 tests boot (tests/v2guest.py): Debian's kernel under qemu
in software emulation (no KVM), booted by virtme-ng over the host's filesystem through 9p, with
2 CPUs, 2 GiB and no systemd. In it run Debian's containerd, runc and CNI plugins and the
kubelet of the node's own program, with the cgroupfs driver on cgroup v2: the guest is not a
test of the systemd driver.

- Network: qemu's user network. Its NAT takes the guest's connections to any of the host's
  addresses, so the guest's kubelet, and its pods behind a masquerading CNI bridge, reach the
  API server where the host's pods do (GATEWAY). Nothing reaches into the guest: the API
  server cannot call its kubelet (no `kubectl logs` or `exec` there), so the tests read the
  guest's state through `sh`, a command channel in the directory host and guest share.
- State: containerd's and the kubelet's on tmpfs mounts made in the guest (overlayfs cannot sit
  on 9p), gone with the VM. What the host reads after the fact (the kubelet's and containerd's
  logs, the pods' logs, the console) is in the shared directory, which the teardown removes.
- Images: the same OCI archives as the host node's, imported into the guest's containerd.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import v2guest

from e2e import ociimage
from e2e.e2enode import (
    IMAGE,
    LOG_TAIL,
    PAUSE_IMAGE,
    Component,
    ComponentFailed,
    Node,
    NodeUnavailable,
    Runtime,
    cni_config,
    containerd_config,
    kubeconfig,
    kubelet_config,
    pids_naming,
)

GUEST_NODE = "kuscale-v2"
SHARED = Path("/tmp/kuscale-e2e-v2")
"""What host and guest share read-write. Not under WORK: the guest lays a tmpfs over /var/lib,
where the kubelet, the CNI plugins and the agent's DaemonSet keep their state."""
STATE = "/var/lib/kuscale-e2e-v2"
"""The guest's own state, on that tmpfs."""
GUEST_RUNTIME = Runtime(
    root=f"{STATE}/containerd/root",
    state=f"{STATE}/containerd/state",
    socket=f"{STATE}/containerd.sock",
    cni_dir=f"{STATE}/cni",
    restrict_oom_score_adj=False,
)
GUEST_BRIDGE = "kse2e1"
GUEST_POD_SUBNET = "10.213.79.0/24"
GUEST_IP = "10.0.2.15"
"""qemu's user network gives the guest this address and routes through 10.0.2.2."""
GUEST_CGROUP = Path("/sys/fs/cgroup")
BOOTED = "kuscale-e2e-v2: booted"
READY_DEADLINE_S = 600.0
"""Boot, containerd, the images and a kubelet read over 9p and run under emulation: about a
minute on an idle machine, several on a busy one."""
STOP_GRACE_S = 60.0


@dataclass
class GuestNode:
    """The v2 node; `start` boots it and waits until it is Ready, `teardown` removes it from
    the cluster and powers it off."""

    host: Node
    archives: tuple[Path, ...] = ()
    """OCI archives the guest imports beside its kubelet's start (the agent's image): its
    emulated CPU takes about a minute for one, which then overlaps the kubelet's start."""
    vm: Component | None = None
    ready_seconds: float = 0.0
    _commands: int = 0

    @property
    def console(self) -> Path:
        return SHARED / "console.log"

    @property
    def pod_logs(self) -> Path:
        return SHARED / "pod-logs"

    def start(self) -> None:
        reason = v2guest.missing_parts()
        if reason is not None:
            raise NodeUnavailable(f"the cgroup v2 node cannot boot: {reason}")
        kernel = v2guest.find_kernel()
        assert kernel is not None
        self._prepare()
        bindir = Path(sys.executable).parent
        env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.vm = Component("guest", self._vng(bindir / "vng", kernel), self.console, env=env)
        started = time.monotonic()
        self.vm.start()
        self._wait(self._ready, "the v2 node is Ready", READY_DEADLINE_S)
        self.ready_seconds = time.monotonic() - started
        self.host.kubectl("taint", "node", GUEST_NODE, "node.kubernetes.io/not-ready:NoSchedule-")

    def _prepare(self) -> None:
        """The shared directory: the guest's certificates, configs, images and boot script."""
        shutil.rmtree(SHARED, ignore_errors=True)
        for directory in ("pki", "cmd", "logs", "pod-logs"):
            (SHARED / directory).mkdir(parents=True)
        certs = self.host.certs
        certs.issue("kubelet-v2", f"/O=system:nodes/CN=system:node:{GUEST_NODE}")
        for name in ("ca.crt", "kubelet-v2.crt", "kubelet-v2.key"):
            shutil.copy(certs.path(name), SHARED / "pki" / name)
        ca = SHARED / "pki" / "ca.crt"
        user = {
            "client-certificate": str(SHARED / "pki" / "kubelet-v2.crt"),
            "client-key": str(SHARED / "pki" / "kubelet-v2.key"),
        }
        (SHARED / "kubelet.kubeconfig").write_text(kubeconfig(self.host.server, ca, user))
        serving = {"address": "0.0.0.0", "healthzBindAddress": "127.0.0.1"}
        config = kubelet_config(ca, GUEST_RUNTIME, self.pod_logs, serving)
        (SHARED / "kubelet.yaml").write_text(config)
        (SHARED / "containerd.toml").write_text(containerd_config(GUEST_RUNTIME))
        (SHARED / "cni.conflist").write_text(
            cni_config(
                "kuscale-v2", GUEST_BRIDGE, GUEST_POD_SUBNET, f"{STATE}/cni-ipam", routed=True
            )
        )
        busybox = shutil.which("busybox") or "/bin/busybox"
        ociimage.write_busybox_archive(Path(busybox), [IMAGE, PAUSE_IMAGE], SHARED / "images.tar")
        (SHARED / "boot.sh").write_text(boot_script(self.host.binary, self.archives))

    def _vng(self, vng: Path, kernel: Path) -> list[str]:
        """The v2 tests' VM, with qemu's user network."""
        command = v2guest.guest_command(vng, kernel, SHARED, SHARED / "boot.sh")
        return [*command[:-2], "--network", "user", *command[-2:]]

    def _ready(self) -> bool:
        node = self.host.get(f"/api/v1/nodes/{GUEST_NODE}")
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _wait(self, condition: Any, what: str, deadline: float) -> None:
        """Poll `condition`; a VM that exits or a deadline missed fails with the kubelet's last
        log lines and the console's tail, and the VM is killed."""
        assert self.vm is not None
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if not self._running():
                raise ComponentFailed(f"{what}: the VM exited\n{self.explain()}")
            try:
                if condition():
                    return
            except (OSError, ValueError):
                pass
            time.sleep(1.0)
        raise ComponentFailed(f"{what}: not within {deadline:.0f} s\n{self.explain()}")

    def explain(self) -> str:
        """What a failure shows: the guest's steps, its kubelet's last lines, its console."""
        return (
            f"steps: {self.boot_steps()}\nthe guest kubelet's last lines:\n"
            + _tail(SHARED / "logs" / "kubelet.log")
            + "\nthe guest's console:\n"
            + _tail(self.console, LOG_TAIL * 2)
        )

    def boot_steps(self) -> dict[str, float]:
        """The boot script's steps, each as seconds since the first."""
        try:
            lines = (SHARED / "steps.log").read_text().splitlines()
        except OSError:
            return {}
        stamped = [(float(t), what) for t, _, what in (line.partition(" ") for line in lines)]
        return {what: round(t - stamped[0][0], 1) for t, what in stamped}

    def sh(self, script: str, timeout: float = 180.0) -> str:
        """Run `script` with the guest's sh and return what it printed; a non-zero status, or
        a guest that does not answer within `timeout`, fails with that output."""
        self._commands += 1
        base = SHARED / "cmd" / str(self._commands)
        staged = base.with_suffix(".tmp")
        staged.write_text(script)
        staged.rename(base.with_suffix(".sh"))
        status = base.with_suffix(".rc")
        end = time.monotonic() + timeout
        while not status.exists():
            if time.monotonic() > end or not self._running():
                raise ComponentFailed(
                    f"the guest did not answer {script[:200]!r} within {timeout:.0f} s\n"
                    + self.explain()
                )
            time.sleep(0.2)
        output = base.with_suffix(".out").read_text(errors="replace")
        if status.read_text().strip() != "0":
            raise ComponentFailed(f"in the guest, {script[:200]!r} failed:\n{output[-3000:]}")
        return output

    def _running(self) -> bool:
        return (
            self.vm is not None and self.vm.process is not None and self.vm.process.poll() is None
        )

    def imported(self, archive: Path) -> bool:
        """Whether the boot script has imported `archive`."""
        return f"imported {archive.name}" in self.boot_steps()

    def ctr(self, *args: str, timeout: float = 600.0) -> str:
        argv = ["ctr", "--address", GUEST_RUNTIME.socket, "-n", "k8s.io", *args]
        return self.sh(shlex.join(argv), timeout)

    def read(self, path: str | Path) -> str:
        return self.sh(f"cat {shlex.quote(str(path))}")

    def memory_mib(self) -> dict[str, int]:
        """The guest's memory as `free` counts it: used, shared (tmpfs) and available."""
        line = self.sh("free -m").splitlines()[1].split()
        return {"total": int(line[1]), "used": int(line[2]), "shared": int(line[4]),
                "available": int(line[6])}  # fmt: skip

    def teardown(self) -> None:
        """The node and its pods out of the cluster first (nothing else would ever delete a
        gone node's pods: the host's teardown would wait on them), then the VM, then the
        shared directory."""
        try:
            self.host.kubectl("delete", "node", GUEST_NODE, "--ignore-not-found")
            on_guest = f"--field-selector=spec.nodeName={GUEST_NODE}"
            self.host.kubectl(
                "delete", "pods", "--all-namespaces", on_guest, "--force", "--grace-period=0"
            )
        except (OSError, ComponentFailed) as err:
            print(f"e2e v2 node: could not remove it from the cluster: {err}")
        self._power_off()
        kept = os.environ.get("KUSCALE_E2E_LOGS")
        if kept and SHARED.is_dir():
            for name in ("console.log", "steps.log", "logs", "pod-logs"):
                source = SHARED / name
                target = Path(kept) / "v2-node" / name
                if source.is_dir():
                    shutil.copytree(source, target, dirs_exist_ok=True)
                elif source.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(source, target)
        shutil.rmtree(SHARED, ignore_errors=True)

    def _power_off(self) -> None:
        """Ask the boot script to stop (it stops the kubelet and containerd, and the VM powers
        off when it ends); past STOP_GRACE_S, kill vng and qemu with it."""
        if self.vm is None or self.vm.process is None:
            return
        process = self.vm.process
        if process.poll() is None:
            (SHARED / "stop").touch()
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
        self.vm = None


def kill_leftover_guest() -> None:
    """A VM an interrupted run left: its qemu names SHARED on its command line."""
    for pid in pids_naming(str(SHARED)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    shutil.rmtree(SHARED, ignore_errors=True)


def boot_script(kubenode: Path, archives: tuple[Path, ...] = ()) -> str:
    """What the guest runs: its state on tmpfs, the network, cgroup v2's controllers for the
    kubelet, containerd with the pods' images, the kubelet and, beside it, the `archives`;
    then the command channel until the host asks it to stop. Each step is stamped, so a slow
    boot shows where its time went."""
    imports = "".join(
        f"$CTR images import {shlex.quote(str(a))} > /dev/null && step imported {a.name}\n"
        for a in archives
    )
    beside = f"(\n{imports}) &\n" if imports else ""
    shared, state = SHARED, STATE
    kubelet = shlex.join(
        [
            str(kubenode), "kubelet",
            f"--config={shared}/kubelet.yaml",
            f"--kubeconfig={shared}/kubelet.kubeconfig",
            "--root-dir=/var/lib/kubelet",
            f"--cert-dir={state}/kubelet-pki",
            f"--hostname-override={GUEST_NODE}",
            f"--node-ip={GUEST_IP}",
        ]
    )  # fmt: skip
    return f"""echo {shlex.quote(BOOTED)}
S={shared}
step() {{ echo "$(date +%s.%N) $*" >> $S/steps.log; }}
step booted
mount -t tmpfs tmpfs /var/lib && mount -t tmpfs tmpfs /var/log || exit 1
mkdir -p {state}/cni && cp $S/cni.conflist {state}/cni/10-kuscale-v2.conflist
if ! ip route show default | grep -q .; then
  link=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
  ip link set "$link" up && ip addr add {GUEST_IP}/24 dev "$link"
  ip route add default via 10.0.2.2
fi
echo '+cpu +cpuset +memory +pids' > {GUEST_CGROUP}/cgroup.subtree_control || exit 1
step network and cgroups
containerd --config $S/containerd.toml > $S/logs/containerd.log 2>&1 &
CTR="ctr --address {GUEST_RUNTIME.socket} -n k8s.io"
until $CTR version > /dev/null 2>&1; do sleep 0.5; done
step containerd answers
$CTR images import $S/images.tar > /dev/null || exit 1
step images imported
{kubelet} > $S/logs/kubelet.log 2>&1 &
step kubelet started
{beside}while [ ! -e $S/stop ]; do
  for command in $S/cmd/*.sh; do
    [ -e "$command" ] || continue
    base=${{command%.sh}}
    sh "$command" > "$base.out" 2>&1
    echo $? > "$base.status" && mv "$base.status" "$base.rc"
    rm -f "$command"
  done
  sleep 0.2
done
kill $(pgrep -f 'kubenode.* kubelet') 2> /dev/null
kill $(pgrep -x containerd) 2> /dev/null
step stopped
"""


def _tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def node_info(host: Node, name: str) -> dict[str, str]:
    """The node's own account of itself: kubelet, runtime and kernel."""
    info: dict[str, str] = host.get(f"/api/v1/nodes/{name}")["status"]["nodeInfo"]
    return info
