"""One figure for every recording: demand, usage and limit over time, per pod and resource."""

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
