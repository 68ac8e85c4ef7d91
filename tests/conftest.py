"""Shared fixtures: real cgroups under a unique name, a local node of agent and workloads on
them, and trees shaped like the kernel's files."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import v2guest
from hypothesis import settings

from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.local.statedir import StateDir
from kuscale.policy.base import Observation


@pytest.fixture(autouse=True)
def root_logger_restored() -> Iterator[None]:
    """A test that calls `main()` in process installs the CLI's log handler, bound to the
    stderr of that moment: pytest's capture, closed once the test ends. Left in place, every
    later record, from any thread, fails with `--- Logging error ---`."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def cgroup_kernel() -> str:
    """Which kernel a real-cgroup test runs on: this host's, unless the test is marked
    `v2_kernel`, which parametrizes it with the cgroup v2 guest's too."""
    return "host"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(v2guest.MARKER)
    if marker is not None:
        kernels = [v2guest.GUEST] if marker.kwargs.get("only") else ["host", v2guest.GUEST]
        metafunc.parametrize("cgroup_kernel", kernels)


@pytest.fixture
def real_cgroups(cgroup_kernel: str) -> Iterator[tuple[CgroupV1 | CgroupV2, str]]:
    """A writable cgroup hierarchy and a unique parent name; everything under it is removed."""
    if os.geteuid() != 0:
        pytest.skip("real cgroup tests need root")
    try:
        cgroups = detect()
    except BackendError as err:
        pytest.skip(f"no cpu cgroup controller: {err}")
    parent = f"kuscale-test-{uuid.uuid4().hex[:8]}"
    try:
        cgroups.create(parent)
    except (BackendError, OSError) as err:
        pytest.skip(f"cgroups are not writable here: {err}")
    yield cgroups, parent
    for root in {cgroups.cpu_root, cgroups.usage_root}:
        _remove_tree(root / parent)


def _remove_tree(directory: Path) -> None:
    """Kill what is left in a test cgroup tree, then remove it bottom-up."""
    if not directory.exists():
        return
    for child in sorted(
        (p for p in directory.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
    ):
        _kill_procs(child)
        child.rmdir()
    _kill_procs(directory)
    directory.rmdir()


def _kill_procs(directory: Path) -> None:
    for line in (directory / "cgroup.procs").read_text().split():
        try:
            os.kill(int(line), signal.SIGKILL)
        except ProcessLookupError:
            continue
    for _ in range(100):
        if not (directory / "cgroup.procs").read_text().strip():
            return
        time.sleep(0.01)


GEMINI_BIN_ENV = "KUSCALE_GEMINI_BIN"
GEMINI_PROGRAMS = ("gem-schd", "gem-pmgr")


@pytest.fixture
def gemini_bin() -> Path:
    """The folder of Gemini's `gem-schd` and `gem-pmgr`, installed by the user as KubeShare
    deploys them: Gemini is an outside program the project neither ships nor builds."""
    folder = os.environ.get(GEMINI_BIN_ENV)
    if not folder:
        pytest.skip(f"set {GEMINI_BIN_ENV} to the folder of Gemini's gem-schd and gem-pmgr")
    missing = [p for p in GEMINI_PROGRAMS if not os.access(Path(folder) / p, os.X_OK)]
    if missing:
        pytest.skip(f"{GEMINI_BIN_ENV}={folder} holds no runnable {' or '.join(missing)}")
    return Path(folder).resolve()


KUSCALE = [sys.executable, "-m", "kuscale"]
BUSY = ["/bin/sh", "-c", "while :; do :; done"]
"""A busy loop that starts in a blink, even in the emulated v2 guest."""


@dataclass
class LocalNode:
    state: Path
    cgroups: CgroupV1 | CgroupV2
    parent: str
    agent: subprocess.Popen[bytes] | None = None

    def start_agent(
        self, *extra: str, env: dict[str, str] | None = None, log: Path | None = None
    ) -> None:
        """The agent, its log appended to `log` where given (else the test's output)."""
        output = log.open("ab") if log is not None else None
        try:
            self.agent = subprocess.Popen(
                [
                    *KUSCALE,
                    "agent",
                    "--local",
                    "--state-dir",
                    str(self.state),
                    "--period",
                    "0.5",
                    "--gpus",
                    "0",
                    *extra,
                ],
                env={**os.environ, **(env or {})},
                stderr=output,
            )
        finally:
            if output is not None:
                output.close()

    def launch(
        self,
        name: str,
        tokens: int,
        command: list[str],
        env: dict[str, str] | None = None,
        gpu: bool = False,
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                *KUSCALE,
                "launch",
                "--state-dir",
                str(self.state),
                "--tokens",
                str(tokens),
                "--name",
                name,
                "--cgroup-parent",
                self.parent,
                *(["--gpu"] if gpu else []),
                "--",
                *command,
            ],
            env={**os.environ, **(env or {})},
        )

    def status(self) -> dict[str, Any] | None:
        """The status the agent last wrote, read in-process: `kuscale status` has tests of
        its own, and a Python start per look is seconds in the emulated v2 guest."""
        return StateDir(self.state).read_status()

    def pod(self, name: str) -> dict[str, Any] | None:
        pods = (self.status() or {}).get("pods", [])
        return next((p for p in pods if p["name"] == name), None)


@pytest.fixture
def node(tmp_path: Path, real_cgroups: tuple[CgroupV1 | CgroupV2, str]) -> Iterator[LocalNode]:
    cgroups, parent = real_cgroups
    local = LocalNode(tmp_path / "state", cgroups, parent)
    yield local
    if local.agent is not None and local.agent.poll() is None:
        local.agent.kill()
        local.agent.wait()


