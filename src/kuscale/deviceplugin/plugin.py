"""The `kuscale.com/token` device plugin: the node's tokens, advertised to the kubelet.

Each token is one device, so the scheduler places pods by the tokens they ask for and the
kubelet hands each container the token IDs it was given. The plugin serves `DevicePlugin`
on its own socket in the kubelet's device-plugin directory, then registers with the
kubelet's `Registration` service there. A kubelet that restarts deletes every socket in that
directory; the plugin notices its socket is gone, serves again and registers again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from kuscale.backends.base import BackendError
from kuscale.deviceplugin import api_pb2 as api
from kuscale.deviceplugin import api_pb2_grpc as rpc
from kuscale.deviceplugin.gpulayer import Allocator, token_id

log = logging.getLogger(__name__)

RESOURCE_NAME = "kuscale.com/token"
API_VERSION = "v1beta1"
PLUGIN_SOCKET = "kuscale.sock"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
TOKENS_ENV = "KUSCALE_TOKENS"
REGISTER_SECONDS = 5.0
"""How long one registration call may take; stopping waits for twice that at most."""

Allocated = Callable[[list[str]], None]


def node_tokens(cores: float, gpus: int, cpu_price: float, gpu_price: float) -> int:
    """What the node's capacity costs at the configured prices, per second."""
    return int(cores * 100 * cpu_price + gpus * 100 * gpu_price)


class TokenPlugin(rpc.DevicePluginServicer):
    """The `DevicePlugin` service over `tokens` identical, always healthy devices."""

    def __init__(
        self,
        tokens: int,
        on_allocate: Allocated | None = None,
        gpu: Allocator | None = None,
    ) -> None:
        if tokens <= 0:
            raise ValueError(f"a node must advertise at least one token, got {tokens}")
        self.ids = [token_id(i) for i in range(tokens)]
        self._known = set(self.ids)
        self._on_allocate = on_allocate
        self._gpu = gpu
        self.stopping = threading.Event()

    def GetDevicePluginOptions(  # noqa: N802 (the API's method names)
        self, request: api.Empty, context: grpc.ServicerContext
    ) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(  # noqa: N802
        self, request: api.Empty, context: grpc.ServicerContext
    ) -> Iterator[api.ListAndWatchResponse]:
        """The whole list once; tokens never fail, so the stream then only stays open."""
        yield api.ListAndWatchResponse(devices=[api.Device(ID=i, health=HEALTHY) for i in self.ids])
        while context.is_active() and not self.stopping.wait(0.2):
            continue

    def GetPreferredAllocation(  # noqa: N802
        self, request: api.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api.PreferredAllocationResponse:
        """Any tokens will do: those that must be included, then the first available."""
        answers = []
        for wanted in request.container_requests:
            chosen = list(wanted.must_include_deviceIDs)
            included = set(chosen)
            rest = [i for i in wanted.available_deviceIDs if i not in included]
            chosen += rest[: max(wanted.allocation_size - len(chosen), 0)]
            answers.append(api.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api.PreferredAllocationResponse(container_responses=answers)

    def Allocate(  # noqa: N802
        self, request: api.AllocateRequest, context: grpc.ServicerContext
    ) -> api.AllocateResponse:
        answers = []
        for wanted in request.container_requests:
            ids = list(wanted.devices_ids)
            unknown = sorted(set(ids) - self._known)
            if unknown or not ids or len(set(ids)) != len(ids):
                log.warning("refused an allocation of tokens %s: not this node's", ids)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tokens {unknown or ids} are not distinct tokens of this node "
                    f"({len(self.ids)} exist)",
                )
            answer = self._gpu_answer(ids, context)
            answer.envs[TOKENS_ENV] = str(len(ids))
            answers.append(answer)
            log.info("allocated %d tokens to a container", len(ids))
            if self._on_allocate is not None:
                self._on_allocate(ids)
        return api.AllocateResponse(container_responses=answers)

    def _gpu_answer(
        self, ids: list[str], context: grpc.ServicerContext
    ) -> api.ContainerAllocateResponse:
        """The GPU layer's part of the answer; a container whose vGPU cannot be made is not
        started without it (the kubelet retries the pod)."""
        if self._gpu is None:
            return api.ContainerAllocateResponse()
        try:
            return self._gpu.allocate(ids)
        except BackendError as err:
            log.error("cannot make a vGPU for tokens %s: %s", ids[:3], err)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the vGPU layer failed: {err}")

    def PreStartContainer(  # noqa: N802
        self, request: api.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()


class DevicePluginServer:
    """Serves a `TokenPlugin` in `kubelet_dir` and keeps it registered with the kubelet."""

    def __init__(self, plugin: TokenPlugin, kubelet_dir: Path, poll_seconds: float = 0.2) -> None:
        self.plugin = plugin
        self.socket = kubelet_dir / PLUGIN_SOCKET
        self.kubelet_socket = kubelet_dir / KUBELET_SOCKET
        self.poll_seconds = poll_seconds
        self.registrations = 0
        self._server: grpc.Server | None = None
        self._serving = threading.Lock()
        """Held while the server is replaced or stopped: the watcher remakes it after a
        kubelet restart, and a stop that lands meanwhile must stop the new one."""
        self._watcher = threading.Thread(target=self._watch, name="deviceplugin", daemon=True)

    def start(self) -> None:
        self._serve()
        self._watcher.start()

    def stop(self) -> None:
        """Stop serving and remove the socket, once: a second call does nothing (the socket
        may by then be the next agent's)."""
        if self.plugin.stopping.is_set():
            return
        self.plugin.stopping.set()
        with self._serving:
            if self._server is not None:
                self._server.stop(grace=0.5).wait()
                self._server = None
        if self._watcher.is_alive():
            self._watcher.join(timeout=2 * REGISTER_SECONDS)
        self.socket.unlink(missing_ok=True)

    def _serve(self) -> None:
        """A new server in place of the old one; none once the plugin is stopping."""
        with self._serving:
            if self._server is not None:
                self._server.stop(grace=None).wait()
                self._server = None
            if self.plugin.stopping.is_set():
                return
            self.socket.unlink(missing_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            rpc.add_DevicePluginServicer_to_server(self.plugin, server)
            server.add_insecure_port(f"unix://{self.socket}")
            server.start()
            self._server = server

    def _register(self) -> bool:
        options = api.DevicePluginOptions(get_preferred_allocation_available=True)
        request = api.RegisterRequest(
            version=API_VERSION,
            endpoint=PLUGIN_SOCKET,
            resource_name=RESOURCE_NAME,
            options=options,
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                rpc.RegistrationStub(channel).Register(request, timeout=REGISTER_SECONDS)
        except grpc.RpcError as err:
            if not self.plugin.stopping.is_set():
                log.warning(
                    "registration with the kubelet at %s failed: %s", self.kubelet_socket, err
                )
            return False
        self.registrations += 1
        log.info("registered %s (%d tokens) with the kubelet", RESOURCE_NAME, len(self.plugin.ids))
        return True

    def _watch(self) -> None:
        """Register, and register again whenever the kubelet deletes our socket, retrying a
        kubelet that is not up yet with a backoff of up to 5 s."""
        registered = False
        backoff = self.poll_seconds
        while not self.plugin.stopping.wait(0 if not registered else self.poll_seconds):
            if registered and os.path.exists(self.socket):
                continue
            if registered:
                log.info(
                    "the kubelet removed %s (a restart?); serving and registering again",
                    self.socket,
                )
                self._serve()
            registered = self._register()
            if not registered:
                self.plugin.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            else:
                backoff = self.poll_seconds
