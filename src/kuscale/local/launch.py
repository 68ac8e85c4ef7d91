"""`kuscale launch`: put a command in a cgroup of its own and register it for the agent.

The launcher moves itself into the new cgroup, registers, then execs the command, so the
workload is this very process: it keeps running when the agent stops, and its exit empties
the cgroup, which is how the agent learns it completed.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import NoReturn

from kuscale import faults
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.vgpu import VgpuLayer
from kuscale.config import PolicyConfig
from kuscale.local.statedir import StateDir, StateDirError
from kuscale.model import GPU_SOCKET_ENV, VGPU_ENV, Held, Original, PodSpec, shares_for_tokens
from kuscale.originals import OriginalsRecord, RecordError

log = logging.getLogger("kuscale.launch")


def prepare(
    state: StateDir,
    cgroups: CgroupV1 | CgroupV2,
    parent: str,
    name: str,
    tokens: int,
    gpu: bool,
    command: list[str],
) -> PodSpec:
    """Validate everything before touching the system, then create the cgroup and vGPU."""
    if not command:
        raise StateDirError("no command given after --")
    if shutil.which(command[0]) is None:
        raise StateDirError(f"command {command[0]!r} not found")
    spec = PodSpec(
        name=name,
        tokens=tokens,
        cgroup=f"{parent}/{name}",
        vgpu_id=name if gpu else None,
        uid=str(uuid.uuid4()),
        owned=True,
    )
    if state.registration(name).exists():
        raise StateDirError(f"a workload named {name!r} is already registered in {state.path}")
    if cgroups.exists(spec.cgroup):
        if not cgroups.is_empty(spec.cgroup):
            raise StateDirError(
                f"cgroup {spec.cgroup} already exists and holds processes: "
                "pick another --name or --cgroup-parent"
            )
        cgroups.remove(spec.cgroup)
    cgroups.create(spec.cgroup)
    faults.reached("launch.cgroup_made")
    born_within_budget(state, cgroups, spec)
    if spec.vgpu_id is not None:
        VgpuLayer(state.vgpu).create(spec.vgpu_id)
    return spec


def born_within_budget(state: StateDir, cgroups: CgroupV1 | CgroupV2, spec: PodSpec) -> None:
    """A new cgroup gets at once the CPU quota and weight its tokens buy (at the default
    CPU price), so the workload never runs beyond its budget before the agent adopts it.
    What the fresh cgroup had (no quota, the default weight) is recorded first: it is what
    the agent, or `kuscale restore`, gives back. Only while an agent holds the record: one
    that stops gives back what this wrote, and with none, nothing would, so the workload
    is left as it was born, unlimited, until an agent adopts it from its registration. A
    record that cannot be written refuses the launch, its fresh cgroup removed, before any
    quota is written."""
    record = OriginalsRecord(state.originals)
    try:
        with record.launch_section() as agent_alive:
            if not agent_alive:
                log.warning(
                    "no agent holds %s: %s runs unlimited until an agent adopts it",
                    state.originals,
                    spec.name,
                )
                return
            _record_then_limit(record, cgroups, spec)
    except RecordError as err:
        cgroups.remove(spec.cgroup)
        raise StateDirError(f"{err}: nothing was launched") from None


def _record_then_limit(
    record: OriginalsRecord, cgroups: CgroupV1 | CgroupV2, spec: PodSpec
) -> None:
    record.save(
        Original(
            key=spec.key,
            uid=spec.uid,
            cgroup=spec.cgroup,
            held=Held(cgroups.read_limit(spec.cgroup)),
            shares=cgroups.read_shares(spec.cgroup),
            launched=True,
        )
    )
    faults.reached("launch.recorded")
    quota = min(spec.tokens / PolicyConfig().cpu.price, cgroups.capacity())
    cgroups.write_limit(spec.cgroup, quota)
    cgroups.write_shares(spec.cgroup, shares_for_tokens(spec.tokens))
    faults.reached("launch.quota_written")


def exec_in_cgroup(
    state: StateDir, cgroups: CgroupV1 | CgroupV2, spec: PodSpec, command: list[str]
) -> NoReturn:
    pid = os.getpid()
    cgroups.attach(spec.cgroup, pid)
    faults.reached("launch.attached")
    state.register(spec, pid)
    faults.reached("launch.registered")
    env = dict(os.environ)
    if spec.vgpu_id is not None:
        env[VGPU_ENV] = spec.vgpu_id
        env[GPU_SOCKET_ENV] = str(state.gpu_socket)
    os.execvpe(command[0], command, env)
