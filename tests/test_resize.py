"""The resize actuator against a local HTTP server that answers a pod's GET and its
`resize` PATCH as the API server does, driven by the real monitor over a cgroup v1 tree."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from conftest import V1_CPU_FILES, V1_CPUACCT_FILES, write_files
from kubernetes import client
from test_apiserver import UID

from kuscale.actuators.resize import ResizeActuator, cpu_percent
from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1
from kuscale.cli import main
from kuscale.config import AgentConfig
from kuscale.model import PodSpec, PodStatus, Resource
from kuscale.monitor import Monitor, PodAdded
from kuscale.originals import OriginalsRecord

POD_PATH = "/api/v1/namespaces/ml/pods/trainer"
CGROUP = f"kubepods/burstable/pod{UID}"


def container(name: str, limit: str | None, request: str) -> dict[str, Any]:
    limits = {"cpu": limit} if limit else {}
    return {"name": name, "resources": {"requests": {"cpu": request}, "limits": limits}}


def trainer(qos: str = "Burstable", app_limit: str | None = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": "trainer", "namespace": "ml", "uid": UID},
        "spec": {
            "containers": [container("app", app_limit, "100m"), container("proxy", "250m", "50m")]
        },
        "status": {"phase": "Running", "qosClass": qos},
    }


class ResizeApi:
    """One pod: GET returns it, PATCH of its `resize` records the request and applies the
    limits, or answers `refusal` (an HTTP status) with a Status body."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.pod_path = POD_PATH
        self.patches: list[dict[str, Any]] = []
        self.refusal: int | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.answer(200, fake.pod) if self.path == fake.pod_path else self.answer(404, {})

            def do_PATCH(self) -> None:
                url = urlparse(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.patches.append(
                    {
                        "path": url.path,
                        "type": self.headers["Content-Type"],
                        "query": parse_qs(url.query),
                        "body": body,
                    }
                )
                if fake.refusal is not None:
                    status = {"kind": "Status", "message": "limits may not go below requests"}
                    self.answer(fake.refusal, status)
                    return
                fake.apply(body)
                self.answer(200, fake.pod)

            def answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def apply(self, patch: dict[str, Any]) -> None:
        for change in patch["spec"]["containers"]:
            for declared in self.pod["spec"]["containers"]:
                if declared["name"] == change["name"]:
                    declared["resources"]["limits"].update(change["resources"]["limits"])

    def limits(self) -> dict[str, str]:
        containers = self.pod["spec"]["containers"]
        return {c["name"]: c["resources"]["limits"].get("cpu") for c in containers}

    @property
    def core(self) -> client.CoreV1Api:
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        return client.CoreV1Api(client.ApiClient(client.Configuration(host=host)))


@pytest.fixture
def cgroups(tmp_path: Path) -> CgroupV1:
    write_files(tmp_path / "cpu" / CGROUP, V1_CPU_FILES)
    write_files(tmp_path / "cpuacct" / CGROUP, V1_CPUACCT_FILES)
    return CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")


def managed(api: ResizeApi, cgroups: CgroupV1) -> Iterator[Monitor]:
    monitor = Monitor(cgroups, None, AgentConfig(), actuator=ResizeActuator(api.core))
    spec = PodSpec(name="trainer", namespace="ml", tokens=50, cgroup=CGROUP, uid=UID)
    monitor.submit(PodAdded(spec))
    monitor.tick(0.0)
    yield monitor
    api.server.shutdown()


def test_the_limit_is_split_by_declared_limits_above_requests_and_given_back(
    cgroups: CgroupV1,
) -> None:
    api = ResizeApi(trainer())
    for monitor in managed(api, cgroups):
        pod = monitor.registry.running["ml/trainer"]
        assert pod.status is PodStatus.RUNNING
        assert monitor.snapshot()["actuator"] == "resize"
        (first,) = api.patches
        assert first["path"] == POD_PATH + "/resize"
        assert first["type"] == "application/strategic-merge-patch+json"
        assert first["query"]["fieldManager"] == ["kuscale"]
        # 10 % asked: 80m and 20m by the declared 1 : 0.25, raised to the 100m and 50m requested.
        assert api.limits() == {"app": "100m", "proxy": "50m"}
        assert pod.resources[Resource.CPU].limit == pytest.approx(15.0)
        monitor.restore()
    assert api.limits() == {"app": "1000m", "proxy": "250m"}


def test_a_limit_the_api_server_refuses_is_counted_and_not_charged(cgroups: CgroupV1) -> None:
    api = ResizeApi(trainer())
    api.refusal = 422
    for monitor in managed(api, cgroups):
        pod = monitor.registry.running["ml/trainer"]
        assert monitor.stats.errors["io"] == 1
        assert not pod.resources[Resource.CPU].changed
        assert api.limits() == {"app": "1", "proxy": "250m"}


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        (trainer(app_limit=None), "declares no limits.cpu"),
        (trainer(qos="Guaranteed"), "QoS class"),
    ],
)
def test_pods_a_resize_cannot_bound_are_refused_with_the_reason(
    cgroups: CgroupV1, pod: dict[str, Any], reason: str
) -> None:
    api = ResizeApi(copy.deepcopy(pod))
    for monitor in managed(api, cgroups):
        refused = monitor.registry.completed["ml/trainer"]
        assert refused.status is PodStatus.REFUSED
        assert reason in refused.reason
        assert api.patches == []


