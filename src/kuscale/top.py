"""`kuscale top`: a live terminal view of every pod, from a local agent or a remote one.

A local agent is read from its state dir's status file; a remote one from its Prometheus
endpoint, parsed with the client library's own parser, so `top` needs nothing the agent does
not already export. Keys sort by c cpu, g gpu, t tokens, b token queue (burst credit),
n name; q quits.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import threading
import time
import tty
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kuscale.local.statedir import StateDir, StateDirError

SORT_KEYS = {"c": "cpu", "g": "gpu", "t": "tokens", "b": "queue", "n": "name"}
QUIT_KEYS = ("q", "\x03")
BAR_WIDTH = 10
FETCH_TIMEOUT = 3.0


class TopError(Exception):
    """The agent cannot be read; the message says why."""


class Source(Protocol):
    label: str

    def fetch(self) -> dict[str, Any]:
        """A snapshot: policy, mode, period and pods as `Monitor.snapshot` gives them."""
        ...


class StateDirSource:
    def __init__(self, path: Path) -> None:
        self.state = StateDir(path)
        self.label = str(path)

    def fetch(self) -> dict[str, Any]:
        try:
            snapshot = self.state.read_status()
        except StateDirError as err:
            raise TopError(str(err)) from err
        if snapshot is None:
            raise TopError(f"no agent has written a status in {self.label}")
        return snapshot


class MetricsSource:
    """Rebuilds the pod list from a remote agent's /metrics."""

    def __init__(self, url: str) -> None:
        self.url = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
        self.label = self.url

    def fetch(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url, timeout=FETCH_TIMEOUT) as response:
                text = response.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise TopError(f"cannot read {self.url}: {err}") from err
        try:
            return snapshot_from_metrics(text)
        except (ValueError, KeyError, TypeError) as err:
            raise TopError(f"{self.url} does not serve kuscale metrics: {err}") from err


RESOURCE_KEYS = {
    "kuscale_pod_limit_percent": "limit",
    "kuscale_pod_usage_percent": "usage",
    "kuscale_pod_usage_average_percent": "avg_usage",
    "kuscale_pod_demand_percent": "demand",
    "kuscale_pod_weight": "weight",
    "kuscale_pod_price_tokens": "price",
    "kuscale_pod_starved": "starved",
}
DEVICE_KEYS = {
    "kuscale_gpu_device_capacity_percent": "capacity",
    "kuscale_gpu_device_limit_percent": "limit",
    "kuscale_gpu_device_usage_percent": "usage",
}
POD_KEYS = {
    "kuscale_pod_tokens": "tokens",
    "kuscale_pod_token_queue_tokens": "token_queue",
    "kuscale_pod_updates_total": "updated_count",
}


def _take_pod_sample(
    pods: dict[tuple[str, str], dict[str, Any]], name: str, labels: dict[str, str], value: float
) -> None:
    pod = pods.setdefault(
        (labels["namespace"], labels["pod"]),
        {
            "name": labels["pod"],
            "namespace": labels["namespace"],
            "tokens": 0,
            "token_queue": 0.0,
            "updated_count": 0,
            "status": "running",
            "reason": "",
            "resources": {},
        },
    )
    if name in RESOURCE_KEYS:
        pod["resources"].setdefault(labels["resource"], {})[RESOURCE_KEYS[name]] = value
    elif name in POD_KEYS:
        pod[POD_KEYS[name]] = value
    else:
        pod["status"] = labels["status"]


def snapshot_from_metrics(text: str) -> dict[str, Any]:
    """The subset of a snapshot that `top` shows, from the exposition format."""
    pods: dict[tuple[str, str], dict[str, Any]] = {}
    devices: dict[int, dict[str, Any]] = {}
    snapshot: dict[str, Any] = {"policy": "?", "mode": "?", "period": 1.0, "ticks": 0}
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, name = sample.labels, sample.name
            if name == "kuscale_policy_info":
                snapshot.update(policy=labels["policy"], mode=labels["mode"])
                found = True
            elif name == "kuscale_ticks_total":
                snapshot["ticks"] = int(sample.value)
            elif name in DEVICE_KEYS:
                index = int(labels["device"])
                devices.setdefault(index, {"device": index})[DEVICE_KEYS[name]] = sample.value
            elif name in RESOURCE_KEYS or name in POD_KEYS or name == "kuscale_pod_status":
                _take_pod_sample(pods, name, labels, sample.value)
    if not found:
        raise ValueError("no kuscale_policy_info sample")
    snapshot["gpu_devices"] = [devices[index] for index in sorted(devices)]
    for pod in pods.values():
        for state in pod["resources"].values():
            state["starved"] = bool(state.get("starved", 0.0))
            for key in RESOURCE_KEYS.values():
                state.setdefault(key, 0.0)
    snapshot["pods"] = list(pods.values())
    return snapshot


