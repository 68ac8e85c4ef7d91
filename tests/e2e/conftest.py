"""The real node for the end-to-end tests: built, started once for this folder's tests, torn
down after the last of them (so the rest of `make test` runs without it), on Ctrl-C or on
SIGTERM; and the line `make e2e` ends with."""

from __future__ import annotations

import atexit
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Protocol

import pytest

from e2e.e2eagent import Cluster
from e2e.e2enode import NODE_NAME, Node, NodeUnavailable, build_components
from e2e.e2enode import install_debian_packages as install_node_packages
from e2e.guestnode import GUEST_NODE, GuestNode, kill_leftover_guest, node_info
from e2e.shipped import build_image

E2E = Path(__file__).resolve().parent
_outcome: dict[str, str] = {}


def _interrupted(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def node() -> Iterator[Node]:
    if os.geteuid() != 0:
        _skip("the node's kubelet and containerd need root")
    try:
        install_node_packages()
        binary = build_components()
    except NodeUnavailable as err:
        _skip(str(err))
    kill_leftover_guest()
    made = Node(binary)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        with _started(made, _skip):
            _outcome["versions"] = _versions(made, NODE_NAME, "v1 host")
            yield made
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="package")
def guest(node: Node) -> Iterator[GuestNode]:
    """The cgroup v2 node, joined to the same cluster, importing the agent's image as it
    starts; torn down before the host node (its pods would hold up the host's teardown),
    also on Ctrl-C or SIGTERM. Where qemu or the kernel are missing its tests skip, saying
    why, and the host's still run."""
    archive, _ = build_image()
    made = GuestNode(node, (archive,))
    with _started(made, pytest.skip):
        _outcome["guest"] = _versions(node, GUEST_NODE, "v2 guest")
        yield made


class _Startable(Protocol):
    def start(self) -> None: ...
    def teardown(self) -> None: ...


@contextmanager
def _started(made: _Startable, skip: Callable[[str], object]) -> Iterator[None]:
    """`made` started, and torn down after, at exit, or when it cannot start: skipped,
    saying why, where a prerequisite is missing, failed otherwise."""
    atexit.register(made.teardown)
    try:
        try:
            made.start()
        except NodeUnavailable as err:
            skip(str(err))
        yield
    finally:
        made.teardown()
        atexit.unregister(made.teardown)


def _versions(node: Node, name: str, where: str) -> str:
    """A node's kubelet and runtime releases as the node reports them."""
    info = node_info(node, name)
    runtime = info["containerRuntimeVersion"].replace("containerd://", "containerd ")
    return f"{info['kubeletVersion']} ({where}, {runtime})"


@pytest.fixture(scope="package")
def cluster(node: Node) -> Cluster:
    """The node with kuscale's manifests applied and the agent's own credentials."""
    return Cluster.prepare(node)


def _skip(reason: str) -> None:
    _outcome["skipped"] = reason
    pytest.skip(reason)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Count this folder's outcomes; the line is written last, after pytest's own."""
    counts = {"passed": 0, "failed": 0}
    for outcome, counted in (("passed", "passed"), ("failed", "failed"), ("error", "failed")):
        for report in terminalreporter.stats.get(outcome, []):
            if Path(str(report.fspath)).resolve().parent == E2E:
                counts[counted] += 1
    if "versions" in _outcome:
        nodes = " + ".join(_outcome[k] for k in ("versions", "guest") if k in _outcome)
        _outcome["line"] = (
            f"e2e: {counts['passed']} passed, {counts['failed']} failed on Kubernetes {nodes}"
        )
    elif "skipped" in _outcome:
        _outcome["line"] = f"e2e: skipped: {_outcome['skipped']}"


def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and "line" in _outcome:
        reporter.write_line(_outcome["line"])
