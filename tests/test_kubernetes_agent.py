"""`kuscale agent --kubernetes` end to end against fakes: a kubelet's pod-resources socket,
an API server over HTTP, and a cgroup v1 tree shaped like the kubelet's."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from conftest import V1_CPU_FILES, V1_CPUACCT_FILES, write_files
from test_apiserver import DIGEST, UID, FakeApiServer, pod, write_kubeconfig
from test_exporter import free_port
from test_podresources import container, serving

from kuscale import faults
from kuscale.backends.cgroup import CgroupV1
from kuscale.backends.vgpu import VgpuLayer
from kuscale.cli import main
from kuscale.config import AgentConfig, GpuLayerConfig
from kuscale.deviceplugin import api_pb2 as plugin_api
from kuscale.deviceplugin import api_pb2_grpc as plugin_rpc
from kuscale.kubernetes import podresources_pb2 as api
from kuscale.kubernetes import podresources_pb2_grpc as rpc
from kuscale.kubernetes.agent import KubeletPaths, KubernetesAgent
from kuscale.kubernetes.apiserver import NodePods
from kuscale.kubernetes.discovery import KubernetesDiscovery
from kuscale.model import PodSpec, PodStatus
from kuscale.monitor import Monitor, PodAdded, PodRemoved, Stop
from kuscale.originals import OriginalsRecord

POD_CGROUP = f"kubepods/burstable/pod{UID}"
CONTAINER_CGROUP = f"{POD_CGROUP}/{DIGEST}"
TOKENS = [f"token-{i}" for i in range(50)]


class Kubelet(rpc.PodResourcesListerServicer):
    """The trainer holds 50 tokens: what half a core costs at the default CPU price."""

    def List(  # noqa: N802
        self, request: api.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api.ListPodResourcesResponse:
        trainer = api.PodResources(
            name="trainer",
            namespace="ml",
            containers=[container("main", ("kuscale.com/token", TOKENS))],
        )
        return api.ListPodResourcesResponse(pod_resources=[trainer])


@pytest.fixture
def pod_resources() -> Iterator[Path]:
    with serving(Kubelet()) as path:
        yield path


def kubelet_tree(root: Path) -> tuple[Path, Path]:
    """The trainer's pod and container cgroups as the kubelet makes them; their quota files."""
    for cgroup in (POD_CGROUP, CONTAINER_CGROUP):
        write_files(root / "cpu" / cgroup, V1_CPU_FILES)
        write_files(root / "cpuacct" / cgroup, V1_CPUACCT_FILES)
    quota = "cpu.cfs_quota_us"
    return root / "cpu" / POD_CGROUP / quota, root / "cpu" / CONTAINER_CGROUP / quota


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_pod_given_tokens_is_found_scaled_and_restored(
    tmp_path: Path, pod_resources: Path
) -> None:
    quota, container_quota = kubelet_tree(tmp_path)
    container_quota.write_text("50000\n")
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    agent = KubernetesAgent(
        AgentConfig(period=0.2),
        apiserver.core,
        "n1",
        tokens=None,
        kubelet=KubeletPaths(pod_resources=pod_resources),
        cgroups=CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct"),
    )
    agent.start()
    try:
        wait_until(
            lambda: (
                "ml/trainer" in agent.monitor.registry.running and quota.read_text().strip() != "-1"
            ),
            "the pod was not adopted and limited",
        )
        pod = agent.monitor.registry.running["ml/trainer"]
        assert (pod.spec.tokens, pod.spec.cgroup, pod.spec.uid) == (50, POD_CGROUP, UID)
        assert pod.spec.containers == (CONTAINER_CGROUP,)
        assert int(quota.read_text()) > 0
        assert container_quota.read_text().strip() == "-1"
    finally:
        agent.stop()
        apiserver.server.shutdown()
    assert quota.read_text().strip() == "-1"
    assert container_quota.read_text().strip() == "50000"


