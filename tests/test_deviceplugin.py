"""The token device plugin against a fake kubelet: real gRPC over real unix sockets."""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from random import Random

import grpc
import pytest
from conftest import wait_for
from hypothesis import given
from hypothesis import strategies as st

from kuscale.backends.vgpu import VgpuLayer
from kuscale.cli import main
from kuscale.config import GpuLayerConfig
from kuscale.deviceplugin import api_pb2 as api
from kuscale.deviceplugin import api_pb2_grpc as rpc
from kuscale.deviceplugin.gpulayer import VgpuAllocator, vgpu_id_for
from kuscale.deviceplugin.plugin import (
    DevicePluginServer,
    TokenPlugin,
    node_tokens,
)


class FakeKubelet(rpc.RegistrationServicer):
    """The kubelet's Registration service on `kubelet.sock`, recording every request."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.requests: queue.Queue[api.RegisterRequest] = queue.Queue()
        self.server: grpc.Server | None = None

    def Register(  # noqa: N802
        self, request: api.RegisterRequest, context: grpc.ServicerContext
    ) -> api.Empty:
        self.requests.put(request)
        return api.Empty()

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        self.server.start()

    def restart(self) -> None:
        """What a real kubelet restart does to the directory: every socket is deleted."""
        assert self.server is not None
        self.server.stop(grace=None).wait()
        for socket in self.directory.glob("*.sock"):
            socket.unlink()
        self.start()


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    """Short, so socket paths stay under the 108 bytes a unix socket name allows."""
    directory = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def kubelet(kubelet_dir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(kubelet_dir)
    fake.start()
    yield fake
    assert fake.server is not None
    fake.server.stop(grace=None)


@pytest.fixture
def plugin(kubelet_dir: Path) -> Iterator[DevicePluginServer]:
    allocated: list[list[str]] = []
    server = DevicePluginServer(TokenPlugin(5, on_allocate=allocated.append), kubelet_dir)
    server.start()
    yield server
    server.stop()


def channel_to(server: DevicePluginServer) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{server.socket}")


def test_the_plugin_registers_and_advertises_its_tokens(
    kubelet: FakeKubelet, plugin: DevicePluginServer
) -> None:
    request = kubelet.requests.get(timeout=5)
    assert (request.version, request.endpoint, request.resource_name) == (
        "v1beta1",
        "kuscale.sock",
        "kuscale.com/token",
    )
    with channel_to(plugin) as channel:
        stub = rpc.DevicePluginStub(channel)
        first = next(iter(stub.ListAndWatch(api.Empty(), timeout=5)))
        assert [d.ID for d in first.devices] == [f"token-{i}" for i in range(5)]
        assert {d.health for d in first.devices} == {"Healthy"}
        assert stub.GetDevicePluginOptions(api.Empty()).get_preferred_allocation_available


def test_allocate_answers_each_container_and_refuses_tokens_that_do_not_exist(
    kubelet: FakeKubelet, plugin: DevicePluginServer
) -> None:
    with channel_to(plugin) as channel:
        stub = rpc.DevicePluginStub(channel)
        wanted = api.ContainerAllocateRequest(devices_ids=["token-0", "token-3"])
        answer = stub.Allocate(api.AllocateRequest(container_requests=[wanted]), timeout=5)
        assert dict(answer.container_responses[0].envs) == {"KUSCALE_TOKENS": "2"}
        too_many = api.ContainerAllocateRequest(devices_ids=["token-0", "token-9"])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Allocate(api.AllocateRequest(container_requests=[too_many]), timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "token-9" in str(refused.value.details())


def test_the_preferred_allocation_keeps_what_must_be_included(
    kubelet: FakeKubelet, plugin: DevicePluginServer
) -> None:
    wanted = api.ContainerPreferredAllocationRequest(
        available_deviceIDs=["token-1", "token-2", "token-4"],
        must_include_deviceIDs=["token-4"],
        allocation_size=2,
    )
    with channel_to(plugin) as channel:
        answer = rpc.DevicePluginStub(channel).GetPreferredAllocation(
            api.PreferredAllocationRequest(container_requests=[wanted]), timeout=5
        )
    assert list(answer.container_responses[0].deviceIDs) == ["token-4", "token-1"]


def test_a_restarted_kubelet_gets_a_new_registration(
    kubelet: FakeKubelet, plugin: DevicePluginServer
) -> None:
    kubelet.requests.get(timeout=5)
    # A registration retried on a busy machine may still be queued from before the restart:
    # only one that arrives after it counts.
    while not kubelet.requests.empty():
        kubelet.requests.get_nowait()
    kubelet.restart()
    again = kubelet.requests.get(timeout=10)
    assert again.resource_name == "kuscale.com/token"
    wait_for(plugin.socket.exists, timeout=10)
    with channel_to(plugin) as channel:
        first = next(iter(rpc.DevicePluginStub(channel).ListAndWatch(api.Empty(), timeout=5)))
    assert len(first.devices) == 5


def test_a_kubelet_that_is_not_up_yet_is_retried(kubelet_dir: Path) -> None:
    server = DevicePluginServer(TokenPlugin(3), kubelet_dir)
    server.start()
    try:
        time.sleep(0.5)
        assert server.registrations == 0
        fake = FakeKubelet(kubelet_dir)
        fake.start()
        assert fake.requests.get(timeout=10).resource_name == "kuscale.com/token"
        assert fake.server is not None
        fake.server.stop(grace=None)
    finally:
        server.stop()


def test_the_node_advertises_what_its_capacity_costs() -> None:
    assert node_tokens(cores=2, gpus=1, cpu_price=1.0, gpu_price=3.0) == 500
    with pytest.raises(ValueError, match="at least one token"):
        TokenPlugin(0)


def test_kuscale_deviceplugin_serves_until_sigterm(kubelet: FakeKubelet) -> None:
    command = [sys.executable, "-m", "kuscale", "deviceplugin", "--kubelet-dir"]
    process = subprocess.Popen([*command, str(kubelet.directory), "--tokens", "7"])
    try:
        assert kubelet.requests.get(timeout=20).resource_name == "kuscale.com/token"
        with grpc.insecure_channel(f"unix://{kubelet.directory / 'kuscale.sock'}") as channel:
            stub = rpc.DevicePluginStub(channel)
            assert len(next(iter(stub.ListAndWatch(api.Empty(), timeout=5))).devices) == 7
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    assert not (kubelet.directory / "kuscale.sock").exists()


def test_kuscale_deviceplugin_refuses_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deviceplugin", "--kubelet-dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["deviceplugin", "--kubelet-dir", str(tmp_path), "--tokens", "0"]) == 2
    assert "--tokens must be a positive integer" in capsys.readouterr().err


HOOK = "/opt/gemini/lib/libgemhook.so.1"


@pytest.fixture
def gpu_plugin(kubelet_dir: Path, tmp_path: Path) -> Iterator[tuple[DevicePluginServer, Path]]:
    root = tmp_path / "vgpu"
    layer = GpuLayerConfig(
        kind="vgpu",
        root=str(root),
        hook_library=HOOK,
        pod_manager="10.0.0.5:50052",
        env={"GEMINI_WINDOW": "100"},
    ).validate()
    server = DevicePluginServer(
        TokenPlugin(20, gpu=VgpuAllocator(layer, VgpuLayer(root))), kubelet_dir
    )
    server.start()
    yield server, root
    server.stop()


def allocate(server: DevicePluginServer, ids: list[str]) -> api.ContainerAllocateResponse:
    with channel_to(server) as channel:
        wanted = api.ContainerAllocateRequest(devices_ids=ids)
        answer = rpc.DevicePluginStub(channel).Allocate(
            api.AllocateRequest(container_requests=[wanted]), timeout=5
        )
    response: api.ContainerAllocateResponse = answer.container_responses[0]
    return response


def test_allocate_gives_a_fresh_vgpu_mounted_with_the_gemini_hooks_variables(
    gpu_plugin: tuple[DevicePluginServer, Path],
) -> None:
    server, root = gpu_plugin
    stale = root / "kuscale-9"
    stale.mkdir(parents=True)
    (stale / "total_runtime").write_text("999999")
    answer = allocate(server, ["token-10", "token-9", "token-11"])
    assert dict(answer.envs) == {
        "KUSCALE_TOKENS": "3",
        "KUSCALE_VGPU_ID": "kuscale-9",
        "POD_NAME": "kuscale-9",
        "LD_PRELOAD": HOOK,
        "POD_MANAGER_IP": "10.0.0.5",
        "POD_MANAGER_PORT": "50052",
        "GEMINI_WINDOW": "100",
    }
    assert [(m.container_path, m.host_path, m.read_only) for m in answer.mounts] == [
        ("/var/run/kuscale/vgpu", str(stale), False),
        (HOOK, HOOK, True),
    ]
    assert (stale / "total_runtime").read_text() == "0"
    assert (stale / "gpu_limit").read_text() == "1000"


def test_a_vgpu_layer_that_fails_keeps_the_container_from_starting(
    gpu_plugin: tuple[DevicePluginServer, Path],
) -> None:
    server, root = gpu_plugin
    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_text("a file where the layer's directory should be")
    with pytest.raises(grpc.RpcError) as refused:
        allocate(server, ["token-1"])
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


@given(st.sets(st.integers(0, 10_000), min_size=1, max_size=20), st.randoms())
def test_a_containers_vgpu_is_named_by_its_lowest_token_whatever_the_order(
    indices: set[int], shuffle: Random
) -> None:
    ids = [f"token-{i}" for i in indices]
    shuffle.shuffle(ids)
    assert vgpu_id_for(ids) == f"kuscale-{min(indices)}"


class RecordedServer:
    """A gRPC server that remembers whether it was stopped."""

    def __init__(self, server: grpc.Server) -> None:
        self.server = server
        self.stopped = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.server, name)

    def stop(self, grace: float | None) -> threading.Event:
        self.stopped = True
        return self.server.stop(grace)


def test_a_server_remade_while_the_plugin_stops_is_stopped_too(
    kubelet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher remakes the server after a kubelet restart; a stop that lands while it
    does must stop the new server, not only the one it replaced."""
    made: list[RecordedServer] = []
    plugin = TokenPlugin(4)
    real_server = grpc.server
    remake_entered = threading.Event()

    def slow_server(executor: futures.ThreadPoolExecutor) -> RecordedServer:
        if made:  # the watcher's remake: still making when the stop comes
            remake_entered.set()
            plugin.stopping.wait(5)
        made.append(RecordedServer(real_server(executor)))
        return made[-1]

    monkeypatch.setattr(grpc, "server", slow_server)
    server = DevicePluginServer(plugin, kubelet_dir)
    server._serve()
    remaking = threading.Thread(target=server._serve)
    remaking.start()
    assert remake_entered.wait(5)
    server.stop()
    remaking.join(10)
    assert len(made) <= 2
    assert all(s.stopped for s in made), "a server made during stop() was never stopped"
