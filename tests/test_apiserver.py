"""This node's pods from the API server: a local HTTP server that speaks the pods list and
watch JSON, driven through the official Kubernetes client."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest.mock import patch
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from kuscale.cli import main
from kuscale.kubernetes.apiserver import NodePods, PodView, join
from kuscale.kubernetes.podresources import TokenHolder

UID = "0b8e4c1a-7d2f-4e3a-9c5b-1f2e3d4c5b6a"
DIGEST = "ab" * 32


def pod(name: str, node: str = "n1", version: int = 1, started: bool = True) -> dict[str, Any]:
    statuses = [
        {
            "name": "main",
            "image": "busybox",
            "imageID": "sha256:1",
            "ready": started,
            "restartCount": 0,
            **({"containerID": f"containerd://{DIGEST}"} if started else {}),
        }
    ]
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": UID,
            "resourceVersion": str(version),
        },
        "spec": {"nodeName": node, "containers": [{"name": "main"}]},
        "status": {"phase": "Running", "qosClass": "Burstable", "containerStatuses": statuses},
    }


class FakeApiServer:
    """GET /api/v1/pods with `fieldSelector=spec.nodeName=N`: a list, or with `watch=true`
    the queued events as JSON lines, then the connection closes as a real watch's does."""

    def __init__(self) -> None:
        self.pods = [pod("trainer"), pod("elsewhere", node="n2")]
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.garbage = threading.Event()
        self.lists = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                node = query.get("fieldSelector", [""])[0].removeprefix("spec.nodeName=")
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if fake.garbage.is_set():
                    self.wfile.write(b"<html>not a pod list</html>\n")
                elif query.get("watch") == ["true"]:
                    fake.stream(self, node)
                else:
                    fake.lists += 1
                    items = [p for p in fake.pods if p["spec"]["nodeName"] == node]
                    body = {"kind": "PodList", "metadata": {"resourceVersion": "5"}, "items": items}
                    self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def stream(self, handler: BaseHTTPRequestHandler, node: str) -> None:
        try:
            event = self.events.get(timeout=2)
        except queue.Empty:
            return
        if event is not None and event["object"].get("spec", {}).get("nodeName", node) == node:
            handler.wfile.write(json.dumps(event).encode() + b"\n")
            handler.wfile.flush()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(client.ApiClient(client.Configuration(host=self.url)))


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    fake.thread.start()
    yield fake
    fake.server.shutdown()


@pytest.fixture
def node_pods(apiserver: FakeApiServer) -> Iterator[NodePods]:
    configuration = client.Configuration(host=apiserver.url)
    pods = NodePods(client.CoreV1Api(client.ApiClient(configuration)), "n1")
    stop = threading.Event()
    runner = threading.Thread(target=pods.run, args=(stop,), daemon=True)
    runner.start()
    assert pods.synced.wait(10)
    yield pods
    stop.set()
    runner.join(timeout=10)


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose one context reaches `server` with no credentials."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: me, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
    )
    return path


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_list_gives_this_nodes_pods_with_uid_qos_and_containers(
    node_pods: NodePods,
) -> None:
    expected = PodView("ml", "trainer", UID, "Burstable", (f"containerd://{DIGEST}",), 1)
    assert node_pods.get("ml", "trainer") == expected
    assert node_pods.get("ml", "elsewhere") is None


def test_watch_events_keep_the_view_current(apiserver: FakeApiServer, node_pods: NodePods) -> None:
    apiserver.events.put({"type": "ADDED", "object": pod("fresh", version=6, started=False)})
    wait_for(lambda: node_pods.get("ml", "fresh") is not None)
    assert node_pods.get("ml", "fresh") == PodView("ml", "fresh", UID, "Burstable", (), 1)
    apiserver.events.put({"type": "DELETED", "object": pod("trainer", version=7)})
    wait_for(lambda: node_pods.get("ml", "trainer") is None)


def test_garbage_from_the_api_server_is_logged_and_retried(
    apiserver: FakeApiServer, node_pods: NodePods, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kuscale.kubernetes.apiserver")
    apiserver.events.put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}})
    wait_for(apiserver.events.empty)
    apiserver.garbage.set()
    wait_for(lambda: "failed" in caplog.text)
    apiserver.garbage.clear()
    before = apiserver.lists
    wait_for(lambda: apiserver.lists > before)
    assert node_pods.get("ml", "trainer") is not None


def test_token_holders_the_api_server_does_not_know_are_skipped(node_pods: NodePods) -> None:
    holders = [
        TokenHolder("ml", "trainer", 3, ("main",), (("token-0", "token-1", "token-2"),)),
        TokenHolder("ml", "ghost", 1, ("main",), (("token-3",),)),
    ]
    joined = join(holders, node_pods)
    assert [(h.name, v.uid) for h, v in joined] == [("trainer", UID)]


def test_kuscale_token_pods_joins_the_kubelet_and_the_api_server(
    apiserver: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url)
    holders = [
        TokenHolder("ml", "trainer", 3, ("main",), (("token-0", "token-1", "token-2"),)),
        TokenHolder("ml", "ghost", 1, ("a",), (("token-3",),)),
    ]
    with patch("kuscale.kubernetes.podresources.list_token_holders", return_value=holders):
        args = ["token-pods", "--node", "n1", "--kubeconfig", str(kubeconfig)]
        assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ml/trainer  3 tokens  uid {UID}  Burstable",
        "ml/ghost  1 tokens  unknown to the API server",
    ]
    kubeconfig.write_text("not: [a kubeconfig\n")
    with patch("kuscale.kubernetes.podresources.list_token_holders", return_value=holders):
        assert main(["token-pods", "--node", "n1", "--kubeconfig", str(kubeconfig)]) == 2
    assert "cannot list node n1's pods" in capsys.readouterr().err