def test_the_cli_refuses_missing_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["agent", "--local"]) == 2
    assert "--local needs --state-dir" in capsys.readouterr().err
    missing = ["agent", "--kubernetes", "--kubeconfig", str(tmp_path / "nope")]
    assert main([*missing, "--metrics-address", ""]) == 2
    assert "kuscale agent: error" in capsys.readouterr().err
    assert main(["agent", "--kubernetes", "--tokens", "-1"]) == 2
    assert "--tokens must be 0 or more" in capsys.readouterr().err
    local_resize = ["agent", "--local", "--state-dir", str(tmp_path), "--actuator", "resize"]
    assert main(local_resize) == 2
    assert "--actuator resize needs --kubernetes" in capsys.readouterr().err


def agent_process(
    tmp_path: Path, server: str, pod_resources: Path, metrics: str = ""
) -> subprocess.Popen[str]:
    """`kuscale agent --kubernetes` as a process against the fakes, advertising no tokens,
    its record under tmp_path/originals."""
    command = [sys.executable, "-m", "kuscale", "agent", "--kubernetes", "--tokens", "0",
               "--kubeconfig", str(write_kubeconfig(tmp_path / "kubeconfig", server)),
               "--pod-resources-socket", str(pod_resources),
               "--record-dir", str(tmp_path / "originals"),
               "--metrics-address", metrics, "--node-name", "n1"]  # fmt: skip
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def stopped(process: subprocess.Popen[str], apiserver: FakeApiServer) -> str:
    """SIGTERM, then what the agent logged; the fake API server goes too."""
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=20)
    apiserver.server.shutdown()
    return stderr


def test_kuscale_agent_kubernetes_runs_until_sigterm(tmp_path: Path, pod_resources: Path) -> None:
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    process = agent_process(tmp_path, apiserver.url, pod_resources)
    stderr = ""
    try:
        deadline = time.monotonic() + 15
        while apiserver.lists == 0:
            assert time.monotonic() < deadline and process.poll() is None, "no list from the agent"
            time.sleep(0.1)
    finally:
        stderr = stopped(process, apiserver)
    assert process.returncode == 0, stderr
    assert "agent running on node n1" in stderr


def test_allocate_makes_the_vgpu_that_discovery_then_scales(
    tmp_path: Path, pod_resources: Path
) -> None:
    kubelet_tree(tmp_path)
    vgpu = tmp_path / "vgpu" / "kuscale-0"
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    config = replace(
        AgentConfig(period=0.2), gpu_layer=GpuLayerConfig(kind="vgpu", root=str(tmp_path / "vgpu"))
    )
    plugins = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    agent = KubernetesAgent(
        config.validate(),
        apiserver.core,
        "n1",
        tokens=len(TOKENS),
        kubelet=KubeletPaths(device_plugins=plugins, pod_resources=pod_resources),
        cgroups=CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct"),
    )
    agent.start()
    try:
        wait_until((plugins / "kuscale.sock").exists, "the plugin is not serving")
        with grpc.insecure_channel(f"unix://{plugins / 'kuscale.sock'}") as channel:
            wanted = plugin_api.ContainerAllocateRequest(devices_ids=TOKENS)
            answer = plugin_rpc.DevicePluginStub(channel).Allocate(
                plugin_api.AllocateRequest(container_requests=[wanted]), timeout=5
            )
        assert answer.container_responses[0].envs["KUSCALE_VGPU_ID"] == "kuscale-0"
        wait_until(
            lambda: (vgpu / "gpu_limit").exists() and (vgpu / "gpu_limit").read_text() != "1000",
            "the pod's vGPU was not limited",
        )
        pod = agent.monitor.registry.running["ml/trainer"]
        assert pod.spec.vgpu_id == "kuscale-0" and pod.status is PodStatus.RUNNING
    finally:
        agent.stop()
        apiserver.server.shutdown()
        shutil.rmtree(plugins, ignore_errors=True)
    assert (vgpu / "gpu_limit").read_text() == "1000"