def stretched(seconds: float) -> float:
    """A deadline of `seconds` on this host, stretched in the v2 guest, where software
    emulation makes every Python start about twenty times slower."""
    return seconds * (v2guest.SLOWDOWN if v2guest.in_guest() else 1.0)


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.25) -> float:
    """Seconds until predicate held; fails the test after `timeout`, `stretched`."""
    timeout = stretched(timeout)
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def write_files(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


V1_CPU_FILES = {
    "cpu.cfs_quota_us": "-1\n",
    "cpu.cfs_period_us": "100000\n",
    "cpu.stat": "nr_periods 10\nnr_throttled 2\nthrottled_time 5000000\nnr_bursts 0\n"
    "burst_time 0\n",
    "cpu.shares": "1024\n",
    "cgroup.procs": "",
}
V1_CPUACCT_FILES = {"cpuacct.usage": "123456789\n", "cgroup.procs": ""}
V2_FILES = {
    "cpu.stat": "usage_usec 2000\nuser_usec 1500\nsystem_usec 500\nnr_periods 7\n"
    "nr_throttled 3\nthrottled_usec 900\nnr_bursts 0\nburst_usec 0\n",
    "cpu.max": "max 100000\n",
    "cpu.weight": "100\n",
    "cgroup.procs": "",
    "cgroup.subtree_control": "",
}


@pytest.fixture
def v1_tree(tmp_path: Path) -> CgroupV1:
    """Separate cpu and cpuacct mounts with one pod cgroup, `pods/a`, as the kernel lays them."""
    write_files(tmp_path / "cpu" / "pods" / "a", V1_CPU_FILES)
    write_files(tmp_path / "cpuacct" / "pods" / "a", V1_CPUACCT_FILES)
    return CgroupV1(tmp_path / "cpu", tmp_path / "cpuacct")


@pytest.fixture
def v2_tree(tmp_path: Path) -> CgroupV2:
    write_files(tmp_path, {"cgroup.subtree_control": "", "cgroup.controllers": "cpu io memory"})
    write_files(tmp_path / "pods", {"cgroup.subtree_control": ""})
    write_files(tmp_path / "pods" / "a", V2_FILES)
    return CgroupV2(tmp_path, tmp_path)


def observation(
    usage: list[list[float]],
    tokens: list[float],
    period: float = 1.0,
    uses: list[list[bool]] | None = None,
    limits: list[list[float]] | None = None,
    queue: list[float] | None = None,
    avg_usage: list[list[float]] | None = None,
    elapsed: list[float] | None = None,
    starved: list[list[bool]] | None = None,
    demand: list[list[float]] | None = None,
    capacity: tuple[float, float] = (200.0, 100.0),
) -> Observation:
    """An observation from plain lists; defaults: CPU only, limits 10, empty queue."""
    n = len(tokens)
    use = np.array(uses if uses is not None else [[True, False]] * n)
    u = np.array(usage, dtype=np.float64)
    return Observation(
        period=period,
        elapsed=np.array(elapsed or [period] * n, dtype=np.float64),
        tokens=np.array(tokens, dtype=np.float64),
        queue=np.array(queue or [0.0] * n, dtype=np.float64),
        usage=u,
        avg_usage=np.array(avg_usage, dtype=np.float64) if avg_usage is not None else u.copy(),
        limits=np.where(
            use, np.array(limits, dtype=np.float64) if limits is not None else 10.0, 0.0
        ),
        starved=np.array(starved, dtype=bool) if starved is not None else np.zeros_like(use),
        demand=np.array(demand, dtype=np.float64) if demand is not None else u.copy(),
        uses=use,
        capacity=np.array(capacity, dtype=np.float64),
    )


settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{v2guest.MARKER}: runs inside the cgroup v2 VM; the host reports its outcome"
    )
    if v2guest.in_guest():
        reporter = v2guest.GuestReporter(Path(os.environ[v2guest.REPORT_ENV]))
        config.pluginmanager.register(reporter, "kuscale-v2-guest-reporter")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests the guest answers go last: one VM runs them all, and on the host they set up
    nothing, so no host test may follow them and find its setup left half done."""
    if not v2guest.in_guest():
        items.sort(key=v2guest.is_guest_item)


_GUEST_RUN = pytest.StashKey[v2guest.GuestRun]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """On the host, a `v2_kernel` test is answered by the one guest this run boots."""
    if v2guest.in_guest() or not v2guest.is_guest_item(item):
        return None
    run = item.config.stash.get(_GUEST_RUN, None)
    if run is None:
        marked = [i.nodeid for i in item.session.items if v2guest.is_guest_item(i)]
        run = item.config.stash[_GUEST_RUN] = v2guest.run_guest(marked, item.config.rootpath)
    v2guest.report_from_guest(item, run.result(item.nodeid))
    return True


FIGURES: list[tuple[str, str, object]] = []
"""(test, name, value) that tests recorded with `record_property`, here or in the guest."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        FIGURES.extend((report.nodeid, name, value) for name, value in report.user_properties)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    for nodeid, name, value in FIGURES:
        terminalreporter.write_line(f"measured: {nodeid.split('::')[-1]}: {name}: {value}")
    run = config.stash.get(_GUEST_RUN, None)
    if run is not None and run.skip is None:
        terminalreporter.write_line(
            f"cgroup v2 guest: kernel {run.kernel}, {len(run.results)} tests reported, "
            f"{run.seconds:.0f} s from boot to power-off"
        )
