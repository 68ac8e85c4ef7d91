"""The real node for the end-to-end tests: built, started once for this folder's tests, torn
down after the last of them (so the rest of `make test` runs without it), on Ctrl-C or on
SIGTERM; and the line `make e2e` ends with."""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from e2e.e2eagent import Cluster
from e2e.e2enode import ComponentFailed, Node, NodeUnavailable, build_components, release
from e2e.e2enode import install_debian_packages as install_node_packages

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
    made = Node(binary)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    atexit.register(made.teardown)
    try:
        made.start()
    except NodeUnavailable as err:
        made.teardown()
        _skip(str(err))
    except (ComponentFailed, OSError, subprocess.SubprocessError):
        made.teardown()
        raise
    _outcome["versions"] = f"Kubernetes {release()} (containerd {_containerd_version()})"
    try:
        yield made
    finally:
        made.teardown()
        atexit.unregister(made.teardown)
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="package")
def cluster(node: Node) -> Cluster:
    """The node with kuscale's manifests applied and the agent's own credentials."""
    return Cluster.prepare(node)


def _skip(reason: str) -> None:
    _outcome["skipped"] = reason
    pytest.skip(reason)


def _containerd_version() -> str:
    answer = subprocess.run(
        ["containerd", "--version"], capture_output=True, text=True, check=False
    )
    found = re.search(r"\b(\d+\.\d+\.\d+)", answer.stdout)
    return found.group(1) if found else "unknown"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Count this folder's outcomes; the line is written last, after pytest's own."""
    counts = {"passed": 0, "failed": 0}
    for outcome, counted in (("passed", "passed"), ("failed", "failed"), ("error", "failed")):
        for report in terminalreporter.stats.get(outcome, []):
            if Path(str(report.fspath)).resolve().parent == E2E:
                counts[counted] += 1
    if "versions" in _outcome:
        _outcome["line"] = (
            f"e2e: {counts['passed']} passed, {counts['failed']} failed on {_outcome['versions']}"
        )
    elif "skipped" in _outcome:
        _outcome["line"] = f"e2e: skipped: {_outcome['skipped']}"


def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and "line" in _outcome:
        reporter.write_line(_outcome["line"])
