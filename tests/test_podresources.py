"""Token holders from the kubelet's pod-resources API: real gRPC over a real unix socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from kuscale.cli import main
from kuscale.kubernetes import podresources_pb2 as api
from kuscale.kubernetes import podresources_pb2_grpc as rpc
from kuscale.kubernetes.podresources import (
    PodResourcesError,
    TokenHolder,
    list_token_holders,
)


def container(name: str, *devices: tuple[str, list[str]]) -> api.ContainerResources:
    return api.ContainerResources(
        name=name,
        devices=[api.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices],
    )


PODS = api.ListPodResourcesResponse(
    pod_resources=[
        api.PodResources(
            name="trainer",
            namespace="ml",
            containers=[
                container("main", ("kuscale.com/token", ["token-0", "token-1"])),
                container("sidecar", ("kuscale.com/token", ["token-2"])),
                container("logs"),
            ],
        ),
        api.PodResources(
            name="gpu-only",
            namespace="ml",
            containers=[container("main", ("nvidia.com/gpu", ["GPU-1"]))],
        ),
        api.PodResources(name="plain", namespace="default", containers=[container("main")]),
    ]
)


class FakePodResources(rpc.PodResourcesListerServicer):
    def List(  # noqa: N802
        self, request: api.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api.ListPodResourcesResponse:
        return PODS


@contextmanager
def serving(kubelet: rpc.PodResourcesListerServicer) -> Iterator[Path]:
    """A fake kubelet's pod-resources socket; a short path, as unix sockets need."""
    directory = Path(tempfile.mkdtemp(prefix="kpr-", dir="/tmp"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
    server.start()
    try:
        yield directory / "kubelet.sock"
    finally:
        server.stop(grace=None)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def socket() -> Iterator[Path]:
    with serving(FakePodResources()) as path:
        yield path


def test_only_pods_given_tokens_are_listed_with_their_count(socket: Path) -> None:
    tokens = (("token-0", "token-1"), ("token-2",))
    assert list_token_holders(socket) == [
        TokenHolder("ml", "trainer", 3, ("main", "sidecar"), tokens)
    ]


def test_a_kubelet_that_does_not_answer_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(PodResourcesError, match="failed"):
        list_token_holders(tmp_path / "kubelet.sock", timeout=0.5)
    assert main(["token-pods", "--pod-resources-socket", str(tmp_path / "kubelet.sock")]) == 2
    assert "pod-resources List" in capsys.readouterr().err


def test_kuscale_token_pods_lists_them(socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["token-pods", "--pod-resources-socket", str(socket)]) == 0
    assert capsys.readouterr().out == "ml/trainer  3 tokens  (main,sidecar)\n"
