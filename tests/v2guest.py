"""The cgroup v2 tests' throwaway VM: one guest per test run, answering for every test marked
`v2_kernel`.

This machine's cpu controller is bound to cgroup v1, so the v2 path can only meet a real
kernel inside a guest: virtme-ng boots Debian's kernel under qemu (software emulation: the
host's /dev/kvm cannot run a stock kernel) over the host's own filesystem through 9p, so the
guest runs this checkout and this virtual environment as they are. Inside, pytest runs the
marked tests and writes each one's outcome to a directory shared read-write; the host then
reports each marked test with the guest's outcome, under the test's own name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

MARKER = "v2_kernel"
GUEST = "v2-guest"
# How much longer a deadline runs in the guest, where a Python start takes about 20 times the
# host's: a generous factor, since a deadline only bounds how long a failure takes to show.
SLOWDOWN = 8.0
REPORT_ENV = "KUSCALE_V2_GUEST_REPORT"
KERNEL_ENV = "KUSCALE_VM_KERNEL"
TIMEOUT_ENV = "KUSCALE_VM_TIMEOUT"
FAULTS_ENV = "KUSCALE_FAULT_GUEST"
"""`all`: the guest runs every fault point with every ending, not one ending per point."""
PASSED_ENV = (FAULTS_ENV,)
"""The host's variables the guest's pytest sees too."""
# The guest takes two to four minutes here, and 370 s with one of the two cores taken by
# stress-ng (the software emulation needs the host's CPUs); past this the VM is killed and
# every test it owed fails with what it printed.
DEFAULT_TIMEOUT_S = 900.0
BOOTED = "kuscale-v2-guest: booted, starting pytest"
"""What the guest prints once its kernel and init are up: a timeout without it never booted."""
TAIL_CHARS = 6000
INSTALL_HINT = (
    "run `make test` as root, or `apt-get install qemu-system-x86 linux-image-amd64 busybox-static`"
)

Outcome = Literal["passed", "failed", "skipped"]


def in_guest() -> bool:
    return REPORT_ENV in os.environ


def is_guest_item(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("cgroup_kernel") == GUEST


def find_kernel(boot: Path = Path("/boot")) -> Path | None:
    """The newest kernel the guest can boot: a generic one (the cloud flavour lacks 9p) with
    its modules installed, or the one KUSCALE_VM_KERNEL names."""
    named = os.environ.get(KERNEL_ENV)
    if named:
        return Path(named)

    def version(image: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", image.name))

    candidates = [
        image
        for image in boot.glob("vmlinuz-*")
        if "cloud" not in image.name
        and Path("/lib/modules", image.name.removeprefix("vmlinuz-")).is_dir()
    ]
    return max(candidates, key=version, default=None)


def missing_parts() -> str | None:
    """Why no guest can boot here, or None when every part is present."""
    if os.geteuid() != 0:
        return "the cgroup v2 VM needs root"
    vng = Path(sys.executable).parent / "vng"
    if not vng.exists():
        return f"virtme-ng is not installed in this environment ({vng})"
    for program in ("qemu-system-x86_64", "busybox"):
        if shutil.which(program) is None:
            return f"{program} is missing: {INSTALL_HINT}"
    kernel = find_kernel()
    if kernel is None:
        return f"no bootable kernel with modules under /boot: {INSTALL_HINT}"
    if not kernel.is_file():
        return f"the kernel {kernel} ({KERNEL_ENV}) does not exist"
    return None


@dataclass
class GuestResult:
    outcome: Outcome
    text: str = ""
    seconds: float = 0.0
    properties: list[tuple[str, object]] = field(default_factory=list)
    """What the test recorded with `record_property`: figures measured in the guest."""


@dataclass
class GuestRun:
    """What one guest answered; `skip` or `error` stand for every test when it never ran."""

    results: dict[str, GuestResult] = field(default_factory=dict)
    skip: str | None = None
    error: str | None = None
    seconds: float = 0.0
    kernel: str = ""

    def result(self, nodeid: str) -> GuestResult:
        if self.skip is not None:
            return GuestResult("skipped", self.skip)
        if nodeid in self.results:
            return self.results[nodeid]
        return GuestResult("failed", self.error or "the guest did not report this test")


def run_guest(nodeids: list[str], rootdir: Path) -> GuestRun:
    """Boot one guest, run `nodeids` there, and collect their outcomes."""
    reason = missing_parts()
    if reason is not None:
        return GuestRun(skip=reason)
    kernel = find_kernel()
    assert kernel is not None
    bindir = Path(sys.executable).parent
    timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kuscale-v2-guest-") as directory:
        shared = Path(directory)
        report = shared / "report.json"
        script = shared / "run.sh"
        script.write_text(guest_script(nodeids, rootdir, report))
        command = guest_command(bindir / "vng", kernel, shared, script)
        env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        printed, error = _boot(command, env, timeout)
        results = _read_report(report)
    stage = "pytest had started" if BOOTED in printed else "it never reached pytest"
    return GuestRun(
        results=results,
        error=f"{error} (kernel {kernel.name}; {stage}); the end of what it printed:\n"
        f"{printed[-TAIL_CHARS:]}",
        seconds=time.monotonic() - started,
        kernel=kernel.name,
    )


def guest_script(nodeids: list[str], rootdir: Path, report: Path) -> str:
    """What the guest runs: pytest on `nodeids` in this checkout, unbuffered and verbose so
    that a guest killed part way shows how far it got."""
    pytest_command = " ".join(
        [
            shlex.quote(sys.executable),
            "-u -m pytest -v -p no:cacheprovider",
            *(shlex.quote(nodeid) for nodeid in nodeids),
        ]
    )
    passed = "".join(
        f" {name}={shlex.quote(os.environ[name])}" for name in PASSED_ENV if name in os.environ
    )
    return (
        f"echo {shlex.quote(BOOTED)}\n"
        f"cd {shlex.quote(str(rootdir))} || exit 1\n"
        f"export {REPORT_ENV}={shlex.quote(str(report))} PYTHONDONTWRITEBYTECODE=1{passed}\n"
        f"exec {pytest_command}\n"
    )


def guest_command(vng: Path, kernel: Path, shared: Path, script: Path) -> list[str]:
    """The vng command line. The script goes through the shared directory, never on the
    command line: virtme-ng hands `--exec` to the guest on the kernel's command line, and
    past its 2048 bytes Debian's kernel stops at boot in a fortified strlen (seen when the
    checkout's path made nine node ids long enough)."""
    return [
        str(vng),
        "--run",
        str(kernel),
        "--disable-kvm",
        "--force-9p",
        "--verbose",
        "--cpus",
        "2",
        "--memory",
        "2G",
        f"--rwdir={shared}",
        "--exec",
        f"sh {shlex.quote(str(script))}",
    ]