def test_cpu_quantities_parse_as_the_api_writes_them() -> None:
    assert [cpu_percent(q) for q in ("250m", "1.5", 2, "0")] == [25.0, 150.0, 200.0, 0.0]
    for garbage in ("lots", "-1", None):
        with pytest.raises(BackendError):
            cpu_percent(garbage)


def kubeconfig(api: ResizeApi, path: Path) -> Path:
    server = f"http://127.0.0.1:{api.server.server_address[1]}"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "agent", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
                "current-context": "fake",
            }
        )
    )
    return path


RestoreAfterACrash = Callable[[ResizeApi, bool], tuple[int, str, str]]
"""Exit status, what restore printed, what it said as errors."""


@pytest.fixture
def record(tmp_path: Path) -> OriginalsRecord:
    return OriginalsRecord(tmp_path / "record")


@pytest.fixture
def restore(
    cgroups: CgroupV1,
    tmp_path: Path,
    record: OriginalsRecord,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> RestoreAfterACrash:
    """`kuscale restore` of `record` on the fixture tree, with a kubeconfig for the fake API
    server or none; the kubeconfig's settings are kept to the test."""
    monkeypatch.setattr("kuscale.backends.cgroup.detect", lambda: cgroups)
    monkeypatch.setattr(client.Configuration, "_default", None)

    def run(api: ResizeApi, credentials: bool) -> tuple[int, str, str]:
        where = ["--kubeconfig", str(kubeconfig(api, tmp_path / "kubeconfig"))]
        code = main(["restore", "--record-dir", str(record.directory), *where[: 2 * credentials]])
        printed = capsys.readouterr()
        return code, printed.out, printed.err

    return run


@pytest.fixture
def crashed(cgroups: CgroupV1, record: OriginalsRecord) -> Iterator[ResizeApi]:
    """An agent resized the pod through the API server, then died without giving it back."""
    api = ResizeApi(trainer())
    monitor = Monitor(
        cgroups, None, AgentConfig(), actuator=ResizeActuator(api.core), originals=record
    )
    monitor.submit(
        PodAdded(PodSpec(name="trainer", namespace="ml", tokens=50, cgroup=CGROUP, uid=UID))
    )
    monitor.tick(0.0)
    assert api.limits() == {"app": "100m", "proxy": "50m"}
    (entry,) = record.entries()
    assert entry.actuator == "resize"
    yield api
    api.server.shutdown()


def test_restore_gives_the_declared_limits_back_through_the_api_server(
    crashed: ResizeApi, record: OriginalsRecord, restore: RestoreAfterACrash
) -> None:
    assert restore(crashed, True)[:2] == (0, f"ml/trainer: given back (cgroup {CGROUP})\n")
    assert crashed.limits() == {"app": "1000m", "proxy": "250m"}
    assert list(record.entries()) == []


@pytest.mark.parametrize("meanwhile", ["deleted", "replaced"])
def test_restore_drops_a_pod_gone_meanwhile_and_touches_no_namesake(
    crashed: ResizeApi, record: OriginalsRecord, restore: RestoreAfterACrash, meanwhile: str
) -> None:
    crashed.patches.clear()
    if meanwhile == "deleted":
        crashed.pod_path = "/api/v1/namespaces/ml/pods/elsewhere"
    else:
        crashed.pod = {**trainer(), "metadata": {"name": "trainer", "namespace": "ml", "uid": "x"}}
    gone = "ml/trainer: gone meanwhile, dropped from the record\n"
    assert restore(crashed, True)[:2] == (0, gone)
    assert crashed.patches == []
    assert list(record.entries()) == []


def test_restore_without_credentials_keeps_the_entry_and_says_why(
    crashed: ResizeApi, record: OriginalsRecord, restore: RestoreAfterACrash
) -> None:
    code, _, errors = restore(crashed, False)
    assert code == 1 and "resized through the API server" in errors
    assert len(list(record.entries())) == 1


def test_a_resized_pod_declaring_its_new_limit_stays_adopted(cgroups: CgroupV1) -> None:
    """Found on the real node: the API server declares the limit each resize sets, and the
    pod came back from discovery as a new pod, was given back and adopted afresh."""
    api = ResizeApi(trainer())
    for monitor in managed(api, cgroups):
        pod = monitor.registry.running["ml/trainer"]
        declared = replace(pod.spec, declared_cpu=15.0)
        monitor.submit(PodAdded(declared))
        monitor.tick(1.0)
        assert monitor.registry.running["ml/trainer"] is pod
        assert pod.spec == declared and "ml/trainer" not in monitor.registry.completed
        given_back = {"name": "app", "resources": {"limits": {"cpu": "1000m"}}}
        assert all(given_back not in p["body"]["spec"]["containers"] for p in api.patches)


def test_an_agent_after_a_crash_gives_back_the_record_not_the_resized_declaration(
    crashed: ResizeApi,
    cgroups: CgroupV1,
    record: OriginalsRecord,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The declared limit wins over a record where the kubelet derived the cgroup from it;
    where the record's agent resized the pod, the declared limit is that agent's own and the
    record is not overruled (nor said to be)."""
    monitor = Monitor(
        cgroups, None, AgentConfig(), actuator=ResizeActuator(crashed.core), originals=record
    )
    spec = PodSpec(
        name="trainer", namespace="ml", tokens=50, cgroup=CGROUP, uid=UID, declared_cpu=15.0
    )
    monitor.submit(PodAdded(spec))
    monitor.tick(0.0)
    monitor.restore()
    assert crashed.limits() == {"app": "1000m", "proxy": "250m"}
    assert list(record.entries()) == []
    assert "declared limit is given back" not in caplog.text
