"""Plain data: what a pod is (its spec), what it had before kuscale, and its counters.

Amounts are percent of one unit (CPU 100 = one core, GPU 100 = one whole GPU's time), as in
the original KuScale. Nothing here touches a file, a clock or a thread, and nothing here
changes: the state of managed pods is the monitor's (`kuscale.monitor`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Resource(enum.IntEnum):
    """Resource columns of every policy array, in a fixed order."""

    CPU = 0
    GPU = 1

    @property
    def label(self) -> str:
        return self.name.lower()


RESOURCES: tuple[Resource, ...] = (Resource.CPU, Resource.GPU)

INITIAL_LIMIT = 10.0
"""Limit a new pod starts with for each resource it uses (the original's value)."""

MIN_SHARES = 2
MAX_SHARES = 262_144
"""The kernel's range of cgroup v1 cpu.shares (v2 cpu.weight is mapped onto it)."""

SHARES_PER_100_TOKENS = 1024
"""cpu.shares per 100 tokens: the kubelet's 1024 shares per core at the default CPU price."""


VGPU_ENV = "KUSCALE_VGPU_ID"
"""What a GPU workload is told, by `kuscale launch` or the device plugin's Allocate: its
client on the GPU layer,"""
GPU_DEVICE_ENV = "KUSCALE_GPU_DEVICE"
"""the device that client is placed on,"""
GPU_SOCKET_ENV = "KUSCALE_GPU_SOCKET"
"""and, in local mode, where the GPU emulator listens."""


def is_decimal(text: str) -> bool:
    """Only the ASCII digits 0-9: `str.isdigit` also takes "²" and "①", which `int` refuses,
    and "１", which no kernel file or wire format holds."""
    return text.isascii() and text.isdigit()


def shares_for_tokens(tokens: int) -> int:
    """cpu.shares in proportion to tokens, inside the kernel's range."""
    return min(max(round(tokens * SHARES_PER_100_TOKENS / 100), MIN_SHARES), MAX_SHARES)


class PodStatus(enum.StrEnum):
    INITIALIZING = "initializing"
    NOT_READY = "not ready"
    RUNNING = "running"
    COMPLETED = "completed"
    REFUSED = "refused"


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
MAX_POD_NAME = 253
_VGPU_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class InvalidSpec(ValueError):
    """A pod description that cannot be accepted; the message says which field and why."""


def validate_pod_name(name: str) -> str:
    """Pod names are DNS-1123 subdomains, as Kubernetes names pods, and become cgroup
    directory and file names in local mode: every dot sits between two alphanumerics, so no
    name is `.`, `..` or holds a `/`."""
    if len(name) > MAX_POD_NAME or not _DNS_SUBDOMAIN.fullmatch(name):
        raise InvalidSpec(
            f"pod name {name!r} is not a DNS-1123 subdomain (lower-case letters, digits, "
            f"'-' and '.', 1-{MAX_POD_NAME} characters, alphanumeric around every dot and "
            "at both ends)"
        )
    return name


def validate_vgpu_id(vgpu_id: str) -> str:
    """vGPU ids become directory names under the GPU layer's root: no '/', no '..'."""
    if not _VGPU_ID.fullmatch(vgpu_id) or set(vgpu_id) <= {"."}:
        raise InvalidSpec(f"vGPU id {vgpu_id!r} must be letters, digits, '_', '.', '-' only")
    return vgpu_id


def validate_tokens(tokens: object) -> int:
    """Tokens are a count of `kuscale.com/token` units: a positive integer, nothing else."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise InvalidSpec(f"tokens must be a positive integer, got {tokens!r}")
    return tokens


@dataclass(frozen=True, slots=True)
class PodSpec:
    """What a discovery source knows about a pod when it asks the monitor to adopt it.

    `cgroup` is relative to the CPU backend's root; `vgpu_id` names the pod's directory in
    the GPU layer (None when the pod uses no GPU).
    """

    name: str
    tokens: int
    cgroup: str
    namespace: str = "local"
    uid: str = ""
    vgpu_id: str | None = None
    owned: bool = False
    """True when kuscale created the cgroup and must remove it once the pod completes."""
    containers: tuple[str, ...] = ()
    """The leaf cgroups of the pod's containers, under `cgroup` (Kubernetes pods)."""
    declared_cpu: float | None = None
    """The pod's CPU limit as the API server declares it (Kubernetes pods whose every
    container has `limits.cpu`), percent: the kubelet's truth, which wins over a record."""

    def __post_init__(self) -> None:
        validate_pod_name(self.name)
        validate_tokens(self.tokens)
        for leaf in self.containers:
            if not leaf.startswith(self.cgroup + "/"):
                raise InvalidSpec(f"container cgroup {leaf!r} is not under {self.cgroup!r}")
        if self.vgpu_id is not None:
            validate_vgpu_id(self.vgpu_id)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def resources(self) -> tuple[Resource, ...]:
        return RESOURCES if self.vgpu_id is not None else (Resource.CPU,)


@dataclass(frozen=True, slots=True)
class ContainerLimit:
    """One container's CPU limit as kuscale found it (percent; None: unlimited)."""

    name: str
    """Its leaf cgroup for the cgroup actuator, its name in the pod for the resize one."""
    limit: float | None
    request: float = 0.0
    """The floor of any limit the API accepts for it (its `requests.cpu`)."""


@dataclass(frozen=True, slots=True)
class Held:
    """What a pod had before kuscale took it over, to be given back."""

    pod: float | None
    containers: tuple[ContainerLimit, ...] = ()


@dataclass(frozen=True, slots=True)
class Original:
    """What a pod had before kuscale first changed anything of it: one entry of the durable
    record, written before the first change and removed once it is given back."""

    key: str
    uid: str
    cgroup: str
    held: Held
    """The pod's CPU limit and its containers', as the actuator found them."""
    shares: int | None = None
    """cpu.shares before kuscale set them from tokens (None: kuscale does not set them)."""
    vgpu_id: str | None = None
    gpu_limit: float | None = None
    """The GPU share before kuscale (None: unlimited); meaningful only with `vgpu_id`."""
    launched: bool = False
    """Recorded by `kuscale launch` as it made the cgroup, before any agent saw the pod."""
    actuator: str = "cgroup"
    """Which CPU actuator held the pod, so `kuscale restore` gives it back the same way:
    `cgroup` writes the cgroups, `resize` asks the API server for the declared limits."""


@dataclass(frozen=True, slots=True)
class CpuCounters:
    """Cumulative CPU counters of one cgroup, as the kernel keeps them."""

    usage_ns: int
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_ns: int = 0
