"""Metrics over real HTTP: scraped and parsed with the client library's own parser."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kuscale.config import AgentConfig
from kuscale.exporter import AddressError, MetricsExporter, parse_address
from kuscale.model import PodSpec
from kuscale.monitor import Monitor, PodAdded
from kuscale.sim.node import SimCpu, SimGpu, SimNode, SimPod
from kuscale.workload import Schedule

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "kuscale-dashboard.json"


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def simulated() -> Iterator[tuple[SimNode, Monitor, MetricsExporter, str]]:
    """A monitor over a simulated node, exporting on a real socket."""
    node = SimNode()
    exporter = MetricsExporter("test-node")
    monitor = Monitor(SimCpu(node), SimGpu(node), AgentConfig(period=0.1), on_tick=exporter.on_tick)
    host, port = exporter.serve("127.0.0.1:0")
    for name, gpu in (("alpha", None), ("beta", "0:50")):
        node.add(name, SimPod(cpu=Schedule.parse("0:80"), gpu=Schedule.parse(gpu) if gpu else None))
        monitor.submit(
            PodAdded(PodSpec(name=name, tokens=400, cgroup=name, vgpu_id=name if gpu else None))
        )
    yield node, monitor, exporter, f"http://{host}:{port}"
    exporter.close()


def tick(node: SimNode, monitor: Monitor, count: int) -> None:
    for _ in range(count):
        node.advance(0.1)
        monitor.tick(node.now)


def test_metrics_follow_prometheus_conventions(
    simulated: tuple[SimNode, Monitor, MetricsExporter, str],
) -> None:
    node, monitor, _, url = simulated
    tick(node, monitor, 5)
    samples = scrape(url + "/metrics")
    names = {s.name for s in samples}
    for name in (
        "kuscale_pod_limit_percent",
        "kuscale_pod_usage_percent",
        "kuscale_pod_usage_average_percent",
        "kuscale_pod_weight",
        "kuscale_pod_price_tokens",
        "kuscale_pod_tokens",
        "kuscale_pod_token_queue_tokens",
        "kuscale_pod_updates_total",
        "kuscale_pod_status",
        "kuscale_pods",
        "kuscale_tick_duration_seconds_bucket",
        "kuscale_ticks_total",
        "kuscale_fast_raises_total",
        "kuscale_policy_info",
    ):
        assert name in names, name
    limit = {
        (s.labels["pod"], s.labels["resource"]): s
        for s in samples
        if s.name == "kuscale_pod_limit_percent"
    }
    assert set(limit) == {("alpha", "cpu"), ("beta", "cpu"), ("beta", "gpu")}
    assert limit[("beta", "gpu")].labels == {
        "pod": "beta",
        "namespace": "local",
        "node": "test-node",
        "resource": "gpu",
    }
    updates = [s for s in samples if s.name == "kuscale_pod_updates_total"]
    assert {s.value for s in updates} == {4.0}
    info = next(s for s in samples if s.name == "kuscale_policy_info")
    assert info.labels["policy"] == "kuscale"
    ticks = next(s for s in samples if s.name == "kuscale_tick_duration_seconds_count")
    assert ticks.value == 5.0
    raises = {s.labels["resource"] for s in samples if s.name == "kuscale_fast_raises_total"}
    assert raises == {"cpu", "gpu"}


def test_completed_pods_disappear_from_the_metrics(
    simulated: tuple[SimNode, Monitor, MetricsExporter, str],
) -> None:
    node, monitor, _, url = simulated
    tick(node, monitor, 3)
    SimCpu(node).remove("alpha")
    tick(node, monitor, 1)
    samples = scrape(url + "/metrics")
    assert not [s for s in samples if s.labels.get("pod") == "alpha"]
    assert [s for s in samples if s.labels.get("pod") == "beta"]
    completed = next(
        s for s in samples if s.name == "kuscale_pods" and s.labels["status"] == "completed"
    )
    assert completed.value == 1.0


def test_healthz_fails_when_the_loop_stops_ticking(
    simulated: tuple[SimNode, Monitor, MetricsExporter, str],
) -> None:
    node, monitor, _, url = simulated
    with pytest.raises(urllib.error.HTTPError) as before:
        urllib.request.urlopen(url + "/healthz", timeout=5)
    assert before.value.code == 503
    tick(node, monitor, 1)
    with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
        assert response.status == 200
    time.sleep(0.4)
    with pytest.raises(urllib.error.HTTPError) as after:
        urllib.request.urlopen(url + "/healthz", timeout=5)
    assert after.value.code == 503
    assert b"last ticked" in after.value.read()


@pytest.mark.parametrize("address", ["nonsense", "host:", ":80", "host:99999", "h:p"])
def test_unparseable_addresses_are_refused(address: str) -> None:
    with pytest.raises(AddressError):
        parse_address(address)


def test_the_dashboard_references_only_exported_metrics(
    simulated: tuple[SimNode, Monitor, MetricsExporter, str],
) -> None:
    node, monitor, _, url = simulated
    tick(node, monitor, 2)
    monitor.stats.errors["range"] += 1
    tick(node, monitor, 1)
    exported = {s.name for s in scrape(url + "/metrics")}
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    expressions += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    referenced = {name for expr in expressions for name in re.findall(r"kuscale_\w+", expr)}
    assert referenced, "the dashboard references no metric"
    assert referenced <= exported, referenced - exported
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"


def agent(state: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kuscale",
            "agent",
            "--local",
            "--state-dir",
            str(state),
            "--period",
            "0.2",
            "--gpus",
            "0",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_status(state: Path, ticks: int) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            status: dict[str, Any] = json.loads((state / "status.json").read_text())
            if status["ticks"] >= ticks:
                return status
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    pytest.fail("the agent did not tick")


@pytest.mark.usefixtures("real_cgroups")
def test_the_agent_serves_metrics_and_health(tmp_path: Path) -> None:
    port = free_port()
    process = agent(tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        wait_for_status(tmp_path, 2)
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        assert any(s.name == "kuscale_ticks_total" and s.value >= 1 for s in samples)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


@pytest.mark.usefixtures("real_cgroups")
@pytest.mark.parametrize("address", ["in-use", "not-an-address"])
def test_a_bad_metrics_address_is_logged_and_the_loop_lives(tmp_path: Path, address: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if address == "in-use":
            address = f"127.0.0.1:{taken.getsockname()[1]}"
        process = agent(tmp_path, "--metrics-address", address)
        try:
            status = wait_for_status(tmp_path, 3)
            assert status["ticks"] >= 3
        finally:
            process.terminate()
            _, err = process.communicate(timeout=10)
    assert process.returncode == 0
    assert "metrics are off" in err


@pytest.mark.parametrize("body", [None, b"hello, not metrics\n", b"# HELP x y\nx{ 1\n"])
def test_top_against_a_remote_that_is_down_or_garbage(body: bytes | None) -> None:
    if body is None:
        url = f"http://127.0.0.1:{free_port()}"
    else:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"

        def answer() -> None:
            connection, _ = server.accept()
            connection.recv(65536)
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body)
            connection.close()
            server.close()

        threading.Thread(target=answer, daemon=True).start()
    result = subprocess.run(
        [sys.executable, "-m", "kuscale", "top", "--url", url, "--once"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "kuscale top: error:" in result.stderr
    assert "Traceback" not in result.stderr