def test_a_pod_is_taken_up_only_once_all_its_containers_have_started(
    tmp_path: Path, pod_resources: Path
) -> None:
    kubelet_tree(tmp_path)
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    apiserver.pods = [pod("trainer", started=False)]
    node_pods = NodePods(apiserver.core, "n1")
    discovery = KubernetesDiscovery(
        node_pods,
        CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct"),
        lambda _event: None,
        interval=1.0,
        pod_resources_socket=pod_resources,
    )
    try:
        node_pods.sync()
        assert discovery.specs() == {}
        apiserver.pods = [pod("trainer")]
        node_pods.sync()
        assert list(discovery.specs()) == ["ml/trainer"]
    finally:
        apiserver.server.shutdown()


TRAINER = PodSpec(
    name="trainer",
    namespace="ml",
    tokens=50,
    cgroup=POD_CGROUP,
    uid=UID,
    containers=(CONTAINER_CGROUP,),
)


def at_point(monkeypatch: pytest.MonkeyPatch, point: str, action: Callable[[], None]) -> None:
    """`action` runs the first time the monitor passes `point`, as another process's event
    would land there: the agent's fault points, with the other process's step as the fault."""
    passed = [False]

    def reached(name: str) -> None:
        if name == point and not passed[0]:
            passed[0] = True
            action()

    monkeypatch.setattr(faults, "reached", reached)


@pytest.mark.parametrize("point", ["adopt.inspected", "adopt.recorded", "adopt.held"])
def test_a_pod_deleted_while_the_agent_adopts_it_is_forgotten_with_nothing_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The kubelet removes a deleted pod's cgroups whatever the agent is doing, and the API
    server's watch says so a moment later."""
    kubelet_tree(tmp_path)
    cgroups = CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")
    record = OriginalsRecord(tmp_path / "record")
    monitor = Monitor(cgroups, None, AgentConfig(period=0.5), originals=record)

    def deleted() -> None:
        for root in ("cpu", "cpuacct"):
            shutil.rmtree(tmp_path / root / POD_CGROUP)
        monitor.submit(PodRemoved(TRAINER.key))

    at_point(monkeypatch, point, deleted)
    monitor.submit(PodAdded(TRAINER))
    for now in (0.0, 0.5, 1.0):
        monitor.tick(now)
    assert TRAINER.key not in monitor.registry.running
    assert list(record.entries()) == []
    assert not (tmp_path / "cpu" / POD_CGROUP).exists(), "a write made the cgroup anew"
    monitor.restore()
    assert list(record.entries()) == []


