"""The figures every command draws: demand, usage and limit over time (the demo, `kuscale
plot`, `kuscale sim`), and bars comparing policies (`kuscale sim --report`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SERIES = (
    ("demand", "tab:gray", "--"),
    ("estimate", "tab:green", ":"),
    ("usage", "tab:blue", "-"),
    ("limit", "tab:red", "-"),
)
"""What a row may carry: the true demand (known in the demo and the simulator), the
policy's demand estimate (in recordings), the measured usage and the limit."""


def plot_timeline(rows: Iterable[dict[str, Any]], path: Path, title: str) -> None:
    """Rows carry t, pod, resource and any of the SERIES keys (percent)."""
    panels: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for row in rows:
        panel = panels[(row["pod"], row["resource"])]
        for series, _, _ in SERIES:
            if row.get(series) is not None:
                panel[series].append((row["t"], row[series]))
    if not panels:
        raise ValueError("nothing to plot: the recording has no samples")
    keys = sorted(panels)
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for name, colour, style in SERIES:
            points = panels[key].get(name)
            if points:
                ax.step(
                    [t for t, _ in points],
                    [v for _, v in points],
                    where="post",
                    color=colour,
                    linestyle=style,
                    label=name,
                )
        ax.set_ylabel(f"{key[0]}\n{key[1]} %")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", ncol=3, fontsize="small")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bars(groups: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """One group of bars per policy, one bar per metric (fractions, drawn as percent)."""
    if not groups:
        raise ValueError("nothing to plot: no policies")
    metrics = list(next(iter(groups.values())))
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(metrics)), 3.5))
    for i, (name, values) in enumerate(groups.items()):
        positions = [m + i * width for m in range(len(metrics))]
        ax.bar(positions, [100 * values[m] for m in metrics], width, label=name)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(metrics))], metrics)
    ax.set_ylabel("%")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncol=min(len(groups), 5))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