def bar(usage: float, limit: float, scale: float) -> Text:
    """Usage filled, the rest of the limit shaded, both against the same scale."""
    used = round(min(usage, scale) / scale * BAR_WIDTH) if scale > 0 else 0
    allowed = max(round(min(limit, scale) / scale * BAR_WIDTH) - used, 0) if scale > 0 else 0
    text = Text("█" * used, style="green")
    text.append("▒" * allowed, style="grey50")
    text.append(" " * max(BAR_WIDTH - used - allowed, 0))
    text.append(f" {usage:3.0f}/{limit:<3.0f}")
    return text


def sort_pods(pods: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    def value(pod: dict[str, Any]) -> Any:
        if key in ("cpu", "gpu"):
            return -pod["resources"].get(key, {}).get("usage", -1.0)
        if key == "tokens":
            return -pod["tokens"]
        if key == "queue":
            return -pod["token_queue"]
        return pod["name"]

    return sorted(pods, key=value)


def render(snapshot: dict[str, Any], source: str, sort_key: str) -> Group:
    pods = [p for p in snapshot["pods"] if p["status"] not in ("completed",)]
    scales = {
        r: max(
            [100.0]
            + [
                max(s["usage"], s["limit"])
                for p in pods
                for name, s in p["resources"].items()
                if name == r
            ]
        )
        for r in ("cpu", "gpu")
    }
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in (
        "pod",
        "tokens",
        "queue",
        "status",
        "cpu use/limit %",
        "gpu use/limit %",
        "starved",
        "updates",
    ):
        table.add_column(
            column,
            no_wrap=True,
            justify="right" if column in ("tokens", "queue", "updates") else "left",
        )
    for pod in sort_pods(pods, sort_key):
        resources = pod["resources"]
        cells = [
            bar(resources[r]["usage"], resources[r]["limit"], scales[r])
            if r in resources
            else Text("-")
            for r in ("cpu", "gpu")
        ]
        starved = ",".join(r for r, s in resources.items() if s.get("starved")) or "-"
        table.add_row(
            pod["name"],
            f"{pod['tokens']:g}",
            f"{pod['token_queue']:.1f}",
            pod["status"],
            *cells,
            starved,
            f"{pod['updated_count']:g}",
        )
    header = Text(
        f"kuscale top · {source} · {snapshot['policy']} · {snapshot['mode']} · "
        f"tick {snapshot.get('ticks', 0)} · {len(pods)} pods · sorted by {sort_key}\n",
        style="bold",
    )
    for device in snapshot.get("gpu_devices", []):
        header.append(
            f"gpu{device['device']}: use {device.get('usage', 0.0):.0f} % · limits "
            f"{device.get('limit', 0.0):.0f} % of {device.get('capacity', 0.0):.0f} %\n"
        )
    header.append("sort: c cpu, g gpu, t tokens, b token queue, n name · q quit", style="dim")
    return Group(header, table)


def refresh_seconds(snapshot: dict[str, Any]) -> float:
    """The agent's period, or a second where the status does not give a sane one."""
    try:
        period = float(snapshot.get("period", 1.0))
    except (TypeError, ValueError):
        return 1.0
    return period if 0.01 <= period <= 3600 else 1.0


@contextlib.contextmanager
def keys_from(stream: Any) -> Iterator[list[str]]:
    """Keys typed on a terminal, collected by a thread; nothing when not on a terminal."""
    pressed: list[str] = []
    if not stream.isatty():
        yield pressed
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if select.select([fd], [], [], 0.1)[0]:
                pressed.append(os.read(fd, 1).decode(errors="replace"))

    tty.setcbreak(fd)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield pressed
    finally:
        stop.set()
        reader.join(timeout=1)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def shown(snapshot: dict[str, Any], source: str, sort_key: str) -> Group:
    """The frame, or a TopError where the status was written by another version, or cut or
    damaged on disk: a view never ends in a traceback."""
    try:
        return render(snapshot, source, sort_key)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise TopError(f"{source} holds a status kuscale cannot show: {err!r}") from None


def run_top(
    source: Source, sort_key: str, once: bool, interval: float | None, console: Console
) -> None:
    snapshot = source.fetch()
    if once:
        console.print(shown(snapshot, source.label, sort_key))
        return
    with keys_from(sys.stdin) as pressed, Live(console=console, auto_refresh=False) as live:
        while True:
            live.update(shown(snapshot, source.label, sort_key), refresh=True)
            deadline = time.monotonic() + (interval or refresh_seconds(snapshot))
            while time.monotonic() < deadline:
                while pressed:
                    key = pressed.pop(0).lower()
                    if key in QUIT_KEYS:
                        return
                    if key in SORT_KEYS:
                        sort_key = SORT_KEYS[key]
                        live.update(shown(snapshot, source.label, sort_key), refresh=True)
                time.sleep(0.05)
            snapshot = source.fetch()