@pytest.mark.parametrize("point", ["adopt.recorded", "adopt.held", "tick.written"])
def test_sigterm_while_an_adoption_writes_its_first_limit_gives_everything_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The stop the SIGTERM handler submits lands mid-adoption; the loop finishes the step
    it is in, then gives back what the kubelet set."""
    quota, container_quota = kubelet_tree(tmp_path)
    container_quota.write_text("50000\n")
    cgroups = CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")
    record = OriginalsRecord(tmp_path / "record")
    monitor = Monitor(cgroups, None, AgentConfig(period=0.05), originals=record)
    at_point(monkeypatch, point, lambda: monitor.submit(Stop()))
    monitor.submit(PodAdded(TRAINER))
    monitor.run()
    assert monitor.stats.ticks >= 1
    assert (quota.read_text().strip(), container_quota.read_text().strip()) == ("-1", "50000")
    assert (tmp_path / "cpu" / POD_CGROUP / "cpu.shares").read_text().strip() == "1024"
    assert list(record.entries()) == []


def healthz(address: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


def test_a_new_agent_waits_healthy_for_the_old_one_to_give_the_record_back(
    tmp_path: Path, pod_resources: Path
) -> None:
    """A rolling update with maxSurge: the new pod's agent starts while the old one holds the
    record; it answers its probes and waits, lists no pod, and takes over once the record
    is given back (or leaves at a SIGTERM)."""
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    old = OriginalsRecord(tmp_path / "originals")
    old.lock()
    address = f"127.0.0.1:{free_port()}"
    process = agent_process(tmp_path, apiserver.url, pod_resources, address)
    stderr = ""
    try:
        wait_until(lambda: healthz(address)[0] == 200, "the waiting agent answers its probe")
        assert "waiting for the agent before this one" in healthz(address)[1]
        assert apiserver.lists == 0, "a waiting agent must not manage pods yet"
        old.unlock()
        wait_until(lambda: apiserver.lists > 0, "the new agent takes over")
    finally:
        stderr = stopped(process, apiserver)
    assert process.returncode == 0, stderr
    assert "took the record over from the agent before this one" in stderr


def test_an_agent_stopped_while_it_waits_for_the_record_leaves_at_once(
    tmp_path: Path, pod_resources: Path
) -> None:
    OriginalsRecord(tmp_path / "originals").lock()
    process = agent_process(tmp_path, "http://127.0.0.1:9", pod_resources)
    assert process.stderr is not None
    for line in process.stderr:
        if "waiting until it gives the record back" in line:
            break
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0


def test_the_device_plugin_is_gone_before_the_record_is_let_go(
    tmp_path: Path, pod_resources: Path
) -> None:
    """A rolling update's next agent serves the plugin's socket, under the same name, as soon
    as it holds the record; gRPC removes a unix socket's path as its server stops, so a
    plugin stopped after the record was let go took the new agent's socket (seen on the real
    node: the node offered no tokens for minutes after a rollout)."""
    kubelet_tree(tmp_path)
    apiserver = FakeApiServer()
    threading.Thread(target=apiserver.server.serve_forever, daemon=True).start()
    plugins = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    record = OriginalsRecord(tmp_path / "originals")
    record.lock()
    agent = KubernetesAgent(
        AgentConfig(period=0.2),
        apiserver.core,
        "n1",
        tokens=len(TOKENS),
        kubelet=KubeletPaths(device_plugins=plugins, pod_resources=pod_resources),
        cgroups=CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct"),
        originals=record,
    )
    assert agent.plugin is not None
    stop_plugin = agent.plugin.stop
    seen: list[tuple[bool, bool]] = []

    def stopping_plugin() -> None:
        seen.append((OriginalsRecord(record.directory).busy(), agent.plugin is not None))
        stop_plugin()

    agent.plugin.stop = stopping_plugin  # type: ignore[method-assign]
    agent.start()
    try:
        wait_until((plugins / "kuscale.sock").exists, "the plugin serves")
    finally:
        agent.stop()
        apiserver.server.shutdown()
        shutil.rmtree(plugins, ignore_errors=True)
    assert seen and seen[0] == (True, True), "the plugin stopped after the record was let go"
    assert not OriginalsRecord(record.directory).busy()


def test_a_vgpu_limit_emptied_by_a_killed_agent_is_adopted_from_the_record(
    tmp_path: Path,
) -> None:
    """A vGPU file is truncated, then written: an agent SIGKILLed between the two leaves it
    empty. The next agent adopts the pod from the record, and gives back what the record
    says was there before any agent touched it."""
    kubelet_tree(tmp_path)
    cgroups = CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")
    layer = VgpuLayer(tmp_path / "vgpu")
    layer.create("trainer-gpu")
    layer.write_limit("trainer-gpu", 40.0)
    record = OriginalsRecord(tmp_path / "record")
    gpu_pod = replace(TRAINER, vgpu_id="trainer-gpu")
    first = Monitor(cgroups, layer, AgentConfig(period=0.5), originals=record)
    first.submit(PodAdded(gpu_pod))
    first.tick(0.0)
    assert gpu_pod.key in first.registry.running
    (tmp_path / "vgpu" / "trainer-gpu" / "gpu_limit").write_text("")
    second = Monitor(cgroups, layer, AgentConfig(period=0.5), originals=record)
    second.submit(PodAdded(gpu_pod))
    second.tick(1.0)
    adopted = second.registry.running[gpu_pod.key]
    assert adopted.status is PodStatus.RUNNING and adopted.taken_over, adopted.reason
    second.restore()
    assert layer.read_limit("trainer-gpu") == pytest.approx(40.0)
    assert list(record.entries()) == []
