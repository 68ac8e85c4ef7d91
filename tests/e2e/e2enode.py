"""A real single-node Kubernetes cluster on this machine, for the end-to-end tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the kubelet and kubectl come
from one program of ours over the Kubernetes Go modules (`e2e/node`), at the release its go.mod
pins; containerd, runc and the CNI plugins come from Debian. The node keeps everything it
makes under WORK (certificates, configs, logs, containerd's state), one bridge (BRIDGE), the
kubelet's `kubepods` cgroups, and the kubelet's own state where an operator's kubelet keeps it
(/var/lib/kubelet, so the shipped DaemonSet's host paths hold as written); `teardown` removes
all of it, also what a run that was killed left: a new run cleans an earlier run's leftovers
(it finds WORK's marker), and refuses to start where `kubepods` cgroups or a kubelet's state
exist that no run of this harness made (a kubelet of the machine's own may be running).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from e2e import ociimage

REPO = Path(__file__).resolve().parents[2]
GO_PROGRAM = REPO / "e2e" / "node"
WORK = Path("/var/lib/kuscale-e2e")
MARKER = WORK / "made-by-kuscale-e2e"
NODE_NAME = "kuscale-e2e"
BRIDGE = "kse2e0"
POD_SUBNET = "10.213.77.0/24"
GATEWAY = "10.213.77.1"
"""The bridge's own address, the pods' gateway: the API server listens here, so a pod (the
agent's, as the DaemonSet runs it) reaches it where no kube-proxy routes the service's IP."""
SERVICE_RANGE = "10.213.78.0/24"
SERVICE_IP = "10.213.78.1"
CGROUP_ROOT = Path("/sys/fs/cgroup")
DEBIAN_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "busybox-static")
CNI_BIN = Path("/usr/lib/cni")
IMAGE = "kuscale.test/busybox:1"
PAUSE_IMAGE = "kuscale.test/pause:1"
NETNS_DIR = Path("/var/run/netns")
KUBELET_HOME = Path("/var/lib/kubelet")
DEVICE_PLUGINS = KUBELET_HOME / "device-plugins"
"""Where the kubelet serves device plugins whatever its --root-dir: a path compiled into it."""
CONTAINER_LOG_LINKS = Path("/var/log/containers")
CNI_RESULTS = Path("/var/lib/cni/results")
LOG_TAIL = 30
KEEP_LOGS_ENV = "KUSCALE_E2E_LOGS"
"""A directory the node's and the agents' logs are copied to before the teardown."""
CAP_SYS_RESOURCE = 24
APT_LOCK_WAIT = ("-o", "DPkg::Lock::Timeout=600")
"""Debian's apt waits this long for a dpkg lock another apt-get holds, instead of failing."""


class NodeUnavailable(Exception):
    """A prerequisite is missing (no Go, no module proxy, not root, a kubelet of the machine's
    own): tests skip, saying why. Anything else that keeps the node from starting fails."""


class ComponentFailed(Exception):
    """A component did not start or died: the message carries its last log lines."""


def release() -> str:
    """The Kubernetes release the Go program pins, from its go.mod."""
    found = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", _go_mod(), re.M)
    if found:
        return found.group(1)
    raise NodeUnavailable("e2e/node/go.mod does not require k8s.io/kubernetes")


def _go_mod() -> str:
    return (GO_PROGRAM / "go.mod").read_text()


def _run(argv: list[str], timeout: float = 120, **kwargs: Any) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    if done.returncode != 0:
        raise ComponentFailed(f"{' '.join(argv)} failed:\n{done.stderr or done.stdout}")
    return str(done.stdout)


def build_components() -> Path:
    """The node program, built once per source state into the user's cache; Go's own build
    cache makes a rebuild after a change cost seconds."""
    if shutil.which("go") is None:
        raise NodeUnavailable("Go is not installed: the Kubernetes components cannot be built")
    sources = [*sorted(GO_PROGRAM.glob("*.go")), GO_PROGRAM / "go.mod", GO_PROGRAM / "go.sum"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kuscale-e2e"
    binary = cache / f"kubenode-{release()}-{digest}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    version = f"-X k8s.io/component-base/version.gitVersion={release()}"
    _go("vet", "-trimpath", ".")
    _go("build", "-trimpath", "-ldflags", f"-s -w {version}", "-o", str(binary), ".")
    return binary


def _go(*args: str) -> None:
    """One go command on the node program; vet and build share the compiled packages, as
    both use -trimpath."""
    done = subprocess.run(
        ["go", *args], cwd=GO_PROGRAM, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-LOG_TAIL:])
        if "proxy.golang.org" in tail or "dial tcp" in tail or "no such host" in tail:
            raise NodeUnavailable(f"the Go module proxy cannot be reached:\n{tail}")
        raise ComponentFailed(f"go {args[0]} of the Kubernetes components failed:\n{tail}")


def install_debian_packages(packages: tuple[str, ...] = DEBIAN_PACKAGES) -> None:
    """`packages` (by default containerd, runc, the CNI plugins and busybox-static, without
    which the node cannot run), from Debian when root and missing. A dpkg lock another
    apt-get holds (the machine's own upgrades) is waited for, and a failed install fails the
    tests."""
    missing = [p for p in packages if not _installed(p)]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise NodeUnavailable(f"{', '.join(missing)} missing and no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q", *APT_LOCK_WAIT], timeout=900, env=env)
    _run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_LOCK_WAIT, *missing],
        timeout=1500,
        env=env,
    )