def _boot(command: list[str], env: dict[str, str], timeout: float) -> tuple[str, str]:
    """Run the guest to its end, or kill it and qemu with it (its own process group) at the
    timeout; what it printed, and what to say for any test it did not report."""
    guest = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        printed, _ = guest.communicate(timeout=timeout)
        return printed, f"the guest exited with status {guest.returncode} without reporting"
    except subprocess.TimeoutExpired:
        host = _host_load()
        os.killpg(guest.pid, signal.SIGKILL)
        printed, _ = guest.communicate()
        return printed, f"the guest was killed after {timeout:.0f} s ({TIMEOUT_ENV}); {host}"


def _host_load() -> str:
    """The host's load and busiest processes when the guest ran out of time: software
    emulation runs only as fast as the host's free CPU lets it."""
    busiest = subprocess.run(
        ["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()[:6]
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return (
        "the host's load average was "
        + load
        + ", its busiest processes:\n"
        + "\n".join(line[:160] for line in busiest)
    )


def _read_report(path: Path) -> dict[str, GuestResult]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {
        nodeid: GuestResult(
            entry["outcome"],
            entry["text"],
            entry["seconds"],
            [(str(name), value) for name, value in entry.get("properties", [])],
        )
        for nodeid, entry in raw.items()
    }


class GuestReporter:
    """Inside the guest: each test's outcome, written after every test so a guest killed
    part way still tells what it finished."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, dict[str, object]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A failure in any phase fails the test; a skip skips it; a passing call passes it."""
        if self.results.get(report.nodeid, {}).get("outcome") == "failed":
            return
        if report.passed and report.when != "call":
            return
        text = report.longreprtext
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        self.results[report.nodeid] = {
            "outcome": report.outcome,
            "text": text,
            "seconds": report.duration,
            "properties": [[name, value] for name, value in report.user_properties],
        }
        self.path.write_text(json.dumps(self.results))


def report_from_guest(item: pytest.Item, result: GuestResult) -> None:
    """Report `item` as the guest ran it, through the same hooks a local run calls."""
    hooks = item.ihook
    hooks.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    keywords: dict[str, int] = dict.fromkeys(item.keywords, 1)
    path, line, _ = item.location
    phases: list[tuple[Literal["setup", "call", "teardown"], Outcome, object]]
    if result.outcome == "skipped":
        reason = result.text.removeprefix("Skipped: ")
        phases = [("setup", "skipped", (path, (line or 0) + 1, f"Skipped: {reason}"))]
    elif result.outcome == "failed":
        message = f"in the cgroup v2 guest:\n{result.text}"
        phases = [("setup", "passed", None), ("call", "failed", message)]
    else:
        phases = [("setup", "passed", None), ("call", "passed", None)]
    phases.append(("teardown", "passed", None))
    for when, outcome, longrepr in phases:
        report = pytest.TestReport(
            item.nodeid,
            item.location,
            keywords,  # type: ignore[arg-type]
            outcome,
            longrepr,  # type: ignore[arg-type]
            when,
            duration=result.seconds if when == "call" else 0.0,
            user_properties=result.properties if when == "call" else [],
        )
        hooks.pytest_runtest_logreport(report=report)
    hooks.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
