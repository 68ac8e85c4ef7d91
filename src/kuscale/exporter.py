"""Prometheus metrics and a health check, served from the agent's latest snapshot.

Gauges are built at scrape time from the snapshot the monitor last handed over, so a
completed pod's series simply stop being exported, and nothing in the loop's hot path
touches the metrics library. The original exported its values as counters it added to and
without namespaces; here values that go up and down are gauges, counts are counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kuscale.model import is_decimal

log = logging.getLogger("kuscale.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STALE_PERIODS = 3
TICK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

POD_LABELS = ("pod", "namespace", "node")
DEVICE_GAUGES = (
    ("capacity", "What the GPU device can give, percent."),
    ("limit", "The GPU limits its running pods hold together, percent."),
    ("usage", "The GPU its running pods used together over the last period, percent."),
)
RESOURCE_LABELS = (*POD_LABELS, "resource")

RESOURCE_GAUGES = (
    ("kuscale_pod_limit_percent", "limit", "Limit in percent of one core or one GPU."),
    ("kuscale_pod_usage_percent", "usage", "Usage over the last interval, percent."),
    ("kuscale_pod_usage_average_percent", "avg_usage", "EWMA of usage, percent."),
    ("kuscale_pod_demand_percent", "demand", "The policy's demand estimate, percent."),
    ("kuscale_pod_weight", "weight", "Dynamic weight of the resource in the pod's objective."),
    ("kuscale_pod_price_tokens", "price", "Price in tokens per percent per second."),
    ("kuscale_pod_starved", "starved", "1 when the pod was throttled or pinned at its limit."),
)


class AddressError(ValueError):
    """A listen address that is not HOST:PORT."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not is_decimal(port) or not 0 <= int(port) <= 65535:
        raise AddressError(f"metrics address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class SnapshotCollector(Collector):
    """Exports the latest snapshot; the monitor thread swaps it in, scrapes only read it."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.snapshot: dict[str, Any] | None = None
        self.updated: float | None = None
        self.waiting: str | None = None
        """Set while a new agent waits for the one before it to give the record back: alive,
        and ready for a rolling update to stop the old one."""

    def update(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot
        self.updated = time.monotonic()

    def healthy(self) -> tuple[bool, str]:
        """Unhealthy when the loop has not ticked for three periods."""
        snapshot, updated = self.snapshot, self.updated
        if self.waiting is not None:
            return True, f"ok: {self.waiting}"
        if snapshot is None or updated is None:
            return False, "the loop has not ticked yet"
        age = time.monotonic() - updated
        limit = STALE_PERIODS * float(snapshot["period"])
        if age > limit:
            return False, f"the loop last ticked {age:.1f} s ago (limit {limit:.1f} s)"
        return True, f"ok: last tick {age:.2f} s ago"

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        if snapshot is None:
            return
        running = [p for p in snapshot["pods"] if p["status"] in ("running", "not ready")]
        yield from self._resource_gauges(running)
        yield from self._pod_metrics(running)
        yield from self._device_gauges(snapshot.get("gpu_devices", []))
        yield from self._agent_metrics(snapshot)

    def _device_gauges(self, devices: list[dict[str, Any]]) -> Iterator[Metric]:
        """Per GPU device: a pod's GPU share lives on one device, which has 100 % alone."""
        for key, doc in DEVICE_GAUGES:
            family = GaugeMetricFamily(
                f"kuscale_gpu_device_{key}_percent", doc, labels=("node", "device")
            )
            for device in devices:
                family.add_metric([self.node, str(device["device"])], float(device[key]))
            yield family

    def _resource_gauges(self, pods: list[dict[str, Any]]) -> Iterator[Metric]:
        for name, key, doc in RESOURCE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=RESOURCE_LABELS)
            for pod in pods:
                for resource, state in pod["resources"].items():
                    family.add_metric(
                        [pod["name"], pod["namespace"], self.node, resource], float(state[key])
                    )
            yield family

    def _pod_metrics(self, pods: list[dict[str, Any]]) -> Iterator[Metric]:
        tokens = GaugeMetricFamily(
            "kuscale_pod_tokens", "Reserved tokens per second.", labels=POD_LABELS
        )
        queue = GaugeMetricFamily(
            "kuscale_pod_token_queue_tokens", "Unspent tokens (burst credit).", labels=POD_LABELS
        )
        spend = GaugeMetricFamily(
            "kuscale_pod_token_spend_tokens",
            "Tokens per second the pod's limits cost.",
            labels=POD_LABELS,
        )
        updates = CounterMetricFamily(
            "kuscale_pod_updates", "Limit updates by kuscale.", labels=POD_LABELS
        )
        status = GaugeMetricFamily(
            "kuscale_pod_status", "1 for the pod's current status.", labels=(*POD_LABELS, "status")
        )
        for pod in pods:
            labels = [pod["name"], pod["namespace"], self.node]
            tokens.add_metric(labels, float(pod["tokens"]))
            queue.add_metric(labels, float(pod["token_queue"]))
            spend.add_metric(
                labels, sum(s["price"] * s["limit"] for s in pod["resources"].values())
            )
            updates.add_metric(labels, float(pod["updated_count"]))
            status.add_metric([*labels, pod["status"]], 1.0)
        yield from (tokens, queue, spend, updates, status)

    def _agent_metrics(self, snapshot: dict[str, Any]) -> Iterator[Metric]:
        by_status = Counter(p["status"] for p in snapshot["pods"])
        pods = GaugeMetricFamily(
            "kuscale_pods", "Pods known to the agent, by status.", labels=("node", "status")
        )
        for status in ("initializing", "not ready", "running", "completed", "refused"):
            pods.add_metric([self.node, status], float(by_status.get(status, 0)))
        errors = CounterMetricFamily(
            "kuscale_actuation_errors",
            "Failed or refused reads and writes, by kind.",
            labels=("node", "kind"),
        )
        for kind, count in sorted(snapshot["errors"].items()):
            errors.add_metric([self.node, kind], float(count))
        ticks = CounterMetricFamily("kuscale_ticks", "Ticks of the loop.", labels=("node",))
        ticks.add_metric([self.node], float(snapshot["ticks"]))
        raises = CounterMetricFamily(
            "kuscale_fast_raises",
            "Limits the watch raised between ticks for pods it saw throttled or pinned.",
            labels=("node", "resource"),
        )
        raises.add_metric([self.node, "cpu"], float(snapshot.get("fast_raises", 0)))
        raises.add_metric([self.node, "gpu"], float(snapshot.get("gpu_fast_raises", 0)))
        info = InfoMetricFamily("kuscale_policy", "The rule and backends in use.", labels=("node",))
        info.add_metric(
            [self.node],
            {
                "policy": snapshot["policy"],
                "mode": snapshot["mode"],
                "gpu_mode": str(snapshot["gpu_mode"]),
                "monitor_only": str(snapshot["monitor_only"]).lower(),
            },
        )
        yield from (pods, errors, ticks, raises, info)


class MetricsExporter:
    """The registry, the tick histogram and the HTTP server for /metrics and /healthz."""

    def __init__(self, node: str) -> None:
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector(node)
        self.registry.register(self.collector)
        self.tick_seconds = Histogram(
            "kuscale_tick_duration_seconds",
            "Time one tick takes: sample, decide, actuate.",
            labelnames=("node",),
            buckets=TICK_BUCKETS,
            registry=self.registry,
        ).labels(node=node)
        self._server: ThreadingHTTPServer | None = None

    def on_tick(self, snapshot: dict[str, Any]) -> None:
        self.collector.update(snapshot)
        self.tick_seconds.observe(float(snapshot["tick_seconds"]))

    def serve(self, address: str) -> tuple[str, int]:
        """Start serving in a daemon thread; returns the bound host and port."""
        host, port = parse_address(address)
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                exporter.handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(request, 200, generate_latest(self.registry), CONTENT_TYPE)
        elif path == "/healthz":
            ok, reason = self.collector.healthy()
            self._reply(request, 200 if ok else 503, reason.encode() + b"\n", "text/plain")
        else:
            self._reply(request, 404, b"try /metrics or /healthz\n", "text/plain")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, code: int, body: bytes, kind: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