def _installed(package: str) -> bool:
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return done.stdout.endswith("installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Component:
    """One process of the node, its output kept in its own log."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    """The process's whole environment; None: this one's."""
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )

    def tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL:])

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ComponentFailed(
                f"{self.name} exited with {self.process.returncode}; its last lines:\n"
                + self.tail()
            )

    def stop(self, grace: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def wait_for(
    condition: Callable[[], bool], what: str, component: Component, deadline: float = 120.0
) -> None:
    """Poll `condition` until it holds; a component that dies or a deadline missed fails with
    that component's last log lines."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        component.check()
        try:
            if condition():
                return
        except (OSError, ValueError, ssl.SSLError):
            pass
        time.sleep(0.5)
    raise ComponentFailed(
        f"{what}: not within {deadline:.0f} s; {component.name}'s last lines:\n" + component.tail()
    )


@dataclass
class Certificates:
    """A throwaway CA and the certificates the node's parts present to each other."""

    directory: Path

    def make(self) -> None:
        self.directory.mkdir(parents=True)
        ca = self.directory / "ca"
        _run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "2", "-subj", "/CN=kuscale-e2e-ca",
             "-keyout", f"{ca}.key", "-out", f"{ca}.crt"]
        )  # fmt: skip
        self.issue(
            "apiserver",
            "/CN=kube-apiserver",
            f"IP:127.0.0.1,IP:{GATEWAY},IP:{SERVICE_IP},DNS:localhost,DNS:kubernetes.default.svc",
        )
        self.issue("admin", "/O=system:masters/CN=kuscale-e2e-admin")
        self.issue("scheduler", "/CN=system:kube-scheduler")
        self.issue("controller-manager", "/CN=system:kube-controller-manager")
        self.issue("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
        _run(["openssl", "genrsa", "-out", str(self.directory / "service-accounts.key"), "2048"])

    def issue(self, name: str, subject: str, alt_names: str = "") -> None:
        key, request, cert = (self.directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        _run(
            ["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-subj", subject, "-keyout", str(key), "-out", str(request)]
        )  # fmt: skip
        extensions = self.directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName={alt_names}\n" if alt_names else "\n")
        _run(
            ["openssl", "x509", "-req", "-in", str(request), "-days", "2",
             "-CA", str(self.directory / "ca.crt"), "-CAkey", str(self.directory / "ca.key"),
             "-CAcreateserial", "-extfile", str(extensions), "-out", str(cert)]
        )  # fmt: skip

    def path(self, name: str) -> Path:
        return self.directory / name


def kubeconfig(server: str, ca: Path, user: dict[str, str]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": "e2e", "user": user}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}],
            "current-context": "e2e",
        }
    )


@dataclass(frozen=True)
class Runtime:
    """Where a node's containerd keeps its state and finds its CNI network: the host node's
    under WORK, the guest node's on its own tmpfs."""

    root: str
    state: str
    socket: str
    cni_dir: str
    restrict_oom_score_adj: bool


def containerd_config(runtime: Runtime) -> str:
    return f"""version = 2
root = "{runtime.root}"
state = "{runtime.state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{runtime.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = {str(runtime.restrict_oom_score_adj).lower()}
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runtime.state}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{runtime.cni_dir}"
"""


def _lacks_sys_resource() -> bool:
    """Whether this process lacks CAP_SYS_RESOURCE (some sandboxes drop it): the kubelet asks
    for a pod sandbox's oom_score_adj of -998, which then only containerd's
    `restrict_oom_score_adj` lets runc start."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return not int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1
    return True


def cni_config(name: str, bridge: str, subnet: str, ipam_dir: str, routed: bool) -> str:
    """A bridge network. `routed` where the pods reach past the node (the guest's, whose API
    server is on the host): a default route through the bridge, and masquerading, since
    qemu's user network answers only the guest's own address."""
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": bridge,
                    "isGateway": True,
                    "isDefaultGateway": routed,
                    "ipMasq": routed,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": subnet}]],
                        "dataDir": ipam_dir,
                    },
                },
            ],
        }
    )


def kubelet_config(ca: Path, runtime: Runtime, pod_logs: Path, serving: dict[str, Any]) -> str:
    """The kubelet's settings: the cgroupfs driver (cgroup v1 on the host, where
    `failCgroupV1: false` lets a kubelet of 1.35 or later start; v2 in the guest); a 5 s sync
    (1 min by default), so a resync that would rewrite a cgroup shows within a test; the
    node's status sent every 2 s (10 s), so a plugin's tokens show in it within seconds.
    `serving`: where the kubelet listens."""
    return yaml.safe_dump(
        {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{runtime.socket}",
            **serving,
            "readOnlyPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(ca)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "failSwapOn": False,
            "syncFrequency": "5s",
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "2s",
            "resolvConf": "",
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "maxPods": 110,
            "podLogsDir": str(pod_logs),
            "serializeImagePulls": False,
        }
    )


@dataclass
class Node:
    """The running node; `start` brings it up, `teardown` removes everything it made."""

    binary: Path
    ports: dict[str, int] = field(default_factory=dict)
    components: dict[str, Component] = field(default_factory=dict)

    @property
    def certs(self) -> Certificates:
        return Certificates(WORK / "pki")

    @property
    def server(self) -> str:
        return f"https://{GATEWAY}:{self.ports['apiserver']}"

    @property
    def admin_kubeconfig(self) -> Path:
        return WORK / "admin.kubeconfig"

    @property
    def kubelet_dir(self) -> Path:
        return KUBELET_HOME

    @property
    def device_plugins(self) -> Path:
        return DEVICE_PLUGINS

    @cached_property
    def runtime(self) -> Runtime:
        return Runtime(
            root=f"{WORK}/containerd/root",
            state=f"{WORK}/containerd/state",
            socket=f"{WORK}/containerd.sock",
            cni_dir=f"{WORK}/cni",
            restrict_oom_score_adj=_lacks_sys_resource(),
        )

    @property
    def pod_resources(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    def start(self) -> None:
        clean_leftovers()
        WORK.mkdir(parents=True)
        MARKER.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "netns": sorted(_netns()),
                    "bridge": BRIDGE,
                    "kubelet_home": not _listing(KUBELET_HOME)
                    or _only_empty_plugins_dir(KUBELET_HOME),
                }
            )
        )
        self.ports = {
            name: free_port()
            for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler",
                         "kubelet")
        }  # fmt: skip
        self.ports["kubelet-healthz"] = free_port()
        (WORK / "logs").mkdir()
        self.certs.make()
        self._write_kubeconfigs()
        self._make_bridge()
        self._start_containerd()
        self._start_etcd()
        self._start_apiserver()
        self._start_controller_manager()
        self._start_scheduler()
        self._start_kubelet()

    def _write_kubeconfigs(self) -> None:
        ca = self.certs.path("ca.crt")
        for name in ("admin", "controller-manager", "scheduler", "kubelet"):
            user = {
                "client-certificate": str(self.certs.path(f"{name}.crt")),
                "client-key": str(self.certs.path(f"{name}.key")),
            }
            (WORK / f"{name}.kubeconfig").write_text(kubeconfig(self.server, ca, user))

    def _make_bridge(self) -> None:
        """The pods' bridge with its gateway address, made before the API server that listens
        on it (the CNI bridge plugin takes a bridge that already holds its gateway)."""
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{GATEWAY}/{POD_SUBNET.partition('/')[2]}", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])

    def _launch(self, name: str, argv: list[str]) -> Component:
        component = Component(name, argv, WORK / "logs" / f"{name}.log")
        self.components[name] = component
        component.start()
        return component

    def ctr(self, *args: str, timeout: float = 120) -> str:
        return _run(
            ["ctr", "--address", str(WORK / "containerd.sock"), "-n", "k8s.io", *args],
            timeout=timeout,
        )

    def _start_containerd(self) -> None:
        (WORK / "cni").mkdir()
        (WORK / "cni" / "10-kuscale-e2e.conflist").write_text(
            cni_config("kuscale-e2e", BRIDGE, POD_SUBNET, f"{WORK}/cni-ipam", routed=False)
        )
        (WORK / "containerd.toml").write_text(containerd_config(self.runtime))
        containerd = self._launch(
            "containerd", ["containerd", "--config", str(WORK / "containerd.toml")]
        )
        wait_for(lambda: bool(self.ctr("version")), "containerd answers", containerd, 60)
        archive = WORK / "images.tar"
        busybox = shutil.which("busybox") or "/bin/busybox"
        ociimage.write_busybox_archive(Path(busybox), [IMAGE, PAUSE_IMAGE], archive)
        self.ctr("images", "import", str(archive))

    def _launch_hosted(self, name: str, flags: list[str]) -> Component:
        """One of the components the node's Go program hosts, run as its own process."""
        return self._launch(name, [str(self.binary), name, *flags])

    def _start_serving(
        self,
        name: str,
        flags: list[str],
        health: str,
        tls: ssl.SSLContext | None,
        what: str,
        deadline: float,
    ) -> None:
        """A hosted component, up once its health URL answers 200."""
        component = self._launch_hosted(name, flags)
        wait_for(lambda: http_ok(health, tls), what, component, deadline)

    def _start_etcd(self) -> None:
        self._start_serving(
            "etcd",
            [
                f"--data-dir={WORK}/etcd",
                f"--listen-client-url=http://127.0.0.1:{self.ports['etcd']}",
                f"--listen-peer-url=http://127.0.0.1:{self.ports['etcd-peer']}",
            ],
            f"http://127.0.0.1:{self.ports['etcd']}/health", None, "etcd is healthy", 60,
        )  # fmt: skip

    def _start_apiserver(self) -> None:
        certs = self.certs
        self._start_serving(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--bind-address={GATEWAY}",
                f"--advertise-address={GATEWAY}",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={certs.path('apiserver.crt')}",
                f"--tls-private-key-file={certs.path('apiserver.key')}",
                f"--client-ca-file={certs.path('ca.crt')}",
                f"--service-account-key-file={certs.path('service-accounts.key')}",
                f"--service-account-signing-key-file={certs.path('service-accounts.key')}",
                f"--service-account-issuer={self.server}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                f"--cert-dir={WORK}/pki/generated",
            ],
            f"{self.server}/readyz", self.tls, "the API server is ready", 180,
        )  # fmt: skip

    @cached_property
    def tls(self) -> ssl.SSLContext:
        """The administrator's TLS context, made once: every poll and request uses it."""
        context = ssl.create_default_context(cafile=str(self.certs.path("ca.crt")))
        context.load_cert_chain(self.certs.path("admin.crt"), self.certs.path("admin.key"))
        return context

    def _start_controller_manager(self) -> None:
        """The controllers the shipped manifests need: the DaemonSet's (its pods and rolling
        updates), the garbage collector (a deleted DaemonSet's pods), the namespace's (an
        uninstall), the service accounts' and the root CA's publisher (every pod's token).
        No node lifecycle controller: the harness untaints the node, and nothing evicts a
        pod of a node whose status is late on a busy machine."""
        certs = self.certs
        self._start_serving(
            "kube-controller-manager",
            [
                f"--kubeconfig={WORK}/controller-manager.kubeconfig",
                f"--authentication-kubeconfig={WORK}/controller-manager.kubeconfig",
                f"--authorization-kubeconfig={WORK}/controller-manager.kubeconfig",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['controller-manager']}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--root-ca-file={certs.path('ca.crt')}",
                f"--service-account-private-key-file={certs.path('service-accounts.key')}",
                "--controllers=daemonset-controller,garbage-collector-controller,"
                "namespace-controller,serviceaccount-controller,"
                "root-ca-certificate-publisher-controller",
                "--concurrent-gc-syncs=2",
            ],
            f"https://127.0.0.1:{self.ports['controller-manager']}/healthz", _insecure(),
            "the controller manager is healthy", 120,
        )  # fmt: skip

    def _start_scheduler(self) -> None:
        self._start_serving(
            "kube-scheduler",
            [
                f"--kubeconfig={WORK}/scheduler.kubeconfig",
                f"--authentication-kubeconfig={WORK}/scheduler.kubeconfig",
                f"--authorization-kubeconfig={WORK}/scheduler.kubeconfig",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                "--leader-elect=false",
            ],
            f"https://127.0.0.1:{self.ports['scheduler']}/healthz", _insecure(),
            "the scheduler is healthy", 120,
        )  # fmt: skip

    def _start_kubelet(self) -> None:
        serving = {
            "address": "127.0.0.1",
            "port": self.ports["kubelet"],
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.ports["kubelet-healthz"],
        }
        config = kubelet_config(self.certs.path("ca.crt"), self.runtime, WORK / "pod-logs", serving)
        (WORK / "kubelet.yaml").write_text(config)
        self.kubelet_dir.mkdir(exist_ok=True)
        self.launch_kubelet()
        wait_for(self.node_ready, "the node is Ready", self.components["kubelet"], 180)
        self.kubectl("taint", "node", NODE_NAME, "node.kubernetes.io/not-ready:NoSchedule-")

    def kubectl(self, *args: str) -> str:
        """kubectl as the cluster's administrator. The kubelet registers its node tainted
        not-ready and, with no controller manager here, the harness takes the taint off once
        the node is Ready, as the node lifecycle controller would."""
        return _run(self.kubectl_argv(*args))

    def kubectl_argv(self, *args: str) -> list[str]:
        """kubectl from the node's own program, at the node's release, as the administrator."""
        return [str(self.binary), "kubectl", f"--kubeconfig={self.admin_kubeconfig}", *args]

    def launch_kubelet(self) -> Component:
        return self._launch_hosted(
            "kubelet",
            [
                f"--config={WORK}/kubelet.yaml",
                f"--kubeconfig={WORK}/kubelet.kubeconfig",
                f"--root-dir={self.kubelet_dir}",
                f"--cert-dir={WORK}/kubelet-pki",
                f"--hostname-override={NODE_NAME}",
            ],
        )  # fmt: skip

    def node_ready(self) -> bool:
        node = self.get(f"/api/v1/nodes/{NODE_NAME}")
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.server + path, context=self.tls, timeout=10) as reply:
            answer: dict[str, Any] = json.load(reply)
            return answer

    def memory_bytes(self) -> int:
        """The resident memory of every process of the node: its components, containerd's
        shims and the pods' processes."""
        pids = {c.process.pid for c in self.components.values() if c.process is not None}
        pids |= _node_pids() | set(_cgroup_pids())
        total = 0
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    def teardown(self) -> None:
        """Pods first, through the kubelet (so the CNI plugin gives back their addresses and
        namespaces), then the components, then whatever is still left."""
        kubelet = self.components.get("kubelet")
        if kubelet is not None and kubelet.process is not None and kubelet.process.poll() is None:
            try:
                self._delete_all_pods()
            except (OSError, ValueError, ComponentFailed) as err:
                print(f"e2e node: pods could not be deleted through the kubelet: {err}")
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver",
                     "etcd"):  # fmt: skip
            if name in self.components:
                self.components[name].stop()
        kept = os.environ.get(KEEP_LOGS_ENV)
        if kept and (WORK / "logs").is_dir():
            shutil.copytree(WORK / "logs", Path(kept), dirs_exist_ok=True)
        clean_leftovers(self.components.get("containerd"))

    def _delete_all_pods(self) -> None:
        self.kubectl(
            "delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--timeout=90s"
        )


