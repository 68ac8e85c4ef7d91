"""`kuscale launch`: put a command in a cgroup of its own and register it for the agent.

The launcher moves itself into the new cgroup, registers, then execs the command, so the
workload is this very process: it keeps running when the agent stops, and its exit empties
the cgroup, which is how the agent learns it completed.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import NoReturn

from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.vgpu import VgpuLayer
from kuscale.gpuemu.client import GPU_SOCKET_ENV, VGPU_ENV
from kuscale.local.statedir import StateDir, StateDirError
from kuscale.model import PodSpec


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
    cgroups.create(spec.cgroup)
    if spec.vgpu_id is not None:
        VgpuLayer(state.vgpu).create(spec.vgpu_id)
    return spec


def exec_in_cgroup(
    state: StateDir, cgroups: CgroupV1 | CgroupV2, spec: PodSpec, command: list[str]
) -> NoReturn:
    pid = os.getpid()
    cgroups.attach(spec.cgroup, pid)
    state.register(spec, pid)
    env = dict(os.environ)
    if spec.vgpu_id is not None:
        env[VGPU_ENV] = spec.vgpu_id
        env[GPU_SOCKET_ENV] = str(state.gpu_socket)
    os.execvpe(command[0], command, env)
