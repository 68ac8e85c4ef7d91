"""The demo on a simulated node: summary, JSON and plot from the real monitor and policy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from conftest import KUSCALE, wait_for
from rich.console import Console

from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.config import AgentConfig
from kuscale.demo import DEMO_WORKLOADS, run_demo, summarise


def test_simulated_demo_writes_summary_and_plot(tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "summary.json", tmp_path / "plot.png"
    with (tmp_path / "out.txt").open("w") as out:
        run_demo(
            AgentConfig(period=0.5),
            20.0,
            json_path,
            plot_path,
            simulate=True,
            console=Console(file=out),
        )
    result = json.loads(json_path.read_text())
    assert result["mode"] == "simulated"
    assert set(result["pods"]) == {w.name for w in DEMO_WORKLOADS}
    trainer = result["pods"]["trainer"]
    assert {"cpu", "gpu", "budget_overspend_fraction"} <= set(trainer)
    for key in (
        "mean_usage",
        "mean_limit",
        "unmet_demand_fraction",
        "slack_fraction",
        "throttled_tick_fraction",
    ):
        assert trainer["cpu"][key] >= 0.0
    assert plot_path.stat().st_size > 10_000


def test_summary_arithmetic() -> None:
    rows = [
        {
            "pod": "p",
            "resource": "cpu",
            "tokens": 100,
            "demand": 50.0,
            "usage": 40.0,
            "limit": 40.0,
            "starved": True,
            "spend": 40.0,
        },
        {
            "pod": "p",
            "resource": "cpu",
            "tokens": 100,
            "demand": 50.0,
            "usage": 50.0,
            "limit": 150.0,
            "starved": False,
            "spend": 150.0,
        },
    ]
    entry = summarise(rows)["p"]
    assert entry["cpu"]["unmet_demand_fraction"] == 10.0 / 100.0
    assert entry["cpu"]["slack_fraction"] == 100.0 / 190.0
    assert entry["cpu"]["throttled_tick_fraction"] == 0.5
    assert entry["budget_overspend_fraction"] == 50.0 / 200.0


def gemini_processes(gemini_bin: Path) -> list[int]:
    """Processes running a program from the Gemini build (whatever started them)."""
    running = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if Path(os.readlink(proc / "exe")).parent == gemini_bin:
                running.append(int(proc.name))
    return running


def test_the_demo_runs_its_gpu_pod_under_the_real_gemini(
    tmp_path: Path, gemini_bin: Path, real_cgroups: tuple[CgroupV1 | CgroupV2, str]
) -> None:
    """`kuscale demo --gpu-layer gemini`: Gemini's own scheduler and pod manager hold the
    trainer to the limits kuscale writes; use read through NVML over the emulated GPU."""
    json_path = tmp_path / "summary.json"
    command = [*KUSCALE, "demo", "--gpu-layer", "gemini", "--gemini-bin", str(gemini_bin)]
    command += ["--duration", "20", "--json", str(json_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert result["gpu_mode"] == "gemini"
    trainer = result["pods"]["trainer"]
    gpu = trainer["gpu"]
    assert gpu["mean_usage"] <= gpu["mean_limit"] + 5.0
    assert gpu["mean_usage"] > 0.4 * gpu["mean_demand"], gpu
    assert trainer["budget_overspend_fraction"] == 0.0
    assert not gemini_processes(gemini_bin), "Gemini's programs outlived the demo"


def test_a_demo_stopped_by_sigterm_removes_what_it_started(
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, _ = real_cgroups
    demo = subprocess.Popen(
        [*KUSCALE, "demo", "--duration", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parent = f"kuscale-demo-{demo.pid}"
    try:
        wait_for(lambda: cgroups.exists(f"{parent}/trainer"), timeout=60)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    # A cgroup is removed only once empty: no workload of the demo outlived it either.
    assert not cgroups.exists(parent), "the demo's cgroups outlived it"
