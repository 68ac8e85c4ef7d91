"""Terminal views of a snapshot, shared by `kuscale status` and the demo's live table."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _resource_cell(resources: dict[str, Any], name: str) -> str:
    state = resources.get(name)
    if state is None:
        return "-"
    mark = " !" if state.get("starved") else ""
    return f"{state['usage']:6.1f} / {state['limit']:6.1f}{mark}"


def status_table(snapshot: dict[str, Any], title: str | None = None) -> Table:
    """Every pod: tokens, status, token queue, and per resource usage against limit."""
    table = Table(
        title=title
        or (
            f"kuscale · {snapshot.get('mode')} · policy {snapshot.get('policy')} · "
            f"tick {snapshot.get('ticks')}"
        )
    )
    for column in ("pod", "tokens", "status", "queue", "cpu use/limit", "gpu use/limit", "updates"):
        table.add_column(
            column,
            justify="left" if column in ("pod", "status") else "right",
            no_wrap=True,
            overflow="ellipsis",
        )
    for pod in snapshot.get("pods", []):
        resources = pod.get("resources", {})
        table.add_row(
            pod["name"],
            str(pod["tokens"]),
            pod["status"],
            f"{pod['token_queue']:.1f}",
            _resource_cell(resources, "cpu"),
            _resource_cell(resources, "gpu"),
            str(pod["updated_count"]),
        )
    return table


def status_lines(snapshot: dict[str, Any]) -> list[str]:
    """Plain text for `kuscale status`: one line per pod and resource, greppable."""
    lines = [
        f"mode={snapshot.get('mode')} policy={snapshot.get('policy')} ticks={snapshot.get('ticks')}"
    ]
    for device in snapshot.get("gpu_devices", []):
        lines.append(
            f"gpu{device['device']}: usage={device['usage']:.1f} limits={device['limit']:.1f} "
            f"capacity={device['capacity']:.0f}"
        )
    for pod in snapshot.get("pods", []):
        head = (
            f"{pod['name']} tokens={pod['tokens']} status={pod['status']!r} "
            f"queue={pod['token_queue']:.2f}"
        )
        if pod.get("gpu_device") is not None:
            head += f" gpu_device={pod['gpu_device']}"
        if pod.get("reason"):
            head += f" reason={pod['reason']!r}"
        lines.append(head)
        for name, state in pod.get("resources", {}).items():
            lines.append(
                f"  {name}: usage={state['usage']:.1f} avg={state['avg_usage']:.1f} "
                f"limit={state['limit']:.1f} weight={state['weight']:.2f} "
                f"price={state['price']:g}"
            )
    return lines
