"""`make soak`: 1000 pods on a cgroup v1 fixture tree with churn — pods leaving and arriving
every tick — ticked at full speed for SOAK_SECONDS (default 600), with the durable record
on. Prints resident memory and open descriptors at the start, once warm (a tenth of the
way: the bounded path cache fills with the churn's new names first) and at the end (both
should be flat from warm to end), pods missed (offered but never adopted), and pods adopted
twice (both should be 0).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from bench_tick import BENCH_CONFIG, current_rss_mib

from kuscale.backends.cgroup import CgroupV1
from kuscale.config import ResourceConfig
from kuscale.model import PodSpec
from kuscale.monitor import Monitor, PodAdded, PodRemoved
from kuscale.originals import OriginalsRecord

PODS = 1000
CHURN = 10
"""Pods that leave, and as many that arrive, every tick."""
CONFIG = replace(
    BENCH_CONFIG,
    policy_config=replace(
        BENCH_CONFIG.policy_config, cpu=ResourceConfig(price=1.0, min=1.0, overcommit=6.0)
    ),
)


class Adoptions(logging.Handler):
    """Counts the monitor's `adopted` events by pod."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) in ("adopted", "adopted_recorded"):
            self.seen[f"{record.namespace}/{record.pod}"] += 1  # type: ignore[attr-defined]


def make_pod(root: Path, name: str) -> None:
    cpu, acct = root / "cpu" / name, root / "cpuacct" / name
    cpu.mkdir(parents=True)
    acct.mkdir(parents=True)
    for file, text in (
        ("cpu.cfs_quota_us", "-1\n"),
        ("cpu.cfs_period_us", "100000\n"),
        ("cpu.shares", "1024\n"),
        ("cpu.stat", "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n"),
        ("cgroup.procs", ""),
    ):
        (cpu / file).write_text(text)
    (acct / "cpuacct.usage").write_text("0\n")
    (acct / "cgroup.procs").write_text("")


def busy(root: Path, name: str, tick: int) -> None:
    (root / "cpuacct" / name / "cpuacct.usage").write_text(f"{tick * 50_000_000}\n")


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soak:
    """The node under churn, and the soak's own books, kept flat: what arrived this tick,
    and how often each pod still here was adopted."""

    def __init__(self, root: Path, adoptions: Adoptions) -> None:
        self.root = root
        self.adoptions = adoptions
        self.record = OriginalsRecord(root / "originals")
        cgroups = CgroupV1(root / "cpu", root / "cpuacct")
        self.monitor = Monitor(cgroups, None, CONFIG, originals=self.record)
        self.live: list[str] = []
        self.offered: list[str] = []
        self.missed = self.twice = self.serial = 0

    def arrive(self) -> None:
        name = f"pod-{self.serial}"
        self.serial += 1
        make_pod(self.root, name)
        spec = PodSpec(name=name, tokens=100 + self.serial % 400, cgroup=name)
        self.monitor.submit(PodAdded(spec))
        self.live.append(name)
        self.offered.append(spec.key)

    def settle(self, leaving: list[str]) -> None:
        """Count this tick's arrivals never adopted; forget the pods that left, counting
        those adopted more than once."""
        self.missed += sum(1 for key in self.offered if self.adoptions.seen[key] == 0)
        self.offered.clear()
        for name in leaving:
            self.twice += self.adoptions.seen.pop(f"local/{name}", 0) > 1

    def tick(self, tick: int) -> None:
        leaving, self.live[:] = self.live[:CHURN], self.live[CHURN:]
        for name in leaving:
            self.monitor.submit(PodRemoved(f"local/{name}"))
        for _ in range(CHURN):
            self.arrive()
        for name in self.live[::50]:
            busy(self.root, name, tick)
        self.monitor.tick(float(tick))
        self.settle(leaving)
        for name in leaving:
            shutil.rmtree(self.root / "cpu" / name)
            shutil.rmtree(self.root / "cpuacct" / name)


def main() -> None:
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    root = Path(tempfile.mkdtemp(prefix="kuscale-soak-", dir="/dev/shm"))
    adoptions = Adoptions()
    monitor_log = logging.getLogger("kuscale.monitor")
    monitor_log.addHandler(adoptions)
    monitor_log.setLevel(logging.INFO)
    monitor_log.propagate = False
    try:
        soak = Soak(root, adoptions)
        for _ in range(PODS):
            soak.arrive()
        soak.monitor.tick(0.0)
        soak.settle([])
        marks = [("start", current_rss_mib(), open_descriptors())]
        started, tick = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            tick += 1
            if len(marks) == 1 and time.monotonic() - started >= seconds / 10:
                marks.append(("warm", current_rss_mib(), open_descriptors()))
            soak.tick(tick)
        marks.append(("end", current_rss_mib(), open_descriptors()))
        soak.monitor.restore()
        twice = soak.twice + sum(1 for count in adoptions.seen.values() if count > 1)
        print(
            f"soak: {tick} ticks of {PODS} pods in {time.monotonic() - started:.0f} s, "
            f"{soak.serial - PODS} pods arrived and as many left"
        )
        print("resident memory: " + ", ".join(f"{rss:.1f} MiB {when}" for when, rss, _ in marks))
        print("open descriptors: " + ", ".join(f"{fds} {when}" for when, _, fds in marks))
        print(f"pods missed: {soak.missed}; pods adopted twice: {twice}")
        print(f"record entries left after the final restore: {len(list(soak.record.entries()))}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
