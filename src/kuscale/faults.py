"""Fault points: the named steps between which a stop or a crash could leave a workload
behind, and a way for a test to make this very process stop at one of them.

A crash at a random moment rarely lands in the short window between two steps (a cgroup
made but its quota not yet recorded, a limit given back but its entry not yet dropped), so
the test harness names the window instead: `KUSCALE_FAULT=POINT[:N[:ACTION]]` makes the
process that passes POINT for the Nth time (default 1) send itself SIGKILL (`kill`, the
default), SIGTERM (`term`, a clean stop asked at that moment) or SIGSTOP (`pause`: held
there, whatever locks it holds, until a SIGCONT, so that a second process can be made to
act while the first one is between two steps). Unset, `reached` is one comparison with
None. A deployed agent runs in a Kubernetes pod, and there the variable is
refused: a fault point is for tests only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from kuscale.model import is_decimal

FAULT_ENV = "KUSCALE_FAULT"
IN_POD_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every container: the mark of a production start."""

POINTS: dict[str, str] = {
    "launch.cgroup_made": "`kuscale launch` made the workload's cgroup",
    "launch.recorded": "launch recorded the fresh cgroup's originals",
    "launch.quota_written": "launch wrote the quota and weight the tokens buy",
    "launch.attached": "launch moved itself into the cgroup",
    "launch.registered": "launch registered the workload, just before exec",
    "adopt.inspected": "the agent read what a pod has, before recording it",
    "adopt.recorded": "the agent recorded a pod's originals",
    "adopt.held": "the agent took a pod over: its own limit binds",
    "tick.sampled": "a tick read every pod's counters",
    "tick.decided": "a tick's policy chose the limits",
    "tick.written": "one resource's limits were written",
    "watch.raised": "the watch raised a starving pod between ticks",
    "stop.given_back": "a stopping agent gave one pod back",
    "stop.record_dropped": "a stopping agent dropped that pod's entry",
    "stop.swept": "a stopping agent gave back one entry no running pod held",
    "restore.given_back": "`kuscale restore` gave one entry back",
    "restore.dropped": "`kuscale restore` dropped that entry",
}
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "pause": signal.SIGSTOP}


class FaultError(ValueError):
    """KUSCALE_FAULT names no point, holds garbage, or is set where it must not be."""


@dataclass(frozen=True)
class Fault:
    point: str
    nth: int
    action: str


def parse(text: str) -> Fault:
    point, _, rest = text.partition(":")
    count, _, action = rest.partition(":")
    if point not in POINTS:
        raise FaultError(
            f"{FAULT_ENV}={text!r} names no fault point; the points are: {', '.join(POINTS)}"
        )
    if count and not (is_decimal(count) and int(count) >= 1):
        raise FaultError(f"{FAULT_ENV}={text!r}: the pass to stop at must be a number >= 1")
    if action and action not in ACTIONS:
        raise FaultError(f"{FAULT_ENV}={text!r}: the action is one of {', '.join(ACTIONS)}")
    return Fault(point, int(count or 1), action or "kill")


class _Trigger:
    """The one armed fault of this process and how often its point has been passed."""

    fault: Fault | None = None
    passes = 0


_trigger = _Trigger()


def arm_from_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Arm the fault KUSCALE_FAULT names, if any; FaultError for a bad one, or in a pod."""
    text = environ.get(FAULT_ENV, "")
    _trigger.fault, _trigger.passes = None, 0
    if not text:
        return
    if environ.get(IN_POD_ENV):
        raise FaultError(
            f"{FAULT_ENV} is set, and this process runs in a Kubernetes pod: fault points are "
            "for tests only; unset it"
        )
    _trigger.fault = parse(text)


def reached(point: str) -> None:
    """The process has just done the step `point` names."""
    fault = _trigger.fault
    if fault is None or fault.point != point:
        return
    _trigger.passes += 1
    if _trigger.passes == fault.nth:
        os.kill(os.getpid(), ACTIONS[fault.action])