def http_ok(url: str, context: ssl.SSLContext | None) -> bool:
    with urllib.request.urlopen(url, context=context, timeout=5) as reply:
        return bool(reply.status == 200)


def _insecure() -> ssl.SSLContext:
    """The scheduler and the controller manager serve certificates they made themselves; only
    their health is asked."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _netns() -> set[str]:
    try:
        return {p.name for p in NETNS_DIR.iterdir()}
    except FileNotFoundError:
        return set()


def _node_pids() -> set[int]:
    """Every process of the node but this one: the components, containerd and its shims all
    name WORK on their command lines."""
    return pids_naming(f"{WORK}/")


def pids_naming(needle: str) -> set[int]:
    """Every process but this one whose command line holds `needle`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle.encode() in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _kubepods_dirs() -> list[Path]:
    return [h / "kubepods" for h in CGROUP_ROOT.iterdir() if (h / "kubepods").is_dir()]


def _cgroup_pids() -> Iterator[int]:
    for top in _kubepods_dirs():
        for procs in top.rglob("cgroup.procs"):
            try:
                yield from (int(pid) for pid in procs.read_text().split())
            except (OSError, ValueError):
                continue


def clean_leftovers(containerd: Component | None = None) -> None:
    """Remove what this harness made, whether this run made it or a run that was killed did;
    refuse, saying why, where `kubepods` cgroups exist and nothing says this harness made
    them."""
    if not MARKER.exists():
        if _kubepods_dirs():
            raise NodeUnavailable(
                f"{_kubepods_dirs()[0]} exists and no earlier e2e run made it: a kubelet may be "
                "running on this machine, so the e2e node will not start beside it"
            )
        if (DEVICE_PLUGINS / "kubelet.sock").exists():
            raise NodeUnavailable(
                f"{DEVICE_PLUGINS}/kubelet.sock exists and no earlier e2e run made it: a kubelet "
                "may be running on this machine, so the e2e node will not start beside it"
            )
        if WORK.exists():
            raise NodeUnavailable(f"{WORK} exists and no e2e run made it; remove it first")
        if _listing(KUBELET_HOME) and not _only_empty_plugins_dir(KUBELET_HOME):
            raise NodeUnavailable(
                f"{KUBELET_HOME} holds a kubelet's state no e2e run made: the e2e node's kubelet "
                "keeps its own there, so it will not start beside it"
            )
        return
    made = json.loads(MARKER.read_text())
    _stop_containers(containerd)
    for pid in _node_pids():
        _kill(pid)
        _wait_gone(pid)
    _kill_and_remove_cgroups()
    for name in _netns() - set(made["netns"]):
        if name.startswith("cni-"):
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
    subprocess.run(["ip", "link", "delete", made["bridge"]], check=False, capture_output=True)
    _remove_outside_files(bool(made["kubelet_home"]))
    _unmount_under(WORK)
    shutil.rmtree(WORK)


def _remove_outside_files(kubelet_home: bool) -> None:
    """What the kubelet and the CNI plugins write outside WORK whatever they are told: the
    device-plugin sockets, the containers' log links and the CNI plugins' cached results."""
    if kubelet_home:
        _unmount_under(KUBELET_HOME)
        shutil.rmtree(KUBELET_HOME, ignore_errors=True)
    else:
        for name in ("kubelet.sock", "kuscale.sock"):
            (DEVICE_PLUGINS / name).unlink(missing_ok=True)
    for link in _listing(CONTAINER_LOG_LINKS):
        if link.is_symlink() and os.readlink(link).startswith(f"{WORK}/"):
            link.unlink()
    for result in _listing(CNI_RESULTS):
        if result.name.startswith("kuscale-e2e-"):
            result.unlink()


def _only_empty_plugins_dir(home: Path) -> bool:
    """What a kubelet leaves after a clean stop of its own plugins: nothing of a pod's."""
    return [p.name for p in _listing(home)] == ["device-plugins"] and not _listing(
        home / "device-plugins"
    )


def _listing(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def _stop_containers(containerd: Component | None) -> None:
    """Ask containerd to kill what the kubelet left, while it still runs."""
    if containerd is None or containerd.process is None or containerd.process.poll() is not None:
        return
    socket_path = str(WORK / "containerd.sock")
    base = ["ctr", "--address", socket_path, "-n", "k8s.io"]
    listed = subprocess.run(
        [*base, "tasks", "ls", "-q"], capture_output=True, text=True, check=False, timeout=30
    )
    for task in listed.stdout.split():
        subprocess.run([*base, "tasks", "kill", "-s", "SIGKILL", task], check=False, timeout=30)
        subprocess.run([*base, "tasks", "rm", "-f", task], check=False, timeout=30)
    containerd.stop()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _wait_gone(pid: int, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
        time.sleep(0.1)


def _kill_and_remove_cgroups() -> None:
    """Every process still in a pod's cgroups is killed, then the trees go, deepest first."""
    for _ in range(50):
        pids = list(_cgroup_pids())
        if not pids:
            break
        for pid in pids:
            _kill(pid)
        time.sleep(0.2)
    for top in _kubepods_dirs():
        for directory in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            _rmdir(directory)
        _rmdir(top)


def _rmdir(directory: Path) -> None:
    for _ in range(50):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise ComponentFailed(f"could not remove the cgroup {directory}")


def _unmount_under(root: Path) -> None:
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
